"""``kthrottle quotas alter|describe|delete``: kafka-configs for quotas.

The flags are kafka-configs.sh's: ``--entity-type users|clients|ips|topics``
paired in order with ``--entity-name NAME`` or ``--entity-default``; users and
clients in one command name a <user, client-id> entity (KIP-55); an ip
(KIP-612) or a topic (kthrottle's own) goes alone. Against ZooKeeper the
znodes and change notifications are exactly Kafka's, so brokers and proxies
alike pick the change up (topics: in kthrottle's own znodes). With
``--bootstrap-server`` the quotas are read and altered through Kafka's admin
API (KIP-546), of a cluster or of a proxy answering it.

SASL/SCRAM credentials are altered the same way, as kafka-configs does
(``--add-config 'SCRAM-SHA-512=[iterations=8192,password=...]'``,
``--delete-config SCRAM-SHA-512``): only the salted credential is written,
into the user znode with --zookeeper, or into --credentials-file.
"""
import argparse
import re
import sys

from .policy.entities import (
    DEFAULT,
    OBSERVE_ONLY,
    QUOTA_KEYS,
    entity_path,
    ip_path,
    keys_for,
    parse_entity,
    topic_path,
)
from .policy.quota_file import STATIC, format_value
from .policy.quotas import GROUPS
from .security import ZOOKEEPER, ClientSecurityOptions

ENTITY_TYPES = ("users", "clients", "ips", "topics")
PASSWORD_ENV = "KTHROTTLE_SASL_PASSWORD"
# towards --bootstrap-server (kafka-configs' --command-config settings, as flags)
SECURITY = ClientSecurityOptions(
    who="the command", password_env=PASSWORD_ENV,
    title="security (with --bootstrap-server)",
    description="The password is never a flag: --sasl-password-file, else the environment "
    "variable %s." % PASSWORD_ENV)
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")  # = sources.credentials.MECHANISMS
# kafka-configs' form of a SCRAM value (ConfigCommand); the password is the rest
_SCRAM_VALUE = re.compile(r"(?:iterations=(\d+),)?password=(.*)", re.DOTALL)


