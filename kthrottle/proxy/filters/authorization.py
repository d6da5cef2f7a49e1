"""The cluster's ACLs, enforced at the proxy for the client's own principal
(``--authorization acls``, the default where the broker would otherwise see
the proxy's principal instead of the client's).

A proxy that authenticates clients itself (``--sasl-mode terminate``, TLS
client certificates, or none) reaches the brokers over connections of its
own principal, which must be allowed whatever every tenant is: without this
filter alice would act with the proxy's rights, on bob's topics too. The
proxy reads the cluster's ACLs (DescribeAcls, ``sources/acls.py``, again
every ``--acl-refresh-ms``) and decides each request as Kafka's authorizer
would for ``User:<principal>`` from the client's address
(``policy/acls.py``), using Kafka's table of the operation each API needs on
each resource (``codecs/acl_requests.py``). A refused request never reaches
a broker, and it is answered as a broker answers it:

- Produce, Fetch, ListOffsets, OffsetCommit, TxnOffsetCommit, DeleteRecords,
  OffsetForLeaderEpoch, OffsetDelete, DescribeProducers, CreateTopics,
  DeleteTopics, CreatePartitions: TOPIC_AUTHORIZATION_FAILED on each refused
  topic, the allowed topics of the same request still served (the request
  goes on without the refused ones, and their errors are put into the
  broker's answer; a Fetch's spliced in, its records left alone); a topic id
  this process has not seen is answered UNKNOWN_TOPIC_ID, which clients
  retry, and every topic's id read for the retry;
- Metadata and DescribeTopicPartitions leave out the topics the principal
  may not describe when asked for every topic, and answer
  TOPIC_AUTHORIZATION_FAILED for each one named; a topic it may describe but
  not create is not created automatically;
- group and transactional APIs answer GROUP_AUTHORIZATION_FAILED or
  TRANSACTIONAL_ID_AUTHORIZATION_FAILED, per group or id where a request
  names several (OffsetFetch, DescribeGroups, DeleteGroups,
  DescribeTransactions, the KIP-848/932/1071 describe calls); ListGroups and
  ListTransactions list only what the principal may describe; a KIP-848 or
  KIP-932 heartbeat needs DESCRIBE on the topics it subscribes to, and its
  assignment keeps only those (the coordinator assigns as the proxy);
- the share-group offset APIs (KIP-932) answer per group and per topic, the
  allowed ones served (``codecs/share_offsets.py``);
- config APIs answer per resource; APIs on the cluster answer
  CLUSTER_AUTHORIZATION_FAILED in their top-level error; a refusal with no
  field to say it in (and a request the proxy cannot decode) closes the
  connection instead, with a WARNING, counted as
  kthrottle_connections_refused_total{reason="authorization"}.

With no authorizer on the cluster (DescribeAcls answers SECURITY_DISABLED, or
is not offered) there is nothing to enforce: every request passes with one
attribute check. Until the ACLs have been read once, requests wait unread.
"""
import logging
import struct
import uuid

from ...codecs import acl_requests as wire
from ...codecs import apis, group_answers, share_offsets, share_topics, streams_topology
from ...codecs.acl_requests import (
    CLUSTER,
    CLUSTER_NAME,
    DESCRIBE,
    GROUP,
    READ,
    TOPIC,
    TOPIC_LISTS,
    TRANSACTIONAL_ID,
    WRITE,
)
from ...codecs.errors import ProtocolError
from ...codecs.metadata_leaders import metadata_layout
from ...codecs.produce import produce_partitions
from ...codecs.rewrite import splice
from ...codecs.wire import (INT16, INT32, read_string, read_uvarint, skip_tagged_fields,
                              write_uvarint)
from ...options import SWITCH, ConfigError, Option, Parsed, parse_duration
from ..filter import (GATHER, GATHER_WHOLE, HEAD, NOTHING, Answer, Defer, QuickFilter, Refuse,
                      Replace)

log = logging.getLogger("kthrottle.authorization")

REFUSED_AUTHORIZATION = "authorization"  # the refusal counter's label
UNREAD_WAIT_MS = 100  # a request before the ACLs are first read looks again this often
ALTER, CREATE, DELETE = wire.ALTER, wire.CREATE, wire.DELETE
DESCRIBE_CONFIGS, ALTER_CONFIGS = wire.DESCRIBE_CONFIGS, wire.ALTER_CONFIGS
IDEMPOTENT_WRITE = wire.IDEMPOTENT_WRITE

# APIs authorized by one operation on the cluster (Kafka's table); a refusal
# is their top-level error
CLUSTER_APIS = {
    27: wire.CLUSTER_ACTION,  # WriteTxnMarkers: kafka-transactions abort (KIP-664)
    29: DESCRIBE, 30: ALTER, 31: ALTER, 34: ALTER, 35: DESCRIBE, 43: ALTER, 45: ALTER,
    46: DESCRIBE, 48: DESCRIBE_CONFIGS, 49: ALTER_CONFIGS, 50: DESCRIBE, 51: ALTER,
    55: DESCRIBE, 57: ALTER, 60: DESCRIBE, 64: ALTER, 74: DESCRIBE_CONFIGS, 80: ALTER,
    81: ALTER, 94: ALTER,
}
# group APIs whose request names one group in its first field (``group_id``),
# and the operation each needs
GROUP_APIS = {11: READ, 12: READ, 13: READ, 14: READ}
# APIs the proxy passes through without a kafka-python schema whose request's
# first field is the group (a compact string): KIP-848, KIP-932, KIP-1071
FIRST_FIELD_GROUP = {68: READ, 76: READ, 78: READ, 79: READ, 88: READ, 91: READ, 92: DELETE,
                     93: READ}
DESCRIBE_SHARE_GROUP_OFFSETS = 90  # groups and their topics, each to describe
STREAMS_GROUP_HEARTBEAT = 88  # KIP-1071: DESCRIBE on its topology's topics too
# share-group APIs whose topics (by id) need READ, checked each (KIP-932)
SHARE_DATA_APIS = frozenset({78, 79})
# share-group offset APIs whose topics (by name) need READ, checked each (KIP-932)
SHARE_OFFSET_APIS = frozenset({91, 92})
# describe APIs without a schema whose first field is an array of groups
GROUP_ARRAY_FIRST = {69: DESCRIBE, 77: DESCRIBE, 89: DESCRIBE}
# heartbeats naming the topics subscribed to: DESCRIBE on each (Kafka answers
# TOPIC_AUTHORIZATION_FAILED otherwise), and their assignments read
HEARTBEATS = frozenset({68, 76})
# APIs without a schema whose top-level error answer the proxy writes itself
GROUP_ANSWERED = frozenset({68, 76, 78, 79, 88, 91, 92})
# no check in Kafka: the handshake and the client's telemetry (KIP-714)
UNCHECKED = {apis.API_VERSIONS, 17, 36, 71, 72}
LIST_GROUPS = 16
# topic-list APIs whose answers take the refused topics' errors back in
MERGED = frozenset(TOPIC_LISTS) - {apis.PRODUCE, apis.FETCH}
TOPIC_IDS_KEPT = 100_000  # topic ids remembered with their names (then forgotten, all)
MERGING_KEPT = 10_000  # Produce answers awaited with refused topics' errors, at most
# delegation tokens: one created through a terminating proxy would be the
# proxy's own principal's, a way around every check here
DELEGATION_TOKEN_APIS = {38, 39, 40, 41}
OPERATION_NOT_ATTEMPTED = 55
FETCH_SESSION_ID_NOT_FOUND = 70
SHARE_SESSION_NOT_FOUND = 122


