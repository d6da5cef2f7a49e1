"""Quotas in ZooKeeper, laid out as a ZooKeeper-mode Kafka cluster keeps them:
``/config/users``, ``/config/clients`` and ``/config/ips`` (KIP-612), announced
in ``/config/changes``. Topic quotas, which no Kafka release has, live in
kthrottle's own ``/kthrottle/config/topics/<topic>`` (the same JSON) and are
announced in ``/kthrottle/config/changes``: Kafka's ``/config/topics`` holds a
ZooKeeper-mode broker's topic configs, and its brokers read ``/config/changes``."""
import asyncio
import json
import logging
import queue
import re
import threading

from ..policy.entities import (
    QUOTA_KEYS,
    ip_path,
    parse_entity,
    parse_quota_value,
    validate_quota_config,
)
from ..policy.quota_file import altered, format_value
from . import QuotaSource, QuotaStore, QuotaStoreError, entity_count, log
from .outage import Outage

CONFIG_ROOT = "/config"
CHANGES = "/config/changes"
CHANGE_PREFIX = "config_change_"
CHANGE_EXPIRATION_SECONDS = 15 * 60  # Kafka's changeExpirationMs
_CHANGE_SEQ = re.compile(r"^%s(\d+)$" % CHANGE_PREFIX)
_UNREAD = object()  # ZooKeeperFollower._entity: the data is to be read
# kthrottle's own entities (topics), beside Kafka's and never among them
OWN_CONFIG_ROOT = "/kthrottle/config"
OWN_CHANGES = "/kthrottle/config/changes"


def _is_own(path):
    return path.startswith("topics/")


def entity_znode(path):
    """Where an entity path's znode is: /config/<path>, or for a topic
    /kthrottle/config/topics/<topic>."""
    return "%s/%s" % (OWN_CONFIG_ROOT if _is_own(path) else CONFIG_ROOT, path)


def _znode_path(znode):
    """An entity znode -> its entity path (as the znode names it)."""
    root = OWN_CONFIG_ROOT if znode.startswith(OWN_CONFIG_ROOT + "/") else CONFIG_ROOT
    return znode[len(root) + 1:]


def changes_znode(path):
    """Where a change of this entity is announced."""
    return OWN_CHANGES if _is_own(path) else CHANGES


def snapshot_path(path):
    """The path a znode's entity has in a snapshot: an ip in its canonical
    text (kafka-configs writes the address as given); ValueError for a name
    that is not an entity (an ip znode that is not an address)."""
    if path.startswith("ips/"):
        return ip_path(path[4:])
    parse_entity(path)
    return path


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


def _config_json(znode, data):
    """The full config map in an entity znode's data (Kafka's
    ``{"version":1,"config":{...}}``); QuotaStoreError if it is not that."""
    if not data:
        return {}
    try:
        config = json.loads(data).get("config", {})
        if not isinstance(config, dict):
            raise ValueError
        return config
    except (ValueError, AttributeError):
        raise QuotaStoreError("znode %s does not hold Kafka's config JSON: %r"
                              % (znode, data[:200])) from None


def entity_quotas(znode, data, path=None):
    """An entity znode's data -> (quotas, problems): the valid quota keys as
    floats, and a message per quota key whose value is unusable or (given
    the entity's ``path``) one its kind cannot hold. Keys that are not quotas
    are left alone: SCRAM credentials share the user znode. Raises
    QuotaStoreError if the data is not Kafka's config JSON."""
    if path is None:
        parse = parse_quota_value
    else:
        def parse(key, value):
            return validate_quota_config({key: value}, path=path)[key]
    return config_entries(znode, _config_json(znode, data), QUOTA_KEYS, parse)


def config_entries(znode, config, keys, parse):
    """The entries of a znode's config map whose key is in ``keys``, each
    read by ``parse(key, value)`` -> (entries, problems): one message per
    entry that does not parse; other keys are left alone."""
    entries, problems = {}, []
    for key, value in config.items():
        if key not in keys:
            continue
        try:
            entries[key] = parse(key, value)
        except ValueError as exc:
            problems.append("ignoring %s in %s: %s" % (key, znode, exc))
    return entries, problems


