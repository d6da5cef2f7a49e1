"""The ``kthrottle`` command."""
import argparse
import logging
import sys

from . import __version__, quotas_command
from .config import BOOTSTRAP, ConfigError, build_config, load_toml, option_groups


def _add_proxy_flags(p, bootstrap_required_text):
    """Every declared option of the proxy (core and components), then
    --config and --log-level."""
    helps = {BOOTSTRAP.name: BOOTSTRAP.help + " " + bootstrap_required_text}
    for group in option_groups():
        group.add_to(p, helps)
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

    for name, help_text, description, bootstrap in (
            ("proxy", "run the proxy in front of a Kafka cluster",
             "Proxy a Kafka cluster. Clients bootstrap from --listen; every broker address in "
             "Metadata, FindCoordinator, DescribeCluster and KIP-951 NodeEndpoints is rewritten "
             "to the proxy, which opens one listener per broker node id.",
             "Required (here or in --config)."),
            ("local", "start a local broker (Tansu) with the proxy in front of it",
             "The embedded default: starts a Kafka-compatible Tansu broker on a free 127.0.0.1 "
             "port and the proxy in front of it, prints the address to point clients at, and "
             "stops both on Ctrl-C.",
             "Not used: the local broker is the upstream.")):
        _add_proxy_flags(sub.add_parser(name, help=help_text, description=description),
                         bootstrap)
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
