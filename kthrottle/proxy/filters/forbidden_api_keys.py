"""Refuse the API keys an operator lists, as ``--forbidden-api-keys``: a
proxy in front of a shared cluster commonly blocks the admin APIs
(CreateTopics, DeleteTopics, AlterConfigs ...) for everyone behind it.

A forbidden API is left out of every ApiVersions answer, so a client that
reads them (every Kafka client does) does not send it; a request of it all
the same reaches no broker: the connection is closed, as a broker closes a
connection that sends an API it does not know, with a WARNING naming the API
and the principal, counted in
kthrottle_connections_refused_total{reason="forbidden_api_key"}.
"""
from ...codecs.apis import ALL_RESPONSES, API_VERSIONS
from ...codecs.versions import splice_api_ranges, with_api_ranges
from ...options import ConfigError, Option, Parsed
from ..filter import GATHER, HEAD, NOTHING, Filter, Refuse

REFUSED_FORBIDDEN_API_KEY = "forbidden_api_key"  # the refusal counter's label
# what every client must be able to send: forbidding them would lock everyone out
ALWAYS_ALLOWED = {18: "ApiVersions", 17: "SaslHandshake", 36: "SaslAuthenticate"}
API_NAMES = {cls.__name__[: -len("Response")].lower(): key for key, cls in ALL_RESPONSES.items()}


def parse_api_keys(value, what="forbidden-api-keys"):
    """``19,DeleteTopics`` (numbers or Kafka's API names, or a TOML list of
    them) -> frozenset of API keys; ConfigError names what is wrong."""
    items = value.split(",") if isinstance(value, str) else value
    keys = set()
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        key = int(text) if text.lstrip("-").isdigit() else API_NAMES.get(text.lower())
        if key is None or key < 0:
            raise ConfigError("%s: %r is not an API key (a number, or a name such as "
                              "CreateTopics)" % (what, text))
        if key in ALWAYS_ALLOWED:
            raise ConfigError("%s: %s (API key %d) cannot be forbidden: every client sends it"
                              % (what, ALWAYS_ALLOWED[key], key))
        keys.add(key)
    return frozenset(keys)


class ForbiddenApiKeys(Filter):
    name = "forbidden-api-keys"
    options_title = "forbidden APIs"
    options = (
        Option("forbidden-api-keys", Parsed(parse_api_keys), default=frozenset(), metavar="LIST",
               help="API keys no client may send through the proxy, by number or Kafka's "
               "name, comma-separated (e.g. 'CreateTopics,DeleteTopics,AlterConfigs' or "
               "'19,20,33'); they are left out of ApiVersions answers, and a request of one "
               "closes its connection and reaches no broker"),
    )

    @classmethod
    def build(cls, config, services):
        return cls(config.forbidden_api_keys) if config.forbidden_api_keys else None

    def __init__(self, api_keys):
        self.api_keys = frozenset(api_keys)

    def request_need(self, api_key, api_version):
        return HEAD if api_key in self.api_keys else NOTHING

    def response_need(self, api_key, api_version):
        return GATHER if api_key == API_VERSIONS else NOTHING

    def api_ranges(self, ranges):
        """The ranges the proxy answers ApiVersions with itself, without these keys."""
        return with_api_ranges(ranges, withheld=self.api_keys)

    def on_response(self, ctx, inflight, frame):
        new = splice_api_ranges(frame, inflight.api_version, withheld=self.api_keys)
        return frame if new is None else new

    def on_request(self, ctx, head, inflight):
        return Refuse("api key %d v%d is forbidden on this proxy (--forbidden-api-keys), "
                      "principal %s" % (head.api_key, head.api_version, ctx.principal),
                      REFUSED_FORBIDDEN_API_KEY)
