"""The composition root of ``kthrottle proxy``: what the configuration names
is built (quota source, credential store, filters, cluster state, fleet
membership), started in order, and stopped in reverse however the run ends."""
import asyncio
import logging
import signal

from ..config import ConfigError


def run_loop(main):
    """Run ``main()`` on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


async def _started(stack, component, start, *args):
    """Start a source (or the like) and have the stack stop it; a
    QuotaStoreError (ZooKeeper or a file out of reach) is the command's
    error, and what was started before is stopped."""
    from ..sources import QuotaStoreError

    stack.push_async_callback(component.stop)
    try:
        await start(*args)
    except QuotaStoreError as exc:
        raise SystemExit("kthrottle: error: %s" % exc) from None
    return component


async def serve(config, on_ready=None, worker=None):
    """``worker``: this process's workers.WorkerHub, when it is one of
    several (--workers); None: the proxy is this process alone."""
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        await _serve(config, on_ready, stack, worker)


async def _serve(config, on_ready, stack, worker=None):
    """Everything started is stopped by ``stack``, in reverse order, however
    this ends (an error at start, a signal). With ``worker`` other than the
    primary, the cluster state and the fleet shares come from the primary
    through the hub, and the admin endpoint is the primary's."""
    from .filter import Services
    from .limits import raise_open_files_limit

    raise_open_files_limit(config.max_connections)
    followed = []  # what SIGHUP re-reads at once (files; ZooKeeper sends its changes)
    reload = _on_sighup(stack, followed)
    primary = worker is None or worker.primary
    if worker is not None:
        await worker.start()
        stack.push_async_callback(worker.close)
        worker.on_reload = reload
    services = Services()
    await _start_quotas(config, services, stack, followed, worker, primary)
    await _start_credentials(config, services, stack, followed)
    await _start_acls(config, services, stack)
    server = _proxy_server(config, services, worker)
    fleet = await _follow_cluster(config, services, server.filters, stack, worker, primary)
    for f in server.filters:  # the filters' own tasks, once what they follow is in force
        stack.push_async_callback(f.stop)
        await f.start(services)
    stack.push_async_callback(server.close)
    tls = server.tls_files()
    if tls is not None:  # the certificate, key and CA just loaded, followed from now on
        await _started(stack, tls, tls.start, server.use_tls)
        followed.append(tls)
    await _start_listening(config, server, services, fleet, stack, followed, primary)
    stop = _stop_on_signals(server, worker, services.quotas)
    if fleet is not None:
        fleet.start_reports(server)
    if on_ready is not None:
        on_ready(server)
    stack.callback(logging.getLogger("kthrottle").info, "shutting down")
    await _tick_until(stop, services.quotas, fleet)
    await server.drain(config.drain_timeout_ms / 1000.0, stop.why)


async def _start_quotas(config, services, stack, followed, worker, primary):
    """The proxy's own upstream token (OAUTHBEARER), the quota source and
    the quota callback, in force before the first client is accepted
    (``services.quotas``: the QuotaManager, or None)."""
    from ..policy.quotas import QuotaManager
    from ..sources import QUOTA_SOURCES, build_source

    if (config.upstream_security_protocol or "").startswith("SASL_") and not config.passthrough \
            and config.upstream_sasl_mechanism == "OAUTHBEARER":
        from ..sources.oauth_token import ClientCredentialsToken

        # first: the proxy's own clients (quotas kept in the cluster, usage
        # reports) log in with it too
        services.upstream_token = ClientCredentialsToken.from_config(config)
        await _started(stack, services.upstream_token, services.upstream_token.start)
    try:
        source = build_source(QUOTA_SOURCES, config, config.quota_source,
                              **({"token": services.upstream_token}
                                 if config.quota_source == "kafka" else {}))
    except ValueError as exc:  # the upstream TLS files
        raise SystemExit("kthrottle: error: %s" % exc) from None
    callback = _quota_callback(config, stack)
    if source is not None or callback is not None:
        services.quotas = QuotaManager(None, config.quota_settings(), callback)
    if source is not None:
        # quotas are in force before the first client is accepted
        await _started(stack, source, source.start, services.quotas.update)
        if hasattr(source, "reload"):
            followed.append(source)
    if services.quotas is not None:
        from ..policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE

        for key, capacity in ((PRODUCER_BYTE_RATE, config.shared_produce_capacity),
                              (CONSUMER_BYTE_RATE, config.shared_fetch_capacity)):
            if capacity:
                services.quotas.set_capacity(key, capacity)
    if callback is not None and primary:
        await _follow_leaders(config, services, stack, worker)
    elif callback is not None:
        from ..policy.quota_callback import Cluster
        from .workers import LEADERS

        worker.follow(LEADERS, Cluster.from_json, services.quotas.update_cluster)
    services.quota_source = source
    if worker is not None:  # the other workers' usage counts from now on
        worker.manager = services.quotas


