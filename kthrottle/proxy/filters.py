"""What the proxy does to requests and responses, as pipeline filters.

Each filter says per API key and version what it needs of a frame, so that
the pipeline's table sends it only those frames. Their order is the order
they see a request in.
"""
from ..codecs import apis, rewrite_response, unsupported_api_versions_response
from ..codecs.request import capped_fetch_head
from ..policy.quotas import client_quotas_apply
from .pipeline import GATHER, HEAD, NOTHING, STREAM, Answer, Filter, Forward, Refuse, Throttle


class VersionGate(Filter):
    """Clients never pick a version the proxy cannot decode (it must read
    every response it may have to rewrite). ApiVersions answers
    are clamped to what the proxy decodes; a too-new ApiVersions request is
    answered UNSUPPORTED_VERSION as a broker would (the client retries
    lower, KIP-511); any other too-new request closes the connection."""

    name = "version-gate"

    def request_need(self, api_key, api_version):
        limit = apis.MAX_DECODABLE_VERSION.get(api_key)
        return HEAD if limit is not None and api_version > limit else NOTHING

    def response_need(self, api_key, api_version):
        return GATHER if api_key == apis.API_VERSIONS else NOTHING

    def on_request(self, conn, head, inflight):
        if head.api_key == apis.API_VERSIONS:
            return Answer(unsupported_api_versions_response(head.correlation_id))
        return Refuse("malformed request from client: request api_key %d v%d is newer than "
                      "the proxy can decode (max v%d)" % (
                          head.api_key, head.api_version,
                          apis.MAX_DECODABLE_VERSION[head.api_key]))

    def on_response(self, conn, inflight, frame):
        new_frame, _ = rewrite_response(frame, inflight.api_key, inflight.api_version, None)
        return frame if new_frame is None else new_frame


class AddressRewrite(Filter):
    """Every broker address a client is given becomes the proxy's, or the
    client connects around the proxy: Metadata, FindCoordinator and
    DescribeCluster are gathered and spliced; the KIP-951 NodeEndpoints at
    the end of Produce v10+ and Fetch v16+ responses are rewritten while the
    records stream on."""

    name = "address-rewrite"
    _GATHERED = (apis.METADATA, apis.FIND_COORDINATOR, apis.DESCRIBE_CLUSTER)

    def __init__(self, advertise):
        from ..codecs.stream import stream_rewriter

        self.advertise = advertise
        self._stream_rewriter = stream_rewriter

    def response_need(self, api_key, api_version):
        if api_key in self._GATHERED:
            return GATHER
        first = apis.NODE_ENDPOINTS_FROM.get(api_key)
        if first is not None and api_version >= first:
            return STREAM
        return NOTHING

    def on_response(self, conn, inflight, frame):
        if inflight.api_key not in self._GATHERED:
            return frame
        new_frame, nodes = rewrite_response(frame, inflight.api_key, inflight.api_version,
                                            self.advertise)
        conn.nodes_seen(nodes)
        return frame if new_frame is None else new_frame

    def stream(self, conn, inflight):
        return self._stream_rewriter(inflight.api_key, inflight.api_version, self.advertise)


class QuotaAccounting(Filter):
    """KIP-55 byte-rate and KIP-124 request-rate quotas: every request is
    counted (the policy says which are exempt), a Fetch response counts its
    size, and what a client earns comes back as a Throttle."""

    name = "quotas"

    def request_need(self, api_key, api_version):
        return HEAD

    def authenticating_need(self, api_key, api_version):
        # a broker answers the requests before authentication (ApiVersions,
        # SASL) in its authenticator, outside the quotas; and the principal
        # they would count against is not known yet
        return NOTHING

    def response_need(self, api_key, api_version):
        return HEAD if api_key == apis.FETCH else NOTHING

    def on_request(self, conn, head, inflight):
        api_key = head.api_key
        if api_key == apis.FETCH and not client_quotas_apply(api_key, head.replica_id):
            return None
        quotas = conn.quotas_for(head.client_id or "")
        inflight.quotas = quotas
        decision = quotas.on_request(api_key, head.frame_len,
                                     head.acks if api_key == apis.PRODUCE else None, conn.now)
        if decision.delay_ms:
            return Throttle(decision.delay_ms, decision.reason)
        return None

    def on_response_head(self, conn, inflight, head, frame_len):
        quotas = inflight.quotas
        if quotas is None:
            return None
        # The response is forwarded whole even when over quota: Kafka answers
        # an over-quota fetch empty, but a proxy that did so would drop
        # records the broker counted as sent to an incremental fetch session
        # (KIP-227). The client is made to wait instead, and its fetch size is
        # capped (FetchCap).
        decision = quotas.on_fetch_response(frame_len, conn.now)
        if decision.delay_ms:
            return Throttle(decision.delay_ms, decision.reason)
        return None


class FetchCap(Filter):
    """A consumer's fetch is capped at what its quota allows at once (Kafka:
    quota x window), so one response cannot carry minutes of quota."""

    name = "fetch-cap"

    def request_need(self, api_key, api_version):
        return HEAD if api_key == apis.FETCH and api_version >= 3 else NOTHING

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # no Fetch gets through before authentication

    def on_request(self, conn, head, inflight):
        if not client_quotas_apply(head.api_key, head.replica_id):
            return None
        cap = conn.quotas_for(head.client_id or "").fetch_max_bytes()
        if cap is None:
            return None
        patched = capped_fetch_head(head, max(int(cap), 1))
        return None if patched is None else Forward(patched)


def standard_filters(advertise, quotas=None, authenticator=None, upstream_login=None,
                     storage=None):
    """The proxy's filters, in the order they see a request: the proxy's
    own login to the broker, then an authenticator, so that nothing reaches
    the others (or the broker) before the client has authenticated. Storage
    comes before the quotas, so that a Produce request held back (PAUSE) is
    counted once, when it goes."""
    filters = [f for f in (upstream_login, authenticator) if f is not None]
    filters += [VersionGate(), AddressRewrite(advertise)]
    if storage is not None:
        filters.append(storage)
    if quotas is not None:
        filters += [QuotaAccounting(), FetchCap()]
    return filters