class _EntityName(argparse.Action):
    """Keeps --entity-name and --entity-default in the order given, as
    kafka-configs pairs them with the --entity-type flags."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list(getattr(namespace, "entity_names", None) or [])
        names.append(DEFAULT if option_string == "--entity-default" else values)
        namespace.entity_names = names


def add_parser(sub):
    quotas = sub.add_parser(
        "quotas", help="alter, describe or delete quotas (and SASL/SCRAM credentials) in a "
        "quota file or ZooKeeper",
        description="Manage quotas with kafka-configs' flags: of users and clients (KIP-55: "
        "producer_byte_rate, consumer_byte_rate in bytes/s; request_rate in requests/s, "
        "KIP-124; controller_mutation_rate in partitions/s, KIP-599), of ips (KIP-612: "
        "connection_creation_rate in connections/s) and of topics (kthrottle's own: "
        "producer_byte_rate, consumer_byte_rate); observe_only=true on any entity makes its "
        "quotas a dry run (--observe-only, --enforce). They live in the TOML quota file a "
        "proxy reads (--quota-file), in ZooKeeper in Kafka's own layout (--zookeeper), where "
        "a change notification is written too, or behind Kafka's admin API "
        "(--bootstrap-server: a cluster, or a proxy with --admin-principals). A user's SASL/SCRAM "
        "credentials (SCRAM-SHA-256, SCRAM-SHA-512) are managed the same way, salted as Kafka "
        "stores them, in the user znodes (--zookeeper) or in a credentials file "
        "(--credentials-file).",
        epilog="examples:\n"
        "  kthrottle quotas alter --quota-file quotas.toml --entity-type users --entity-name alice "
        "--add-config producer_byte_rate=1048576,request_rate=100\n"
        "  kthrottle quotas alter --zookeeper 127.0.0.1:2181 --entity-type users --entity-name alice "
        "--entity-type clients --entity-default --add-config consumer_byte_rate=2097152\n"
        "  kthrottle quotas describe --zookeeper 127.0.0.1:2181/kafka --entity-type users\n"
        "  kthrottle quotas alter --quota-file quotas.toml --entity-type ips --entity-default "
        "--add-config connection_creation_rate=10\n"
        "  kthrottle quotas alter --bootstrap-server proxy:9092 --entity-type topics "
        "--entity-name orders --add-config producer_byte_rate=1048576 --observe-only\n"
        "  kthrottle quotas delete --quota-file quotas.toml --entity-type clients --entity-name app\n"
        "  kthrottle quotas alter --credentials-file credentials.toml --entity-type users "
        "--entity-name alice --add-config 'SCRAM-SHA-512=[iterations=8192,password=alice-secret]'\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = quotas.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    for name, text in (("alter", "add or change quota keys of one entity, or a user's SCRAM "
                                 "credentials (--add-config), or remove some (--delete-config)"),
                       ("describe", "show quotas: of one entity, of every entity of a type, "
                                    "or all; and which SCRAM mechanisms users have"),
                       ("delete", "remove the quotas of one entity (all keys, or those of "
                                  "--delete-config); with --credentials-file alone, a user's "
                                  "SCRAM credentials")):
        p = actions.add_parser(name, help=text, description=text)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--quota-file", metavar="PATH", help="the TOML quota file a proxy reads")
        ZOOKEEPER.replace(help="ZooKeeper of a ZooKeeper-mode Kafka cluster (or of the "
                          "proxies); SCRAM credentials go into the user znodes, as kafka-configs "
                          "does").add_to(where)
        where.add_argument("--bootstrap-server", metavar="HOST:PORT[,HOST:PORT...]",
                           help="Kafka's admin API (DescribeClientQuotas, AlterClientQuotas) of "
                           "a cluster, or of a kthrottle proxy answering it (--admin-principals;"
                           " topics only there)")
        p.add_argument("--credentials-file", metavar="PATH",
                       help="the TOML file of salted SCRAM credentials a proxy reads (with "
                       "--quota-file, or alone; not with --zookeeper)")
        p.add_argument("--entity-type", action="append", choices=ENTITY_TYPES, default=[],
                       help="users, clients, ips or topics; users and clients both for a "
                       "<user, client-id> entity")
        p.add_argument("--entity-name", action=_EntityName, metavar="NAME", dest="entity_names",
                       help="a user principal, client-id, ip address or topic, paired in order "
                       "with --entity-type")
        p.add_argument("--entity-default", action=_EntityName, nargs=0, dest="entity_names",
                       help="the <default> entity of the --entity-type in the same position")
        if name == "alter":
            p.add_argument("--add-config", metavar="K=V[,K=V...]",
                           help="quota keys to set: %s; or a user's SCRAM credential, "
                           "%s=[password=...] or [iterations=N,password=...] (salted "
                           "before it is written)" % (", ".join(QUOTA_KEYS),
                                                      "|".join(SCRAM_MECHANISMS)))
            dry = p.add_mutually_exclusive_group()
            dry.add_argument("--observe-only", action="store_true",
                             help="make the entity's quotas a dry run: measured and reported, "
                             "delaying no one (sets observe_only=true)")
            dry.add_argument("--enforce", action="store_true",
                             help="enforce the entity's quotas again (removes observe_only)")
        if name in ("alter", "delete"):
            p.add_argument("--delete-config", metavar="K[,K...]",
                           help="quota keys or SCRAM mechanisms to remove")
        SECURITY.add_to(p)
    from . import recommendations

    recommendations.add_parser(actions)  # its own flags: read, not alter
    return quotas


def _entity(args, parser, need_names):
    """(named {entity type: name or DEFAULT}, types, path or None when not
    every type is named)."""
    types = args.entity_type
    names = args.entity_names or []
    if len(types) > 2 or len(set(types)) != len(types) or (
            len(types) == 2 and set(types) != {"users", "clients"}):
        parser.error("give --entity-type users, clients, or both once each; or ips or "
                     "topics alone")
    if len(names) > len(types):
        parser.error("each --entity-name/--entity-default needs an --entity-type before it")
    if need_names and (not types or len(names) < len(types)):
        parser.error("name the entity: --entity-type with --entity-name NAME or "
                     "--entity-default for each")
    # kafka-configs accepts the types in either order; the entity is the same
    named = dict(zip(types, names))
    path = None
    try:
        if "ips" in named:
            path = ip_path(named["ips"])
            named["ips"] = parse_entity(path)["ip"]
        elif "topics" in named:
            path = topic_path(named["topics"])
        elif named and len(named) == len(types):
            path = entity_path(user=named.get("users"), client_id=named.get("clients"))
    except ValueError as exc:
        parser.error(str(exc))
    return named, types, path


def _split_outside_brackets(text, sep):
    """Split at ``sep`` where it is not inside [...] (kafka-configs' rule)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_add(text, parser):
    """K=V[,K=V...]; a value in [...] may hold commas (kafka-configs' form)."""
    out = {}
    for item in filter(None, (part.strip() for part in _split_outside_brackets(text, ","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error("--add-config takes K=V[,K=V...], got %r"
                         % (item if "password" not in item else key.strip() + "=..."))
        value = value.strip()
        if value.startswith("[") and value.endswith("]"):
            value = value[1:-1]
        out[key.strip()] = value
    if not out:
        parser.error("--add-config is empty")
    return out


def _scram_credentials(add, parser):
    """The SCRAM entries of --add-config, salted (RFC 5802): {mechanism: credential}."""
    from .sources.credentials import scram_from_password

    out = {}
    for mechanism, value in add.items():
        m = _SCRAM_VALUE.fullmatch(value)
        if not m:  # never echo the value: it holds a password
            parser.error("%s takes [password=PASSWORD] or [iterations=N,password=PASSWORD]"
                         % mechanism)
        iterations = int(m.group(1)) if m.group(1) else 4096  # kafka-configs' default
        try:
            out[mechanism] = scram_from_password(mechanism, m.group(2), iterations)
        except ValueError as exc:
            parser.error("%s: %s" % (mechanism, exc))
    return out


def _scram_text(entry):
    """Kafka's describe form: SCRAM-SHA-256=iterations=4096, ... (never the keys)."""
    return ", ".join("%s=iterations=%d" % (m, entry[m].iterations)
                     for m in SCRAM_MECHANISMS if m in entry)


_WORDS = {"user": "user-principal", "client-id": "client-id", "ip": "ip", "topic": "topic"}


def _describe_entity(path):
    parts = []
    for kind, name in parse_entity(path).items():
        word = _WORDS[kind]
        parts.append("the default %s" % word if name == DEFAULT else "%s '%s'" % (word, name))
    return ", ".join(parts)


def _config_text(config):
    return ",".join("%s=%s" % (k, format_value(config[k], k)) for k in QUOTA_KEYS if k in config)


def _open_stores(args):
    """(quota store or None, credentials store or None); with --zookeeper
    both are one connection."""
    if args.bootstrap_server:
        from .sources.kafka_quotas import AdminApiQuotaStore

        return AdminApiQuotaStore(args.bootstrap_server, args.security), None
    if args.zookeeper:
        from .sources.credentials import ZooKeeperCredentialStore
        from .sources.zookeeper import ZooKeeperQuotaStore

        store = ZooKeeperQuotaStore(args.zookeeper).connect()
        return store, ZooKeeperCredentialStore(store=store)
    quotas = credentials = None
    if args.quota_file:
        from .sources.file import FileQuotaStore

        quotas = FileQuotaStore(args.quota_file)
    if args.credentials_file:
        from .sources.credentials import FileCredentialStore

        credentials = FileCredentialStore(args.credentials_file)
    return quotas, credentials


def run(args, parser):
    if args.action == "recommend":
        from . import recommendations

        return recommendations.run(args, parser)
    from .policy.quota_file import altered
    from .sources import QuotaStoreError

    if not (args.quota_file or args.zookeeper or args.bootstrap_server or args.credentials_file):
        parser.error("give --quota-file, --zookeeper, --bootstrap-server or --credentials-file")
    if args.zookeeper and args.credentials_file:
        parser.error("with --zookeeper, SCRAM credentials are in the user znodes: "
                     "--credentials-file does not go with it")
    if args.bootstrap_server and args.credentials_file:
        parser.error("with --bootstrap-server, SCRAM credentials are the cluster's: "
                     "--credentials-file does not go with it")
    if args.bootstrap_server:
        from .options import ConfigError, parse_host_port

        try:
            args.bootstrap_server = [parse_host_port(s.strip(), "--bootstrap-server")
                                     for s in args.bootstrap_server.split(",") if s.strip()]
            args.security = SECURITY.resolve(vars(args))
        except ConfigError as exc:
            parser.error(str(exc))
    need_names = args.action != "describe"
    named, types, path = _entity(args, parser, need_names)
    user = named.get("users")
    observe = getattr(args, "observe_only", False)
    enforce = getattr(args, "enforce", False)
    if args.action == "alter":
        if not args.add_config and not args.delete_config and not (observe or enforce):
            parser.error("alter needs --add-config, --delete-config, --observe-only or "
                         "--enforce")
    add = _parse_add(args.add_config, parser) if getattr(args, "add_config", None) else {}
    delete = [k.strip() for k in (getattr(args, "delete_config", None) or "").split(",") if k.strip()]
    if observe or enforce:
        if OBSERVE_ONLY in add or OBSERVE_ONLY in delete:
            parser.error("--observe-only and --enforce set %s: it is not also in --add-config "
                         "or --delete-config" % OBSERVE_ONLY)
        if observe:
            add[OBSERVE_ONLY] = "true"
        else:
            delete.append(OBSERVE_ONLY)
    if args.action == "delete" and not delete:
        # the quotas; with --credentials-file, a user's credentials there too
        quota_store = args.quota_file or args.zookeeper or args.bootstrap_server
        delete = (list(keys_for(path)) if quota_store else []) + (
            list(SCRAM_MECHANISMS) if args.credentials_file and types == ["users"]
            and user != DEFAULT else [])
    scram_add = {k: v for k, v in add.items() if k in SCRAM_MECHANISMS}
    scram_delete = [k for k in delete if k in SCRAM_MECHANISMS]
    quota_add = {k: v for k, v in add.items() if k not in SCRAM_MECHANISMS}
    quota_delete = [k for k in delete if k not in SCRAM_MECHANISMS]
    scram = bool(scram_add or scram_delete)
    quotas = bool(quota_add or quota_delete)
    if args.action != "describe":
        # everything is checked before anything is written
        if scram:
            if types != ["users"] or user == DEFAULT:
                parser.error("SCRAM credentials are for a named user: --entity-type users "
                             "--entity-name NAME alone")
            if not (args.zookeeper or args.credentials_file):
                parser.error("SCRAM credentials go to --credentials-file PATH or --zookeeper")
            both = set(scram_add) & set(scram_delete)
            if both:
                parser.error("%s is both added and deleted" % sorted(both)[0])
        if quotas:
            if not (args.quota_file or args.zookeeper or args.bootstrap_server):
                parser.error("quota keys go to --quota-file PATH, --zookeeper or "
                             "--bootstrap-server")
            try:
                altered({}, quota_add, quota_delete, path)
            except ValueError as exc:
                parser.error(str(exc))
        scram_add = _scram_credentials(scram_add, parser)
    try:
        quota_store, credential_store = _open_stores(args)
    except QuotaStoreError as exc:
        print("kthrottle quotas: error: %s" % exc, file=sys.stderr)
        return 1
    try:
        if args.action == "describe":
            return _describe(quota_store, credential_store, named, types)
        try:
            if args.zookeeper and scram:
                config, entry = _alter_znode(quota_store, path, quota_add, quota_delete,
                                             scram_add, scram_delete)
            else:
                if scram and quotas:  # two files: read both before writing either
                    quota_store.read(missing_ok=True)
                    credential_store.read(missing_ok=True)
                config = quota_store.alter(path, quota_add, quota_delete) if quotas else None
                entry = credential_store.alter(user, scram_add, scram_delete) if scram else None
        except ValueError as exc:  # a bad key or value: nothing was written
            parser.error(str(exc))
        if config is not None:
            print("Completed updating quotas for %s%s." % (
                _describe_entity(path),
                ": %s" % _config_text(config) if config else " (no quotas left)"))
        if entry is not None:
            print("Completed updating SCRAM credentials for %s%s." % (
                _describe_entity(path),
                ": %s" % _scram_text(entry) if entry else " (none left)"))
        return 0
    except QuotaStoreError as exc:
        print("kthrottle quotas: error: %s" % exc, file=sys.stderr)
        return 1
    finally:
        if quota_store is not None:
            quota_store.close()
        if credential_store is not None:
            credential_store.close()


def _alter_znode(store, path, quota_add, quota_delete, scram_add, scram_delete):
    """Quotas and SCRAM credentials of a user in one write of its znode and
    one change notification. Returns (quotas or None, credentials)."""
    from .sources.credentials import _scram_entries, with_scram
    from .sources.zookeeper import CONFIG_ROOT, with_quotas

    quotas = {}

    def change(full):
        if quota_add or quota_delete:
            full, new = with_quotas(full, quota_add, quota_delete, path)
            quotas.update(new)
        return with_scram(full, scram_add, scram_delete)

    full = store.alter_config(path, change)
    entry = _scram_entries("%s/%s" % (CONFIG_ROOT, path), full)[0]
    return (quotas if quota_add or quota_delete else None), entry


_TYPE_OF = {"users": "user", "clients": "client-id", "ips": "ip", "topics": "topic"}
_KIND_ORDER = {"user": 0, "client-id": 0, "ip": 1, "topic": 2}


def _describe(store, credential_store, named, types):
    shown = 0
    user = named.get("users")
    snapshot = store.read() if store is not None else {}
    wanted = {_TYPE_OF[t]: named.get(t) for t in types}

    def order(path):
        return _KIND_ORDER[next(iter(parse_entity(path)))], path

    for path in sorted((p for p in snapshot if p not in (STATIC, GROUPS)), key=order):
        entity = parse_entity(path)
        if types:
            if set(entity) != set(wanted):
                continue
            if any(name is not None and entity[t] != name for t, name in wanted.items()):
                continue
        print("Quotas for %s are %s" % (_describe_entity(path), _config_text(snapshot[path])))
        shown += 1
    for name, config in (snapshot.get(GROUPS) or {}).items() if not types else ():
        quotas = {k: v for k, v in config.items() if k != "members"}
        print("Quotas for quota group '%s' (members %s) are %s"
              % (name, ", ".join(config["members"]), _config_text(quotas)))
        shown += 1
    static = snapshot.get(STATIC)
    if static and not types:
        print("Static defaults (quota.producer.default / quota.consumer.default) are %s"
              % _config_text(static))
        shown += 1
    if credential_store is not None and types in ([], ["users"]):
        credentials = credential_store.read()
        for name in credentials.users:
            if user is not None and name != user:
                continue
            entry = {m: credentials.scram(m, name) for m in credentials.mechanisms(name)}
            # as kafka-configs --describe shows them: mechanisms and iterations only
            print("SCRAM credential configs for %s are %s"
                  % (_describe_entity(entity_path(user=name)), _scram_text(entry)))
            shown += 1
    if not shown:
        scram = credential_store is not None and types in ([], ["users"])
        what = "quotas" if not scram else (
            "SCRAM credentials" if store is None else "quotas or SCRAM credentials")
        print("No %s configured%s." % (what, " for that entity" if types else ""))
    return 0
