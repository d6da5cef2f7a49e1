"""Quotas in a TOML file (format: ``kthrottle.policy.quota_file``)."""
import asyncio
import hashlib
import os
import tempfile
import tomllib

from ..policy.quota_file import QuotaFileError, altered, document_text, snapshot_from_document
from . import QuotaSource, QuotaStore, QuotaStoreError, entity_count, log


class FileQuotaStore(QuotaStore):
    def __init__(self, path):
        self.path = str(path)

    def read_bytes(self, missing_ok=False):
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            if missing_ok:
                return None
            raise QuotaStoreError("quota file %s does not exist" % self.path) from None
        except OSError as exc:
            raise QuotaStoreError("cannot read quota file %s: %s" % (self.path, exc.strerror)) from None

    def parse(self, data, empty_ok=False):
        """File content -> snapshot, or QuotaStoreError saying what is wrong."""
        if not data.strip() and not empty_ok:
            # `cat > file` and many editors truncate before writing: an empty
            # file is far more often a write in progress than a wish
            raise QuotaStoreError(
                "quota file %s is empty; to remove all quotas, write a file holding only "
                "a comment (e.g. '# no quotas')" % self.path)
        try:
            doc = tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise QuotaStoreError("quota file %s is not UTF-8 text: %s" % (self.path, exc)) from None
        except tomllib.TOMLDecodeError as exc:
            raise QuotaStoreError("quota file %s is not valid TOML: %s" % (self.path, exc)) from None
        try:
            return snapshot_from_document(doc)
        except QuotaFileError as exc:
            raise QuotaStoreError("quota file %s: %s" % (self.path, exc)) from None

    def read(self, missing_ok=False):
        """The snapshot; with ``missing_ok`` (for ``alter``, which writes a
        whole new file) a missing or empty file reads as no quotas."""
        data = self.read_bytes(missing_ok)
        if data is None:
            return {}
        return self.parse(data, empty_ok=missing_ok)

    def alter(self, path, add=None, delete=()):
        """The file is rewritten atomically (comments are not kept); a
        missing or empty file is started afresh."""
        snapshot = self.read(missing_ok=True)
        config = altered(snapshot.get(path, {}), add, delete)
        if config:
            snapshot[path] = config
        else:
            snapshot.pop(path, None)
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            fd, tmp = tempfile.mkstemp(prefix=".quotas-", dir=directory)
            with os.fdopen(fd, "w") as f:
                f.write(document_text(snapshot))
            os.replace(tmp, self.path)
        except OSError as exc:
            raise QuotaStoreError("cannot write quota file %s: %s" % (self.path, exc.strerror)) from None
        return config


class FileQuotaSource(QuotaSource):
    """Polls the file's content (cheap for a small file, and it also sees an
    editor's rename-over or a ConfigMap's symlink swap). Content, not
    mtime/size/inode, tells a change: a same-size rewrite within one mtime
    tick is still a change.

    A changed file is applied once two consecutive polls read the same
    content, so a file caught half-written is never taken. A settled version
    that is empty or invalid is refused: logged once, counted in
    ``rejected``; the last applied quotas stay in force and ``healthy`` is
    false until a valid version is applied (or the applied one is back)."""

    def __init__(self, path, poll_interval=0.25):
        self.store = FileQuotaStore(path)
        self.poll_interval = poll_interval
        self.healthy = False
        self.rejected = 0
        self.describe = "quota file %s" % self.store.path
        self._applied = None  # digest of the content in force
        self._seen = None  # what the previous poll read
        self._refused = None  # the settled version last refused (logged already)
        self._task = None

    def _read(self):
        """(version, data, error): version is the content's digest, or the
        error message when the file cannot be read."""
        try:
            data = self.store.read_bytes()
        except QuotaStoreError as exc:
            return ("error", str(exc)), None, exc
        return hashlib.sha256(data).digest(), data, None

    async def start(self, on_update):
        version, data, error = await asyncio.to_thread(self._read)
        if error is not None:
            raise error
        snapshot = self.store.parse(data)  # a bad file at start is an error for the command
        on_update(snapshot)
        self._applied = self._seen = version
        self.healthy = True
        log.info("quotas from %s: %d entities", self.describe, entity_count(snapshot))
        self._task = asyncio.get_running_loop().create_task(self._follow(on_update))

    async def _follow(self, on_update):
        while True:
            await asyncio.sleep(self.poll_interval)
            await self.poll(on_update)

    async def poll(self, on_update):
        """One look at the file (the follower calls this every poll interval)."""
        version, data, error = await asyncio.to_thread(self._read)
        previous, self._seen = self._seen, version
        if version != previous:
            return  # still changing, or being written: wait until it settles
        if version == self._applied:
            if not self.healthy:
                log.info("%s holds the quotas in force again", self.describe)
                self.healthy = True
                self._refused = None
            return
        if version == self._refused:
            return
        try:
            if error is not None:
                raise error
            snapshot = self.store.parse(data)
        except QuotaStoreError as exc:
            self._refused = version
            if data is not None:
                self.rejected += 1  # a version of the file, not a missing file
            self.healthy = False
            log.error("%s; the last known quotas stay in force", exc)
            return
        on_update(snapshot)
        self._applied = version
        self._refused = None
        if not self.healthy:
            log.info("%s is valid again", self.describe)
        self.healthy = True
        log.info("quotas reloaded from %s: %d entities", self.describe, entity_count(snapshot))

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
