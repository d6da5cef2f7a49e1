"""Every broker address a client is given becomes the proxy's."""
from ...codecs import apis, rewrite_response
from ...codecs.stream import stream_rewriter, untouched_check
from ..filter import GATHER, NOTHING, STREAM, QuickFilter


class AddressRewrite(QuickFilter):
    """Every broker address a client is given becomes the proxy's, or the
    client connects around the proxy: Metadata, FindCoordinator and
    DescribeCluster are gathered and spliced; the KIP-951 NodeEndpoints at
    the end of Produce v10+ and Fetch v16+ responses, and KIP-932's at the
    end of ShareFetch and ShareAcknowledge v1+ responses, are rewritten while
    the records stream on. A node id the proxy has no address for (``advertise``
    raises UnmappedNode, a ValueError) closes the one connection whose
    response named it, counted in kthrottle_connections_refused_total."""

    name = "address-rewrite"
    _GATHERED = (apis.METADATA, apis.FIND_COORDINATOR, apis.DESCRIBE_CLUSTER)

    @classmethod
    def build(cls, config, services):
        return cls(services.advertise)

    def __init__(self, advertise):
        self.advertise = advertise

    def response_need(self, api_key, api_version):
        if api_key in self._GATHERED:
            return GATHER
        first = apis.NODE_ENDPOINTS_FROM.get(api_key)
        if first is not None and api_version >= first:
            return STREAM
        return NOTHING

    def on_response(self, ctx, inflight, frame):
        if inflight.api_key not in self._GATHERED:
            return frame
        new_frame, nodes = rewrite_response(frame, inflight.api_key, inflight.api_version,
                                            self.advertise)
        ctx.nodes_seen(nodes)
        return frame if new_frame is None else new_frame

    def quick_response_check(self, api_key, api_version):
        # a NodeEndpoints response with no tagged fields at its end names no
        # broker (the usual Produce answer)
        if api_key in self._GATHERED:
            return None
        return untouched_check(api_key, api_version)

    def stream(self, ctx, inflight):
        return stream_rewriter(inflight.api_key, inflight.api_version, self.advertise)
