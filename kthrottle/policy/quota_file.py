"""The quota file: KIP-55 entities in TOML, to and from a quota snapshot.

    [users.alice]                      # users/alice: all alice's clients share it
    producer_byte_rate = 1048576
    [users.alice.clients.app]          # users/alice/clients/app
    request_rate = 50
    [users."<default>"]                # users/<default>: each user its own bucket
    consumer_byte_rate = 2097152
    [users."<default>".clients."<default>"]
    [groups.etl]                       # a quota group (KIP-257): every member, one bucket
    members = ["User:alice", "User:bob", "client-id:etl-*"]
    producer_byte_rate = 1048576
    [clients.reporting]                # clients/reporting: shared across users
    [clients."<default>"]
    [ips."<default>"]                  # ips/<default>: each address its own bucket (KIP-612)
    connection_creation_rate = 10
    [ips."10.0.0.1"]                   # ips/10.0.0.1
    [topics.orders]                    # topics/orders: kthrottle's own per-topic byte rates
    producer_byte_rate = 1048576
    observe_only = true                # any entity: measured and reported, delays no one
    [topics."<default>"]
    [static]                           # server.properties' static client-id defaults
    "quota.producer.default" = 10485760

Names are written as clients send them (the file is for people); entity paths
sanitize them as Kafka does (ip addresses are written in their canonical text).
Each table holds only the keys its kind of entity may (entities.keys_for). No I/O here: text or parsed TOML in, snapshot out.
Edits that keep the operator's comments and order: ``toml_edit``.
"""
import json

from .entities import (
    CLIENT_QUOTA_KEYS,
    DEFAULT,
    OBSERVE_ONLY,
    QUOTA_KEYS,
    STATIC_DEFAULT_KEYS,
    entity_kind,
    entity_path,
    ip_path,
    parse_entity,
    parse_entity_path,
    parse_quota_value,
    topic_path,
    validate_quota_config,
)
from .quotas import GROUPS, member_pattern

STATIC = "static"


class QuotaFileError(ValueError):
    """A quota file that does not describe quotas; the message says where."""


def _quota_values(table, where, path):
    # nested tables (clients of a user) are the caller's
    config = {k: v for k, v in table.items() if not isinstance(v, dict)}
    try:
        return validate_quota_config(config, path=path)
    except ValueError as exc:
        raise QuotaFileError("%s: %s" % (where, exc)) from None


def _table(value, where):
    if not isinstance(value, dict):
        raise QuotaFileError("%s must be a table of quotas" % where)
    return value


def snapshot_from_document(doc):
    """Parsed TOML -> ``{entity path: {quota key: float}}`` (plus "static")."""
    snapshot = {}
    seen = set()
    for section, body in doc.items():
        if section == "users":
            for user, table in _table(body, "[users]").items():
                where = "[users.%s]" % json.dumps(user)
                table = _table(table, where)
                for key, value in table.items():
                    if isinstance(value, dict) and key != "clients":
                        raise QuotaFileError("%s: unknown table %r (only clients)" % (where, key))
                path = entity_path(user=user)
                config = _quota_values(table, where, path)
                if config:
                    snapshot[path] = config
                clients = _table(table.get("clients", {}), where + ".clients")
                for client_id, ctable in clients.items():
                    cwhere = "%s.clients.%s" % (where, json.dumps(client_id))
                    path = entity_path(user=user, client_id=client_id)
                    config = _quota_values(_no_subtables(_table(ctable, cwhere), cwhere), cwhere,
                                           path)
                    if config:
                        snapshot[path] = config
        elif section == "clients":
            for client_id, table in _table(body, "[clients]").items():
                where = "[clients.%s]" % json.dumps(client_id)
                path = entity_path(client_id=client_id)
                config = _quota_values(_no_subtables(_table(table, where), where), where, path)
                if config:
                    snapshot[path] = config
        elif section in ("ips", "topics"):
            to_path = ip_path if section == "ips" else topic_path
            for name, table in _table(body, "[%s]" % section).items():
                where = "[%s.%s]" % (section, json.dumps(name))
                try:
                    path = to_path(name)
                except ValueError as exc:
                    raise QuotaFileError("%s: %s" % (where, exc)) from None
                if path in seen:
                    # two spellings of one address (::1 and 0:0::1)
                    raise QuotaFileError("%s: the same entity as another table (%s)"
                                         % (where, path))
                seen.add(path)
                config = _quota_values(_no_subtables(_table(table, where), where), where, path)
                if config:
                    snapshot[path] = config
        elif section == GROUPS:
            groups = {}
            for name, table in _table(body, "[groups]").items():
                where = "[groups.%s]" % json.dumps(name)
                table = _no_subtables(_table(table, where), where)
                members = table.get("members")
                if not isinstance(members, list) or not members:
                    raise QuotaFileError("%s: members must be a list of User:<principal> and "
                                         "client-id:<client-id> (* for any characters)" % where)
                for member in members:
                    try:
                        member_pattern(member)
                    except ValueError as exc:
                        raise QuotaFileError("%s: %s" % (where, exc)) from None
                config = {k: v for k, v in table.items() if k != "members"}
                try:
                    config = validate_quota_config(config, path="users/group")
                except ValueError as exc:
                    raise QuotaFileError("%s: %s" % (where, exc)) from None
                if not any(k != OBSERVE_ONLY for k in config):
                    raise QuotaFileError("%s: no quota (a group holds the keys of a user: %s)"
                                         % (where, ", ".join(CLIENT_QUOTA_KEYS)))
                config["members"] = list(members)
                groups[name] = config
            if groups:
                snapshot[GROUPS] = groups
        elif section == STATIC:
            static = {}
            for name, value in _table(body, "[static]").items():
                key = STATIC_DEFAULT_KEYS.get(name)
                if key is None:
                    raise QuotaFileError("[static]: unknown key %r (known: %s)"
                                         % (name, ", ".join(STATIC_DEFAULT_KEYS)))
                try:
                    static[key] = parse_quota_value(key, value)
                except ValueError as exc:
                    raise QuotaFileError("[static]: %s: %s" % (name, exc)) from None
            if static:
                snapshot[STATIC] = static
        else:
            raise QuotaFileError("unknown section %r (known: users, clients, groups, ips, topics, static)" % section)
    return snapshot


