"""Quotas in a TOML file (format: ``kthrottle.policy.quota_file``), and the
file handling other TOML files followed live share (the credentials file)."""
import asyncio
import hashlib
import os
import tempfile
import tomllib

from ..policy.quota_file import (
    QuotaFileError,
    altered,
    document_text,
    entity_table,
    snapshot_from_document,
)
from . import QuotaSource, QuotaStore, QuotaStoreError, cancelled, entity_count, log


def read_file_bytes(path, kind, missing_ok=False):
    """The whole file; None if it is missing and ``missing_ok``. ``kind``
    ("quota file") names it in the QuotaStoreError."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise QuotaStoreError("%s %s does not exist" % (kind, path)) from None
    except OSError as exc:
        raise QuotaStoreError("cannot read %s %s: %s" % (kind, path, exc.strerror)) from None


def stat_signature(path):
    """What says a file may have changed without reading it: its inode (an
    editor's rename-over, a ConfigMap's symlink swap), size and change
    times. Raises OSError."""
    st = os.stat(path)
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def load_toml(path, data, kind, what, empty_ok=False):
    """File content -> parsed TOML, or QuotaStoreError saying what is wrong.
    ``what`` ("quotas") is what a comment-only file empties."""
    if not data.strip() and not empty_ok:
        # `cat > file` and many editors truncate before writing: an empty
        # file is far more often a write in progress than a wish
        raise QuotaStoreError(
            "%s %s is empty; to remove all %s, write a file holding only "
            "a comment (e.g. '# no %s')" % (kind, path, what, what))
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise QuotaStoreError("%s %s is not UTF-8 text: %s" % (kind, path, exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise QuotaStoreError("%s %s is not valid TOML: %s" % (kind, path, exc)) from None


def write_file_atomically(path, text, kind):
    """Replace the file's content in one rename (readers never see half of
    it); an existing file keeps its permission bits, a new one is 0600."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kthrottle-", dir=directory)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        except FileNotFoundError:
            pass
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise QuotaStoreError("cannot write %s %s: %s" % (kind, path, exc.strerror)) from None


class TomlFileStore:
    """A TOML file read whole into one value (the quotas, the credentials):
    ``kind`` names it in messages, ``section`` is what an empty file lacks,
    ``from_document`` reads the parsed TOML (raising ``document_error``),
    ``empty()`` is the value of no file."""

    kind = section = start_text = None
    document_error = ValueError

    def __init__(self, path):
        self.path = str(path)

    def read_bytes(self, missing_ok=False):
        return read_file_bytes(self.path, self.kind, missing_ok)

    def signature(self):
        return stat_signature(self.path)

    def parse(self, data, empty_ok=False):
        """File content -> the value, or QuotaStoreError saying what is wrong."""
        doc = load_toml(self.path, data, self.kind, self.section, empty_ok)
        try:
            return self.from_document(doc)
        except self.document_error as exc:
            raise QuotaStoreError("%s %s: %s" % (self.kind, self.path, exc)) from None

    def read(self, missing_ok=False):
        """The value; with ``missing_ok`` (for ``alter``, which starts a
        missing or empty file afresh) a missing or empty file reads as
        ``empty()``."""
        data = self.read_bytes(missing_ok)
        if data is None:
            return self.empty()
        return self.parse(data, empty_ok=missing_ok)

    def edit(self, update, key_text=None):
        """Change the file in place: ``update(value)`` -> (the new value,
        its changed tables as ``edit_tables`` takes them), or ValueError
        with nothing written. Only those tables change; comments, blank
        lines and the order of the rest stay. A missing or empty file starts
        as ``start_text``. ``key_text`` as ``edit_tables`` takes it. Written
        atomically; returns the bytes written."""
        from tomlkit.exceptions import TOMLKitError

        from ..policy.toml_edit import edit_tables

        data = self.read_bytes(missing_ok=True)
        value = self.empty() if data is None else self.parse(data, empty_ok=True)
        value, tables = update(value)
        text = data.decode("utf-8") if data is not None and data.strip() else self.start_text
        try:
            text = edit_tables(text, tables, key_text)
            if not text.strip():  # an empty file would be taken for a write in progress
                text = self.start_text
            written = text.encode("utf-8")
            same = self.parse(written, empty_ok=True) == value
        except (TOMLKitError, ValueError, QuotaStoreError):
            same = False
        if not same:  # a layout edit_tables does not know (an inline table, dotted keys)
            raise QuotaStoreError(
                "%s %s: cannot change it in place; write each entity as a [table] "
                "of its own, as `kthrottle quotas alter` writes them" % (self.kind, self.path))
        write_file_atomically(self.path, text, self.kind)
        return written

    def close(self):
        pass


