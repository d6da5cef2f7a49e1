"""``kthrottle quotas alter|describe|delete``: kafka-configs for quotas.

The flags are kafka-configs.sh's: ``--entity-type users|clients`` paired in
order with ``--entity-name NAME`` or ``--entity-default``; both types in one
command name a <user, client-id> entity (KIP-55). Against ZooKeeper the znodes
and change notifications are exactly Kafka's, so brokers and proxies alike
pick the change up.
"""
import argparse
import sys

from .policy.entities import DEFAULT, QUOTA_KEYS, entity_path, parse_entity_path
from .policy.quota_file import STATIC, format_value

ENTITY_TYPES = ("users", "clients")


class _EntityName(argparse.Action):
    """Keeps --entity-name and --entity-default in the order given, as
    kafka-configs pairs them with the --entity-type flags."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list(getattr(namespace, "entity_names", None) or [])
        names.append(DEFAULT if option_string == "--entity-default" else values)
        namespace.entity_names = names


def zookeeper_arg(value):
    from .config import ConfigError, parse_zookeeper

    try:
        return parse_zookeeper(value, "--zookeeper")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub):
    quotas = sub.add_parser(
        "quotas", help="alter, describe or delete quotas in a quota file or ZooKeeper",
        description="Manage KIP-55 quotas (producer_byte_rate, consumer_byte_rate in bytes/s; "
        "request_rate in requests/s, KIP-124) with kafka-configs' flags, in the TOML quota "
        "file a proxy reads (--quota-file) or in ZooKeeper in Kafka's own layout "
        "(--zookeeper), where a change notification is written too.",
        epilog="examples:\n"
        "  kthrottle quotas alter --quota-file quotas.toml --entity-type users --entity-name alice "
        "--add-config producer_byte_rate=1048576,request_rate=100\n"
        "  kthrottle quotas alter --zookeeper 127.0.0.1:2181 --entity-type users --entity-name alice "
        "--entity-type clients --entity-default --add-config consumer_byte_rate=2097152\n"
        "  kthrottle quotas describe --zookeeper 127.0.0.1:2181/kafka --entity-type users\n"
        "  kthrottle quotas delete --quota-file quotas.toml --entity-type clients --entity-name app\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = quotas.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    for name, text in (("alter", "add or change quota keys of one entity (--add-config), "
                                 "or remove some (--delete-config)"),
                       ("describe", "show quotas: of one entity, of every entity of a type, "
                                    "or all"),
                       ("delete", "remove the quotas of one entity (all keys, or those of "
                                  "--delete-config)")):
        p = actions.add_parser(name, help=text, description=text)
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--quota-file", metavar="PATH", help="the TOML quota file a proxy reads")
        where.add_argument("--zookeeper", metavar="HOST:PORT[/chroot]", type=zookeeper_arg,
                           help="ZooKeeper of a ZooKeeper-mode Kafka cluster (or of the proxies)")
        p.add_argument("--entity-type", action="append", choices=ENTITY_TYPES, default=[],
                       help="users or clients; give both for a <user, client-id> entity")
        p.add_argument("--entity-name", action=_EntityName, metavar="NAME", dest="entity_names",
                       help="a user principal or client-id, paired in order with --entity-type")
        p.add_argument("--entity-default", action=_EntityName, nargs=0, dest="entity_names",
                       help="the <default> entity of the --entity-type in the same position")
        if name == "alter":
            p.add_argument("--add-config", metavar="K=V[,K=V...]",
                           help="quota keys to set: %s" % ", ".join(QUOTA_KEYS))
        if name in ("alter", "delete"):
            p.add_argument("--delete-config", metavar="K[,K...]", help="quota keys to remove")
    return quotas


def _entity(args, parser, need_names):
    types = args.entity_type
    names = args.entity_names or []
    if len(types) > 2 or len(set(types)) != len(types):
        parser.error("give --entity-type users, clients, or both once each")
    if len(names) > len(types):
        parser.error("each --entity-name/--entity-default needs an --entity-type before it")
    if need_names and (not types or len(names) < len(types)):
        parser.error("name the entity: --entity-type with --entity-name NAME or "
                     "--entity-default for each")
    named = dict(zip(types, names))
    # kafka-configs accepts the types in either order; the entity is the same
    return named.get("users"), named.get("clients"), types


def _parse_add(text, parser):
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error("--add-config takes K=V[,K=V...], got %r" % item)
        out[key.strip()] = value.strip()
    if not out:
        parser.error("--add-config is empty")
    return out


def _describe_entity(path):
    user, client_id = parse_entity_path(path)
    parts = []
    if user is not None:
        parts.append("the default user-principal" if user == DEFAULT else "user-principal '%s'" % user)
    if client_id is not None:
        parts.append("the default client-id" if client_id == DEFAULT else "client-id '%s'" % client_id)
    return ", ".join(parts)


def _config_text(config):
    return ",".join("%s=%s" % (k, format_value(config[k])) for k in QUOTA_KEYS if k in config)


def _open_store(args):
    if args.quota_file:
        from .sources.file import FileQuotaStore

        return FileQuotaStore(args.quota_file)
    from .sources.zookeeper import ZooKeeperQuotaStore

    return ZooKeeperQuotaStore(args.zookeeper).connect()


def run(args, parser):
    from .sources import QuotaStoreError

    need_names = args.action != "describe"
    user, client_id, types = _entity(args, parser, need_names)
    if args.action == "alter":
        if not args.add_config and not args.delete_config:
            parser.error("alter needs --add-config and/or --delete-config")
    add = _parse_add(args.add_config, parser) if getattr(args, "add_config", None) else {}
    delete = [k.strip() for k in (getattr(args, "delete_config", None) or "").split(",") if k.strip()]
    if args.action == "delete" and not delete:
        delete = list(QUOTA_KEYS)
    try:
        store = _open_store(args)
    except QuotaStoreError as exc:
        print("kthrottle quotas: error: %s" % exc, file=sys.stderr)
        return 1
    try:
        if args.action == "describe":
            return _describe(store, user, client_id, types)
        path = entity_path(user=user, client_id=client_id)
        try:
            config = store.alter(path, add, delete)
        except ValueError as exc:  # a bad key or value: nothing was written
            parser.error(str(exc))
        print("Completed updating quotas for %s%s." % (
            _describe_entity(path),
            ": %s" % _config_text(config) if config else " (no quotas left)"))
        return 0
    except QuotaStoreError as exc:
        print("kthrottle quotas: error: %s" % exc, file=sys.stderr)
        return 1
    finally:
        store.close()


def _describe(store, user, client_id, types):
    snapshot = store.read()
    shown = 0
    for path in sorted(p for p in snapshot if p != STATIC):
        u, c = parse_entity_path(path)
        if types:
            if ("users" in types) != (u is not None) or ("clients" in types) != (c is not None):
                continue
            if user is not None and u != user or client_id is not None and c != client_id:
                continue
        print("Quotas for %s are %s" % (_describe_entity(path), _config_text(snapshot[path])))
        shown += 1
    static = snapshot.get(STATIC)
    if static and not types:
        print("Static defaults (quota.producer.default / quota.consumer.default) are %s"
              % _config_text(static))
        shown += 1
    if not shown:
        print("No quotas configured%s." % (" for that entity" if types else ""))
    return 0
