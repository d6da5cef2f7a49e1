"""The proxy's filters: one module each, registered below in the order they
see a request.

Adding a filter: a module in this package with a ``Filter`` subclass
(``proxy/filter.py`` says what a filter sees and may do) that names the
``options`` it reads and how ``build(config, services)`` makes it from them
(None when the configuration does not ask for it); then one line in
``REGISTERED``. Its options become flags of ``kthrottle proxy`` and keys of
its TOML file. ``forbidden_api_keys.py`` is the smallest example.
"""
from . import (
    address_rewrite,
    admin_api,
    authorization,
    broker_only,
    client_id_required,
    controller_mutation,
    forbidden_api_keys,
    partition_leaders,
    quotas,
    sasl_passthrough,
    sasl_terminate,
    storage,
    topic_quotas,
    unknown_api_keys,
    upstream_login,
    version_gate,
)

REGISTERED = (
    # an API key the proxy does not know is refused as that, whatever else
    # the connection waits for (its authentication too)
    unknown_api_keys.UnknownApiKeys,
    # the proxy's own login to the broker, then the client's authentication,
    # so that nothing reaches the others (or the broker) before it
    upstream_login.UpstreamSaslLogin,
    sasl_terminate.SaslTerminate,
    sasl_passthrough.SaslPassthrough,
    # an API an operator forbids stays forbidden, even one the proxy answers;
    # so do those only brokers and controllers send
    forbidden_api_keys.ForbiddenApiKeys,
    broker_only.BrokerOnlyApis,
    # a request without the client.id the operator requires reaches nothing else
    client_id_required.ClientIdRequired,
    # after authentication (it needs the principal); it answers in the
    # broker's place, so before what would count or rewrite the request
    admin_api.AdminApi,
    # the cluster's ACLs for the client's own principal: what is refused is
    # answered here, before anything counts it or rewrites it
    authorization.Authorization,
    version_gate.VersionGate,
    address_rewrite.AddressRewrite,
    # before the quotas: a Produce request held back (PAUSE) is counted
    # once, when it goes
    storage.StorageThrottle,
    # a quota callback's partition leaders, from the Metadata answers clients get
    partition_leaders.PartitionLeadersSeen,
    quotas.QuotaAccounting,
    # per-topic quotas: their throttle and the client's, the larger kept
    topic_quotas.TopicQuotas,
    quotas.FetchCap,
    # KIP-599: after the request quota, which counts a refused mutation too
    controller_mutation.ControllerMutationQuota,
)


def build_filters(config, services):
    """The filters the configuration asks for, in the registered order."""
    built = (cls.build(config, services) for cls in REGISTERED)
    return [f for f in built if f is not None]


def standard_filters(advertise, quotas=None, authenticator=None, upstream_login=None,
                     storage=None):
    """The proxy's chain from filters made by hand (tests and benchmarks
    that run a pipeline without a configuration), in the registered order."""
    from .address_rewrite import AddressRewrite
    from .broker_only import BrokerOnlyApis
    from .controller_mutation import ControllerMutationQuota
    from .quotas import FetchCap, QuotaAccounting
    from .topic_quotas import TopicQuotas
    from .unknown_api_keys import UnknownApiKeys
    from .version_gate import VersionGate

    chosen = [UnknownApiKeys(), upstream_login, authenticator, BrokerOnlyApis(), VersionGate(),
              AddressRewrite(advertise), storage]
    if quotas is not None:
        chosen += [QuotaAccounting(), TopicQuotas(quotas), FetchCap(), ControllerMutationQuota()]
    order = {cls: i for i, cls in enumerate(REGISTERED)}
    return sorted((f for f in chosen if f is not None), key=lambda f: order[type(f)])
