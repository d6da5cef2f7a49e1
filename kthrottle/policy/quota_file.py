"""The quota file: KIP-55 entities in TOML, to and from a quota snapshot.

    [users.alice]                      # users/alice: all alice's clients share it
    producer_byte_rate = 1048576
    [users.alice.clients.app]          # users/alice/clients/app
    request_rate = 50
    [users."<default>"]                # users/<default>: each user its own bucket
    consumer_byte_rate = 2097152
    [users."<default>".clients."<default>"]
    [clients.reporting]                # clients/reporting: shared across users
    [clients."<default>"]
    [static]                           # server.properties' static client-id defaults
    "quota.producer.default" = 10485760

Names are written as clients send them (the file is for people); entity paths
sanitize them as Kafka does. No I/O here: text or parsed TOML in, snapshot out;
``edit_tables`` changes some tables of a file's text and keeps the rest of it
(comments, blank lines, order) as the operator wrote it.
"""
import json
import os
import tomllib

import tomlkit
from tomlkit.container import Container
from tomlkit.items import Comment, Null, SingleKey, Table, Trivia, Whitespace

from .entities import (
    DEFAULT,
    QUOTA_KEYS,
    STATIC_DEFAULT_KEYS,
    entity_path,
    parse_entity_path,
    parse_quota_value,
)

STATIC = "static"


class QuotaFileError(ValueError):
    """A quota file that does not describe quotas; the message says where."""


def _quota_values(table, where):
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            continue  # a nested table (clients of a user), handled by the caller
        try:
            out[key] = parse_quota_value(key, value)
        except ValueError as exc:
            raise QuotaFileError("%s: %s" % (where, exc)) from None
    return out


def _table(value, where):
    if not isinstance(value, dict):
        raise QuotaFileError("%s must be a table of quotas" % where)
    return value


def snapshot_from_document(doc):
    """Parsed TOML -> ``{entity path: {quota key: float}}`` (plus "static")."""
    snapshot = {}
    for section, body in doc.items():
        if section == "users":
            for user, table in _table(body, "[users]").items():
                where = "[users.%s]" % json.dumps(user)
                table = _table(table, where)
                for key, value in table.items():
                    if isinstance(value, dict) and key != "clients":
                        raise QuotaFileError("%s: unknown table %r (only clients)" % (where, key))
                config = _quota_values(table, where)
                if config:
                    snapshot[entity_path(user=user)] = config
                clients = _table(table.get("clients", {}), where + ".clients")
                for client_id, ctable in clients.items():
                    cwhere = "%s.clients.%s" % (where, json.dumps(client_id))
                    config = _quota_values(_no_subtables(_table(ctable, cwhere), cwhere), cwhere)
                    if config:
                        snapshot[entity_path(user=user, client_id=client_id)] = config
        elif section == "clients":
            for client_id, table in _table(body, "[clients]").items():
                where = "[clients.%s]" % json.dumps(client_id)
                config = _quota_values(_no_subtables(_table(table, where), where), where)
                if config:
                    snapshot[entity_path(client_id=client_id)] = config
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
            raise QuotaFileError("unknown section %r (known: users, clients, static)" % section)
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


def format_value(value):
    """A quota value as Kafka writes it: whole numbers without a fraction."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def entity_names(path):
    """An entity path's table in the file, as names: ("users", "alice", ...)."""
    user, client_id = parse_entity_path(path)
    names = ()
    if user is not None:
        names += ("users", user)
    if client_id is not None:
        names += ("clients", client_id)
    return names


def entity_table(path, config):
    """What ``edit_tables`` takes for an entity: (names, {key: value text})."""
    return entity_names(path), {k: format_value(config[k]) for k in QUOTA_KEYS if k in config}


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
                lines.append("%s = %s" % (_toml_key(key), format_value(config[key])))

    def order(path):
        user, client_id = parse_entity_path(path)
        # clients/* last; <default> after named entities at each level
        return (user is None, user == DEFAULT, user or "", client_id is not None,
                client_id == DEFAULT, client_id or "")

    for path in sorted((p for p in snapshot if p != STATIC), key=order):
        section("[%s]" % table_header(entity_names(path)), snapshot[path], QUOTA_KEYS)
    static = snapshot.get(STATIC)
    if static:
        names = {key: name for name, key in STATIC_DEFAULT_KEYS.items()}
        section("[static]", {names[k]: v for k, v in static.items()},
                [names[k] for k in QUOTA_KEYS if k in names])
    return "\n".join(lines) + "\n"


def altered(config, add=None, delete=()):
    """``config`` with ``add`` ({key: value}, validated) set and ``delete``
    (keys) removed; raises ValueError naming the bad key, changing nothing."""
    add = {key: parse_quota_value(key, value) for key, value in (add or {}).items()}
    for key in delete:
        if key not in QUOTA_KEYS:
            raise ValueError("unknown quota key %r (known: %s)" % (key, ", ".join(QUOTA_KEYS)))
        if key in add:
            raise ValueError("%s is both added and deleted" % key)
    out = {k: v for k, v in config.items() if k not in delete}
    out.update(add)
    return out


# editing a file in place (tomlkit) -------------------------------------------
#
# tomlkit keeps every comment and blank line, but files the comment lines above
# a [header] under the table before it. So a table's header and keys are
# removed while its comment lines stay where they are, and a new table goes
# right after its neighbour's last key, before the comments leading the next.

