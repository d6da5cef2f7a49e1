"""Kafka's quota and SCRAM admin APIs, answered by the proxy for what it
owns (``--admin-principals``): kafka-configs.sh --bootstrap-server, Strimzi's
User Operator and Terraform manage kthrottle's quotas and users through the
proxy's own address.

- DescribeClientQuotas / AlterClientQuotas (KIP-546) from and to the quota
  source (the quota file, or ZooKeeper): a change is in force on this proxy
  before the answer goes out, on other proxies as they follow the source.
  A source the cluster owns (``owned_by_cluster``) gets the request
  forwarded, and is asked to re-read (``refresh_soon()``) once the broker's
  AlterClientQuotas answer has passed.
- DescribeUserScramCredentials / AlterUserScramCredentials (KIP-554) from
  and to the credential store of ``--sasl-mode terminate``: the salted
  password the client sends becomes Kafka's stored_key/server_key.
- Only the principals listed may (Kafka's super.users convention); anyone
  else gets CLUSTER_AUTHORIZATION_FAILED on every entry, as a broker with an
  authorizer answers. What the proxy does not own (no quota source, no
  credential store) is forwarded to the brokers once authorized.
- ApiVersions lists the APIs answered here with the versions answered,
  whatever the broker lists (Tansu has none of them).

Writes to a store block (a file rename, ZooKeeper round trips): they run in
a worker thread (Pending), the connection reading nothing more meanwhile.
"""
import asyncio
import logging

from ...codecs import admin as wire
from ...codecs.apis import API_VERSIONS
from ...codecs.versions import splice_api_ranges, with_api_ranges
from ...options import ConfigError, Option, Parsed
from ...policy import quota_admin as rules
from ..filter import GATHER, HEAD, NOTHING, Answer, Filter, Pending, Refuse

log = logging.getLogger("kthrottle.admin_api")

ADMIN_APIS = wire.QUOTA_APIS + wire.SCRAM_APIS


def parse_admin_principals(value, what="admin-principals"):
    try:
        return rules.parse_principals(value)
    except ValueError as exc:
        raise ConfigError("%s: %s" % (what, exc)) from None


def _in_thread(fn, *args):
    """An awaitable of ``fn(*args)`` run in the loop's default executor."""
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