def _no_subtables(table, where):
    for key, value in table.items():
        if isinstance(value, dict):
            raise QuotaFileError("%s: unexpected table %r" % (where, key))
    return table


def _toml_key(name):
    """A bare key where TOML allows one, else a basic string (JSON's escapes
    are TOML's)."""
    if name and all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        return name
    return json.dumps(name, ensure_ascii=False)


def format_value(value, key=None):
    """A quota value as Kafka writes it: whole numbers without a fraction;
    observe_only (``key``) as true or false."""
    if key == OBSERVE_ONLY:
        return "true" if value else "false"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def entity_names(path):
    """An entity path's table in the file, as names: ("users", "alice", ...),
    ("ips", "10.0.0.1"), ("topics", "orders")."""
    kind = entity_kind(path)
    if kind != "client":
        (name,) = parse_entity(path).values()
        return (kind + "s", name)
    user, client_id = parse_entity_path(path)
    names = ()
    if user is not None:
        names += ("users", user)
    if client_id is not None:
        names += ("clients", client_id)
    return names


def entity_table(path, config):
    """What ``edit_tables`` takes for an entity: (names, {key: value text})."""
    return entity_names(path), {k: format_value(config[k], k) for k in QUOTA_KEYS if k in config}


def table_header(names):
    return ".".join(_toml_key(name) for name in names)


def document_text(snapshot):
    """A snapshot as quota-file text, entities in a stable order."""
    lines = ["# kthrottle quotas (KIP-55 entities); see `kthrottle quotas --help`."]

    def section(header, config, keys):
        lines.append("")
        lines.append(header)
        for key in keys:
            if key in config:
                lines.append("%s = %s" % (_toml_key(key), format_value(config[key], key)))

    kinds = {"client": 0, "ip": 1, "topic": 2}

    def order(path):
        kind = entity_kind(path)
        if kind != "client":
            (name,) = parse_entity(path).values()
            return (kinds[kind], name == DEFAULT, name)
        user, client_id = parse_entity_path(path)
        # clients/* after users/*; <default> after named entities at each level
        return (0, user is None, user == DEFAULT, user or "", client_id is not None,
                client_id == DEFAULT, client_id or "")

    for path in sorted((p for p in snapshot if p not in (STATIC, GROUPS)), key=order):
        section("[%s]" % table_header(entity_names(path)), snapshot[path], QUOTA_KEYS)
    for name, config in (snapshot.get(GROUPS) or {}).items():
        section("[groups.%s]" % _toml_key(name), config, ())
        lines.append("members = %s" % json.dumps(list(config["members"]), ensure_ascii=False))
        for key in QUOTA_KEYS:
            if key in config:
                lines.append("%s = %s" % (_toml_key(key), format_value(config[key], key)))
    static = snapshot.get(STATIC)
    if static:
        names = {key: name for name, key in STATIC_DEFAULT_KEYS.items()}
        section("[static]", {names[k]: v for k, v in static.items()},
                [names[k] for k in QUOTA_KEYS if k in names])
    return "\n".join(lines) + "\n"


def altered(config, add=None, delete=(), path=None):
    """``config`` with ``add`` ({key: value}, validated; for the entity at
    ``path`` when given) set and ``delete`` (keys) removed; raises ValueError
    naming the bad key, changing nothing. Setting observe_only false clears
    it (an entity is enforced unless it says otherwise)."""
    add = validate_quota_config(add or {}, path=path)
    for key in delete:
        if key not in QUOTA_KEYS:
            raise ValueError("unknown quota key %r (known: %s)" % (key, ", ".join(QUOTA_KEYS)))
        if key in add:
            raise ValueError("%s is both added and deleted" % key)
    out = {k: v for k, v in config.items() if k not in delete}
    out.update(add)
    if not out.get(OBSERVE_ONLY, 1.0):
        del out[OBSERVE_ONLY]
    return out
