"""Require a client.id, as ``--client-id-required``: client-id quotas,
the metrics' ``client_id`` label and the logs are only as useful as the
client-ids clients send, and a client that sends none (null or empty, which
Kafka accepts) shares the default bucket with every other such client.
``--client-id-pattern REGEX`` (implies it) also requires the whole
client.id to match.

A request without one (or not matching) reaches no broker: the connection
is closed, as a broker closes a connection that sends what it refuses, with
a WARNING naming the client.id, the API and the principal, counted in
kthrottle_connections_refused_total{reason="client_id_required"}. Every
request's head is read (the client.id is in each), so Produce and Fetch
requests take the pipeline's long way while this filter is on.
"""
import re

from ...options import SWITCH, ConfigError, Option, Parsed
from ..filter import HEAD, Filter, Refuse

REFUSED_CLIENT_ID_REQUIRED = "client_id_required"  # the refusal counter's label


def parse_pattern(value, what="client-id-pattern"):
    """A regular expression the whole client.id must match."""
    if not isinstance(value, str) or not value:
        raise ConfigError("%s must be a regular expression" % what)
    try:
        return re.compile(value)
    except re.error as exc:
        raise ConfigError("%s: %r is not a regular expression: %s" % (what, value, exc)) \
            from None


class ClientIdRequired(Filter):
    name = "client-id-required"
    options_title = "client.id policy"
    options = (
        Option("client-id-required", SWITCH, default=False,
               help="refuse requests without a client.id (null or empty): the connection is "
               "closed and the request reaches no broker"),
        Option("client-id-pattern", Parsed(parse_pattern), metavar="REGEX",
               help="refuse requests whose client.id does not match this regular expression "
               "as a whole (implies --client-id-required)"),
    )

    @classmethod
    def build(cls, config, services):
        pattern = config.client_id_pattern
        if not (config.client_id_required or pattern is not None):
            return None
        return cls(pattern)

    def __init__(self, pattern=None):
        self.pattern = pattern  # re.Pattern, or None: any non-empty client.id

    def request_need(self, api_key, api_version):
        return HEAD

    def on_request(self, ctx, head, inflight):
        client_id = head.client_id
        if client_id and (self.pattern is None or self.pattern.fullmatch(client_id)):
            return None
        why = ("no client.id" if not client_id else
               "client.id %r does not match --client-id-pattern %s"
               % (client_id, self.pattern.pattern))
        return Refuse("%s (api key %d v%d, principal %s): this proxy requires one "
                      "(--client-id-required)" % (why, head.api_key, head.api_version,
                                                   ctx.principal),
                      REFUSED_CLIENT_ID_REQUIRED)
