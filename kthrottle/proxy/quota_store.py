"""Where quotas live: a TOML file or ZooKeeper in Kafka's own layout.

Stores (blocking, used by ``kthrottle quotas`` and by the sources) read a whole
snapshot and alter one entity. Sources (used by the proxy) read once at start,
then follow changes and hand each new snapshot to a callback on the event loop.
If the file or ZooKeeper goes away, the last known quotas stay in force,
``healthy`` turns false (a metric shows it) and a log line says so.
"""
import asyncio
import json
import logging
import os
import queue
import re
import tempfile
import threading
import tomllib

from ..policy.entities import QUOTA_KEYS, parse_entity_path, parse_quota_value
from ..policy.quota_file import QuotaFileError, altered, document_text, format_value, snapshot_from_document

log = logging.getLogger("kthrottle.quotas")


class QuotaStoreError(Exception):
    """The store cannot be read or written; the message says which and why."""


# file -------------------------------------------------------------------

class FileQuotaStore:
    def __init__(self, path):
        self.path = str(path)

    def read(self, missing_ok=False):
        try:
            with open(self.path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            if missing_ok:
                return {}
            raise QuotaStoreError("quota file %s does not exist" % self.path) from None
        except OSError as exc:
            raise QuotaStoreError("cannot read quota file %s: %s" % (self.path, exc.strerror)) from None
        except tomllib.TOMLDecodeError as exc:
            raise QuotaStoreError("quota file %s is not valid TOML: %s" % (self.path, exc)) from None
        try:
            return snapshot_from_document(doc)
        except QuotaFileError as exc:
            raise QuotaStoreError("quota file %s: %s" % (self.path, exc)) from None

    def alter(self, path, add=None, delete=()):
        """Set ``add`` and remove ``delete`` keys of one entity; returns its
        new config. The file is rewritten atomically (comments are not kept)."""
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

    def close(self):
        pass


class FileQuotaSource:
    """Re-reads the file when it changes (polled: cheap, and it also sees an
    editor's rename-over or a ConfigMap's symlink swap)."""

    def __init__(self, path, poll_interval=0.25):
        self.store = FileQuotaStore(path)
        self.poll_interval = poll_interval
        self.healthy = False
        self.describe = "quota file %s" % self.store.path
        self._stamp = None
        self._task = None

    def _stat(self):
        try:
            st = os.stat(self.store.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    async def start(self, on_update):
        self._stamp = self._stat()
        snapshot = self.store.read()  # a bad file at start is an error for the command
        on_update(snapshot)
        self.healthy = True
        log.info("quotas from %s: %d entities", self.describe, _count(snapshot))
        self._task = asyncio.get_running_loop().create_task(self._follow(on_update))

    async def _follow(self, on_update):
        while True:
            await asyncio.sleep(self.poll_interval)
            stamp = self._stat()
            if stamp == self._stamp:
                continue
            self._stamp = stamp
            try:
                snapshot = await asyncio.to_thread(self.store.read)
            except QuotaStoreError as exc:
                if self.healthy:
                    log.error("%s; the last known quotas stay in force", exc)
                self.healthy = False
                continue
            on_update(snapshot)
            if not self.healthy:
                log.info("%s is readable again", self.describe)
            self.healthy = True
            log.info("quotas reloaded from %s: %d entities", self.describe, _count(snapshot))

    async def stop(self):
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def _count(snapshot):
    return sum(1 for p in snapshot if p != "static")


# ZooKeeper ---------------------------------------------------------------

CONFIG_ROOT = "/config"
CHANGES = "/config/changes"
CHANGE_PREFIX = "config_change_"
CHANGE_EXPIRATION_SECONDS = 15 * 60  # Kafka's changeExpirationMs
_CHANGE_SEQ = re.compile(r"^%s(\d+)$" % CHANGE_PREFIX)


def _kazoo(hosts, timeout):
    import warnings

    from kazoo.client import KazooClient

    # kazoo logs every failed reconnect; the sources log state changes once
    logging.getLogger("kazoo.client").setLevel(logging.ERROR)
    # "No chroot path exists": Kafka's tools, too, create it on first write
    warnings.filterwarnings("ignore", message="No chroot path exists")
    # reconnect forever, at most 2 s apart: a ZooKeeper that comes back is found
    return KazooClient(hosts=hosts, timeout=timeout,
                       connection_retry={"max_tries": -1, "max_delay": 2})


class ZooKeeperQuotaStore:
    """Quota znodes exactly as Kafka (ZooKeeper mode) keeps them:
    ``/config/users/<user>[/clients/<client-id>]`` and ``/config/clients/<client-id>``
    holding ``{"version":1,"config":{"producer_byte_rate":"1024",...}}``, and a
    sequential ``/config/changes/config_change_N`` per change
    (``{"version":2,"entity_path":"users/alice"}``). ``hosts`` is
    ``HOST:PORT[,HOST:PORT...][/chroot]``."""

    def __init__(self, hosts, timeout=10.0, client=None):
        self.hosts = hosts
        self.zk = client or _kazoo(hosts, timeout)
        self._own = client is None
        self._closed = False
        self.timeout = timeout

    def connect(self):
        from kazoo.handlers.threading import KazooTimeoutError

        try:
            self.zk.start(timeout=self.timeout)
        except KazooTimeoutError:
            self.close()
            raise QuotaStoreError("cannot reach ZooKeeper at %s (waited %.0f s)"
                                  % (self.hosts, self.timeout)) from None
        return self

    def close(self):
        if self._own and not self._closed:
            self._closed = True
            self.zk.stop()
            self.zk.close()

    def _config_of(self, znode):
        """The full config map of an entity znode (None if absent)."""
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self.zk.get(znode)
        except NoNodeError:
            return None
        if not data:
            return {}
        try:
            doc = json.loads(data)
            config = doc.get("config", {})
            if not isinstance(config, dict):
                raise ValueError
            return config
        except (ValueError, AttributeError):
            raise QuotaStoreError("znode %s does not hold Kafka's config JSON: %r"
                                  % (znode, data[:200])) from None

    def _quotas_of(self, znode):
        config = self._config_of(znode)
        if not config:
            return None
        out = {}
        for key, value in config.items():
            if key not in QUOTA_KEYS:
                continue  # SCRAM credentials and other keys share the user znode
            try:
                out[key] = parse_quota_value(key, value)
            except ValueError as exc:
                log.error("ignoring %s in %s: %s", key, znode, exc)
        return out or None

    def _children(self, znode):
        from kazoo.exceptions import NoNodeError

        try:
            return self.zk.get_children(znode)
        except NoNodeError:
            return []

    def read(self):
        snapshot = {}
        for user in self._children("/config/users"):
            base = "users/%s" % user
            config = self._quotas_of("%s/%s" % (CONFIG_ROOT, base))
            if config:
                snapshot[base] = config
            for client in self._children("/config/%s/clients" % base):
                path = "%s/clients/%s" % (base, client)
                config = self._quotas_of("%s/%s" % (CONFIG_ROOT, path))
                if config:
                    snapshot[path] = config
        for client in self._children("/config/clients"):
            path = "clients/%s" % client
            config = self._quotas_of("%s/%s" % (CONFIG_ROOT, path))
            if config:
                snapshot[path] = config
        return snapshot

    def read_entity(self, path):
        return self._quotas_of("%s/%s" % (CONFIG_ROOT, path))

    def alter(self, path, add=None, delete=()):
        """As kafka-configs --zookeeper --alter: rewrite the entity znode
        (keeping keys that are not quotas, like SCRAM credentials), then
        announce the change."""
        parse_entity_path(path)
        znode = "%s/%s" % (CONFIG_ROOT, path)
        full = self._config_of(znode) or {}
        quotas = {k: v for k, v in full.items() if k in QUOTA_KEYS}
        new = altered({k: parse_quota_value(k, v) for k, v in quotas.items()}, add, delete)
        full = {k: v for k, v in full.items() if k not in QUOTA_KEYS}
        full.update({k: format_value(v) for k, v in new.items()})
        data = json.dumps({"version": 1, "config": full}, separators=(",", ":")).encode()
        if self.zk.exists(znode):
            self.zk.set(znode, data)
        else:
            self.zk.create(znode, data, makepath=True)
        self.zk.ensure_path(CHANGES)
        created = self.zk.create(
            "%s/%s" % (CHANGES, CHANGE_PREFIX),
            json.dumps({"version": 2, "entity_path": path}, separators=(",", ":")).encode(),
            sequence=True)
        self._purge_notifications(self.zk.exists(created).ctime / 1000.0)
        return new

    def _purge_notifications(self, now, older_than=CHANGE_EXPIRATION_SECONDS):
        """Kafka's brokers delete notifications older than 15 minutes; with
        only proxies watching, the tool does it so they do not pile up.
        ``now`` is ZooKeeper's clock (a znode's ctime), not this machine's."""
        from kazoo.exceptions import NoNodeError

        horizon = now - older_than
        for name in self._children(CHANGES):
            znode = "%s/%s" % (CHANGES, name)
            try:
                if self.zk.exists(znode).ctime / 1000.0 < horizon:
                    self.zk.delete(znode)
            except (NoNodeError, AttributeError):
                pass  # deleted meanwhile


class ZooKeeperQuotaSource:
    """Follows Kafka's change notifications. Blocking ZooKeeper calls run on
    one worker thread (kazoo callbacks arrive on kazoo's threads); each new
    snapshot is handed to the event loop with call_soon_threadsafe."""

    def __init__(self, hosts, timeout=10.0):
        self.store = ZooKeeperQuotaStore(hosts, timeout)
        self.describe = "ZooKeeper %s" % hosts
        self.healthy = False
        self._loop = None
        self._on_update = None
        self._snapshot = {}
        self._last_seq = -1
        self._work = queue.Queue()
        self._worker = None
        self._was_down = False
        self._stopping = False

    async def start(self, on_update):
        self._loop = asyncio.get_running_loop()
        self._on_update = on_update
        await asyncio.to_thread(self.store.connect)
        zk = self.store.zk
        snapshot = await asyncio.to_thread(self._resync)
        on_update(snapshot)
        self.healthy = True
        log.info("quotas from %s: %d entities", self.describe, _count(snapshot))
        zk.add_listener(self._state_changed)
        self._worker = threading.Thread(target=self._run, name="kthrottle-zookeeper", daemon=True)
        self._worker.start()
        await asyncio.to_thread(zk.ensure_path, CHANGES)
        zk.ChildrenWatch(CHANGES, self._changes)

    def _state_changed(self, state):  # kazoo thread: must not block
        from kazoo.protocol.states import KazooState

        if self._stopping:
            return
        if state == KazooState.CONNECTED:
            if self._was_down:
                self._was_down = False
                self._work.put(("resync", None))
        else:
            self._was_down = True
            self._loop.call_soon_threadsafe(self._went_away, state)

    def _went_away(self, state):
        if self.healthy:
            log.warning("ZooKeeper connection %s (%s): the last known quotas stay in force "
                        "until it is back", str(state).lower(), self.store.hosts)
        self.healthy = False

    def _changes(self, children):  # kazoo thread
        self._work.put(("changes", list(children)))

    def _run(self):
        while True:
            what, arg = self._work.get()
            if what == "stop":
                return
            try:
                if what == "resync":
                    snapshot = self._resync()
                    self._publish(snapshot, back=True)
                elif what == "changes":
                    self._apply_changes(arg)
            except QuotaStoreError as exc:
                log.error("%s; the last known quotas stay in force", exc)
            except Exception as exc:  # connection dropped mid-read: the reconnect resyncs
                log.warning("reading quotas from ZooKeeper failed (%s: %s); will resync on "
                            "reconnect", type(exc).__name__, exc)

    def _resync(self):
        seqs = [_seq(name) for name in self.store._children(CHANGES)]
        snapshot = self.store.read()
        self._last_seq = max([s for s in seqs if s is not None], default=self._last_seq)
        self._snapshot = snapshot
        return dict(snapshot)

    def _apply_changes(self, children):
        fresh = sorted((s, c) for s, c in ((_seq(c), c) for c in children)
                       if s is not None and s > self._last_seq)
        changed = False
        for seq, name in fresh:
            path = self._notified_path("%s/%s" % (CHANGES, name))
            self._last_seq = seq
            if path is None:
                continue
            config = self.store.read_entity(path)
            if config:
                self._snapshot[path] = config
            else:
                self._snapshot.pop(path, None)
            changed = True
            log.info("quota change for %s: %s", path, config or "removed")
        if changed:
            self._publish(dict(self._snapshot))

    def _notified_path(self, znode):
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self.store.zk.get(znode)
            doc = json.loads(data)
            path = doc["entity_path"] if doc.get("version") == 2 else "%s/%s" % (
                doc["entity_type"], doc["entity_name"])  # version 1 notifications
            if not (path.startswith("users/") or path.startswith("clients/")):
                return None  # topics, brokers: not quotas
            parse_entity_path(path)
            return path
        except NoNodeError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError):
            log.error("ignoring change notification %s: not Kafka's JSON", znode)
            return None

    def _publish(self, snapshot, back=False):
        def apply():
            self._on_update(snapshot)
            if back or not self.healthy:
                log.info("ZooKeeper is back (%s): quotas resynced, %d entities",
                         self.store.hosts, _count(snapshot))
            self.healthy = True

        self._loop.call_soon_threadsafe(apply)

    async def stop(self):
        self._stopping = True
        self._work.put(("stop", None))
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join, 5)
        await asyncio.to_thread(self.store.close)


def _seq(name):
    m = _CHANGE_SEQ.match(name)
    return int(m.group(1)) if m else None
