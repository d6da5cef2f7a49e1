"""The ``kthrottle`` command."""
import argparse
import logging
import sys

from . import __version__, quotas_command
from .config import (
    DEFAULT_LISTEN,
    ConfigError,
    build_config,
    load_toml,
    parse_admin_listen,
    parse_connection_overrides,
    parse_host_port,
)


def _host_port(what):
    return _checked(lambda value: parse_host_port(value, what))


def _checked(parse):
    def check(value):
        try:
            return parse(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def _add_limit_flags(p):
    g = p.add_argument_group(
        "limits of every listener (Kafka's names and defaults; a connection over a limit is "
        "closed at once, with a log line and kthrottle_connections_refused_total)")
    g.add_argument(
        "--sasl-server-max-receive-size", type=int, metavar="BYTES",
        help="largest frame accepted before the client has authenticated (default 524288, "
        "Kafka's sasl.server.max.receive.size); --max-frame-size applies after")
    g.add_argument(
        "--connections-max-idle-ms", type=int, metavar="MS",
        help="close a connection on which nothing has moved for this long (default 600000, "
        "Kafka's connections.max.idle.ms)")
    g.add_argument(
        "--handshake-timeout-ms", type=int, metavar="MS",
        help="close a connection whose TLS handshake and SASL authentication have not both "
        "finished this long after it was accepted (default 10000)")
    g.add_argument(
        "--max-connections", type=int, metavar="N",
        help="open client connections allowed at once, all listeners together (Kafka's "
        "max.connections; default: no limit)")
    g.add_argument(
        "--max-connections-per-ip", type=int, metavar="N",
        help="open client connections allowed from one source address (Kafka's "
        "max.connections.per.ip; default: no limit)")
    g.add_argument(
        "--max-connections-per-ip-overrides", metavar="HOST:N,...",
        type=_checked(parse_connection_overrides),
        help="per-address exceptions to --max-connections-per-ip, e.g. "
        "'10.0.0.5:200,batch.example.com:50' (Kafka's max.connections.per.ip.overrides; host "
        "names are resolved at start)")


def _add_lifecycle_flags(p):
    g = p.add_argument_group(
        "stopping and reloading",
        "SIGTERM (or SIGINT) stops gracefully: every listener stops accepting, so new "
        "connections are refused; no connection reads a request after the one it is reading "
        "(as a Kafka broker shutting down stops reading requests: a client sends what was not "
        "read again, elsewhere); each connection is closed as soon as its client has every "
        "response it is owed, one owed none at once; then the process exits 0. A second "
        "SIGTERM closes what is left at once. SIGHUP re-reads --quota-file, --credentials-file "
        "and the TLS certificate, key and CA of the listeners and of the admin endpoint, each "
        "also re-read when its file changes: live connections stay up, new ones use the new "
        "material; a file that does not load is logged and the material in force stays.")
    g.add_argument(
        "--drain-timeout-ms", type=int, metavar="MS",
        help="how long a graceful stop waits for the responses still owed before it closes "
        "the connections waiting for them (default 30000; 0 closes them at once)")


def _add_proxy_flags(p, bootstrap_required_text):
    p.add_argument(
        "--bootstrap-server", dest="bootstrap_servers", action="append",
        type=_host_port("--bootstrap-server"), metavar="HOST:PORT",
        help="an upstream broker to bootstrap from; repeat for several. " + bootstrap_required_text,
    )
    p.add_argument(
        "--listen", type=_host_port("--listen"), metavar="HOST:PORT",
        help="bootstrap address clients connect to (default %s)" % DEFAULT_LISTEN,
    )
    p.add_argument(
        "--node-port-base", type=int, metavar="PORT",
        help="upstream node id N is served on port PORT+N (default: the listen port + 1)",
    )
    p.add_argument(
        "--advertised-host", metavar="HOST",
        help="host written into the broker addresses clients receive (default: the listen host)",
    )
    p.add_argument(
        "--max-frame-size", type=int, metavar="BYTES",
        help="largest request accepted; a larger one closes that connection "
        "(default 104857600, Kafka's socket.request.max.bytes)",
    )
    p.add_argument(
        "--upstream-connect-timeout-ms", type=int, metavar="MS",
        help="how long one broker address may take to accept a connection before the next "
        "is tried (default 10000, Kafka's socket.connection.setup.timeout.ms)",
    )
    q = p.add_argument_group("quotas (KIP-55 <user, client-id> byte-rate and request-rate quotas)")
    q.add_argument(
        "--quota-file", metavar="PATH",
        help="TOML file of quotas, re-read when it changes (see kthrottle quotas --help)",
    )
    q.add_argument(
        "--zookeeper", metavar="HOST:PORT[/chroot]", type=quotas_command.zookeeper_arg,
        help="read quotas from ZooKeeper in Kafka's layout (/config/users, /config/clients) "
        "and follow its change notifications",
    )
    q.add_argument(
        "--admin-listen", type=_checked(parse_admin_listen), metavar="[HOST:]PORT",
        help="serve /metrics (Prometheus) and /quotas (JSON) here, on 127.0.0.1 unless a host "
        "is given; off unless given",
    )
    q.add_argument(
        "--admin-token-file", metavar="PATH",
        help="file holding a bearer token that /quotas requires (Authorization: Bearer ...); "
        "/quotas names every connected principal and client-id",
    )
    q.add_argument("--admin-ssl-cert", metavar="PEM",
                   help="serve the admin endpoint over HTTPS with this certificate (chain)")
    q.add_argument("--admin-ssl-key", metavar="PEM", help="its private key")
    q.add_argument("--admin-ssl-ca", metavar="PEM",
                   help="CA bundle of the client certificates that /quotas then requires (mTLS); "
                   "/metrics stays readable without one")
    q.add_argument(
        "--quota-mode", choices=("token-bucket", "window"),
        help="token-bucket (default): burst allowance of --quota-burst-seconds, then held to "
        "the quota; window: exactly Kafka's sampled windows and X = (O - T) / T x W",
    )
    q.add_argument("--quota-window-num", type=int, metavar="N",
                   help="samples in the rate window, Kafka's quota.window.num (default 11)")
    q.add_argument("--quota-window-size-seconds", type=float, metavar="S",
                   help="length of one sample, Kafka's quota.window.size.seconds (default 1)")
    q.add_argument(
        "--max-throttle-ms", type=int, metavar="MS",
        help="longest byte-rate delay for one response (default: the measured window W, "
        "10-11 s; Kafka leaves byte-rate throttles uncapped). Request-rate delays are capped "
        "at one quota window, as in Kafka",
    )
    q.add_argument("--quota-burst-seconds", type=float, metavar="S",
                   help="token-bucket mode: burst allowance in seconds of quota (default 1)")
    a = p.add_argument_group("client security (Kafka's security.protocol and SASL settings)")
    a.add_argument(
        "--security-protocol", metavar="P",
        help="what clients speak to the listeners: PLAINTEXT (default), SSL, SASL_PLAINTEXT "
        "or SASL_SSL",
    )
    a.add_argument(
        "--sasl-mode", choices=("terminate", "passthrough"),
        help="who verifies a SASL client: terminate (default), the proxy itself; the broker "
        "then sees only the proxy's connection, so broker-side per-user quotas and ACLs no "
        "longer apply; or passthrough: the client's SASL exchange goes on to the broker, "
        "which verifies it, and the proxy binds the user name it named once the broker says "
        "yes (the upstream side must then be SASL_PLAINTEXT or SASL_SSL)",
    )
    a.add_argument(
        "--sasl-enabled-mechanisms", metavar="LIST",
        type=lambda v: [m.strip() for m in v.split(",") if m.strip()],
        help="comma-separated, of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 (default: all three)",
    )
    a.add_argument(
        "--credentials-file", metavar="PATH",
        help="TOML file of salted SCRAM credentials (never passwords; write it with "
        "kthrottle quotas alter --credentials-file ... --add-config "
        "'SCRAM-SHA-512=[password=...]'), re-read when it changes; without it, the SCRAM "
        "credentials in --zookeeper are used. PLAIN is checked against them",
    )
    a.add_argument("--ssl-cert", metavar="PEM", help="the listeners' certificate (chain)")
    a.add_argument("--ssl-key", metavar="PEM", help="its private key")
    a.add_argument("--ssl-ca", metavar="PEM",
                   help="CA bundle that client certificates are checked against (mTLS)")
    a.add_argument(
        "--ssl-client-auth", choices=("none", "requested", "required"),
        help="client certificates, as Kafka's ssl.client.auth (default none); with SSL the "
        "principal is the certificate's subject, mapped by --ssl-principal-mapping-rules",
    )
    a.add_argument(
        "--ssl-principal-mapping-rules", metavar="RULES",
        help="Kafka's ssl.principal.mapping.rules, e.g. 'RULE:^CN=(.*?),OU=.*$/$1/L,DEFAULT' "
        "(default DEFAULT: the subject as RFC 2253 writes it, CN=alice,OU=team,O=org)",
    )
    a.add_argument(
        "--failed-authentication-delay-ms", type=int, metavar="MS",
        help="a failed authentication is answered after this delay, then the connection "
        "closes (Kafka's connection.failed.authentication.delay.ms, default 100)",
    )
    s = p.add_argument_group(
        "storage-aware throttling (the cluster state kthrottle spark-sync writes to --zookeeper)")
    s.add_argument(
        "--storage-scope", choices=("cluster", "partition", "off"),
        help="cluster (default): when a broker volume passes its soft limit every producer "
        "is slowed by the state's factor, and past its hard limit its Produce requests are "
        "held; partition: only Produce requests writing to a partition with a replica on "
        "such a volume are slowed, or throttled for --storage-pause-max-ms; off: ignore the "
        "cluster state. Applies when --zookeeper is given, from the first snapshot the job "
        "writes",
    )
    s.add_argument("--storage-fail-safe", choices=("PAUSE", "OPEN"),
                   help="what an unknown state means (a snapshot older than "
                   "--storage-max-age-ms, brokers without a fresh volume report): PAUSE "
                   "(default) or OPEN")
    s.add_argument("--storage-max-age-ms", type=int, metavar="MS",
                   help="a cluster state older than this is unknown (default 120000)")
    s.add_argument("--storage-base-rate", type=float, metavar="BYTES/S",
                   help="the produce rate a producer without a producer_byte_rate quota "
                   "keeps at factor 1 when throttled for storage (default 1048576)")
    s.add_argument("--storage-pause-max-ms", type=int, metavar="MS",
                   help="longest a Produce request is held while paused, before it goes on "
                   "(default 10000; keep it under the clients' request.timeout.ms)")
    s.add_argument("--storage-excluded-principals", metavar="LIST",
                   type=lambda v: [m.strip() for m in v.split(",") if m.strip()],
                   help="comma-separated principals never throttled for storage (the volume "
                   "agents, canaries)")
    s.add_argument("--cluster-state-znode", metavar="PATH",
                   help="where the cluster state is (default /kthrottle/cluster-state, under "
                   "the --zookeeper chroot)")
    f = p.add_argument_group(
        "fleet-wide quotas (several proxies in front of one cluster share each quota; "
        "kthrottle spark-sync computes the shares)")
    f.add_argument(
        "--proxy-id", metavar="ID",
        help="make this proxy a member of a fleet: each quota set in --zookeeper (needed) "
        "holds for the whole fleet, this proxy applying its share of it. It publishes its "
        "usage (per quota bucket: quota, rate, demand) every --usage-interval, keyed by ID, and "
        "applies the shares the Spark job writes to <cluster-state-znode>/shares/ID live; a "
        "bucket without a share yet gets the document's prior fraction of its quota. "
        "[A-Za-z0-9._-], unique in the fleet. Without it the configured quotas apply as they are",
    )
    f.add_argument("--usage-interval", type=int, metavar="MS",
                   help="how often the usage report is published (default 5000)")
    f.add_argument("--usage-topic", metavar="NAME",
                   help="compacted topic of the usage reports (default __kthrottle_proxy_usage; "
                   "created if missing, with the upstream security settings below)")
    f.add_argument("--share-max-age-ms", type=int, metavar="MS",
                   help="shares older than this (or none yet) are unknown and the fail-safe "
                   "applies (default 60000)")
    f.add_argument(
        "--share-fail-safe", choices=("last", "equal", "whole"),
        help="what applies while the shares are unknown: last (default) keeps the last "
        "shares (the configured quotas if there were none); equal gives each bucket its "
        "quota / the number of proxies last seen; whole the configured quota",
    )
    u = p.add_argument_group("towards the brokers")
    u.add_argument(
        "--upstream-security-protocol", metavar="P",
        help="what the proxy speaks to the brokers: PLAINTEXT (default), SSL, SASL_PLAINTEXT "
        "or SASL_SSL (with the proxy's own SASL identity below in terminate mode; in "
        "passthrough mode SASL_PLAINTEXT or SASL_SSL, by default the client side's)",
    )
    u.add_argument("--upstream-ssl-ca", metavar="PEM",
                   help="CA bundle the brokers' certificates are checked against (default: the "
                   "system's); host names are checked")
    u.add_argument("--upstream-ssl-cert", metavar="PEM",
                   help="the proxy's client certificate, for brokers that require mTLS")
    u.add_argument("--upstream-ssl-key", metavar="PEM", help="its private key")
    u.add_argument("--upstream-sasl-mechanism", metavar="M",
                   help="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (default)")
    u.add_argument("--upstream-sasl-username", metavar="USER", help="the proxy's SASL user")
    u.add_argument(
        "--upstream-sasl-password-file", metavar="PATH",
        help="file holding the proxy's SASL password (else the environment variable "
        "KTHROTTLE_UPSTREAM_SASL_PASSWORD; never a flag)",
    )
    _add_limit_flags(p)
    _add_lifecycle_flags(p)
    p.add_argument(
        "--config", metavar="FILE",
        help="TOML file with the same keys as the long flags (bootstrap-server = [...], "
        "listen = ..., ...), at top level or under [proxy]; flags win",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


def make_parser():
    parser = argparse.ArgumentParser(
        prog="kthrottle",
        description="A Kafka-protocol throttling proxy. Clients point at the proxy's address "
        "and everything they send reaches the brokers through it.",
    )
    parser.add_argument("--version", action="version", version="kthrottle " + __version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    proxy = sub.add_parser(
        "proxy", help="run the proxy in front of a Kafka cluster",
        description="Proxy a Kafka cluster. Clients bootstrap from --listen; every broker "
        "address in Metadata, FindCoordinator, DescribeCluster and KIP-951 NodeEndpoints is "
        "rewritten to the proxy, which opens one listener per broker node id.",
    )
    _add_proxy_flags(proxy, "Required (here or in --config).")

    local = sub.add_parser(
        "local", help="start a local broker (Tansu) with the proxy in front of it",
        description="The embedded default: starts a Kafka-compatible Tansu broker on a free "
        "127.0.0.1 port and the proxy in front of it, prints the address to point clients "
        "at, and stops both on Ctrl-C.",
    )
    _add_proxy_flags(local, "Not used: the local broker is the upstream.")
    quotas_command.add_parser(sub)
    from .spark_sync import agent, job

    agent.add_parser(sub)
    job.add_parser(sub)
    return parser


def _flag_values(args):
    return {
        "bootstrap_servers": args.bootstrap_servers,
        "listen": args.listen,
        "node_port_base": args.node_port_base,
        "advertised_host": args.advertised_host,
        "max_frame_size": args.max_frame_size,
        "upstream_connect_timeout_ms": args.upstream_connect_timeout_ms,
        "drain_timeout_ms": args.drain_timeout_ms,
        "sasl_server_max_receive_size": args.sasl_server_max_receive_size,
        "connections_max_idle_ms": args.connections_max_idle_ms,
        "handshake_timeout_ms": args.handshake_timeout_ms,
        "max_connections": args.max_connections,
        "max_connections_per_ip": args.max_connections_per_ip,
        "max_connections_per_ip_overrides": args.max_connections_per_ip_overrides,
        "admin_token_file": args.admin_token_file,
        "admin_ssl_cert": args.admin_ssl_cert,
        "admin_ssl_key": args.admin_ssl_key,
        "admin_ssl_ca": args.admin_ssl_ca,
        "quota_file": args.quota_file,
        "zookeeper": args.zookeeper,
        "admin_listen": args.admin_listen,
        "quota_mode": args.quota_mode,
        "quota_window_num": args.quota_window_num,
        "quota_window_size_seconds": args.quota_window_size_seconds,
        "max_throttle_ms": args.max_throttle_ms,
        "quota_burst_seconds": args.quota_burst_seconds,
        "security_protocol": args.security_protocol,
        "sasl_mode": args.sasl_mode,
        "sasl_enabled_mechanisms": args.sasl_enabled_mechanisms,
        "credentials_file": args.credentials_file,
        "failed_authentication_delay_ms": args.failed_authentication_delay_ms,
        "ssl_cert": args.ssl_cert,
        "ssl_key": args.ssl_key,
        "ssl_ca": args.ssl_ca,
        "ssl_client_auth": args.ssl_client_auth,
        "ssl_principal_mapping_rules": args.ssl_principal_mapping_rules,
        "upstream_security_protocol": args.upstream_security_protocol,
        "upstream_ssl_ca": args.upstream_ssl_ca,
        "upstream_ssl_cert": args.upstream_ssl_cert,
        "upstream_ssl_key": args.upstream_ssl_key,
        "upstream_sasl_mechanism": args.upstream_sasl_mechanism,
        "upstream_sasl_username": args.upstream_sasl_username,
        "upstream_sasl_password_file": args.upstream_sasl_password_file,
        "storage_scope": args.storage_scope,
        "storage_fail_safe": args.storage_fail_safe,
        "storage_max_age_ms": args.storage_max_age_ms,
        "storage_base_rate": args.storage_base_rate,
        "storage_pause_max_ms": args.storage_pause_max_ms,
        "storage_excluded_principals": args.storage_excluded_principals,
        "cluster_state_znode": args.cluster_state_znode,
        "proxy_id": args.proxy_id,
        "usage_interval_ms": args.usage_interval,
        "usage_topic": args.usage_topic,
        "share_max_age_ms": args.share_max_age_ms,
        "share_fail_safe": args.share_fail_safe,
    }


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command == "quotas":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        action_parser = parser._subparsers._group_actions[0].choices["quotas"]
        action_parser = action_parser._subparsers._group_actions[0].choices[args.action]
        return quotas_command.run(args, action_parser)
    if args.command in ("volume-agent", "spark-sync"):
        from .spark_sync import agent, job

        return (agent if args.command == "volume-agent" else job).run(args)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        file_values = load_toml(args.config) if args.config else {}
        flags = _flag_values(args)
        if args.command == "local":
            flags["bootstrap_servers"] = [("127.0.0.1", 0)]  # replaced once the broker runs
        config = build_config(file_values, flags)
    except ConfigError as exc:
        parser.exit(2, "kthrottle: error: %s\n" % exc)

    from .proxy.app import run_local, run_loop, serve

    if args.command == "proxy":
        run_loop(lambda: serve(config))
        return 0
    return run_local(config)


if __name__ == "__main__":
    sys.exit(main())