async def _start_credentials(config, services, stack, followed):
    """The store the terminating filter verifies clients with, or the users
    the admin API manages for other proxies (none with OAUTHBEARER alone);
    the JWKS keys OAUTHBEARER tokens are checked against."""
    from ..sources import CREDENTIAL_STORES, build_source

    terminate = config.sasl_enabled and config.sasl_mode == "terminate"
    credentials = (build_source(CREDENTIAL_STORES, config)
                   if terminate or config.admin_principals else None)
    if credentials is not None or terminate:
        from ..sources.credentials import Credentials

        current = [Credentials({})]
        if credentials is not None:
            await _started(stack, credentials, credentials.start,
                           lambda snapshot: current.__setitem__(0, snapshot))
            if hasattr(credentials, "reload"):
                followed.append(credentials)
        services.credentials = lambda: current[0]
        services.credential_source = credentials
    if terminate and "OAUTHBEARER" in config.sasl_enabled_mechanisms:
        from ..sources.jwks import JwksKeys

        services.jwks = JwksKeys(config.sasl_oauthbearer_jwks_endpoint_url,
                                 config.sasl_oauthbearer_jwks_endpoint_refresh_ms)
        await _started(stack, services.jwks, services.jwks.start)
        followed.append(services.jwks)


def _proxy_server(config, services, worker):
    """The filters the configuration asks for, built here from the registry
    with what the listeners own (ServerParts), and the server given them."""
    from .filters import build_filters
    from .server import ProxyServer, ServerParts

    try:
        parts = ServerParts(config)
        filters = build_filters(config, parts.provide(services))
        server = ProxyServer(config, filters, services.quotas, parts)
    except ValueError as exc:  # the TLS files
        raise SystemExit("kthrottle: error: %s" % exc) from None
    if worker is not None:
        server.reuse_port = True
    return server


async def _follow_cluster(config, services, filters, stack, worker, primary):
    """The cluster state, for the filters that take it (follows_cluster_state:
    ``services.cluster_state``), and the fleet shares (returned: the
    FleetMember, ForwardedShares or None), in force before the first client
    is accepted; with --workers the primary's, handed to the others."""
    followers = [f for f in filters if f.follows_cluster_state]
    state_topic = None  # one consumer of --cluster-state-topic for the state and the shares
    if config.cluster_state_topic and primary and (followers or config.fleet_enabled):
        from ..sources.state_topic import reader_for

        try:
            state_topic = reader_for(config, token=services.upstream_token)
        except ValueError as exc:  # the upstream TLS files
            raise SystemExit("kthrottle: error: %s" % exc) from None
    if followers:
        await _follow_cluster_state(config, services, followers, stack, worker, primary,
                                    state_topic)
    fleet = None
    if config.fleet_enabled:
        fleet = await _fleet(config, services, stack, worker, primary, state_topic)
    if worker is not None and (followers or fleet is not None):
        from .workers import PRIMARY_STARTED

        if primary:
            worker.send(PRIMARY_STARTED)
        else:  # what the primary follows is in force here too before the first client
            await worker.primary_started()
            if fleet is not None:
                fleet.tick()
    return fleet


async def _follow_cluster_state(config, services, followers, stack, worker, primary,
                                state_topic):
    from ..policy.storage import ClusterState
    from ..sources.cluster_state import ClusterStateSource
    from .workers import CLUSTER_STATE

    def new_state(state):
        for f in followers:
            f.on_cluster_state(state)

    if not primary:
        worker.follow(CLUSTER_STATE, ClusterState.from_json, new_state)
        return
    if state_topic is not None:
        from ..sources.state_topic import ClusterStateTopic

        cluster_state = ClusterStateTopic(state_topic)
    else:
        cluster_state = ClusterStateSource(config.zookeeper, config.cluster_state_znode)
    if worker is not None:
        cluster_state.forward = worker.forwarder(CLUSTER_STATE)
    await _started(stack, cluster_state, cluster_state.start, new_state)
    services.cluster_state = cluster_state


