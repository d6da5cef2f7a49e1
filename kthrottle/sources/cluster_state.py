"""The cluster-state snapshot the Spark job writes to one znode, followed live.

``/kthrottle/cluster-state`` (under the chroot of the connect string) holds
the snapshot's JSON (``policy.storage``); the job replaces it whole, and one
znode write is atomic. A kazoo data watch reads each new version; it is parsed
on kazoo's thread and handed to the event loop. A malformed snapshot is
refused with a log line (once per content) and counted; the last good one
stays in force. So is one dated more than ``MAX_CLOCK_SKEW`` ahead of this
machine's clock: it would never grow old, and the fail-safe for a stale
snapshot would never apply (issue 14). A deleted znode keeps the last
snapshot too: it ages, and the reader's fail-safe takes over once it is too
old.
"""
import asyncio
import logging
import time

from . import QuotaStoreError
from .state_topic import ClusterStateWatch
from .zookeeper import ZooKeeperQuotaStore

log = logging.getLogger("kthrottle.storage")

DEFAULT_ZNODE = "/kthrottle/cluster-state"


def shares_znode(proxy_id, cluster_state_znode=DEFAULT_ZNODE):
    """Where the Spark job writes a fleet member's quota shares, and the
    proxy started with ``--proxy-id`` reads them: ``<cluster-state znode>/
    shares/<proxy id>`` (under the chroot), one znode per proxy."""
    return "%s/shares/%s" % (cluster_state_znode.rstrip("/"), proxy_id)


class ZnodeWatch:
    """Follows one znode that a writer replaces whole: each new version is
    parsed (``parse``, on kazoo's thread), its time checked against this
    machine's clock (the value's ``check_clock(now)``: a document dated ahead
    would never age) and handed to the event loop. What does not parse or is
    dated ahead is refused with a log line (once per content) and counted;
    the last good value stays in force. A deleted or emptied znode keeps it
    too (it ages; its reader decides what that means), and so does a lost
    connection to ZooKeeper: logged once when lost and once when back, when
    kazoo reads the znode again."""

    what = "the cluster state"  # for log lines
    fail_safe = ("the last snapshot stays in force until it is older than --storage-max-age-ms, "
                 "then --storage-fail-safe applies")  # what applies meanwhile

    def __init__(self, hosts, znode, timeout=10.0):
        self.hosts = hosts
        self.znode = znode
        self.store = ZooKeeperQuotaStore(hosts, timeout)
        self.rejected = 0
        self.updates = 0
        self.disconnects = 0  # connections to ZooKeeper lost (suspended or expired)
        self.seen = False  # a good value was read at least once
        # on the event loop, with each good version's bytes as read: the
        # other worker processes (--workers) are given them to parse
        self.forward = None
        self._loop = None
        self._on_update = None
        self._last_bad = None
        self._stopped = False
        self._down = False

    @property
    def healthy(self):
        return self.store.zk.connected and not self._stopped

    @property
    def connected(self):
        """Whether the ZooKeeper session is connected now (a metric)."""
        return self.store.zk.connected

    def parse(self, data):
        raise NotImplementedError

    async def start(self, on_update):
        """Connect and start watching; ``on_update(value)`` is called on the
        event loop for each good version (also the one there now)."""
        self._loop = asyncio.get_running_loop()
        self._on_update = on_update
        await asyncio.to_thread(self.store.connect)
        try:
            await asyncio.to_thread(self.store.zk.DataWatch, self.znode, self._changed)
        except Exception as exc:  # kazoo's errors: the connection, permissions
            await self.stop()
            raise QuotaStoreError("cannot watch %s in ZooKeeper %s: %s"
                                  % (self.znode, self.hosts, exc)) from None
        # kazoo's DataWatch reads the znode again itself once reconnected
        self.store.zk.add_listener(self._state_changed)

    def _state_changed(self, state):
        """On kazoo's thread (must not block): one line when the connection
        is lost (SUSPENDED, then maybe LOST: one outage) and one when it is
        back, whatever kazoo's retries do in between."""
        from kazoo.protocol.states import KazooState

        if self._stopped or self._loop is None:
            return
        if state == KazooState.CONNECTED:
            if self._down:
                self._down = False
                self._say(log.info, "ZooKeeper is back (%s): following %s in %s again",
                          self.hosts, self.what, self.znode)
        elif not self._down:
            self._down = True
            self.disconnects += 1
            self._say(log.warning, "ZooKeeper connection %s (%s): %s in %s is not followed "
                      "until it is back; %s", str(state).lower(), self.hosts, self.what,
                      self.znode, self.fail_safe)

    def _say(self, fn, *args):
        try:  # logged on the event loop, in order with what the watch hands it
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    async def stop(self):
        self._stopped = True
        await asyncio.to_thread(self.store.close)

    def _changed(self, data, stat):
        """On kazoo's thread."""
        if self._stopped:
            return False  # ends the watch
        if not data:
            # deleted, or empty: a parent znode made for the quota shares
            # below it (shares_znode) before any snapshot was written
            if self.seen:
                log.warning("%s %s was %s; the last one stays until it is too old", self.what,
                            self.znode, "deleted" if data is None else "emptied")
            return None
        try:
            value = self.parse(data)
            value.check_clock(time.time())
        except (ValueError, UnicodeDecodeError, OSError, EOFError) as exc:  # gzip: OSError, EOF
            if data != self._last_bad:
                self._last_bad = data
                log.error("refused %s in %s (version %d): %s; the previous one stays",
                          self.what, self.znode, stat.version, exc)
            self.rejected += 1  # after the line: whoever sees the count finds it logged
            return None
        self._last_bad = None
        self.seen = True
        self.updates += 1
        self._loop.call_soon_threadsafe(self._on_update, value)
        if self.forward is not None:
            self._loop.call_soon_threadsafe(self.forward, bytes(data))
        return None


class ClusterStateSource(ClusterStateWatch, ZnodeWatch):
    def __init__(self, hosts, znode=DEFAULT_ZNODE, timeout=10.0):
        super().__init__(hosts, znode, timeout)

    @property
    def state_where(self):
        return "at %s in ZooKeeper %s" % (self.znode, self.hosts)