class AclView:
    """The ACLs in force: ``authorizer`` is None until read, ALLOW_ALL when
    the cluster has none, else a ``policy.acls.Authorizer``."""

    ALLOW_ALL = "allow-all"

    def __init__(self):
        self.authorizer = None
        self.generation = 0
        # topic id -> name: from the Metadata answers clients get, and read
        # whole (want_topic_ids) when a request names an id not in it
        self.topic_names = {}
        self.want_topic_ids = _nothing

    def set_topic_ids(self, names):
        """Every topic's id, as just read from the cluster."""
        self.topic_names.clear()
        self.topic_names.update(names)

    def update(self, snapshot):
        from ...policy.acls import Authorizer

        if not snapshot.enabled:
            self.authorizer = self.ALLOW_ALL
        else:
            self.authorizer = Authorizer(
                snapshot.bindings, snapshot.super_users, snapshot.allow_everyone_if_no_acl_found)
        self.generation += 1


def _nothing():
    pass


def _first_compact_string(frame, head):
    """The first field of a flexible request body: a compact string."""
    pos = head.body_offset
    size, pos = read_uvarint(frame, pos)
    if size == 0:
        return None
    end = pos + size - 1
    if end > len(frame):
        raise ProtocolError("truncated request")
    return bytes(frame[pos:end]).decode("utf-8", "replace")


def _refresh(value, what):
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise ConfigError("%s: %s" % (what, exc)) from None
    if seconds < 0.1:
        raise ConfigError("%s: at least 100ms, got %r" % (what, value))
    return seconds


def _super_users(value, what):
    """Kafka's super.users: ``User:admin;User:ops`` (or a TOML list)."""
    items = value.split(";") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError("%s must be principals separated by ';' (User:admin;User:ops)" % what)
    users = frozenset(i.strip() for i in items if i.strip())
    for user in users:
        if ":" not in user:
            raise ConfigError("%s: %r is not a principal (User:NAME)" % (what, user))
    return users


AUTHORIZATION_MODES = ("acls", "none")


def _share_offsets_groups(frame, body):
    """[(group id, [topic name] or None)] of a DescribeShareGroupOffsets request
    (DescribeShareGroupOffsetsRequest.json: Groups, each a GroupId and Topics,
    each a TopicName and Partitions)."""
    out = []
    try:
        count, pos = read_uvarint(frame, body)
        for _ in range(max(count - 1, 0)):
            group, pos = read_string(frame, pos, True)
            topics_count, pos = read_uvarint(frame, pos)
            topics = None if topics_count == 0 else []
            for _ in range(max(topics_count - 1, 0)):
                name, pos = read_string(frame, pos, True)
                partitions, pos = read_uvarint(frame, pos)
                pos = skip_tagged_fields(frame, pos + 4 * max(partitions - 1, 0))
                topics.append(name or "")
            pos = skip_tagged_fields(frame, pos)
            out.append((group or "", topics))
    except IndexError:
        raise ProtocolError("truncated DescribeShareGroupOffsets request") from None
    if pos > len(frame):
        raise ProtocolError("truncated DescribeShareGroupOffsets request")
    return out


def _first_compact_strings(frame, head):
    """The first field of a flexible request body: a compact array of compact strings."""
    count, pos = read_uvarint(frame, head.body_offset)
    out = []
    for _ in range(max(count - 1, 0)):
        size, pos = read_uvarint(frame, pos)
        end = pos + max(size - 1, 0)
        if end > len(frame):
            raise ProtocolError("truncated request")
        out.append(bytes(frame[pos:end]).decode("utf-8", "replace"))
        pos = end
    return out