def edit_tables(text, changes, key_text=None):
    """``text`` (TOML) with each of ``changes`` ((names, {key: value text}))
    applied: the table at ``names`` gets exactly those keys (an unchanged
    value is left as written; keys come in the given order when new), a
    table left without keys loses its header, and so does a parent it
    leaves empty. Everything else, comments included, stays as it is. A new
    key is written as ``key_text(name)`` (default: bare where TOML allows)."""
    key_text = key_text or _toml_key
    doc = tomlkit.parse(text)
    for names, entries in changes:
        table = next((t for t, n, _ in _sections(doc) if n == tuple(names)), None)
        if table is None:
            if entries:
                _add_table(doc, tuple(names), entries, key_text)
            continue
        body = table.value.body
        present = set()
        for i, (key, item) in enumerate(body[:_head_end(body)]):
            if key is None:
                continue
            if key.key not in entries:
                body[i] = (None, Null())
                continue
            present.add(key.key)
            value = tomlkit.value(entries[key.key])
            if value.unwrap() != item.unwrap():
                for field in ("indent", "comment_ws", "comment", "trail"):
                    setattr(value.trivia, field, getattr(item.trivia, field))
                body[i] = (key, value)
        added = [_key_value(k, v, key_text) for k, v in entries.items() if k not in present]
        if added:
            end = _end_line(body)
            body[end:end] = added
        if not entries:
            _drop(doc, table)
    return doc.as_string()


def _end_line(body):
    """Where a key goes after the table's last one (ending its line if it
    was the file's last)."""
    end = _kv_end(body)
    if end and "\n" not in body[end - 1][1].trivia.trail:
        body[end - 1][1].trivia.trail += "\n"
    return end


def _key_value(name, text, key_text):
    return SingleKey(name, original=key_text(name)), tomlkit.value(text)


def _sections(doc):
    """The tables that have a [header], in file order: (table, names,
    ancestors from the outermost)."""
    out = []

    def walk(body, ancestors):
        for _, item in body:
            if isinstance(item, Table):
                if item.display_name is not None:
                    out.append((item, _header_names(item.display_name), ancestors))
                walk(item.value.body, ancestors + [item])

    walk(doc.body, [])
    return out


def _header_names(header):
    names, doc = [], tomllib.loads("[%s]" % header)
    while len(doc) == 1:
        (name, doc), = doc.items()
        names.append(name)
    return tuple(names)


def _head_end(body):
    """Where the tables inside a table's body start."""
    return next((i for i, (_, item) in enumerate(body) if isinstance(item, Table)), len(body))


def _kv_end(body):
    """Just after the table's last key/value."""
    return max((i + 1 for i, (key, _) in enumerate(body[:_head_end(body)]) if key is not None),
               default=0)


def _body_of(doc, ancestors):
    return ancestors[-1].value.body if ancestors else doc.body


def _drop(doc, table):
    """Remove a table's header (its keys are gone): its comment lines move to
    the end of the table before it, its tables stay; then a parent left
    empty goes too."""
    sections = _sections(doc)
    i = next(i for i, (t, _, _) in enumerate(sections) if t is table)
    ancestors = sections[i][2]
    body = table.value.body
    head = _head_end(body)
    kept = [(None, item) for _, item in body[:head] if isinstance(item, (Comment, Whitespace))]
    del body[:head]
    container = _body_of(doc, ancestors)
    at = next(j for j, (_, item) in enumerate(container) if item is table)
    if any(isinstance(item, Table) for _, item in body):  # they stay, under no header
        container[at] = (container[at][0], Table(table.value, Trivia(), False, True))
    else:
        container[at] = (None, Null())
    before = sections[i - 1][0].value.body if i else doc.body
    at = _head_end(before)
    if (at and kept and isinstance(kept[0][1], Whitespace)
            and isinstance(before[at - 1][1], Whitespace)):
        kept = kept[1:]  # one blank line between tables is enough
    before[at:at] = kept
    for depth in range(len(ancestors) - 1, -1, -1):
        parent = ancestors[depth]
        pbody = parent.value.body
        if any(isinstance(item, Table) for _, item in pbody):
            return
        if parent.display_name is not None:
            if _kv_end(pbody) == 0:
                _drop(doc, parent)
            return
        container = _body_of(doc, ancestors[:depth])
        at = next(j for j, (_, item) in enumerate(container) if item is parent)
        container[at] = (None, Null())


def _add_table(doc, names, entries, key_text):
    """A new table, right after the last table sharing the most leading names
    with it (a user's client after the user's tables, a user after the other
    users), or at the end."""
    anchor, shared = None, -1
    for table, tnames, _ in _sections(doc):
        common = len(os.path.commonprefix([tnames, names]))
        if common >= shared:
            anchor, shared = table, common
    new = Table(Container(), Trivia(indent="\n"), False, False, display_name=table_header(names))
    new.value.body.extend(_key_value(k, v, key_text) for k, v in entries.items())
    key = SingleKey(names[-1])
    if anchor is None:
        doc.body.append((key, new))
        return
    body = anchor.value.body
    end = _end_line(body)
    new.value.body.extend(body[end:_head_end(body)])  # the comments leading the next table
    body[end:_head_end(body)] = [(key, new)]