async def _fleet(config, services, stack, worker, primary, state_topic):
    from .fleet import FleetMember
    from .workers import SHARES, ForwardedShares

    if not primary:
        return ForwardedShares(config, services.quotas, worker)
    watch = None
    if state_topic is not None:
        from ..sources.state_topic import SharesTopic

        watch = SharesTopic(state_topic, config.proxy_id)
    fleet = FleetMember(config, services.quotas, token=services.upstream_token, watch=watch)
    if worker is not None:
        fleet.watch.forward = worker.forwarder(SHARES)
    # the shares are in force before the first client is accepted
    await _started(stack, fleet, fleet.start)
    return fleet


async def _start_listening(config, server, services, fleet, stack, followed, primary):
    """The listeners, the proxy's own contact with the brokers (/readyz) and,
    on the primary, the admin endpoint."""
    from .admin import AdminServer
    from .health import BrokerContact

    try:
        try:
            await server.start()
        except ValueError as exc:  # an unknown host in max-connections-per-ip-overrides, a node with no port
            raise SystemExit("kthrottle: error: %s" % exc) from None
        # the proxy's own ApiVersions now and then: no broker answering is said
        # at once, and /readyz knows it on an idle proxy
        contact = BrokerContact(server)
        contact.start()
        stack.push_async_callback(contact.stop)
        if not (config.admin_listen and primary):  # the primary's serves the machine
            return
        try:  # the token file and the TLS files: start errors of their own
            admin = AdminServer(server, *config.admin_listen, source=services.quota_source,
                                cluster_state=services.cluster_state, fleet=fleet,
                                credentials=services.credential_source, contact=contact,
                                max_entities=config.metrics_max_entities,
                                token=config.admin_token(), ssl_cert=config.admin_ssl_cert,
                                ssl_key=config.admin_ssl_key, ssl_ca=config.admin_ssl_ca)
        except (ConfigError, ValueError) as exc:
            raise SystemExit("kthrottle: error: %s" % exc) from None
        await admin.start()
        stack.push_async_callback(admin.close)
        if config.admin_ssl_cert:
            followed.append(await _admin_tls_files(stack, config, admin))
    except OSError as exc:
        raise SystemExit("kthrottle: error: cannot listen: %s" % exc) from None


class _Stop(asyncio.Event):
    """Set by the first SIGINT or SIGTERM (or the supervisor's stop):
    ``why`` names it."""

    why = None


def _stop_on_signals(server, worker, manager):
    """The Event a stop sets; a second signal cuts the drain short."""
    stop = _Stop()
    loop = asyncio.get_running_loop()

    def begin_stop(why):
        if stop.why is None:
            stop.why = why
            stop.set()

    def on_stop(sig):
        if stop.why is not None:
            server.cut_drain(sig.name)
        else:
            begin_stop(sig.name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop, sig)
    if worker is not None:
        # the supervisor's: one stop whether or not this process got the
        # signal itself too (a terminal's Ctrl-C, systemd's control group)
        worker.on_stop = begin_stop
        worker.on_cut = lambda why: server.cut_drain(why) if stop.why else begin_stop(why)
        if worker.stop_requested is not None:
            begin_stop(worker.stop_requested)
        worker.serving(manager)
    return stop


async def _tick_until(stop, manager, fleet):
    """Until ``stop``: once a second the quota shares age, the callback is
    polled and shared capacity applied; idle quota buckets expire."""
    loop = asyncio.get_running_loop()
    callback = manager is not None and manager.callback is not None
    ticks = 0
    every_second = (fleet is not None or callback
                    or bool(manager is not None and manager.capacity))
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1 if every_second else 60)
        except asyncio.TimeoutError:
            ticks += 1
            if fleet is not None:
                fleet.tick()
            if callback:
                manager.poll_callback()
            if manager is not None and manager.capacity:
                manager.apply_capacity(loop.time())
            if manager is not None and (not every_second or ticks % 60 == 0):
                manager.expire(loop.time())


def _quota_callback(config, stack):
    """The --quota-callback loaded and configured (closed with the proxy), or
    None; one that cannot be stops the start."""
    if not config.quota_callback:
        return None
    from ..policy.quota_callback import QuotaCallbackError, load_callback

    spec = config.quota_callback["class"]
    try:
        callback = load_callback(spec, config.quota_callback.get("config") or {})
    except QuotaCallbackError as exc:
        raise SystemExit("kthrottle: error: %s" % exc) from None

    def close():
        try:
            callback.close()
        except Exception as exc:
            logging.getLogger("kthrottle").warning(
                "quota callback %s: close failed: %s: %s", spec, type(exc).__name__, exc)

    stack.callback(close)
    logging.getLogger("kthrottle").info(
        "quota callback %s decides which bucket each client counts in and its limit", spec)
    return callback