def with_quotas(full, add=None, delete=(), path=None):
    """An entity's full config map with its quotas altered (validated as
    ``altered`` does, for the entity at ``path``: ValueError, nothing
    changed) -> (new map, new quotas). Keys that are not quotas are kept as
    they are."""
    quotas = {k: v for k, v in full.items() if k in QUOTA_KEYS}
    new = altered({k: parse_quota_value(k, v) for k, v in quotas.items()}, add, delete, path)
    full = {k: v for k, v in full.items() if k not in QUOTA_KEYS}
    full.update({k: format_value(v, k) for k, v in new.items()})
    return full, new


class ZooKeeperQuotaStore(QuotaStore):
    """Quota znodes exactly as Kafka (ZooKeeper mode) keeps them:
    ``/config/users/<user>[/clients/<client-id>]``, ``/config/clients/<client-id>``
    and ``/config/ips/<ip>`` holding
    ``{"version":1,"config":{"producer_byte_rate":"1024",...}}``, and a
    sequential ``/config/changes/config_change_N`` per change
    (``{"version":2,"entity_path":"users/alice"}``); topics the same way under
    ``/kthrottle/config`` (see the module). ``hosts`` is
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

    def children(self, znode):
        from kazoo.exceptions import NoNodeError

        try:
            return self.zk.get_children(znode)
        except NoNodeError:
            return []

    #: requests a bulk read (a resync) has in flight at once: a round trip
    #: per batch rather than per znode (100,000 entities, one at a time,
    #: are as many round trips)
    READ_BATCH = 1000

    def _pipelined(self, items, call):
        """{item: what ``call(item)`` (a kazoo ``*_async`` read) answers,
        None for a znode that does not exist}, READ_BATCH in flight at a
        time. Other errors (the connection lost) raise, as the one-by-one
        reads do."""
        from kazoo.exceptions import NoNodeError

        out = {}
        for i in range(0, len(items), self.READ_BATCH):
            pending = [(item, call(item)) for item in items[i:i + self.READ_BATCH]]
            for item, result in pending:
                try:
                    out[item] = result.get()
                except NoNodeError:
                    out[item] = None
        return out

    def entity_paths(self):
        """Every entity path that has a znode (ips as their znodes are
        named), users (and their clients) first, then clients, ips, topics."""
        paths = []
        users = self.children("/config/users")
        clients = self._pipelined(["%s/users/%s/clients" % (CONFIG_ROOT, u) for u in users],
                                  self.zk.get_children_async)
        for user in users:
            base = "users/%s" % user
            paths.append(base)
            paths.extend("%s/clients/%s" % (base, c)
                         for c in clients["%s/%s/clients" % (CONFIG_ROOT, base)] or ())
        paths.extend("clients/%s" % c for c in self.children("/config/clients"))
        paths.extend("ips/%s" % ip for ip in self.children("/config/ips"))
        paths.extend("topics/%s" % t for t in self.children(OWN_CONFIG_ROOT + "/topics"))
        return paths

    def entity_data(self, path):
        """The raw data of an entity znode, None if there is none."""
        from kazoo.exceptions import NoNodeError

        try:
            return self.zk.get(entity_znode(path))[0]
        except NoNodeError:
            return None

    def entity_data_many(self, paths):
        """{path: the raw data of its entity znode, None if there is none},
        read pipelined (see READ_BATCH)."""
        znodes = {path: entity_znode(path) for path in paths}
        got = self._pipelined(list(dict.fromkeys(znodes.values())), self.zk.get_async)
        return {path: None if got[znode] is None else got[znode][0]
                for path, znode in znodes.items()}

    def read_entity(self, path):
        """The quotas of one entity (None if it has none). A znode that is
        not Kafka's config JSON raises QuotaStoreError; an unusable value is
        logged and left out."""
        data = self.entity_data(path)
        if data is None:
            return None
        quotas, problems = entity_quotas(entity_znode(path), data, path)
        for problem in problems:
            log.error(problem)
        return quotas or None

    def read(self):
        snapshot = {}
        for path in self.entity_paths():
            try:
                key = snapshot_path(path)
            except ValueError as exc:
                log.error("ignoring %s: %s", entity_znode(path), exc)
                continue
            config = self.read_entity(path)
            if config:
                snapshot[key] = config
        return snapshot

    def alter(self, path, add=None, delete=()):
        """As kafka-configs --zookeeper --alter: rewrite the entity znode
        (keeping keys that are not quotas, like SCRAM credentials), then
        announce the change (a topic's in kthrottle's own znodes)."""
        path = snapshot_path(path)
        result = {}

        def change(full):
            full, quotas = with_quotas(full, add, delete, path)
            result.update(quotas)
            return full

        self.alter_config(path, change)
        return result

    def alter_config(self, path, change):
        """Rewrite the whole config map of the entity znode at ``path`` with
        ``change(config) -> new config`` (it may raise ValueError: nothing
        is written then), then write the change notification Kafka's
        brokers follow (a topic's in kthrottle's own). Returns the new config."""
        znode = entity_znode(path)
        full = change(_config_json(znode, self.entity_data(path)))
        data = json.dumps({"version": 1, "config": full}, separators=(",", ":")).encode()
        if self.zk.exists(znode):
            self.zk.set(znode, data)
        else:
            self.zk.create(znode, data, makepath=True)
        changes = changes_znode(path)
        self.zk.ensure_path(changes)
        created = self.zk.create(
            "%s/%s" % (changes, CHANGE_PREFIX),
            json.dumps({"version": 2, "entity_path": path}, separators=(",", ":")).encode(),
            sequence=True)
        self._purge_notifications(self.zk.exists(created).ctime / 1000.0, changes=changes)
        return full

    def _purge_notifications(self, now, older_than=CHANGE_EXPIRATION_SECONDS, changes=CHANGES):
        """Kafka's brokers delete notifications older than 15 minutes; with
        only proxies watching, the tool does it so they do not pile up.
        ``now`` is ZooKeeper's clock (a znode's ctime), not this machine's."""
        from kazoo.exceptions import NoNodeError

        horizon = now - older_than
        for name in self.children(changes):
            znode = "%s/%s" % (changes, name)
            try:
                if self.zk.exists(znode).ctime / 1000.0 < horizon:
                    self.zk.delete(znode)
            except (NoNodeError, AttributeError):
                pass  # deleted meanwhile