class AdminApi(Filter):
    name = "admin-api"
    options_title = "admin API (KIP-546 quotas, KIP-554 SCRAM users)"
    options = (
        Option("admin-principals", Parsed(parse_admin_principals), default=frozenset(),
               metavar="LIST",
               help="principals that may describe and alter quotas and SCRAM users through "
               "the proxy's admin API (DescribeClientQuotas, AlterClientQuotas, "
               "DescribeUserScramCredentials, AlterUserScramCredentials), as Kafka's "
               "super.users: 'User:admin;User:ops' (or comma-separated); User:ANONYMOUS "
               "allows a PLAINTEXT listener. The proxy then answers those APIs from and to "
               "its quota source and credential store; others get "
               "CLUSTER_AUTHORIZATION_FAILED. Unset: the brokers answer them"),
    )

    @classmethod
    def build(cls, config, services):
        if not config.admin_principals:
            return None
        return cls(config.admin_principals, quota_source=services.quota_source,
                   quotas=services.quotas, credential_source=services.credential_source,
                   credentials=services.credentials)

    def __init__(self, principals, quota_source=None, quotas=None, credential_source=None,
                 credentials=None, run_blocking=_in_thread):
        """``quotas``: the policy QuotaManager (whose snapshot is described);
        ``credentials()``: the credentials snapshot in force;
        ``run_blocking(fn, *args)``: fn's result or an awaitable of it."""
        self.principals = frozenset(principals)
        self.quota_source = quota_source
        self.quotas = quotas
        self.credential_source = credential_source
        self.credentials = credentials
        self.run_blocking = run_blocking
        self.cluster_quotas = getattr(quota_source, "owned_by_cluster", False)
        self.answers_quotas = (not self.cluster_quotas and quotas is not None
                               and hasattr(quota_source, "alter_entities"))
        self.answers_scram = credentials is not None and hasattr(credential_source, "alter_users")
        # ApiVersions: the proxy's own ranges for what it answers; the
        # brokers' (up to what it can refuse in) for what it forwards
        answered = set()
        if self.answers_quotas:
            answered.update(wire.QUOTA_APIS)
        if self.answers_scram:
            answered.update(wire.SCRAM_APIS)
        self.answered = {key: wire.VERSIONS[key] for key in sorted(answered)}
        self.clamped = {key: wire.VERSIONS[key][1] for key in ADMIN_APIS if key not in answered}

    # the table ---------------------------------------------------------------

    def request_need(self, api_key, api_version):
        return GATHER if api_key in wire.VERSIONS else NOTHING

    def authenticating_need(self, api_key, api_version):
        return NOTHING  # the authenticator refuses them before authentication

    def response_need(self, api_key, api_version):
        if api_key == API_VERSIONS:
            return GATHER
        if api_key == wire.ALTER_CLIENT_QUOTAS and self.cluster_quotas:
            return HEAD
        return NOTHING

    # ApiVersions -----------------------------------------------------------------

    def api_ranges(self, ranges):
        """The broker's ranges as the proxy advertises them (its own
        ApiVersions answers before authentication: discovery.ApiVersionsCache)."""
        return with_api_ranges(ranges, self.answered, self.clamped)

    def on_response(self, ctx, inflight, frame):
        if inflight.api_key != API_VERSIONS:
            return frame
        new = splice_api_ranges(frame, inflight.api_version, self.answered, self.clamped)
        return frame if new is None else new

    def on_response_head(self, ctx, inflight, head, frame_len):
        # a forwarded AlterClientQuotas has been answered: the cluster's
        # quotas are read again now, not at the next refresh
        if inflight.api_key == wire.ALTER_CLIENT_QUOTAS:
            self.quota_source.refresh_soon()
        return None

    # requests ----------------------------------------------------------------------

    def on_request(self, ctx, head, inflight):
        api_key, version = head.api_key, head.api_version
        low, high = wire.VERSIONS[api_key]
        if not low <= version <= high:
            return Refuse("malformed request from client: api key %d v%d is outside the "
                          "versions the proxy answers (v%d-v%d)" % (api_key, version, low, high))
        request = wire.decode_request(api_key, version, head.buf)
        cid = head.correlation_id
        if ctx.principal not in self.principals:
            log.warning("admin API: principal %s may not use api key %d "
                        "(not in --admin-principals): CLUSTER_AUTHORIZATION_FAILED",
                        ctx.principal, api_key)
            return Answer(wire.refusal(api_key, version, cid, request,
                                       rules.CLUSTER_AUTHORIZATION_FAILED,
                                       rules.CLUSTER_AUTHORIZATION_FAILED_MESSAGE))
        if api_key in self.clamped:
            return None  # not the proxy's own: the brokers answer
        if api_key == wire.DESCRIBE_CLIENT_QUOTAS:
            return Answer(self._describe_quotas(version, cid, request))
        if api_key == wire.ALTER_CLIENT_QUOTAS:
            return self._alter_quotas(ctx, version, cid, request)
        if api_key == wire.DESCRIBE_USER_SCRAM_CREDENTIALS:
            results = rules.describe_scram(self.credentials(), request)
            return Answer(wire.describe_scram_response(version, cid, results))
        return self._alter_scram(ctx, version, cid, request)

    # quotas ------------------------------------------------------------------------

    def _describe_quotas(self, version, cid, request):
        try:
            entries = rules.describe_quotas(self.quotas.config.snapshot, request.components,
                                            request.strict)
        except rules.AdminError as exc:
            return wire.describe_quotas_response(version, cid, None, exc.code, exc.message)
        return wire.describe_quotas_response(version, cid, entries)

    def _alter_quotas(self, ctx, version, cid, request):
        judged = rules.quota_changes((e.entity, e.ops) for e in request.entries)
        changes = [c for _, c in judged if not isinstance(c, rules.AdminError)]
        principal = ctx.principal

        def answer(errors):
            results = []
            for entity, change in judged:
                if isinstance(change, rules.AdminError):
                    results.append((entity, change.code, change.message))
                elif change.path in errors:
                    results.append((entity, rules.UNKNOWN_SERVER_ERROR, errors[change.path]))
                else:
                    results.append((entity, rules.NONE, None))
            return wire.alter_quotas_response(version, cid, results)

        if request.validate_only or not changes:
            return Answer(answer({}))
        source = self.quota_source
        items = [(c.path, c.add, c.delete) for c in changes]

        def done(ctx, result, error):
            if error is not None:
                log.error("admin API: altering quotas in %s failed: %s", source.describe, error)
                return answer({c.path: "cannot write %s: %s" % (source.describe, error)
                               for c in changes})
            errors, then = result
            if then is not None:
                then()
            for path, add, delete in items:
                if path not in errors:
                    log.info("admin API: %s altered quotas of %s in %s: set %s, removed %s",
                             principal, path, source.describe, add or "nothing",
                             ", ".join(delete) or "nothing")
            return answer(errors)

        return Pending(lambda: self.run_blocking(source.alter_entities, items), done)

    # SCRAM ---------------------------------------------------------------------------

    def _alter_scram(self, ctx, version, cid, request):
        from ...sources.credentials import ScramCredential

        snapshot = self.credentials()
        refused, changes = rules.scram_changes(
            request.deletions, request.upsertions,
            lambda user, mechanism: snapshot.scram(mechanism, user) is not None)
        if not changes:
            return Answer(wire.alter_scram_response(version, cid, refused))
        items = [(c.user, {m: ScramCredential(*value) for m, value in c.add.items()}, c.delete)
                 for c in changes]
        source = self.credential_source
        principal = ctx.principal

        def done(ctx, result, error):
            if error is not None:
                log.error("admin API: altering credentials in %s failed: %s",
                          source.describe, error)
                errors = {c.user: "cannot write %s: %s" % (source.describe, error)
                          for c in changes}
            else:
                errors, then = result
                if then is not None:
                    then()
            results = list(refused)
            for user, add, delete in items:
                if user in errors:
                    results.append((user, rules.UNKNOWN_SERVER_ERROR, errors[user]))
                else:
                    results.append((user, rules.NONE, None))
                    log.info("admin API: %s altered the SCRAM credentials of %r in %s: set %s, "
                             "removed %s", principal, user, source.describe,
                             ", ".join(add) or "nothing", ", ".join(delete) or "nothing")
            return wire.alter_scram_response(version, cid, results)

        return Pending(lambda: self.run_blocking(source.alter_users, items), done)
