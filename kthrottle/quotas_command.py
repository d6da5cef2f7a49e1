"""``kthrottle quotas alter|describe|delete``: kafka-configs for quotas.

The flags are kafka-configs.sh's: ``--entity-type users|clients`` paired in
order with ``--entity-name NAME`` or ``--entity-default``; both types in one
command name a <user, client-id> entity (KIP-55). Against ZooKeeper the znodes
and change notifications are exactly Kafka's, so brokers and proxies alike
pick the change up.

SASL/SCRAM credentials are altered the same way, as kafka-configs does
(``--add-config 'SCRAM-SHA-512=[iterations=8192,password=...]'``,
``--delete-config SCRAM-SHA-512``): only the salted credential is written,
into the user znode with --zookeeper, or into --credentials-file.
"""
import argparse
import re
import sys

from .policy.entities import DEFAULT, QUOTA_KEYS, entity_path, parse_entity_path
from .policy.quota_file import STATIC, format_value
from .security import ZOOKEEPER

ENTITY_TYPES = ("users", "clients")
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
        description="Manage KIP-55 quotas (producer_byte_rate, consumer_byte_rate in bytes/s; "
        "request_rate in requests/s, KIP-124) with kafka-configs' flags, in the TOML quota "
        "file a proxy reads (--quota-file) or in ZooKeeper in Kafka's own layout "
        "(--zookeeper), where a change notification is written too. A user's SASL/SCRAM "
        "credentials (SCRAM-SHA-256, SCRAM-SHA-512) are managed the same way, salted as Kafka "
        "stores them, in the user znodes (--zookeeper) or in a credentials file "
        "(--credentials-file).",
        epilog="examples:\n"
        "  kthrottle quotas alter --quota-file quotas.toml --entity-type users --entity-name alice "
        "--add-config producer_byte_rate=1048576,request_rate=100\n"
        "  kthrottle quotas alter --zookeeper 127.0.0.1:2181 --entity-type users --entity-name alice "
        "--entity-type clients --entity-default --add-config consumer_byte_rate=2097152\n"
        "  kthrottle quotas describe --zookeeper 127.0.0.1:2181/kafka --entity-type users\n"
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
        p.add_argument("--credentials-file", metavar="PATH",
                       help="the TOML file of salted SCRAM credentials a proxy reads (with "
                       "--quota-file, or alone; not with --zookeeper)")
        p.add_argument("--entity-type", action="append", choices=ENTITY_TYPES, default=[],
                       help="users or clients; give both for a <user, client-id> entity")
        p.add_argument("--entity-name", action=_EntityName, metavar="NAME", dest="entity_names",
                       help="a user principal or client-id, paired in order with --entity-type")
        p.add_argument("--entity-default", action=_EntityName, nargs=0, dest="entity_names",
                       help="the <default> entity of the --entity-type in the same position")
        if name == "alter":
            p.add_argument("--add-config", metavar="K=V[,K=V...]",
                           help="quota keys to set: %s; or a user's SCRAM credential, "
                           "%s=[password=...] or [iterations=N,password=...] (salted "
                           "before it is written)" % (", ".join(QUOTA_KEYS),
                                                      "|".join(SCRAM_MECHANISMS)))
        if name in ("alter", "delete"):
            p.add_argument("--delete-config", metavar="K[,K...]",
                           help="quota keys or SCRAM mechanisms to remove")
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


def _open_stores(args):
    """(quota store or None, credentials store or None); with --zookeeper
    both are one connection."""
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
    from .policy.quota_file import altered
    from .sources import QuotaStoreError

    if not (args.quota_file or args.zookeeper or args.credentials_file):
        parser.error("give --quota-file, --zookeeper or --credentials-file")
    if args.zookeeper and args.credentials_file:
        parser.error("with --zookeeper, SCRAM credentials are in the user znodes: "
                     "--credentials-file does not go with it")
    need_names = args.action != "describe"
    user, client_id, types = _entity(args, parser, need_names)
    if args.action == "alter":
        if not args.add_config and not args.delete_config:
            parser.error("alter needs --add-config and/or --delete-config")
    add = _parse_add(args.add_config, parser) if getattr(args, "add_config", None) else {}
    delete = [k.strip() for k in (getattr(args, "delete_config", None) or "").split(",") if k.strip()]
    if args.action == "delete" and not delete:
        # the quotas; with --credentials-file, a user's credentials there too
        delete = (list(QUOTA_KEYS) if args.quota_file or args.zookeeper else []) + (
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
            if not (args.quota_file or args.zookeeper):
                parser.error("quota keys go to --quota-file PATH or --zookeeper")
            try:
                altered({}, quota_add, quota_delete)
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
            return _describe(quota_store, credential_store, user, client_id, types)
        path = entity_path(user=user, client_id=client_id)
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
            full, new = with_quotas(full, quota_add, quota_delete)
            quotas.update(new)
        return with_scram(full, scram_add, scram_delete)

    full = store.alter_config(path, change)
    entry = _scram_entries("%s/%s" % (CONFIG_ROOT, path), full)[0]
    return (quotas if quota_add or quota_delete else None), entry


def _describe(store, credential_store, user, client_id, types):
    shown = 0
    snapshot = store.read() if store is not None else {}
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
        what = "quotas" if credential_store is None else (
            "SCRAM credentials" if store is None else "quotas or SCRAM credentials")
        print("No %s configured%s." % (what, " for that entity" if types else ""))
    return 0
