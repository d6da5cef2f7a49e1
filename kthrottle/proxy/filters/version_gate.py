"""Clients never pick a version the proxy cannot decode."""
from ...codecs import apis, rewrite_response, unsupported_api_versions_response
from ..filter import BUILT_ALWAYS, GATHER, HEAD, NOTHING, Answer, Filter, Refuse


class VersionGate(Filter):
    """Clients never pick a version the proxy cannot decode (it must read
    every response it may have to rewrite). ApiVersions answers
    are clamped to what the proxy decodes, and list no API the proxy refuses
    (one it does not know, one only brokers send: apis.advertised_range); a
    too-new ApiVersions request is answered UNSUPPORTED_VERSION as a broker
    would (the client retries lower, KIP-511); any other request of a version
    the proxy does not decode (too new, or ShareFetch and ShareAcknowledge
    v0, KIP-932's early access) closes the connection."""

    name = "version-gate"
    built = BUILT_ALWAYS

    def request_need(self, api_key, api_version):
        limit = apis.MAX_DECODABLE_VERSION.get(api_key)
        if limit is not None and api_version > limit:
            return HEAD
        first = apis.MIN_DECODABLE_VERSION.get(api_key)
        return HEAD if first is not None and api_version < first else NOTHING

    def response_need(self, api_key, api_version):
        return GATHER if api_key == apis.API_VERSIONS else NOTHING

    def on_request(self, ctx, head, inflight):
        if head.api_key == apis.API_VERSIONS:
            return Answer(unsupported_api_versions_response(head.correlation_id))
        first = apis.MIN_DECODABLE_VERSION.get(head.api_key)
        if first is not None and head.api_version < first:
            return Refuse("request api_key %d v%d is older than the proxy can decode (min v%d)"
                          % (head.api_key, head.api_version, first))
        return Refuse("malformed request from client: request api_key %d v%d is newer than "
                      "the proxy can decode (max v%d)" % (
                          head.api_key, head.api_version,
                          apis.MAX_DECODABLE_VERSION[head.api_key]))

    def on_response(self, ctx, inflight, frame):
        new_frame, _ = rewrite_response(frame, inflight.api_key, inflight.api_version, None)
        return frame if new_frame is None else new_frame