class Authorization(QuickFilter):
    name = "authorization"
    options_title = "authorization"
    options = (
        Option("authorization", default="acls", choices=AUTHORIZATION_MODES,
               help="where the brokers see the proxy's principal instead of the client's "
               "(every sasl-mode but passthrough): acls (default), the cluster's own ACLs "
               "(read with DescribeAcls) are enforced at the proxy for each client's "
               "principal, so a tenant does only what its own ACLs allow; none, every "
               "client acts with the proxy's rights (a WARNING at start says so). A "
               "cluster without an authorizer has nothing to enforce"),
        Option("acl-refresh", Parsed(_refresh), default=5.0, metavar="DURATION",
               help="authorization acls: how often the cluster's ACLs are read again, e.g. "
               "5s (default), 500ms; a change takes effect on this proxy within that"),
        Option("super-users", Parsed(_super_users), metavar="PRINCIPALS",
               help="authorization acls: the brokers' super.users (User:admin;User:ops), "
               "allowed everything; Kafka does not show that setting to clients, so without "
               "this no principal is a super user at the proxy"),
        Option("allow-everyone-if-no-acl-found", SWITCH,
               help="authorization acls: as the brokers' allow.everyone.if.no.acl.found, a "
               "resource no ACL names is allowed to everyone (default: as the brokers "
               "show it, else off)"),
    )

    @classmethod
    def build(cls, config, services):
        view = getattr(services, "acls", None)
        if view is None or config.authorization != "acls":
            return None
        log.info("authorization: the cluster's ACLs enforced for each client's principal, "
                 "read again every %gs; super users %s; a resource no ACL names is %s",
                 config.acl_refresh, ", ".join(sorted(config.super_users or ())) or
                 "as the brokers show them", {True: "allowed to everyone",
                                              False: "refused"}.get(
                     config.allow_everyone_if_no_acl_found, "as the brokers say"))
        return cls(view)

    def __init__(self, view):
        self.view = view
        self.topic_names = view.topic_names  # topic id -> name (AclView)
        # correlation ids of Produce requests sent on without refused topics, whose
        # answers take those topics' errors (any connection's: one that shares an id
        # only takes the long way)
        self.merging = set()

    def new_state(self):
        return _State()

    # needs -------------------------------------------------------------------

    def request_need(self, api_key, api_version):
        # the head first: a request waits there (Defer) until the ACLs are read,
        # and is then read whole (Gather) where its body is needed; a Produce or
        # Fetch only for a principal not allowed every topic
        return NOTHING if api_key in UNCHECKED else HEAD

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # the authenticator holds everything else back meanwhile

    def response_need(self, api_key, api_version):
        # a Fetch's answer is gathered only where the request had refused
        # topics besides allowed ones (ctx.gather_response); a Produce's on the
        # long way only while one of its kind awaits the refused topics' errors
        # (quick_response_check)
        if api_key in MERGED or api_key in (apis.METADATA, LIST_GROUPS, apis.FIND_COORDINATOR,
                                            apis.PRODUCE):
            return GATHER
        return NOTHING

    def quick_response_check(self, api_key, api_version):
        return self._produce_check if api_key == apis.PRODUCE else None

    def _produce_check(self, frame):
        """True: a Produce answer with no refused topics to put in (the short way)."""
        merging = self.merging
        return not merging or INT32.unpack_from(frame, 4)[0] not in merging

    def quick(self, api_key, api_version):
        return api_key == apis.PRODUCE or api_key == apis.FETCH

    # a Produce lease (QuotaManager.lease, 100 ms at most) may stand for readiness too:
    # a change of ACLs then holds for a Produce of a leased head within that
    quick_ready_follows_quotas = True

    def quick_ready(self, ctx):
        authorizer = self.view.authorizer
        if authorizer is AclView.ALLOW_ALL:
            return True
        if authorizer is None:
            return False
        principal, host = _who(ctx)
        return (authorizer.allowed_every(principal, host, TOPIC, WRITE)
                and authorizer.allowed_every(principal, host, TOPIC, READ)
                and authorizer.allowed_every(principal, host, TRANSACTIONAL_ID, WRITE))

    def quick_response_ready(self, ctx, inflight):
        return True

    # requests ------------------------------------------------------------------

    def on_request(self, ctx, head, inflight):
        authorizer = self.view.authorizer
        if authorizer is AclView.ALLOW_ALL:
            return None
        if authorizer is None:  # not read yet: the request waits, unread
            return Defer(UNREAD_WAIT_MS, "the cluster's ACLs are not read yet")
        key, version = head.api_key, head.api_version
        principal, host = _who(ctx)
        if key == apis.PRODUCE or key == apis.FETCH:
            op = WRITE if key == apis.PRODUCE else READ
            if authorizer.allowed_every(principal, host, TOPIC, op) and (
                    key == apis.FETCH
                    or authorizer.allowed_every(principal, host, TRANSACTIONAL_ID, WRITE)):
                return None
            if key == apis.FETCH and version >= 7:
                verdict = self._fetch_session(ctx, head)
                if verdict is not None:
                    return verdict

        # read whole first (asked again then), even when its head holds all of it:
        # only a request gathered whole may be replaced
        if not ctx.request_whole:
            return GATHER_WHOLE
        allowed = _Decider(authorizer, principal, host)
        frame = head.buf
        try:
            if key == apis.PRODUCE and _produce_allowed(frame, head, allowed):
                return None  # read with the proxy's own walker: nothing to decode
            if key == apis.FETCH and version >= 4 and all(
                    isinstance(t, str) and allowed(TOPIC, t, READ)
                    for t in wire.fetch_request_topics(frame, head.body_offset, version)):
                return None  # likewise
            if key in CLUSTER_APIS:
                if allowed(CLUSTER, CLUSTER_NAME, CLUSTER_APIS[key]):
                    return None
                return self._refuse_top_level(ctx, head, wire.CLUSTER_AUTHORIZATION_FAILED)
            if key in DELEGATION_TOKEN_APIS:
                return self._close(ctx, head, "a delegation token made through the proxy would "
                                   "be the proxy's own")
            if key in FIRST_FIELD_GROUP:
                group = _first_compact_string(frame, head)
                if not allowed(GROUP, group or "", FIRST_FIELD_GROUP[key]):
                    return self._refuse_top_level(ctx, head, wire.GROUP_AUTHORIZATION_FAILED)
                if key in HEARTBEATS:
                    names, _ = group_answers.subscribed_topics(key, version, frame,
                                                               head.body_offset)
                    if names and not all(allowed(TOPIC, n, DESCRIBE) for n in names):
                        return self._refuse_top_level(ctx, head,
                                                      wire.TOPIC_AUTHORIZATION_FAILED)
                    if not allowed.every(TOPIC, DESCRIBE):
                        # the coordinator assigns as the proxy's principal (a regex
                        # may match topics she may not see): her answer is read
                        ctx.note(inflight, allowed)
                        ctx.gather_response(inflight)
                if key == STREAMS_GROUP_HEARTBEAT:
                    names = streams_topology.topology_topics(key, version, frame,
                                                             head.body_offset)
                    # an invalid topology is the broker's to answer (before any topic
                    # is authorized, as Kafka does)
                    if names and streams_topology.invalid_topology(names) is None and not all(
                            allowed(TOPIC, n, DESCRIBE) for n in names):
                        return self._refuse_top_level(ctx, head,
                                                      wire.TOPIC_AUTHORIZATION_FAILED)
                if key in SHARE_DATA_APIS and not allowed.every(TOPIC, READ):
                    return self._share_topics(ctx, head, inflight, frame, allowed)
                if key in SHARE_OFFSET_APIS and not allowed.every(TOPIC, READ):
                    return self._share_offsets(ctx, head, inflight, allowed)
                return None
            if key == DESCRIBE_SHARE_GROUP_OFFSETS:
                groups = _share_offsets_groups(frame, head.body_offset)
                if all(allowed(GROUP, g, DESCRIBE) and (
                        allowed.every(TOPIC, DESCRIBE) if topics is None
                        else all(allowed(TOPIC, t, DESCRIBE) for t in topics))
                       for g, topics in groups):
                    return None
                return self._describe_share_offsets(ctx, head, inflight, allowed)
            if key in GROUP_ARRAY_FIRST:
                op = GROUP_ARRAY_FIRST[key]
                groups = _first_compact_strings(frame, head)
                refused = [g for g in groups if not allowed(GROUP, g or "", op)]
                if not refused:
                    return None
                answer = group_answers.describe_groups_error_response(
                    key, version, head.correlation_id, refused, wire.GROUP_AUTHORIZATION_FAILED)
                if len(refused) == len(groups):
                    return Answer(answer)
                # the allowed groups asked of the broker, the refused ones put into its answer
                ctx.note(inflight, answer)
                ctx.gather_response(inflight)
                return Replace(group_answers.groups_request_without(
                    frame, head.body_offset, lambda g: allowed(GROUP, g, op)))
            if wire.request_class(key) is None:
                return self._close(ctx, head, "no decoder to check it with")
            request = wire.decode(key, version, frame)
            handler = _HANDLERS.get(key)
            if handler is not None:
                return handler(self, ctx, head, inflight, request, allowed)
            if key in TOPIC_LISTS:
                return self._topic_list(ctx, head, inflight, request, allowed)
            return self._close(ctx, head, "no rule for it")
        except (ProtocolError, ValueError) as exc:  # the walker's ValueError: past the frame
            return Refuse("malformed api key %d v%d request: %s" % (key, version, exc))

    # answers -------------------------------------------------------------------

    def _refuse_top_level(self, ctx, head, error):
        key, version = head.api_key, head.api_version
        if key in GROUP_ANSWERED:
            # Kafka's answer of 91 and 92 carries the error's message too
            message = share_offsets.MESSAGES.get(error) if key in SHARE_OFFSET_APIS else None
            try:
                return Answer(group_answers.error_response(key, version, head.correlation_id,
                                                           error, message))
            except ValueError:  # a version the proxy has no layout of
                return self._close(ctx, head, "refused, in a version the proxy cannot answer")
        if wire.has_field(key, version, "error_code"):
            fields = {"error_code": error}
            if wire.has_field(key, version, "error_message"):
                fields["error_message"] = None
            return Answer(wire.response_for(key, version, head.correlation_id, **fields))
        return self._close(ctx, head, "refused, and its answer has no error field")

    def _close(self, ctx, head, why):
        return Refuse("api key %d v%d for principal %s: %s (--authorization acls)"
                      % (head.api_key, head.api_version, ctx.principal, why),
                      REFUSED_AUTHORIZATION)

    def _produce(self, ctx, head, inflight, request, allowed):
        """Produce: WRITE on its transactional id (refused: every partition
        answered TRANSACTIONAL_ID_AUTHORIZATION_FAILED), then on each topic."""
        txn = request.transactional_id
        if txn is not None and not allowed(TRANSACTIONAL_ID, txn, WRITE):
            if request.acks == 0:
                return self._close(ctx, head, "an acks=0 Produce of a refused transactional id")
            return _all_topics_refused(self, head, request,
                                       wire.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
        return self._topic_list(ctx, head, inflight, request, allowed)

    def _topic_list(self, ctx, head, inflight, request, allowed, extra=None):
        """A topic-list API: each topic checked; the refused ones answered
        TOPIC_AUTHORIZATION_FAILED (UNKNOWN_TOPIC_ID for an id the principal
        cannot have been given), the rest served by the broker."""
        key, version = head.api_key, head.api_version
        spec = TOPIC_LISTS[key]
        entries = list(getattr(request, spec.req_topics, None) or [])
        kept, refused, errors = [], [], []
        for entry in entries:
            name = wire.topic_key(entry, spec, self.topic_names)
            if name is None:
                # an id this process has not seen: Kafka's answer for an unknown
                # one, which clients retry after a Metadata refresh, by when it is
                # read (the topic may be new, or named on another worker)
                self.view.want_topic_ids()
                refused.append(entry)
                errors.append(wire.UNKNOWN_TOPIC_ID)
            elif allowed(TOPIC, name, spec.operation) and (
                    extra is None or extra(name)):
                kept.append(entry)
            else:
                refused.append(entry)
                errors.append(wire.TOPIC_AUTHORIZATION_FAILED)
        if not refused:
            return None
        if key == apis.PRODUCE and request.acks == 0:
            # no answer is awaited: Kafka closes the connection of an acks=0 Produce it refuses
            return self._close(ctx, head, "an acks=0 Produce to a refused topic")
        answered = wire.refused_topic_entries(key, version, request, refused, errors)
        if not kept:
            fields = {spec.resp_topics: answered}
            if key == apis.FETCH:
                fields.update(error_code=0, session_id=0)
            return Answer(wire.response_for(key, version, head.correlation_id, **fields))
        setattr(request, spec.req_topics, kept)
        if key == apis.PRODUCE:
            if len(self.merging) >= MERGING_KEPT:
                self.merging.clear()  # those of closed connections: only the short way lost
            self.merging.add(head.correlation_id)
            ctx.note(inflight, answered)
        elif key in MERGED:
            ctx.note(inflight, answered)
        elif key == apis.FETCH:
            # the answer is read whole for this one only, and the refused
            # topics' entries put in as they are, the records left alone
            ctx.note(inflight, wire.fetch_topic_entries(version, answered))
            ctx.gather_response(inflight)
        return Replace(wire.encode(request, head.correlation_id, head.client_id))

    # responses -----------------------------------------------------------------

    def on_response(self, ctx, inflight, frame):
        key = inflight.api_key
        if key == apis.METADATA:
            return self._metadata_response(ctx, inflight, frame)
        if key == LIST_GROUPS:
            return self._list_groups_response(ctx, inflight, frame)
        answered = ctx.noted(inflight)
        if answered is None:
            return frame
        if key == apis.PRODUCE:
            self.merging.discard(inflight.correlation_id)
        if key == apis.FETCH:
            return wire.add_fetch_topics(frame, inflight.api_version, answered)
        if key in HEARTBEATS:
            return self._assignment(inflight, frame, answered)
        if key in SHARE_DATA_APIS:
            for answer in answered:
                frame = share_topics.add_topics(key, inflight.api_version, frame, answer)
            return frame
        if key in GROUP_ARRAY_FIRST:
            return group_answers.add_described_groups(frame, answered)
        if key in share_offsets.KEYS:
            response = share_offsets.decode_response(key, inflight.api_version, frame)
            answered.into(response)
            return share_offsets.encode_response(response, inflight.correlation_id)
        if answered.__class__ is _Merge:
            response = wire.decode_response(key, inflight.api_version, frame)
            answered.into(response)
            return wire.encode_response(response, inflight.correlation_id)
        if key == apis.FIND_COORDINATOR:
            response = wire.decode_response(key, inflight.api_version, frame)
            response.coordinators = list(response.coordinators or []) + answered
            return wire.encode_response(response, inflight.correlation_id)
        spec = TOPIC_LISTS[key]
        response = wire.decode_response(key, inflight.api_version, frame)
        setattr(response, spec.resp_topics,
                list(getattr(response, spec.resp_topics) or []) + answered)
        return wire.encode_response(response, inflight.correlation_id)


    def _fetch_session(self, ctx, head):
        """An incremental Fetch (KIP-227) names only what changed; the broker
        serves the rest of its session as it is. Kafka checks every partition
        of the session on each request; the proxy checks a session's
        partitions when its full request opens it, so after a change of ACLs
        an incremental request is answered FETCH_SESSION_ID_NOT_FOUND, and the
        client opens a new session with a full request, checked whole."""
        state = ctx.state
        generation = self.view.generation
        if head.fetch_session_id == 0 or head.fetch_session_epoch <= 0:
            state.fetch_generation = generation  # a full request: checked now
            return None
        if state.fetch_generation == generation:
            return None
        version = head.api_version
        return Answer(wire.response_for(apis.FETCH, version, head.correlation_id,
                                        error_code=FETCH_SESSION_ID_NOT_FOUND, session_id=0,
                                        responses=[]))

    def _share_topics(self, ctx, head, inflight, frame, allowed):
        """ShareFetch, ShareAcknowledge: READ on each topic (named by id); the
        refused ones (and ids not seen yet: UNKNOWN_TOPIC_ID) are left out of
        the request and answered in the broker's answer as Kafka answers them.
        The request goes on even with no topic left: the broker keeps the share
        session's epoch."""
        key, version, body = head.api_key, head.api_version, head.body_offset
        # a share session's incremental requests name only what changed, and the
        # broker serves the rest of the session: after a change of ACLs the client
        # opens a new one (Kafka's client does on SHARE_SESSION_NOT_FOUND), whose
        # first request names every partition
        state = ctx.state
        generation = self.view.generation
        epoch = share_topics.session_epoch(key, version, frame, body)
        if epoch == 0:
            state.share_generation = generation
        elif epoch > 0 and state.share_generation != generation:
            return Answer(group_answers.error_response(key, version, head.correlation_id,
                                                       SHARE_SESSION_NOT_FOUND))
        names = self.topic_names
        refused, unknown = [], []
        for topic_id, partitions in share_topics.request_partitions(key, version, frame, body):
            name = names.get(topic_id)
            if name is None:
                unknown.append((topic_id, partitions))
            elif not allowed(TOPIC, name, READ):
                refused.append((topic_id, partitions))
        if not refused and not unknown:
            return None
        if unknown:
            self.view.want_topic_ids()
        options = share_topics.refusal_options(key, version, frame, body)
        answers = [share_topics.refused_response(key, version, head.correlation_id, topics,
                                                 error, **options)
                   for topics, error in ((refused, wire.TOPIC_AUTHORIZATION_FAILED),
                                         (unknown, wire.UNKNOWN_TOPIC_ID)) if topics]
        dropped = {topic_id for topic_id, _ in refused + unknown}
        ctx.note(inflight, answers)
        ctx.gather_response(inflight)
        return Replace(share_topics.request_without(key, version, frame, body,
                                                    lambda topic_id: topic_id not in dropped))

    def _share_offsets(self, ctx, head, inflight, allowed):
        """AlterShareGroupOffsets, DeleteShareGroupOffsets (group already
        allowed): READ on each topic; the refused ones are left out of the
        request and answered first in the broker's answer, as Kafka does. The
        request goes on even with no topic left, as Kafka's coordinator is
        asked (it still answers for the group: not found, not empty)."""
        key, version = head.api_key, head.api_version
        request = share_offsets.decode_request(key, version, head.buf)
        topics = list(request.topics or [])
        refused = [t for t in topics if not allowed(TOPIC, t.topic_name or "", READ)]
        if not refused:
            return None
        error = wire.TOPIC_AUTHORIZATION_FAILED
        if key == share_offsets.ALTER_OFFSETS:
            ids = {}
            for topic_id, name in self.topic_names.items():
                ids.setdefault(name, topic_id)
            answered = share_offsets.refused_altered_topics(refused, ids, error)
        else:
            answered = [share_offsets.refused_deleted_topic(t, error) for t in refused]

        def into(response):
            if not response.error_code:  # a top-level error is the whole answer
                response.responses = answered + list(response.responses or [])

        request.topics = _without(topics, refused)
        _later(ctx, inflight, _Merge(into))
        return Replace(share_offsets.encode_request(request, head.correlation_id,
                                                    head.client_id))

    def _describe_share_offsets(self, ctx, head, inflight, allowed):
        """DescribeShareGroupOffsets: DESCRIBE on each group and on each topic a
        group names; refused groups and topics are left out of the request and
        answered in their places in the broker's answer, as Kafka answers them;
        a group naming no topics gets only those the principal may describe."""
        version = head.api_version
        request = share_offsets.decode_request(head.api_key, version, head.buf)
        error = wire.TOPIC_AUTHORIZATION_FAILED
        plan = []  # per group of the request: a refused entry, or (refused topics, see all)
        kept = []
        for group in request.groups or []:
            if not allowed(GROUP, group.group_id or "", DESCRIBE):
                plan.append(share_offsets.refused_group(version, group.group_id,
                                                        wire.GROUP_AUTHORIZATION_FAILED))
                continue
            refused = []
            if group.topics is not None:
                topics = list(group.topics)
                refused = [t for t in topics if not allowed(TOPIC, t.topic_name or "", DESCRIBE)]
                group.topics = _without(topics, refused)
            plan.append(([share_offsets.refused_described_topic(version, t, error)
                          for t in refused], group.topics is None))
            kept.append(group)
        if not kept:
            return Answer(share_offsets.response(head.api_key, version, head.correlation_id,
                                                 groups=plan))

        def into(response):
            answers = iter(list(response.groups or []))
            groups = []
            for step in plan:
                if not isinstance(step, tuple):
                    groups.append(step)
                    continue
                group = next(answers, None)
                if group is None:
                    break
                refused, every = step
                if every:
                    group.topics = [t for t in group.topics or []
                                    if allowed(TOPIC, t.topic_name or "", DESCRIBE)]
                elif refused and not group.error_code:
                    group.topics = list(group.topics or []) + refused
                groups.append(group)
            response.groups = groups + list(answers)

        request.groups = kept
        _later(ctx, inflight, _Merge(into))
        return Replace(share_offsets.encode_request(request, head.correlation_id,
                                                    head.client_id))

    def _assignment(self, inflight, frame, allowed):
        """A heartbeat's answer without the assigned topics the principal may
        not describe; an id not seen yet is left in (and read: the Fetch of
        it is checked on its own)."""
        names = self.topic_names

        def keep(topic_id):
            name = names.get(topic_id)
            if name is None:
                self.view.want_topic_ids()
                return True
            return allowed(TOPIC, name, DESCRIBE)

        return group_answers.assignment_without(inflight.api_key, inflight.api_version, frame,
                                                keep) or frame


class _Merge:
    """What the proxy answered itself of a request sent on in part: put
    into the broker's answer by ``into(response)`` (a decoded response)."""

    __slots__ = ("into",)

    def __init__(self, into):
        self.into = into


def _later(ctx, inflight, merge):
    """The broker's answer to this request is read whole and ``merge`` put into it."""
    ctx.note(inflight, merge)
    ctx.gather_response(inflight)


def _in_part(ctx, head, inflight, request, field, kept, answer_field, answered):
    """A request naming several entries, some refused: none kept, ``answered``
    (the refused ones' answer entries) is the answer; else the request goes on
    with ``kept`` in its ``field``, and ``answered`` is put into the broker's
    answer's ``answer_field``."""
    if not kept:
        return Answer(wire.response_for(head.api_key, head.api_version, head.correlation_id,
                                        **{answer_field: answered}))
    setattr(request, field, kept)
    _later(ctx, inflight, _append(answer_field, answered))
    return Replace(wire.encode(request, head.correlation_id, head.client_id))


def _without(entries, refused):
    """``entries`` less those in ``refused`` (a sublist of them, in order: the
    same objects), in one pass: ``t not in refused`` scanned the refused list
    for every entry, comparing kafka-python objects field by field (a request
    naming 1,000 topics, half of them refused, made 500,000 comparisons)."""
    left = iter(refused)
    nxt = next(left, _END)
    kept = []
    for entry in entries:
        if entry is nxt:
            nxt = next(left, _END)
        else:
            kept.append(entry)
    return kept


_END = object()


def _append(field, entries):
    """A _Merge adding ``entries`` to the response's array ``field``."""
    def into(response):
        setattr(response, field, list(getattr(response, field) or []) + entries)
    return _Merge(into)


def _produce_allowed(frame, head, allowed):
    """Whether a whole Produce is allowed as it is: WRITE on its transactional
    id (if any) and on every topic it names, read with the proxy's own walker
    (codecs/produce.py) rather than decoded; False also when it names a topic
    by id (v13), which the slower path sorts out."""
    version = head.api_version
    pos = head.body_offset
    if version >= 9:  # compact nullable string
        size, pos = read_uvarint(frame, pos)
        size -= 1
    else:
        size = int.from_bytes(frame[pos:pos + 2], "big", signed=True)
        pos += 2
    if size >= 0:
        txn = bytes(frame[pos:pos + size]).decode("utf-8", "replace")
        if not allowed(TRANSACTIONAL_ID, txn, WRITE):
            return False
    topics = {topic for topic, _ in produce_partitions(frame, version)}
    return all(isinstance(t, str) and allowed(TOPIC, t, WRITE) for t in topics)


class _State:
    __slots__ = ("who", "fetch_generation", "share_generation")

    def __init__(self):
        self.who = None  # (Kafka's principal string, host, the principal it was made for)
        # AclView.generation when this connection's last full Fetch was checked
        self.fetch_generation = None
        self.share_generation = None  # the same, for a share session's first request


def _who(ctx):
    """("User:<principal>", the client's address as Kafka writes it), kept per connection."""
    state = ctx.state
    who = state.who
    if who is None or who[2] is not ctx.principal:
        from ...policy.acls import java_host_address

        host = java_host_address(ctx.client_host) if ctx.client_host else ""
        who = state.who = ("User:%s" % ctx.principal, host, ctx.principal)
    return who[0], who[1]


class _Decider:
    """allowed(resource type, name, operation) for one principal and host."""

    __slots__ = ("authorizer", "principal", "host")

    def __init__(self, authorizer, principal, host):
        self.authorizer, self.principal, self.host = authorizer, principal, host

    def __call__(self, resource_type, name, operation):
        return self.authorizer.allowed(self.principal, self.host, resource_type, name, operation)

    def any(self, resource_type, operation):
        return self.authorizer.allowed_any(self.principal, self.host, resource_type, operation)

    def every(self, resource_type, operation):
        return self.authorizer.allowed_every(self.principal, self.host, resource_type,
                                             operation)


# handlers of the APIs whose rules are more than one topic list ----------------

def _metadata(self, ctx, head, inflight, request, allowed):
    """Metadata: every topic (null list) is asked of the broker and the
    answer filtered; named topics the principal may not describe are
    answered refused (the broker's answer then carries them); a topic it may
    describe but not create is not created."""
    topics = request.topics
    # v0 asks for every topic with an empty list; v1+ with a null one
    named = bool(topics)  # v0 asks for every topic with an empty list, v1+ with null
    by_id = frozenset(t.topic_id for t in topics or () if not t.name
                      and getattr(t, "topic_id", None) not in (None, wire.NO_TOPIC_ID))
    ctx.note(inflight, _MetadataAsk(named, allowed, by_id))
    if not topics:
        return None
    changed = False
    if request.allow_auto_topic_creation and not allowed(CLUSTER, CLUSTER_NAME, CREATE):
        for entry in topics:
            if entry.name and not allowed(TOPIC, entry.name, CREATE):
                request.allow_auto_topic_creation = False
                changed = True
                break
    if changed:
        return Replace(wire.encode(request, head.correlation_id, head.client_id))
    return None


class _MetadataAsk:
    __slots__ = ("named", "allowed", "by_id")

    def __init__(self, named, allowed, by_id):
        self.named, self.allowed, self.by_id = named, allowed, by_id


# what Kafka lists in authorized_operations (KIP-430) for a topic and the cluster
TOPIC_OPERATIONS = (READ, WRITE, CREATE, DESCRIBE, DELETE, ALTER, DESCRIBE_CONFIGS,
                    ALTER_CONFIGS)
CLUSTER_OPERATIONS = (CREATE, wire.CLUSTER_ACTION, DESCRIBE_CONFIGS, ALTER_CONFIGS,
                      IDEMPOTENT_WRITE, ALTER, DESCRIBE)
# authorized_operations not asked for (Kafka's INT32_MIN), as the answer's int32 reads it
OPERATIONS_NOT_ASKED = -2 ** 31


def _operations(allowed, kind, name, operations):
    """KIP-430's bitfield of what the principal may do, as kafka-python keeps
    it: the set of the operation codes whose bits are set."""
    return {op for op in operations if allowed(kind, name, op)}


def _metadata_response(self, ctx, inflight, frame):
    """The broker's Metadata answer as this principal may see it, spliced:
    each topic's entry walked past (its partitions skipped, never decoded:
    a cluster's answer may hold 100,000 of them), those it may not describe
    left out (every topic asked for) or answered refused with no partitions
    (named), and the authorized operations where asked for (KIP-430) the
    principal's; every other byte as it came. The frame itself when nothing
    changes."""
    ask = ctx.noted(inflight)
    if ask is None:  # not looked at (no authorizer, or the proxy's own question)
        return frame
    version = inflight.api_version
    try:
        layout = metadata_layout(frame, version)
    except ProtocolError as exc:
        raise ProtocolError("malformed response v%d of api key %d: %s"
                            % (version, apis.METADATA, exc)) from None
    names = self.topic_names
    compact = version >= FLEXIBLE_METADATA
    allowed = ask.allowed
    edits = []
    topics = layout.topics
    kept = 0
    for topic in topics:
        name = topic.name
        raw = topic.topic_id
        topic_id = None
        if raw is not None:
            topic_id = wire.NO_TOPIC_ID if raw == _NO_TOPIC_ID_BYTES else uuid.UUID(bytes=raw)
        if name and topic_id is not None and topic_id != wire.NO_TOPIC_ID:
            if len(names) > TOPIC_IDS_KEPT:
                names.clear()
            names[topic_id] = name
        if not name or allowed(TOPIC, name, DESCRIBE):
            kept += 1
            at = topic.ops_at
            if name and at >= 0 and INT32.unpack_from(frame, at)[0] != OPERATIONS_NOT_ASKED:
                edits.append((at, at + 4, _bitfield(_operations(allowed, TOPIC, name,
                                                                TOPIC_OPERATIONS))))
            continue
        if not ask.named:  # left out
            edits.append((topic.start, topic.end, b""))
            continue
        kept += 1
        edits.append((topic.start, topic.start + 2, INT16.pack(wire.TOPIC_AUTHORIZATION_FAILED)))
        if topic_id is not None and topic_id in ask.by_id:
            # asked by id: the name is not given away (null from v12, empty before)
            edits.append((topic.name_at, topic.id_at,
                          (b"\x00" if version >= 12 else b"\x01") if compact else b"\x00\x00"))
        elif topic_id is not None:
            edits.append((topic.id_at, topic.id_at + 16, _NO_TOPIC_ID_BYTES))
        # no partitions (an empty array)
        edits.append((topic.partitions_at, topic.partitions_end,
                      b"\x01" if compact else b"\x00\x00\x00\x00"))
    if kept != len(topics):
        edits.insert(0, (layout.topics_at, layout.topics_count_end,
                         write_uvarint(kept + 1) if compact else INT32.pack(kept)))
    at = layout.cluster_ops_at  # v8-10: what the broker says is the proxy's
    if at >= 0 and INT32.unpack_from(frame, at)[0] != OPERATIONS_NOT_ASKED:
        edits.append((at, at + 4, _bitfield(_operations(allowed, CLUSTER, CLUSTER_NAME,
                                                        CLUSTER_OPERATIONS))))
    if not edits:
        return frame
    return splice(frame, edits)


FLEXIBLE_METADATA = 9  # compact arrays and strings in a Metadata answer from v9
_NO_TOPIC_ID_BYTES = bytes(16)
_UINT32 = struct.Struct(">I")


def _bitfield(operations):
    """KIP-430's authorized_operations: bit n set for operation code n."""
    bits = 0
    for op in operations:
        bits |= 1 << op
    return _UINT32.pack(bits)


def _find_coordinator(self, ctx, head, inflight, request, allowed):
    """FindCoordinator: DESCRIBE on the group (key type 0) or the
    transactional id (1); v4+ asks for several keys at once."""
    kind = GROUP if request.key_type == 0 else TRANSACTIONAL_ID if request.key_type == 1 \
        else None
    if kind is None:  # a share coordinator key (KIP-932): group:topic-id:partition
        kind = GROUP
    error = wire.ERROR_FOR[kind]
    version = head.api_version
    if version < 4:
        key = request.key or ""
        if kind == GROUP and request.key_type == 2:
            key = key.split(":", 1)[0]
        if allowed(kind, key, DESCRIBE):
            return None
        return Answer(wire.response_for(10, version, head.correlation_id, error_code=error,
                                        error_message=None, node_id=-1, host="", port=-1))
    keys = list(request.coordinator_keys or [])
    refused = [k for k in keys
               if not allowed(kind, k.split(":", 1)[0] if request.key_type == 2 else k,
                              DESCRIBE)]
    if not refused:
        return None
    coordinator = wire.response_class(10)[version].fields["coordinators"].data_class
    answered = [coordinator(key=k, node_id=-1, host="", port=-1, error_code=error,
                            error_message=None) for k in refused]
    if len(refused) == len(keys):
        return Answer(wire.response_for(10, version, head.correlation_id, coordinators=answered))
    # the allowed keys asked of the broker, the refused ones put into its answer
    request.coordinator_keys = _without(keys, refused)
    ctx.note(inflight, answered)
    return Replace(wire.encode(request, head.correlation_id, head.client_id))


def _group_first(self, ctx, head, inflight, request, allowed):
    op = GROUP_APIS[head.api_key]
    if allowed(GROUP, request.group_id or "", op):
        return None
    return self._refuse_top_level(ctx, head, wire.GROUP_AUTHORIZATION_FAILED)


def _offset_commit(self, ctx, head, inflight, request, allowed):
    if not allowed(GROUP, request.group_id or "", READ):
        return _all_topics_refused(self, head, request, wire.GROUP_AUTHORIZATION_FAILED)
    return self._topic_list(ctx, head, inflight, request, allowed)


def _txn_offset_commit(self, ctx, head, inflight, request, allowed):
    if not allowed(TRANSACTIONAL_ID, request.transactional_id or "", WRITE):
        return _all_topics_refused(self, head, request,
                                   wire.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
    if not allowed(GROUP, request.group_id or "", READ):
        return _all_topics_refused(self, head, request, wire.GROUP_AUTHORIZATION_FAILED)
    return self._topic_list(ctx, head, inflight, request, allowed)


def _offset_delete(self, ctx, head, inflight, request, allowed):
    if not allowed(GROUP, request.group_id or "", DELETE):
        return self._refuse_top_level(ctx, head, wire.GROUP_AUTHORIZATION_FAILED)
    return self._topic_list(ctx, head, inflight, request, allowed)


def _all_topics_refused(self, head, request, error):
    key, version = head.api_key, head.api_version
    spec = TOPIC_LISTS[key]
    entries = list(getattr(request, spec.req_topics, None) or [])
    answered = wire.refused_topic_entries(key, version, request, entries,
                                          [error] * len(entries))
    return Answer(wire.response_for(key, version, head.correlation_id,
                                    **{spec.resp_topics: answered}))


def _offset_fetch(self, ctx, head, inflight, request, allowed):
    """OffsetFetch: DESCRIBE on each group (v8+ names several), then on each
    topic it names (a null list: the broker leaves out what the principal
    may not see... as the proxy's principal, so the answer is read). Refused
    groups are answered GROUP_AUTHORIZATION_FAILED and refused topics
    TOPIC_AUTHORIZATION_FAILED on each partition, in the broker's answer."""
    version = head.api_version
    names = self.topic_names
    if version < 8:
        if not allowed(GROUP, request.group_id or "", DESCRIBE):
            if version >= 2:
                return Answer(wire.response_for(9, version, head.correlation_id, topics=[],
                                                error_code=wire.GROUP_AUTHORIZATION_FAILED))
            topic_cls = wire.response_class(9)[version].fields["topics"].data_class
            return Answer(wire.response_for(9, version, head.correlation_id, topics=[
                _refused_offsets(topic_cls, t, names, wire.GROUP_AUTHORIZATION_FAILED)
                for t in request.topics or []]))
        if request.topics is None:  # every topic the group has offsets for
            if allowed.every(TOPIC, DESCRIBE):
                return None
            _later(ctx, inflight, _Merge(lambda r: _offsets_seen(r, allowed)))
            return None
        kept, refused = _split_topics(request.topics, allowed, names)
        if not refused:
            return None
        topic_cls = wire.response_class(9)[version].fields["topics"].data_class
        answered = [_refused_offsets(topic_cls, t, names) for t in refused]
        if not kept:
            fields = {"topics": answered}
            if version >= 2:
                fields["error_code"] = 0
            return Answer(wire.response_for(9, version, head.correlation_id, **fields))
        request.topics = kept
        _later(ctx, inflight, _append("topics", answered))
        return Replace(wire.encode(request, head.correlation_id, head.client_id))
    group_cls = wire.response_class(9)[version].fields["groups"].data_class
    topic_cls = group_cls.fields["topics"].data_class
    kept_groups, refused_groups, per_group, every_topic = [], [], {}, []
    for group in request.groups or []:
        if not allowed(GROUP, group.group_id or "", DESCRIBE):
            refused_groups.append(group_cls(group_id=group.group_id, topics=[],
                                            error_code=wire.GROUP_AUTHORIZATION_FAILED))
            continue
        kept_groups.append(group)
        if group.topics is None:
            every_topic.append(group.group_id)
            continue
        kept, refused = _split_topics(group.topics, allowed, names)
        if refused:
            group.topics = kept
            per_group[group.group_id] = [_refused_offsets(topic_cls, t, names)
                                         for t in refused]
    if every_topic and allowed.every(TOPIC, DESCRIBE):
        every_topic = []
    if not refused_groups and not per_group and not every_topic:
        return None
    if not kept_groups:
        return Answer(wire.response_for(9, version, head.correlation_id, groups=refused_groups))

    def into(response):
        for group in response.groups or []:
            if group.group_id in every_topic:
                group.topics = [t for t in group.topics or []
                                if _described(allowed, t, names)]
            group.topics = list(group.topics or []) + per_group.get(group.group_id, [])
        response.groups = list(response.groups or []) + refused_groups

    _later(ctx, inflight, _Merge(into))
    if refused_groups or per_group:
        request.groups = kept_groups
        return Replace(wire.encode(request, head.correlation_id, head.client_id))
    return None


def _split_topics(topics, allowed, names):
    kept, refused = [], []
    for topic in topics:
        (kept if _described(allowed, topic, names) else refused).append(topic)
    return kept, refused


def _described(allowed, topic, names):
    """Whether the principal may describe an OffsetFetch topic (by name, or by id from v10)."""
    name = topic.name
    if not name:
        topic_id = getattr(topic, "topic_id", None)
        name = names.get(topic_id) if topic_id is not None else None
        if name is None:
            return False
    return allowed(TOPIC, name, DESCRIBE)


def _refused_offsets(topic_cls, topic, names, error=wire.TOPIC_AUTHORIZATION_FAILED):
    """Kafka's answer for an OffsetFetch topic it refuses: each partition asked
    with ``error``, no offset (-1)."""
    part_cls = topic_cls.fields["partitions"].data_class
    fields = {"name": topic.name or ""}
    if "topic_id" in topic_cls.fields:
        fields["topic_id"] = getattr(topic, "topic_id", None) or wire.NO_TOPIC_ID
    fields["partitions"] = [
        part_cls(partition_index=i, committed_offset=-1, committed_leader_epoch=-1,
                 metadata="", error_code=error)
        for i in topic.partition_indexes or []]
    return topic_cls(**fields)


def _offsets_seen(response, allowed):
    response.topics = [t for t in response.topics or [] if allowed(TOPIC, t.name or "",
                                                                   DESCRIBE)]


def _named(kind, op, field, answer_field, id_field, **blank):
    """A request naming resources of ``kind`` (groups, transactional ids) in
    ``field``: ``op`` on each; a refused one is answered ``kind``'s
    AUTHORIZATION_FAILED in the broker's answer's ``answer_field``, named in
    its ``id_field``, its other fields ``blank`` (those its version has)."""
    error = wire.ERROR_FOR[kind]

    def handler(self, ctx, head, inflight, request, allowed):
        names = list(getattr(request, field) or [])
        refused = [n for n in names if not allowed(kind, n or "", op)]
        if not refused:
            return None
        entry_cls = wire.response_class(head.api_key)[head.api_version].fields[
            answer_field].data_class
        extra = {k: v for k, v in blank.items() if k in entry_cls.fields}
        answered = [entry_cls(error_code=error, **{id_field: n}, **extra) for n in refused]
        return _in_part(ctx, head, inflight, request, field, _without(names, refused),
                        answer_field, answered)
    return handler


def _list_groups(self, ctx, head, inflight, request, allowed):
    if not allowed(CLUSTER, CLUSTER_NAME, DESCRIBE):
        ctx.note(inflight, allowed)  # the answer lists only the groups it may describe
    return None


def _list_groups_response(self, ctx, inflight, frame):
    allowed = ctx.noted(inflight)
    if allowed is None:
        return frame
    response = wire.decode_response(LIST_GROUPS, inflight.api_version, frame)
    response.groups = [g for g in response.groups or []
                       if allowed(GROUP, g.group_id or "", DESCRIBE)]
    return wire.encode_response(response, inflight.correlation_id)


def _init_producer_id(self, ctx, head, inflight, request, allowed):
    txn = request.transactional_id
    if txn is not None:
        ok = allowed(TRANSACTIONAL_ID, txn, WRITE)
        error = wire.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    else:  # idempotence (KIP-679): IdempotentWrite on the cluster, or Write on some topic
        ok = allowed(CLUSTER, CLUSTER_NAME, IDEMPOTENT_WRITE) or allowed.any(TOPIC, WRITE)
        error = wire.CLUSTER_AUTHORIZATION_FAILED
    if ok:
        return None
    return self._refuse_top_level(ctx, head, error)


def _txn_first(op_group=None):
    def handler(self, ctx, head, inflight, request, allowed):
        if not allowed(TRANSACTIONAL_ID, request.transactional_id or "", WRITE):
            return self._refuse_top_level(ctx, head, wire.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
        if op_group is not None and not allowed(GROUP, request.group_id or "", op_group):
            return self._refuse_top_level(ctx, head, wire.GROUP_AUTHORIZATION_FAILED)
        return None
    return handler


def _add_partitions_to_txn(self, ctx, head, inflight, request, allowed):
    """AddPartitionsToTxn: WRITE on the transactional id, then on each topic.
    Up to v3 (clients), a refused topic fails the whole request as Kafka
    fails it: TOPIC_AUTHORIZATION_FAILED on its partitions, OPERATION_NOT_ATTEMPTED
    on the others. v4+ (batched, sent by brokers to verify) is checked whole."""
    version = head.api_version
    if version <= 3:
        txns = [(request.v3_and_below_transactional_id, request.v3_and_below_topics)]
    else:
        txns = [(t.transactional_id, t.topics) for t in request.transactions or []]
    for txn, topics in txns:
        if not allowed(TRANSACTIONAL_ID, txn or "", WRITE):
            return self._refuse_top_level(ctx, head, wire.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
        refused = {t.name for t in topics or [] if not allowed(TOPIC, t.name or "", WRITE)}
        if not refused:
            continue
        if version > 3:
            return self._close(ctx, head, "a topic it names is refused")
        topic_cls = wire.response_class(24)[version].fields[
            "results_by_topic_v3_and_below"].data_class
        part_cls = topic_cls.fields["results_by_partition"].data_class
        return Answer(wire.response_for(24, version, head.correlation_id,
                                        results_by_topic_v3_and_below=[
            topic_cls(name=t.name, results_by_partition=[
                part_cls(partition_index=p, partition_error_code=(
                    wire.TOPIC_AUTHORIZATION_FAILED if t.name in refused
                    else OPERATION_NOT_ATTEMPTED))
                for p in t.partitions or []])
            for t in topics or []]))
    return None


_CONFIG_RESOURCES = {2: TOPIC, 4: CLUSTER, 8: CLUSTER, 16: CLUSTER}  # broker logger: cluster


def _configs(op):
    """DescribeConfigs, AlterConfigs, IncrementalAlterConfigs: ``op`` on each
    topic named, or on the cluster for a broker's (and its loggers'); a
    refused resource is answered TOPIC_ or CLUSTER_AUTHORIZATION_FAILED in
    the broker's answer."""
    def handler(self, ctx, head, inflight, request, allowed):
        key, version = head.api_key, head.api_version
        resources = list(request.resources or [])
        kept, refused = [], []
        for resource in resources:
            kind = _CONFIG_RESOURCES.get(resource.resource_type, CLUSTER)
            name = resource.resource_name if kind == TOPIC else CLUSTER_NAME
            (kept if allowed(kind, name or "", op) else refused).append((resource, kind))
        if not refused:
            return None
        field = "results" if key == 32 else "responses"
        result_cls = wire.response_class(key)[version].fields[field].data_class
        extra = {"configs": []} if "configs" in result_cls.fields else {}
        answered = [result_cls(error_code=wire.ERROR_FOR[kind], error_message=None,
                               resource_type=r.resource_type, resource_name=r.resource_name,
                               **extra) for r, kind in refused]
        return _in_part(ctx, head, inflight, request, "resources", [r for r, _ in kept], field,
                        answered)
    return handler


def _create_topics(self, ctx, head, inflight, request, allowed):
    if allowed(CLUSTER, CLUSTER_NAME, CREATE):
        return None
    return self._topic_list(ctx, head, inflight, request, allowed)


def _describe_topic_partitions(self, ctx, head, inflight, request, allowed):
    """DescribeTopicPartitions: DESCRIBE on each topic named (a refused one
    answered TOPIC_AUTHORIZATION_FAILED in the broker's answer); with none
    named the broker lists every topic, and the answer keeps those the
    principal may describe. The operations it says are the principal's."""
    topics = list(request.topics or [])
    refused = [t for t in topics if not allowed(TOPIC, t.name or "", DESCRIBE)]
    version = head.api_version
    topic_cls = wire.response_class(75)[version].fields["topics"].data_class
    answered = [topic_cls(error_code=wire.TOPIC_AUTHORIZATION_FAILED, name=t.name,
                          topic_id=wire.NO_TOPIC_ID, is_internal=False, partitions=[],
                          topic_authorized_operations=OPERATIONS_NOT_ASKED) for t in refused]
    if topics and len(refused) == len(topics):
        return Answer(wire.response_for(75, version, head.correlation_id, topics=answered,
                                        next_cursor=None))

    def into(response):
        kept = []
        for topic in response.topics or []:
            name = topic.name or ""
            if topic.error_code == 0 and not allowed(TOPIC, name, DESCRIBE):
                continue  # listed because the proxy's principal may see it
            if topic.topic_authorized_operations != OPERATIONS_NOT_ASKED:
                # a plain int32 bitfield here (KIP-430's, one bit per operation code)
                topic.topic_authorized_operations = sum(
                    1 << op for op in _operations(allowed, TOPIC, name, TOPIC_OPERATIONS))
            kept.append(topic)
        response.topics = kept + answered

    _later(ctx, inflight, _Merge(into))
    if refused:
        request.topics = _without(topics, refused)
        return Replace(wire.encode(request, head.correlation_id, head.client_id))
    return None


def _list_transactions(self, ctx, head, inflight, request, allowed):
    """ListTransactions: the answer lists the transactional ids the principal
    may describe, as Kafka's does."""
    if allowed.every(TRANSACTIONAL_ID, DESCRIBE):
        return None

    def into(response):
        response.transaction_states = [
            t for t in response.transaction_states or []
            if allowed(TRANSACTIONAL_ID, t.transactional_id or "", DESCRIBE)]

    _later(ctx, inflight, _Merge(into))
    return None


_HANDLERS = {
    apis.PRODUCE: Authorization._produce,
    apis.METADATA: _metadata,
    apis.FIND_COORDINATOR: _find_coordinator,
    8: _offset_commit,
    9: _offset_fetch,
    11: _group_first, 12: _group_first, 13: _group_first, 14: _group_first,
    15: _named(GROUP, DESCRIBE, "groups", "groups", "group_id", group_state="",
               protocol_type="", protocol_data="", members=[], authorized_operations=None),
    LIST_GROUPS: _list_groups,
    19: _create_topics,
    22: _init_producer_id,
    24: _add_partitions_to_txn,
    25: _txn_first(READ),
    26: _txn_first(),
    28: _txn_offset_commit,
    32: _configs(DESCRIBE_CONFIGS),
    33: _configs(ALTER_CONFIGS),
    42: _named(GROUP, DELETE, "groups_names", "results", "group_id"),
    44: _configs(ALTER_CONFIGS),
    47: _offset_delete,
    65: _named(TRANSACTIONAL_ID, DESCRIBE, "transactional_ids", "transaction_states",
               "transactional_id", transaction_state="", transaction_timeout_ms=0,
               transaction_start_time_ms=-1, producer_id=-1, producer_epoch=-1, topics=[]),
    66: _list_transactions,
    75: _describe_topic_partitions,
}
Authorization._metadata_response = _metadata_response
Authorization._list_groups_response = _list_groups_response