class FileQuotaStore(TomlFileStore, QuotaStore):
    kind = "quota file"
    section = "quotas"
    document_error = QuotaFileError

    @staticmethod
    def from_document(doc):
        return snapshot_from_document(doc)

    start_text = document_text({})

    @staticmethod
    def empty():
        return {}

    def alter(self, path, add=None, delete=()):
        """Only the entity's table changes: the file keeps its comments and
        layout (see ``edit``); a missing or empty file is started afresh.
        Returns the entity's quotas now."""
        written = self.alter_many([(path, add, delete)])
        return self.parse(written, empty_ok=True).get(path, {})

    def alter_many(self, changes):
        """Alter several entities (``changes``: (path, add, delete) each, valid)
        in one edit of the file; returns the bytes written."""
        return self.edit(lambda old: self._altered(old, changes))

    @staticmethod
    def _altered(snapshot, changes):
        snapshot = dict(snapshot)
        for path, add, delete in changes:
            config = altered(snapshot.get(path, {}), add, delete, path)
            if config:
                snapshot[path] = config
            else:
                snapshot.pop(path, None)
        paths = dict.fromkeys(path for path, _, _ in changes)
        return snapshot, [entity_table(path, snapshot.get(path, {})) for path in paths]


class FollowedFile:
    """A file followed live by polling its content (cheap for a small file,
    and it also sees an editor's rename-over or a ConfigMap's symlink swap).
    Content, not mtime/size/inode, tells a change: a same-size rewrite within
    one mtime tick is still a change.

    A poll reads the content only when the file's stat (``store.signature()``,
    taken on the event loop: a local file or a mounted volume) changed since
    the last read, or every ``content_every`` polls: a thread's round trip
    for every poll costs an idle proxy more than all else it does, and a
    same-size rewrite within one mtime tick is still seen then.

    A changed file is applied once two consecutive polls read the same
    content, so a file caught half-written is never taken. A settled version
    that is empty or invalid is refused: logged once, counted in
    ``rejected``; the last applied content stays in force and ``healthy`` is
    false until a valid version is applied (or the applied one is back).

    ``store`` has ``read_bytes()`` and ``parse(data)`` (both raise
    QuotaStoreError); a subclass names what the file holds (``noun``) and
    sums a parsed version up for log lines (``summary``)."""

    noun = "quotas"
    log = log
    content_every = 20  # polls at most between two reads of the content

    def __init__(self, store, describe, poll_interval=0.25):
        self.store = store
        self.poll_interval = poll_interval
        self.healthy = False
        self.rejected = 0
        self.describe = describe
        self._applied = None  # digest of the content in force
        self._seen = None  # what the previous poll read
        self._refused = None  # the settled version last refused (logged already)
        self._task = None
        self._on_update = None  # what start was given (reload hands new versions to it)
        self._signature = None  # the stat before the last read (None: read at the next poll)
        self._unread_polls = 0  # polls since that read

    def summary(self, value):
        raise NotImplementedError

    def _stat(self):
        signature = getattr(self.store, "signature", None)
        if signature is None:
            return None
        try:
            return signature()
        except OSError:  # the read says what is wrong
            return None

    def _read(self):
        """(version, data, error): version is the content's digest, or the
        error message when the file cannot be read."""
        try:
            data = self.store.read_bytes()
        except QuotaStoreError as exc:
            return ("error", str(exc)), None, exc
        return hashlib.sha256(data).digest(), data, None

    async def start(self, on_update):
        signature = self._stat()
        version, data, error = await asyncio.to_thread(self._read)
        if error is not None:
            raise error
        value = self.store.parse(data)  # a bad file at start is an error for the command
        on_update(value)
        self._on_update = on_update
        self._applied = self._seen = version
        self._signature = signature
        self.healthy = True
        self.log.info("%s from %s: %s", self.noun, self.describe, self.summary(value))
        self._task = asyncio.get_running_loop().create_task(self._follow(on_update))

    async def _follow(self, on_update):
        while True:
            await asyncio.sleep(self.poll_interval)
            await self.poll(on_update)

    async def poll(self, on_update):
        """One look at the file (the follower calls this every poll interval)."""
        signature = self._stat()
        if (signature is not None and signature == self._signature
                and self._unread_polls < self.content_every
                and (self._seen == self._applied or self._seen == self._refused)):
            self._unread_polls += 1  # unchanged, and what it held is settled
            return
        self._unread_polls = 0
        version, data, error = await asyncio.to_thread(self._read)
        self._signature = signature
        previous, self._seen = self._seen, version
        if version != previous:
            return  # still changing, or being written: wait until it settles
        if version == self._applied:
            if not self.healthy:
                self.log.info("%s holds the %s in force again", self.describe, self.noun)
                self.healthy = True
                self._refused = None
            return
        if version == self._refused:
            return
        try:
            if error is not None:
                raise error
            # a large file takes seconds to parse: off the event loop, which
            # keeps serving every connection meanwhile
            value = await asyncio.to_thread(self.store.parse, data)
        except QuotaStoreError as exc:
            self._refused = version
            if data is not None:
                self.rejected += 1  # a version of the file, not a missing file
            self.healthy = False
            self.log.error("%s; the last known %s stay in force", exc, self.noun)
            return
        if self._seen != version:
            return  # written or read anew while this version was parsed: that one counts
        on_update(value)
        self._applied = version
        self._refused = None
        if not self.healthy:
            self.log.info("%s is valid again", self.describe)
        self.healthy = True
        self.log.info("%s reloaded from %s: %s", self.noun, self.describe, self.summary(value))

    def written(self, data, value=None):
        """This process has just written ``data`` to the file (an admin API
        alteration): it is in force now, not after the next two polls. On
        the event loop, after the write; ``value`` is ``data`` parsed, when
        the writer parsed it already (off the loop)."""
        if self._on_update is None:  # not started
            return
        if value is None:
            value = self.store.parse(data)
        self._on_update(value)
        self._applied = self._seen = hashlib.sha256(data).digest()
        self._refused = None
        self._signature = None  # read at the next poll
        self.healthy = True
        self.log.info("%s written to %s: %s", self.noun, self.describe, self.summary(value))

    def _write(self, alter, changes, errors=(QuotaStoreError,)):
        """Blocking (a worker thread): ``alter(changes)`` (a store's edit of the
        file, the bytes written) -> ({key: error message}, then): each
        change's key (its first item) with why when the edit failed (one of
        ``errors``), else ``then()``, which puts what was written in force
        (``written``) on the event loop."""
        try:
            data = alter(changes)
            value = self.store.parse(data, empty_ok=True)  # here, not on the event loop
        except errors as exc:
            return {change[0]: str(exc) for change in changes}, None
        return {}, lambda: self.written(data, value)

    async def reload(self):
        """Look at the file now rather than at the next poll (SIGHUP). A
        new version is applied as a poll would once a second read agrees
        with this one; a version refused before is logged again."""
        if self._on_update is None:  # not started
            return
        version = (await asyncio.to_thread(self._read))[0]
        self._seen, self._refused = version, None
        self._signature = None
        if version == self._applied and self.healthy:
            self.log.info("%s unchanged: the %s in force stay", self.describe, self.noun)
            return
        await self.poll(self._on_update)

    async def stop(self):
        self._task = await cancelled(self._task)


class FollowedStoreFile(FollowedFile):
    """A FollowedFile made from the file's path: its store is a
    ``store_class`` of that path, its log lines call it ``what`` and the
    path."""

    store_class = None
    what = None

    def __init__(self, path, poll_interval=0.25):
        store = self.store_class(path)
        super().__init__(store, "%s %s" % (self.what, store.path), poll_interval)


class FileQuotaSource(FollowedStoreFile, QuotaSource):
    """The quota file followed live (see FollowedFile)."""

    store_class = FileQuotaStore
    what = "quota file"

    def summary(self, snapshot):
        return "%d entities" % entity_count(snapshot)

    def alter_entities(self, changes):
        """Blocking (a worker thread): write ``changes`` ((path, add, delete)
        each, valid) in one edit of the file -> ({path: error message},
        then): ``then()`` on the event loop puts the new quotas in force at
        once."""
        return self._write(self.store.alter_many, changes)
