"""KIP-599's controller_mutation_rate: partitions created, added or deleted
per second, per <user, client-id> as the other client quotas.

CreateTopics, CreatePartitions and DeleteTopics requests count the
partitions they mutate; validate_only ones count nothing. A request of a
strict version (CreateTopics v6+, DeleteTopics v5+, CreatePartitions v3+)
that comes while the quota is violated is answered by the proxy, every topic
THROTTLING_QUOTA_EXCEEDED with throttle_time_ms, and never reaches the
broker; the one that crosses the quota goes through, as a broker lets it.
Older versions go through and the client is throttled by what they earned.

Partition counts the request does not give (a topic deleted, or grown
without an assignment) are asked of the broker: a Metadata request of the
filter's own goes just ahead of the mutation on the same connection, so its
answer reflects the topics before the mutation, and arrives before the
mutation's own answer (which carries the throttle). A topic created with the
broker's default count (-1) counts 1, Kafka's default num.partitions, and is
corrected from the answer's num_partitions (CreateTopics v5+).
"""
import logging
from functools import partial

from ...codecs import apis
from ...codecs.errors import ProtocolError
from ...codecs.mutations import (
    CREATE_TOPICS,
    DELETE_TOPICS,
    VERSIONS,
    created_partitions,
    decode_mutation,
    metadata_request,
    partition_counts,
    throttled_response,
)
from ...policy.entities import CONTROLLER_MUTATION_RATE
from ..filter import BUILT_WITH_QUOTAS, GATHER, HEAD, NOTHING, Answer, Filter, Throttle

log = logging.getLogger("kthrottle.controller_mutation")

# CreateTopics answers say the partitions a topic was created with from v5 (KIP-525)
_CREATED_COUNT_FROM = 5


class _Noted:
    """What the filter keeps with a forwarded mutation until its answer."""

    __slots__ = ("bucket", "strict", "delay_ms", "defaulted")

    def __init__(self, bucket, strict):
        self.bucket = bucket
        self.strict = strict
        self.delay_ms = 0  # what partitions counted after the request earned
        self.defaulted = ()  # topics created with the broker's default count


def _in_versions(api_key, api_version):
    versions = VERSIONS.get(api_key)
    return versions is not None and versions[0] <= api_version <= versions[1]


def record(bucket, partitions, now, strict):
    """Count ``partitions``; the throttle it earns a permissive request.
    Strict (KIP-599): the request that crosses the quota goes through
    unthrottled, the debt it leaves refuses the next ones, so it is not
    counted as a throttle given."""
    if not strict or bucket.observe_only:
        return bucket.record(partitions, now)
    bucket.charge(partitions, now)
    return 0


class ControllerMutationQuota(Filter):
    """KIP-599 controller_mutation_rate on CreateTopics, CreatePartitions
    and DeleteTopics."""

    name = "controller-mutation"
    built = BUILT_WITH_QUOTAS

    def request_need(self, api_key, api_version):
        return GATHER if _in_versions(api_key, api_version) else NOTHING

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # refused before authentication; no principal yet

    def response_need(self, api_key, api_version):
        if not _in_versions(api_key, api_version):
            return NOTHING
        if api_key == CREATE_TOPICS and api_version >= _CREATED_COUNT_FROM:
            return GATHER  # num_partitions of topics created with the default
        return HEAD

    def on_request(self, ctx, head, inflight):
        bucket = ctx.quotas_for(head.client_id or "").current().mutation
        if bucket is None:
            return None
        mutation = decode_mutation(head.buf)
        if mutation.validate_only or not mutation.topics:
            return None
        now = ctx.now
        strict = mutation.strict
        if strict and not bucket.observe_only:
            debt = bucket.debt_ms(now)
            if debt > 0:
                bucket.note_refused(debt, now)
                log.debug("%s v%d from %s/%s refused: %s over for %d ms", head.api_key,
                          head.api_version, ctx.principal, head.client_id,
                          CONTROLLER_MUTATION_RATE, debt)
                # muted for the debt too, as a broker mutes the channel
                return Answer(throttled_response(mutation, debt), debt)
        noted = _Noted(bucket, strict)
        counted = 0
        asked = []
        for topic in mutation.topics:
            if topic.partitions is not None:
                counted += topic.partitions
            elif mutation.api_key == CREATE_TOPICS:
                counted += 1  # the broker's default: Kafka's num.partitions is 1
                if mutation.api_version >= _CREATED_COUNT_FROM:
                    noted.defaulted += (topic.name,)
            else:
                asked.append(topic)
        delay = record(bucket, counted, now, strict) if counted else 0
        if asked or noted.defaulted:
            ctx.note(inflight, noted)
        if asked:
            frame, version = metadata_request(asked)
            ctx.send_request(frame, apis.METADATA, version,
                             partial(self._counted, noted, mutation.api_key, asked, version))
        if delay:
            return Throttle(delay, CONTROLLER_MUTATION_RATE)
        return None

    def _counted(self, noted, api_key, asked, version, ctx, frame):
        """The broker's answer to the filter's Metadata request: count the
        partitions deleted or added."""
        try:
            by_name, by_id = partition_counts(frame, version)
        except ProtocolError as exc:
            log.warning("partition counts for %s not known, not counted: %s",
                        CONTROLLER_MUTATION_RATE, exc)
            return
        partitions = 0
        for topic in asked:
            current = by_name.get(topic.name) if topic.name is not None else by_id.get(
                topic.topic_id)
            if current is None:
                continue  # no such topic: the broker refuses it, nothing mutates
            if api_key == DELETE_TOPICS:
                partitions += current
            elif topic.new_total > current:
                partitions += topic.new_total - current
        if partitions:
            noted.delay_ms = record(noted.bucket, partitions, ctx.now, noted.strict)

    def on_response_head(self, ctx, inflight, head, frame_len):
        noted = ctx.noted(inflight)
        if noted is not None and noted.delay_ms:
            return Throttle(noted.delay_ms, CONTROLLER_MUTATION_RATE)
        return None

    def on_response(self, ctx, inflight, frame):
        noted = ctx.noted(inflight)
        if noted is None or not noted.defaulted:
            return frame
        try:
            created = created_partitions(frame, inflight.api_version)
        except ProtocolError as exc:
            log.warning("CreateTopics answer not read for %s: %s", CONTROLLER_MUTATION_RATE, exc)
            return frame
        # counted 1 each when the request came; the rest now (the next
        # request pays for it)
        more = sum(created[name] - 1 for name in noted.defaulted if created.get(name, 0) > 1)
        if more:
            record(noted.bucket, more, ctx.now, noted.strict)
        return frame
