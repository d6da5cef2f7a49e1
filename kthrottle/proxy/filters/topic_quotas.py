"""Per-topic byte-rate quotas: kthrottle's own, for a topic shared by many
clients (the case KIP-1010 proposes for Kafka).

A ``topics/<topic>`` (or ``topics/<default>``) entity's producer_byte_rate
counts the record bytes every client writes to the topic, its
consumer_byte_rate the record bytes every client reads from it, in one
bucket per topic (``QuotaManager.topic_bucket``). A Produce request is read
as it streams to the broker (``codecs/produce.py``), a Fetch response as it
streams to the client (``codecs/fetch_topics.py``): partition headers only,
the records skipped. The strongest throttle among a request's topics
applies; beside the client's own quotas the pipeline keeps the larger delay.
A Fetch response's topics are known only once it has gone, so its throttle
mutes the client (its next request is not read for that long) without
being written in that response's throttle_time_ms.

While the quota source holds no topic entity a request costs one attribute
check: nothing is read. Topic ids (Produce v13, Fetch v13+, KIP-516) are
named from the Metadata responses clients are given (v10+), read while
topic quotas are in force; an id not seen there is asked of the broker
(a Metadata request of the proxy's own, at most once per
``ASK_INTERVAL``) and not counted until known.
"""
import logging
import warnings
from functools import partial
from itertools import islice

from ...codecs import ProtocolError, apis
from ...codecs.fetch_topics import MAX_VERSION as FETCH_MAX_VERSION
from ...codecs.fetch_topics import FetchTopicBytes, metadata_topic_ids
from ...codecs.produce import MAX_VERSION as PRODUCE_MAX_VERSION
from ...codecs.produce import ProducePartitions
from ...policy.entities import CONSUMER_BYTE_RATE, DEFAULT, PRODUCER_BYTE_RATE, topic_name
from ..filter import GATHER, HEAD, NOTHING, STREAM, Observe, QuickFilter, Throttle

log = logging.getLogger("kthrottle.quotas")

# Topic buckets (or None: no quota) looked up for a configuration generation;
# past this many names (a client producing to random names) it starts over.
BUCKETS_KEPT = 10_000
# Topic ids remembered with their names; past this the oldest are forgotten.
TOPIC_IDS_KEPT = 100_000
# An unknown topic id is asked of the broker at most this often (seconds,
# proxy-wide): the answer lists every topic, and ids a client names that
# the cluster no longer has must not turn into a request each.
ASK_INTERVAL = 10.0
METADATA_ASK_VERSION = 12  # topic ids in the answer (v10+), null names allowed

_REPLICA = "replica"  # noted on a follower's Fetch: no topic quota counts it