async def _follow_leaders(config, services, stack, worker):
    """The cluster's partition leaders for the quota callback
    (update_cluster_metadata), read as the proxy's principal; with
    --workers, handed to the other workers too."""
    from ..sources.leaders import PartitionLeaders
    from .workers import LEADERS

    try:
        leaders = PartitionLeaders(config.bootstrap_servers, config.upstream_security(),
                                   token=services.upstream_token)
    except ValueError as exc:  # the upstream TLS files
        raise SystemExit("kthrottle: error: %s" % exc) from None
    manager = services.quotas
    forward = worker.forwarder(LEADERS) if worker is not None else None

    def new_leaders(cluster):
        manager.update_cluster(cluster)
        if forward is not None:
            forward(cluster.to_json())

    await leaders.start(new_leaders)
    stack.push_async_callback(leaders.stop)


async def _start_acls(config, services, stack):
    """Where the brokers see the proxy's principal, not the client's: the
    cluster's ACLs followed for the authorization filter (--authorization
    acls), or a WARNING naming whose rights every client has (none)."""
    if config.passthrough:
        return  # the brokers authorize each client's own principal
    security = config.upstream_security()
    if config.upstream_identity == "delegation-token":
        from ..sources.delegation_tokens import DelegationTokens

        # each client's broker connections are its own: the brokers authorize it
        client_id = "kthrottle-proxy-%s" % config.proxy_id if config.proxy_id else "kthrottle"
        try:
            services.tokens = DelegationTokens(config.bootstrap_servers, security,
                                               client_id=client_id,
                                               token=services.upstream_token)
        except ValueError as exc:  # the upstream TLS files
            raise SystemExit("kthrottle: error: %s" % exc) from None
        stack.push_async_callback(services.tokens.stop)
        return
    whom = ("User:%s" % security.sasl_username if security.sasl_username
            else "the proxy's own (its TLS certificate's, or ANONYMOUS)")
    if config.authorization == "none":
        logging.getLogger("kthrottle").warning(
            "--authorization none: every client acts at the brokers as the proxy's principal, "
            "%s; the cluster's ACLs are not applied per client", whom)
        return
    from ..sources.acls import AclsRefused, KafkaAclSource
    from .filters.authorization import AclView

    client_id = "kthrottle-proxy-%s" % config.proxy_id if config.proxy_id else "kthrottle"
    try:
        source = KafkaAclSource(
            config.bootstrap_servers, security, refresh=config.acl_refresh, client_id=client_id,
            token=services.upstream_token, super_users=config.super_users,
            allow_everyone_if_no_acl_found=config.allow_everyone_if_no_acl_found)
    except ValueError as exc:  # the upstream TLS files
        raise SystemExit("kthrottle: error: %s" % exc) from None
    view = AclView()
    view.want_topic_ids = source.topic_ids_soon
    source.on_topic_ids = view.set_topic_ids
    try:
        await _started(stack, source, source.start, view.update)
    except AclsRefused as exc:
        raise SystemExit("kthrottle: error: %s" % exc) from None
    services.acls = view


def _on_sighup(stack, followed):
    """SIGHUP re-reads what is in ``followed`` by then (from the start: a
    SIGHUP while starting must not end the process, SIGHUP's default)."""
    loop = asyncio.get_running_loop()
    reloads = set()

    def on_reload():
        task = loop.create_task(_reload(followed))
        reloads.add(task)  # held until done
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_reload)
    stack.callback(lambda: [task.cancel() for task in list(reloads)])
    return on_reload


async def _admin_tls_files(stack, config, admin):
    """The admin endpoint's certificate, key and CA, followed live."""
    from .admin import admin_tls_context
    from .tls import TlsFiles

    cert, key, ca = config.admin_ssl_cert, config.admin_ssl_key, config.admin_ssl_ca
    files = TlsFiles("the admin endpoint's TLS", [p for p in (cert, key, ca) if p],
                     lambda: admin_tls_context(cert, key, ca),
                     logger=logging.getLogger("kthrottle.admin"))
    await _started(stack, files, files.start, admin.use_tls)
    return files


async def _reload(followed):
    """SIGHUP: each followed file is looked at now, not at its next poll."""
    log = logging.getLogger("kthrottle")
    if not followed:
        log.info("SIGHUP: nothing to re-read (no --quota-file, --credentials-file or TLS files)")
        return
    log.info("SIGHUP: re-reading %s", "; ".join(f.describe for f in followed))
    for files in followed:
        try:
            await files.reload()
        except Exception:  # a bug: said, and the next file is still re-read
            log.exception("SIGHUP: re-reading %s failed", files.describe)
