"""Clients never pick a version the proxy cannot decode."""
from ...codecs import apis, rewrite_response, unsupported_api_versions_response
from ..filter import GATHER, HEAD, NOTHING, Answer, Filter, Refuse


class VersionGate(Filter):
    """Clients never pick a version the proxy cannot decode (it must read
    every response it may have to rewrite). ApiVersions answers
    are clamped to what the proxy decodes; a too-new ApiVersions request is
    answered UNSUPPORTED_VERSION as a broker would (the client retries
    lower, KIP-511); any other too-new request closes the connection."""

    name = "version-gate"

    @classmethod
    def build(cls, config, services):
        return cls()

    def request_need(self, api_key, api_version):
        limit = apis.MAX_DECODABLE_VERSION.get(api_key)
        return HEAD if limit is not None and api_version > limit else NOTHING

    def response_need(self, api_key, api_version):
        return GATHER if api_key == apis.API_VERSIONS else NOTHING

    def on_request(self, ctx, head, inflight):
        if head.api_key == apis.API_VERSIONS:
            return Answer(unsupported_api_versions_response(head.correlation_id))
        return Refuse("malformed request from client: request api_key %d v%d is newer than "
                      "the proxy can decode (max v%d)" % (
                          head.api_key, head.api_version,
                          apis.MAX_DECODABLE_VERSION[head.api_key]))

    def on_response(self, ctx, inflight, frame):
        new_frame, _ = rewrite_response(frame, inflight.api_key, inflight.api_version, None)
        return frame if new_frame is None else new_frame
