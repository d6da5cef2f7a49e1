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

So is a follower's Fetch: ``replica_id`` >= 0 (Fetch v0-14; from v15 it is a
tag only brokers set, KIP-903), which Kafka also authorizes as ClusterAction
and which a client quota does not count (KIP-124): a client that claims to be
a follower would fetch past every quota.

Always on: nothing to configure, and no other API is looked at (the filter
table asks this filter about these keys alone). A consumer's Fetch takes the
short way (Filter.quick): its head is read once per connection and client,
and only a head that names a replica is sent the long way, to be refused.
"""
from ...codecs.apis import BROKER_ONLY_APIS, FETCH
from ..filter import HEAD, NOTHING, Filter, Refuse

REFUSED_BROKER_ONLY_API = "broker_only_api"  # the refusal counter's label

# Fetch versions whose replica_id is a field a client could set
FOLLOWER_FETCH_VERSIONS = range(0, 15)


def _long_way():
    return False


class BrokerOnlyApis(Filter):
    name = "broker-only-apis"

    @classmethod
    def build(cls, config, services):
        return cls()

    def request_need(self, api_key, api_version):
        if api_key == FETCH:
            return HEAD if api_version in FOLLOWER_FETCH_VERSIONS else NOTHING
        return HEAD if api_key in BROKER_ONLY_APIS else NOTHING

    def quick(self, api_key, api_version):
        return api_key == FETCH

    def quick_check(self, ctx, head):
        # a consumer (replica_id -1) is judged by nothing here; a head that
        # names a replica goes the long way, to on_request
        return _long_way if head.replica_id >= 0 else None

    def on_request(self, ctx, head, inflight):
        if head.api_key == FETCH:
            replica_id = head.replica_id
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
