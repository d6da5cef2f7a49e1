"""Refuse API keys the proxy does not know.

A key the proxy knows is one kafka-python's schemas describe, one it passes
through on purpose (``codecs.apis.PASSED_THROUGH``: KIP-848's, KIP-714's,
KIP-932's, KIP-1071's ... client APIs), or one only brokers send (refused by
``broker_only.py``). Any other key, a future Kafka's or one Kafka never had,
could carry record data past the quotas or broker addresses past the
rewriting, so it is refused as a broker refuses a key it does not know: the
connection is closed and nothing reaches the broker, with a WARNING naming
the key and the principal, counted in
kthrottle_connections_refused_total{reason="unknown_api_key"}. ApiVersions
answers never list such a key (``codecs.apis.advertised_range``), so a
well-behaved client never sends one.

Always on, first of all the filters and before authentication too: the
reason is this one whatever else the connection is waiting for. No known API
is looked at (the filter table asks this filter about unknown keys alone).
"""
from ...codecs.apis import KNOWN_API_KEYS
from ..filter import BUILT_ALWAYS, HEAD, NOTHING, Filter, Refuse

REFUSED_UNKNOWN_API_KEY = "unknown_api_key"  # the refusal counter's label


class UnknownApiKeys(Filter):
    name = "unknown-api-keys"
    built = BUILT_ALWAYS

    def request_need(self, api_key, api_version):
        return NOTHING if api_key in KNOWN_API_KEYS else HEAD

    # authenticating_need: the same (Filter's default), so that a key
    # unknown before authentication is refused as this one too

    def on_request(self, ctx, head, inflight):
        return Refuse("api key %d (v%d) is not one the proxy knows: refused, not passed to "
                      "the broker; principal %s" % (head.api_key, head.api_version,
                                                      ctx.principal),
                      REFUSED_UNKNOWN_API_KEY)