class ZooKeeperFollower:
    """Follows Kafka's config znodes through its change notifications in
    sequence order, as a broker's ZkNodeChangeNotificationListener does.
    Blocking ZooKeeper calls run on one worker thread (kazoo callbacks arrive
    on kazoo's threads); each new snapshot is handed to the event loop with
    call_soon_threadsafe.

    An entity znode that is not Kafka's config JSON, or a value that is
    unusable, is skipped with a log line (once per content) and counted in
    ``rejected``; the rest applies and the entity keeps what it last had.
    A notification is only passed once its entity was read: a read that fails
    (connection lost, no permission) stops there, ``healthy`` turns false and
    everything is read again (resync) on reconnect, or after a pause if the
    connection is up.

    A subclass says what it follows: ``noun`` ("quotas"), which entities
    (``entity_paths``, ``follows``), what an entity znode holds for it
    (``parse_entity``), what ``on_update`` is handed (``handed``) and how a
    snapshot reads in a log line (``summary``, ``change_text``)."""

    noun = "quotas"
    log = log
    #: the notification directories followed
    change_dirs = (CHANGES,)

    def __init__(self, hosts, timeout=10.0, retry_interval=1.0, max_retry_interval=30.0):
        self.store = ZooKeeperQuotaStore(hosts, timeout)
        self.describe = "ZooKeeper %s" % hosts
        self.healthy = False
        self.rejected = 0
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self._loop = None
        self._on_update = None
        self._snapshot = {}
        self._last_seq = dict.fromkeys(self.change_dirs, -1)  # per notification directory
        self._bad = {}  # znode -> the data last refused, so each content is logged once
        self._outage = Outage()  # failed reads until a resync succeeds: logged once per reason
        self.disconnects = 0  # connections to ZooKeeper lost (suspended or expired)
        self._retry_delay = retry_interval
        self._retry = None  # threading.Timer of a pending retry
        self._work = queue.Queue()
        self._worker = None
        self._was_down = False
        self._stopping = False

    # what a subclass follows ----------------------------------------------

    def entity_paths(self):
        """The entity paths to read on a resync (blocking)."""
        return self.store.entity_paths()

    def follows(self, path):
        """Whether a notified (valid) entity path is one this follows."""
        return True

    def parse_entity(self, znode, data):
        """Entity znode data -> (value or None, [problem messages]); raises
        QuotaStoreError if it is not Kafka's config JSON."""
        raise NotImplementedError

    def handed(self, snapshot):
        """What ``on_update`` gets for ``{entity path: value}``."""
        return dict(snapshot)

    def summary(self, snapshot):
        return "%d entities" % entity_count(snapshot)

    def change_text(self, path, value):
        return "%s change for %s: %s" % (self.noun, path, value or "none")

    # the machinery ----------------------------------------------------------

    @property
    def connected(self):
        """Whether the ZooKeeper session is connected now (a metric)."""
        return self.store.zk.connected

    async def start(self, on_update):
        from kazoo.exceptions import KazooException

        self._loop = asyncio.get_running_loop()
        self._on_update = on_update
        await asyncio.to_thread(self.store.connect)
        zk = self.store.zk
        try:
            snapshot = await asyncio.to_thread(self._resync)
        except KazooException as exc:
            raise QuotaStoreError("cannot read %s from %s: %s"
                                  % (self.noun, self.describe, _reason(exc))) from None
        on_update(self.handed(snapshot))
        self.healthy = True
        self.log.info("%s from %s: %s", self.noun, self.describe, self.summary(snapshot))
        zk.add_listener(self._state_changed)
        self._worker = threading.Thread(target=self._run, name="kthrottle-zookeeper", daemon=True)
        self._worker.start()
        for changes in self.change_dirs:
            await asyncio.to_thread(zk.ensure_path, changes)
            zk.ChildrenWatch(changes, lambda children, d=changes: self._changes(d, children))

    def _state_changed(self, state):  # kazoo thread: must not block
        from kazoo.protocol.states import KazooState

        if self._stopping:
            return
        if state == KazooState.CONNECTED:
            if self._was_down:
                self._was_down = False
                self._work.put(("resync", "reconnect"))
        elif not self._was_down:  # SUSPENDED, then maybe LOST: one outage, one line
            self._was_down = True
            self.disconnects += 1
            self._loop.call_soon_threadsafe(self._went_away, state)

    def _went_away(self, state):
        self.log.warning("ZooKeeper connection %s (%s): the last known %s stay in force "
                         "until it is back", str(state).lower(), self.store.hosts, self.noun)
        self.healthy = False

    def _changes(self, changes, children):  # kazoo thread
        self._work.put(("changes", (changes, list(children))))

    def _run(self):
        while True:
            what, arg = self._work.get()
            if what == "stop":
                return
            try:
                if what == "changes":
                    self._apply_changes(*arg)
                    continue
                if what == "entities":
                    self._reread(*arg)
                    continue
                snapshot = self._resync()
            except Exception as exc:
                self._failed(exc)
                continue
            # only a whole read makes the source current again after a failure
            failed = self._outage.recovered()
            after = " (after %d failed read(s))" % failed if failed else ""
            if arg == "reconnect":
                note = "ZooKeeper is back (%s): %s resynced%s, %s" % (
                    self.store.hosts, self.noun, after, self.summary(snapshot))
            else:
                note = "%s read from %s after all%s: %s" % (
                    self.noun, self.describe, after, self.summary(snapshot))
            self._to_loop(snapshot, healthy=True, note=note, always=arg == "reconnect")
            self._retry_delay = self.retry_interval

    def _failed(self, exc):
        reason = str(exc) if isinstance(exc, QuotaStoreError) else _reason(exc)
        # retried with a back-off until a resync succeeds: a line per new reason
        if self._outage.failed(reason):
            if self._outage.failures == 1:
                self.log.warning("reading %s from %s failed (%s); the last known %s stay in "
                                 "force until a resync succeeds", self.noun, self.describe,
                                 reason, self.noun)
            else:
                self.log.warning("reading %s from %s still fails (%d failed reads so far), "
                                 "now with: %s", self.noun, self.describe,
                                 self._outage.failures, reason)
        self._to_loop(healthy=False)
        # on a lost connection the reconnect resyncs; otherwise (a permission,
        # a hiccup) try again after a pause, backing off
        if self.store.zk.connected and not self._stopping and not (
                self._retry is not None and self._retry.is_alive()):
            self._retry = threading.Timer(self._retry_delay, self._work.put, (("resync", "retry"),))
            self._retry.daemon = True
            self._retry.start()
            self._retry_delay = min(self._retry_delay * 2, self.max_retry_interval)

    def _key(self, path):
        """An entity znode's path in the snapshot (snapshot_path), None for
        one that names no entity (logged once)."""
        try:
            return snapshot_path(path)
        except ValueError as exc:
            znode = entity_znode(path)
            self._reject(znode, b"", ["ignoring %s: %s" % (znode, exc)])
            return None

    def _entity(self, path, previous, key=None, data=_UNREAD):
        """What one entity holds as the source applies it (None: nothing);
        ``key``: its path in the snapshot (``path`` unless an ip's differs);
        ``data``: its znode's data, read already (None: no znode); read now
        when not given."""
        key = key or path
        znode = entity_znode(path)
        if data is _UNREAD:
            data = self.store.entity_data(path)
        if data is None:
            self._bad.pop(znode, None)
            return None
        try:
            value, problems = self.parse_entity(znode, data)
        except QuotaStoreError as exc:
            # as a broker does, go on past one bad entity rather than refuse all
            self._reject(znode, data, ["%s; skipped, its last known %s (if any) stay "
                                       "in force" % (exc, self.noun)])
            return previous.get(key)
        if problems:
            self._reject(znode, data, problems)
        else:
            self._bad.pop(znode, None)
        return value or None

    def _reject(self, znode, data, messages):
        if self._bad.get(znode) == data:
            return  # this very content was logged already (by an earlier read)
        self._bad[znode] = data
        self.rejected += 1
        for message in messages:
            self.log.error(message)

    def _resync(self):
        seqs = {changes: [_seq(name) for name in self.store.children(changes)]
                for changes in self.change_dirs}
        snapshot = {}
        present = set()
        paths = self.entity_paths()
        datas = self.store.entity_data_many(paths)  # pipelined: not a round trip each
        for path in paths:
            present.add(entity_znode(path))
            key = self._key(path)
            if key is None:
                continue
            value = self._entity(path, self._snapshot, key, datas[path])
            if value:
                snapshot[key] = value
        self._bad = {z: d for z, d in self._bad.items() if z in present}
        for changes, found in seqs.items():
            self._last_seq[changes] = max([s for s in found if s is not None],
                                          default=self._last_seq[changes])
        self._snapshot = snapshot
        return dict(snapshot)

    def _apply_changes(self, changes, children):
        """Apply the notifications in ``changes`` after the last one applied
        there, in order."""
        fresh = sorted((s, c) for s, c in ((_seq(c), c) for c in children)
                       if s is not None and s > self._last_seq[changes])
        changed = False
        try:
            for seq, name in fresh:
                path = self._notified_path("%s/%s" % (changes, name), changes)
                key = path and self._key(path)
                if key is not None:
                    value = self._entity(path, self._snapshot, key)
                    if value:
                        self._snapshot[key] = value
                    else:
                        self._snapshot.pop(key, None)
                    changed = True
                    self.log.info(self.change_text(key, value))
                # only now: a notification whose entity could not be read is
                # not passed over (the retry or the reconnect resync reads it)
                self._last_seq[changes] = seq
        finally:
            if changed:  # what was read before a failure is in force already
                self._to_loop(dict(self._snapshot))

    def reread(self, paths, timeout=10.0):
        """Blocking (a worker thread, not the loop): read these entities now,
        rather than when their change notifications arrive, and hand the new
        snapshot to the event loop before returning (an admin API
        alteration this process has just written)."""
        done = threading.Event()
        self._work.put(("entities", (list(paths), done)))
        done.wait(timeout)

    def _reread(self, paths, done):
        try:
            for path in paths:
                key = self._key(path)
                if key is None:
                    continue
                value = self._entity(path, self._snapshot, key)
                if value:
                    self._snapshot[key] = value
                else:
                    self._snapshot.pop(key, None)
            self._to_loop(dict(self._snapshot))
        finally:
            done.set()

    def alter_entities(self, changes, alter=None, path_of=lambda change: change[0]):
        """Blocking (a worker thread): write each of ``changes`` ((entity
        path, ...) tuples, valid) with ``alter(change)`` (as kafka-configs
        --zookeeper does: the znode, then a change notification), then read
        them back at once -> ({change[0]: error message}, None). Each entity
        is written alone, so one failure leaves the others done."""
        errors = {}
        written = []
        for change in changes:
            path = path_of(change)
            try:
                alter(change)
                written.append(path)
            except QuotaStoreError as exc:
                errors[change[0]] = str(exc)
            except Exception as exc:  # kazoo: the connection, a permission
                errors[change[0]] = "cannot write %s in %s: %s" % (
                    entity_znode(path), self.describe, _reason(exc))
        if written:
            self.reread(written)
        return errors, None

    def _notified_path(self, znode, changes=CHANGES):
        """The entity a notification names; None for one that is gone, is
        not about what this follows, or is not Kafka's JSON (each passed over).
        Kafka's notifications name users, clients and ips (its topics are
        topic configs, not quotas); kthrottle's own name topics."""
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self.store.zk.get(znode)
        except NoNodeError:
            return None  # purged meanwhile
        try:
            doc = json.loads(data)
            path = doc["entity_path"] if doc.get("version") == 2 else "%s/%s" % (
                doc["entity_type"], doc["entity_name"])  # version 1 notifications
            kinds = ("topics/",) if changes == OWN_CHANGES else ("users/", "clients/", "ips/")
            if not path.startswith(kinds):
                return None  # Kafka's topics, brokers: not quotas
            if not path.startswith("ips/"):  # an ip's name is checked when read
                parse_entity(path)
        except (ValueError, KeyError, TypeError, AttributeError):
            self.rejected += 1
            self.log.error("ignoring change notification %s: not Kafka's JSON: %r",
                           znode, data[:200])
            return None
        return path if self.follows(path) else None

    def _to_loop(self, snapshot=None, healthy=None, note=None, always=False):
        """Hand a snapshot and/or a health change to the event loop, in order."""
        value = self.handed(snapshot) if snapshot is not None else None

        def apply():
            if snapshot is not None:
                self._on_update(value)
            if healthy is not None:
                if note and (always or healthy and not self.healthy):
                    self.log.info(note)
                self.healthy = healthy

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(apply)

    async def stop(self):
        self._stopping = True
        if self._retry is not None:
            self._retry.cancel()
        self._work.put(("stop", None))
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join, 5)
        await asyncio.to_thread(self.store.close)


class ZooKeeperQuotaSource(ZooKeeperFollower, QuotaSource):
    """The quotas of every entity znode, followed live (see ZooKeeperFollower):
    Kafka's users, clients and ips, and kthrottle's own topics."""

    change_dirs = (CHANGES, OWN_CHANGES)

    def parse_entity(self, znode, data):
        return entity_quotas(znode, data, _znode_path(znode))

    def change_text(self, path, quotas):
        return "quota change for %s: %s" % (path, quotas or "no quotas")

    def alter_entities(self, changes):
        """(path, add, delete) each: see ZooKeeperFollower.alter_entities."""
        return super().alter_entities(
            changes, lambda change: self.store.alter(change[0], change[1], change[2]))


def _reason(exc):
    return "%s%s" % (type(exc).__name__, ": %s" % exc if str(exc) else "")


def _seq(name):
    m = _CHANGE_SEQ.match(name)
    return int(m.group(1)) if m else None