class TopicQuotas(QuickFilter):
    name = "topic-quotas"

    @classmethod
    def build(cls, config, services):
        return None if services.quotas is None else cls(services.quotas, services.api_versions)

    def __init__(self, manager, api_versions=None):
        self.manager = manager  # policy QuotaManager
        self.api_versions = api_versions  # the broker's ranges (Services.api_versions) or None
        self.generation = -1
        self.active = False  # the configuration has topic quotas
        self.buckets = {}  # (quota key, topic name) -> Bucket or None, this generation
        self.topic_names = {}  # topic id (uuid.UUID) -> name
        self.asked_at = None  # when the last Metadata question was asked (ctx.now)
        self.uncounted = 0  # topic-id bytes not counted: the id was not known yet

    def _refresh(self):
        manager = self.manager
        self.generation = manager.generation
        self.active = manager.config.has_topic_quotas
        self.buckets.clear()

    # needs --------------------------------------------------------------------

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.PRODUCE or api_key == apis.FETCH else NOTHING

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # no Produce gets through before authentication

    def response_need(self, api_key, api_version):
        if api_key == apis.FETCH:
            return STREAM
        if api_key == apis.METADATA and api_version >= 10:
            return GATHER  # gathered already, to rewrite its addresses
        return NOTHING

    # Produce ------------------------------------------------------------------

    def on_request(self, ctx, head, inflight):
        if self.generation != self.manager.generation:
            self._refresh()
        if not self.active:
            return None
        if head.api_key == apis.FETCH:
            if head.replica_id >= 0:  # a follower: a broker, not a client
                ctx.note(inflight, _REPLICA)
            return None
        if head.api_version > PRODUCE_MAX_VERSION:
            return None
        return Observe(ProducePartitions(head.api_version), self._produced)

    def quick(self, api_key, api_version):
        # nothing to do without topic quotas
        return api_key == apis.PRODUCE or api_key == apis.FETCH

    quick_ready_follows_quotas = True  # it reads the configuration alone

    def quick_ready(self, ctx):
        if self.generation != self.manager.generation:
            self._refresh()
        return not self.active

    def quick_response_ready(self, ctx, inflight):
        return self.quick_ready(ctx)

    def _produced(self, ctx, reader):
        return self._decide(ctx, PRODUCER_BYTE_RATE, reader.topic_bytes)

    # Fetch --------------------------------------------------------------------

    def stream(self, ctx, inflight):
        if inflight.api_key != apis.FETCH:
            return None
        if self.generation != self.manager.generation:
            self._refresh()
        if not self.active or inflight.api_version > FETCH_MAX_VERSION:
            return None
        if ctx.noted(inflight) is _REPLICA:
            return None
        return Observe(FetchTopicBytes(inflight.api_version), self._fetched)

    def _fetched(self, ctx, reader):
        return self._decide(ctx, CONSUMER_BYTE_RATE, reader.topic_bytes)

    # both ---------------------------------------------------------------------

    def _decide(self, ctx, key, topic_bytes):
        """Count each topic's bytes in its bucket; the strongest throttle."""
        if self.generation != self.manager.generation:
            self._refresh()
        now = ctx.now
        delay = 0
        worst = None
        unknown = False
        for topic, nbytes in topic_bytes.items():
            if not nbytes:
                continue
            if topic.__class__ is not str:  # a topic id
                name = self.topic_names.get(topic)
                if name is None:
                    self.uncounted += nbytes
                    unknown = True
                    continue
                topic = name
            bucket = self._bucket(key, topic)
            if bucket is None:
                continue
            ms = bucket.record(nbytes, now)
            if ms > delay:
                delay = ms
                worst = topic
        if unknown:
            self._ask_topic_ids(ctx)
        if delay:
            return Throttle(delay, "%s of topic %s" % (key, worst))
        return None

    def _bucket(self, key, topic):
        buckets = self.buckets
        found = buckets.get((key, topic), False)
        if found is not False:
            return found
        if len(buckets) >= BUCKETS_KEPT:
            buckets.clear()
        bucket = None
        if topic != DEFAULT:  # a request naming "<default>" is not the default entity
            try:
                topic_name(topic)  # only Kafka's legal names: the broker refuses others
            except ValueError:
                pass
            else:
                bucket = self.manager.topic_bucket(key, topic)
        buckets[key, topic] = bucket
        return bucket

    # topic ids --------------------------------------------------------------------

    def on_response(self, ctx, inflight, frame):
        if inflight.api_key != apis.METADATA:
            return frame
        if self.generation != self.manager.generation:
            self._refresh()
        if self.active:
            self._learn(frame, inflight.api_version)
        return frame

    def _learn(self, frame, version):
        try:
            ids = metadata_topic_ids(frame, version)
        except ProtocolError as exc:
            log.debug("topic ids not read from a Metadata v%d response: %s", version, exc)
            return
        names = self.topic_names
        for topic_id, name in ids.items():
            if names.get(topic_id) != name:
                names[topic_id] = name
        excess = len(names) - TOPIC_IDS_KEPT
        if excess > 0:
            # the oldest forgotten in one pass: deleting the first key one at a time
            # walks past the slots of those deleted before it each time (quadratic: a
            # cluster of 150,000 topics took a second per Metadata answer)
            for topic_id in list(islice(names, excess)):
                del names[topic_id]

    def _ask_topic_ids(self, ctx):
        """Ask the broker for every topic's id (the client learnt them from
        Metadata that did not pass this proxy while topic quotas were on)."""
        clock = ctx.now
        if self.asked_at is not None and clock - self.asked_at < ASK_INTERVAL:
            return
        version = self._metadata_version()
        if version is None:
            return
        self.asked_at = clock
        ctx.send_request(_metadata_request(version), apis.METADATA, version,
                         partial(self._answered, version))

    def _metadata_version(self):
        ranges = self.api_versions.current if self.api_versions is not None else None
        if not ranges:
            return METADATA_ASK_VERSION
        for api_key, low, high in ranges:
            if api_key == apis.METADATA:
                version = min(high, METADATA_ASK_VERSION)
                return version if version >= 10 and version >= low else None
        return None

    def _answered(self, version, ctx, frame):
        self._learn(frame, version)


def _metadata_request(version):
    """A framed Metadata request for every topic (null topics), creating
    none; its correlation id is set by the pipeline."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ...codecs._kafka import MetadataRequest
    request = MetadataRequest[version](topics=None, allow_auto_topic_creation=False,
                                       include_topic_authorized_operations=False)
    request.with_header(correlation_id=0, client_id="kthrottle")
    return bytes(request.encode(header=True, framed=True))


__all__ = ["TopicQuotas"]
