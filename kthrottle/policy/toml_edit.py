"""Edits of a hand-written TOML file (the quota file, the credentials file)
that change some tables and keep the rest of it (comments, blank lines,
order) as the operator wrote it, with tomlkit. No I/O here: text in, text
out. Loaded only when a file is edited (the proxy need not carry tomlkit).
"""
import os
import tomllib

import tomlkit
from tomlkit.container import Container
from tomlkit.items import Comment, Null, SingleKey, Table, Trivia, Whitespace

from .quota_file import _toml_key, table_header

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
