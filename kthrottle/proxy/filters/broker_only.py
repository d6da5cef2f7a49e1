"""Refuse, from clients, the requests only brokers and controllers send.

Kafka authorizes these as ClusterAction on the cluster: the ZooKeeper-mode
controller's orders to brokers (LeaderAndIsr, StopReplica, UpdateMetadata,
ControlledShutdown), the KRaft quorum's and brokers' requests to the
controllers, and a share partition leader's to the share coordinator (KIP-932;
the table is ``codecs.apis.BROKER_ONLY_APIS``, which ApiVersions answers
never list either). No broker or controller talks to another through a
client-facing proxy, so from a client they can only be a probe: in
sasl-mode terminate the broker would see them under the proxy's own
principal, which may hold ClusterAction, and they count against no quota.
The connection is closed, as a broker closes one that sends an API its
listener does not serve, with a WARNING naming the API and the principal,
counted in kthrottle_connections_refused_total{reason="broker_only_api"}.

So is a follower's Fetch: ``replica_id`` >= 0 (Fetch v0-14), or from v15 a
ReplicaState tag at the request's end naming a replica (KIP-903), which Kafka
also authorizes as ClusterAction and which a client quota does not count
(KIP-124): a client that claims to be a follower would fetch past every
quota, read past the high watermark, and move the leader's idea of what that
replica holds.

Always on: nothing to configure, and no other API is looked at (the filter
table asks this filter about these keys alone). A consumer's Fetch takes the
short way (Filter.quick): its head is read once per connection and client,
and only a head that names a replica is sent the long way, to be refused;
from v15 each Fetch's end is read for the tag (codecs.request.fetch_replica_state,
a few microseconds), as the head cannot say.
"""
from ...codecs.apis import BROKER_ONLY_APIS, FETCH
from ...codecs.errors import ProtocolError
from ...codecs.request import fetch_replica_state
from ..filter import BUILT_ALWAYS, GATHER_WHOLE, HEAD, NOTHING, QuickFilter, Refuse

REFUSED_BROKER_ONLY_API = "broker_only_api"  # the refusal counter's label

# Fetch versions whose replica_id is a field a client could set (later ones: a tag)
FOLLOWER_FETCH_VERSIONS = range(0, 15)


def _long_way(frame):
    return False


def _replica_state_check(version, body):
    """check(frame) of a Fetch v15+ whose body starts at ``body``: True when
    it names no replica (a malformed one goes the long way, to be refused)."""
    def check(frame):
        try:
            return fetch_replica_state(frame, body, version) < 0
        except ProtocolError:
            return False
    return check


class BrokerOnlyApis(QuickFilter):
    name = "broker-only-apis"
    built = BUILT_ALWAYS

    def request_need(self, api_key, api_version):
        return HEAD if api_key == FETCH or api_key in BROKER_ONLY_APIS else NOTHING

    def quick(self, api_key, api_version):
        return api_key == FETCH

    def quick_check(self, ctx, head):
        # a consumer (replica_id -1) is judged by nothing here; a head that
        # names a replica goes the long way, to on_request
        if head.api_version not in FOLLOWER_FETCH_VERSIONS:
            # the head has the usual layout (QuickHead): header v2 without tags
            return _replica_state_check(head.api_version,
                                        15 + len(head.client_id.encode("utf-8")))
        return _long_way if head.replica_id >= 0 else None

    def on_request(self, ctx, head, inflight):
        if head.api_key == FETCH:
            if head.api_version in FOLLOWER_FETCH_VERSIONS:
                replica_id = head.replica_id
            elif len(head.buf) < head.frame_len:
                return GATHER_WHOLE  # the tag is at its end
            else:
                try:
                    replica_id = fetch_replica_state(head.buf, head.body_offset,
                                                     head.api_version)
                except ProtocolError as exc:
                    return Refuse("malformed Fetch v%d request: %s" % (head.api_version, exc))
            if replica_id < 0:
                return None
            return Refuse("a follower's Fetch (v%d, replica_id %d) is sent by brokers only, "
                          "never through this proxy; principal %s" % (
                              head.api_version, replica_id, ctx.principal),
                          REFUSED_BROKER_ONLY_API)
        return Refuse("%s (api key %d v%d) is sent by brokers and controllers only, never "
                      "through this proxy; principal %s" % (
                          BROKER_ONLY_APIS[head.api_key], head.api_key, head.api_version,
                          ctx.principal), REFUSED_BROKER_ONLY_API)
