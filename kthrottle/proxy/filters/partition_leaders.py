"""The partition leaders every Metadata answer names, handed to a quota
callback (KIP-257's update_cluster_metadata) before the client reads them.

A client moves to a partition's new leader right after a Metadata answer
says where it is; a callback that splits quotas by leader (LeaderProportional)
must know as soon as the client does, or the client's first requests to the
new leader count against the share of a broker that, as far as the callback
knows, leads nothing of its. The proxy's periodic read of every leader
(sources.leaders) still covers leaders no client has asked about. Built only
with --quota-callback; a Metadata answer that does not read leaves the
leaders as they were (it goes on to the client unchanged either way).
"""
import logging

from ...codecs import ProtocolError, apis
from ...codecs.metadata_leaders import MAX_VERSION, metadata_leaders
from ..filter import GATHER, NOTHING, Filter

log = logging.getLogger("kthrottle.quotas")


class PartitionLeadersSeen(Filter):
    name = "partition-leaders"

    @classmethod
    def build(cls, config, services):
        manager = services.quotas
        if manager is None or manager.callback is None:
            return None
        return cls(manager)

    def __init__(self, manager):
        self.manager = manager  # policy QuotaManager (with a callback)

    def response_need(self, api_key, api_version):
        if api_key == apis.METADATA and api_version <= MAX_VERSION:
            return GATHER  # gathered anyway, to rewrite its addresses
        return NOTHING

    def on_response(self, ctx, inflight, frame):
        try:
            leaders = metadata_leaders(frame, inflight.api_version)
        except ProtocolError as exc:
            log.debug("partition leaders not read from a Metadata v%d answer: %s",
                      inflight.api_version, exc)
            return frame
        if leaders:
            self.manager.note_leaders(leaders)
        return frame
