"""Quota sources driven directly on an asyncio loop: real files in tmp_path,
a real ZooKeeper (and a TCP relay process in front of it to cut the source's
connection alone). No proxy."""
import asyncio
import logging
import os
import signal
import subprocess
import sys
import uuid

import pytest

from kthrottle.embedded import free_port
from kthrottle.sources import QUOTA_SOURCES, QuotaStoreError, build_source
from kthrottle.sources.file import FileQuotaSource
from kthrottle.sources.zookeeper import ZooKeeperQuotaSource, ZooKeeperQuotaStore
from kthrottle_testkit import zookeeper as zk_server

pytestmark = pytest.mark.integration

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="scripts/test installs ZooKeeper")


class Updates:
    """What a source handed to on_update, in order."""

    def __init__(self):
        self.snapshots = []

    def __call__(self, snapshot):
        asyncio.get_running_loop()  # raises unless called on the event loop
        self.snapshots.append(snapshot)

    @property
    def last(self):
        return self.snapshots[-1]


async def until(predicate, timeout=5.0, what="condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("timed out waiting for %s" % what)
        await asyncio.sleep(0.02)


def logged(caplog, text):
    return sum(text in r.getMessage() for r in caplog.records if r.name == "kthrottle.quotas")


@pytest.fixture
def quota_log(caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.quotas")
    return caplog


# file -------------------------------------------------------------------

A = '[clients.a]\nproducer_byte_rate = 1000\n'
A_AND_B = A + '[clients.b]\nconsumer_byte_rate = 3000\n'


def write(path, text):
    """Rewrite in place (same inode), as `cat > file` does."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(0)
        f.write(text.encode())


def quota_source(quota_file=None, zookeeper=None):
    from types import SimpleNamespace

    return build_source(QUOTA_SOURCES, SimpleNamespace(quota_file=quota_file, zookeeper=zookeeper))


def test_the_registry_builds_the_source_the_configuration_names():
    assert quota_source() is None
    assert isinstance(quota_source(quota_file="/q.toml"), FileQuotaSource)
    assert isinstance(quota_source(zookeeper="127.0.0.1:2181/kafka"), ZooKeeperQuotaSource)
    # a file named wins, as the proxy refuses both at once anyway
    assert isinstance(quota_source("/q.toml", "127.0.0.1:2181"), FileQuotaSource)


def test_a_same_size_rewrite_within_one_mtime_tick_is_applied(tmp_path):
    path = tmp_path / "quotas.toml"
    write(path, A)

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=0.05)
        await source.start(updates)
        try:
            assert updates.last == {"clients/a": {"producer_byte_rate": 1000.0}}
            before = os.stat(path)
            write(path, A.replace("1000", "2000"))
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = os.stat(path)
            assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
                before.st_mtime_ns, before.st_size, before.st_ino)
            await until(lambda: updates.last == {"clients/a": {"producer_byte_rate": 2000.0}},
                        timeout=3, what="the rewrite to be applied")
            assert source.healthy and source.rejected == 0
        finally:
            await source.stop()

    asyncio.run(scenario())


def test_a_changed_file_is_parsed_off_the_event_loop_which_keeps_running(tmp_path):
    """A file of 100,000 entities takes seconds to parse: a poll parses it in
    a worker thread, so every connection is served meanwhile. A parse that
    blocks the loop shows as a tick of the loop that comes too late."""
    import threading
    import time

    path = tmp_path / "quotas.toml"
    write(path, A)

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=0.05)
        await source.start(updates)
        loop_thread = threading.current_thread()
        parsed_on = []
        parse = source.store.parse

        def slow_parse(data, empty_ok=False):
            parsed_on.append(threading.current_thread())
            time.sleep(0.6)  # as long as a large file takes
            return parse(data, empty_ok)

        source.store.parse = slow_parse
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        task = asyncio.get_running_loop().create_task(ticker())
        try:
            write(path, A.replace("1000", "2000"))
            await until(lambda: updates.last == {"clients/a": {"producer_byte_rate": 2000.0}},
                        timeout=5, what="the change to be applied")
        finally:
            task.cancel()
            await source.stop()
        assert parsed_on and loop_thread not in parsed_on
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < 0.5, max(gaps)  # never stalled for the parse's 0.6 s

    asyncio.run(scenario())


def test_a_poll_reads_the_file_only_when_its_stat_changed_or_every_content_every_polls(
        tmp_path):
    """Polls driven by hand: an unchanged file is not read (a thread's round
    trip per poll is most of what an idle proxy costs), a changed one is read
    until it settles; a change its stat does not show (a filesystem with a
    coarse clock) is read at the content_every-th poll."""
    path = tmp_path / "quotas.toml"
    write(path, A)

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=3600)  # the follower never wakes
        reads = []
        read_bytes = source.store.read_bytes
        source.store.read_bytes = lambda *a: reads.append(1) or read_bytes(*a)
        await source.start(updates)
        try:
            assert len(reads) == 1
            for _ in range(5):
                await source.poll(updates)
            assert len(reads) == 1  # unchanged: not read
            write(path, A_AND_B)
            await source.poll(updates)
            await source.poll(updates)  # the same content twice: applied
            assert len(reads) == 3 and len(updates.snapshots) == 2
            for _ in range(5):
                await source.poll(updates)
            assert len(reads) == 3
            # a rewrite whose stat is the same: read at the content_every-th poll
            signature = source.store.signature()
            source.store.signature = lambda: signature
            write(path, A.replace("1000", "2000"))
            for _ in range(source.content_every - 5):
                await source.poll(updates)
            assert len(reads) == 3
            await source.poll(updates)  # the content_every-th since the last read
            await source.poll(updates)  # read again: the same content, applied
            assert len(reads) == 5
            assert updates.last == {"clients/a": {"producer_byte_rate": 2000.0}}
        finally:
            await source.stop()

    asyncio.run(scenario())


def test_a_file_caught_half_written_is_never_applied(tmp_path):
    """Polls driven by hand (no timing): a first half that is itself valid
    TOML, seen by one poll only, is never taken; the whole file, seen by two
    polls in a row, is."""
    path = tmp_path / "quotas.toml"
    write(path, A_AND_B)
    full = {"clients/a": {"producer_byte_rate": 1000.0}, "clients/b": {"consumer_byte_rate": 3000.0}}

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=3600)  # the follower never wakes
        await source.start(updates)
        try:
            for _ in range(3):
                write(path, A)  # caught half-written by one poll
                await source.poll(updates)
                write(path, A_AND_B)
                await source.poll(updates)
            assert updates.snapshots == [full]
            write(path, A)  # now A for real: two polls see it
            await source.poll(updates)
            assert updates.snapshots == [full]
            await source.poll(updates)
            assert updates.last == {"clients/a": {"producer_byte_rate": 1000.0}}
            assert source.healthy and source.rejected == 0
        finally:
            await source.stop()

    asyncio.run(scenario())


def test_an_empty_file_is_refused_and_a_comment_only_file_means_no_quotas(tmp_path, quota_log):
    path = tmp_path / "quotas.toml"
    write(path, A)

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=0.05)
        await source.start(updates)
        try:
            write(path, "")
            await until(lambda: logged(quota_log, "is empty") == 1, what="the empty file refused")
            assert logged(quota_log, "to remove all quotas, write a file holding only a comment") == 1
            assert not source.healthy and source.rejected == 1
            write(path, "\n   \n\t\n")  # whitespace only: empty too, another version
            await until(lambda: source.rejected == 2, what="the blank file refused")
            await asyncio.sleep(0.3)
            assert logged(quota_log, "is empty") == 2 and source.rejected == 2
            assert updates.snapshots == [{"clients/a": {"producer_byte_rate": 1000.0}}]

            write(path, "# no quotas for now\n")
            await until(lambda: updates.last == {}, what="the comment-only file applied")
            assert source.healthy and source.rejected == 2
        finally:
            await source.stop()

    asyncio.run(scenario())


def test_an_empty_file_at_start_is_a_clear_error(tmp_path):
    path = tmp_path / "quotas.toml"
    write(path, "")

    async def scenario():
        source = FileQuotaSource(path)
        with pytest.raises(QuotaStoreError) as err:
            await source.start(Updates())
        await source.stop()
        return str(err.value)

    message = asyncio.run(scenario())
    assert message.startswith("quota file %s is empty; to remove all quotas" % path)
    assert "\n" not in message


def test_the_store_refuses_to_read_an_empty_file_but_alter_starts_it_afresh(tmp_path):
    from kthrottle.sources.file import FileQuotaStore

    path = tmp_path / "quotas.toml"
    write(path, " \n")
    store = FileQuotaStore(path)
    with pytest.raises(QuotaStoreError, match="is empty"):
        store.read()
    assert store.alter("clients/a", {"request_rate": "5"}) == {"request_rate": 5.0}
    assert store.read() == {"clients/a": {"request_rate": 5.0}}
    write(path, "# nothing\n")
    assert store.read() == {}


def test_every_bad_version_is_logged_once_and_counted(tmp_path, quota_log):
    path = tmp_path / "quotas.toml"
    write(path, A)
    fast = "producer_byte_rate must be a number, got 'fast'"
    unknown = "unknown quota key 'byte_rate'"

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=0.05)
        await source.start(updates)
        try:
            write(path, A.replace("1000", '"fast"'))
            await until(lambda: logged(quota_log, fast), what="the first bad edit logged")
            assert not source.healthy and source.rejected == 1
            write(path, A.replace("producer_", ""))
            await until(lambda: logged(quota_log, unknown), what="the second bad edit logged")
            await asyncio.sleep(0.3)  # several more polls of the same bad file
            assert logged(quota_log, fast) == 1 and logged(quota_log, unknown) == 1
            assert logged(quota_log, "the last known quotas stay in force") == 2
            assert not source.healthy and source.rejected == 2
            assert updates.snapshots == [{"clients/a": {"producer_byte_rate": 1000.0}}]

            write(path, A.replace("1000", "500"))
            await until(lambda: updates.last == {"clients/a": {"producer_byte_rate": 500.0}},
                        what="the valid edit applied")
            assert source.healthy and source.rejected == 2
        finally:
            await source.stop()

    asyncio.run(scenario())


def test_a_vanished_file_keeps_the_quotas_until_it_is_back(tmp_path, quota_log):
    path = tmp_path / "quotas.toml"
    write(path, A)

    async def scenario():
        updates = Updates()
        source = FileQuotaSource(path, poll_interval=0.05)
        await source.start(updates)
        try:
            path.unlink()
            await until(lambda: not source.healthy, what="unhealthy")
            await asyncio.sleep(0.3)
            assert logged(quota_log, "does not exist; the last known quotas stay in force") == 1
            assert source.rejected == 0  # no version of the file was refused
            write(path, A)  # the same content as in force: healthy again, nothing to apply
            await until(lambda: source.healthy, what="healthy again")
            assert len(updates.snapshots) == 1
        finally:
            await source.stop()

    asyncio.run(scenario())


# ZooKeeper ---------------------------------------------------------------

RELAY = r"""
import socket, sys, threading
port, target = int(sys.argv[1]), int(sys.argv[2])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(16)
print("ready", flush=True)

def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

while True:
    client, _ = server.accept()
    try:
        upstream = socket.create_connection(("127.0.0.1", target))
    except OSError:
        client.close()
        continue
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
"""


class Relay:
    """A TCP relay process in front of ZooKeeper, on 127.0.0.1 and a free
    port: stopping it cuts only the connections that go through it."""

    def __init__(self, target_port):
        self.port = free_port()
        self.target_port = target_port
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", RELAY, str(self.port),
                                      str(self.target_port)],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert self.proc.stdout.readline().strip() == b"ready"
        return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        if self.proc is not None:
            self.proc.stdout.close()
        self.proc = None


@pytest.fixture
def chroot():
    return "/kthrottle-%s" % uuid.uuid4().hex[:8]


@pytest.fixture
def writer(zookeeper, chroot):
    """A kazoo client of the test's own, on the chroot, that may read what it
    protects with ACLs."""
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=zookeeper.hosts + chroot, auth_data=[("digest", "admin:secret")])
    zk.start(timeout=10)
    yield zk
    zk.stop()
    zk.close()


@pytest.fixture
def relay(zookeeper):
    r = Relay(zookeeper.port).start()
    yield r
    r.stop()


def znode(config):
    import json

    return json.dumps({"version": 1, "config": config}).encode()


def notify(zk, path):
    zk.create("/config/changes/config_change_", b'{"version":2,"entity_path":"%s"}' % path.encode(),
              sequence=True, makepath=True)


@needs_zookeeper
def test_a_malformed_znode_is_skipped_logged_once_per_content_and_counted(
        zookeeper, relay, writer, chroot, quota_log):
    writer.create("/config/clients/good", znode({"producer_byte_rate": "1000"}), makepath=True)
    writer.create("/config/clients/broken", b"producer_byte_rate=5")
    writer.create("/config/users/bob", znode({"producer_byte_rate": "fast", "request_rate": "10"}),
                  makepath=True)
    writer.ensure_path("/config/changes")
    good = {"clients/good": {"producer_byte_rate": 1000.0}, "users/bob": {"request_rate": 10.0}}

    # kafka-configs-style reads of the store still name the bad znode
    store = ZooKeeperQuotaStore(zookeeper.hosts + chroot).connect()
    try:
        with pytest.raises(QuotaStoreError, match="znode /config/clients/broken does not hold "
                                                  "Kafka's config JSON"):
            store.read()
    finally:
        store.close()
    quota_log.clear()  # that read logged the bad value too

    async def scenario():
        updates = Updates()
        source = ZooKeeperQuotaSource("127.0.0.1:%d%s" % (relay.port, chroot))
        await source.start(updates)
        try:
            assert updates.last == good
            assert source.healthy and source.rejected == 2
            assert logged(quota_log, "/config/clients/broken does not hold Kafka's config JSON") == 1
            assert logged(quota_log, "ignoring producer_byte_rate in /config/users/bob") == 1

            # a resync (after a lost connection) reads the same bad content: no new lines
            relay.stop()
            await until(lambda: not source.healthy, timeout=15, what="the connection lost")
            relay.start()
            await until(lambda: source.healthy, timeout=15, what="the resync")
            assert logged(quota_log, "ZooKeeper is back") == 1
            assert updates.last == good
            assert logged(quota_log, "/config/clients/broken does not hold") == 1
            assert logged(quota_log, "ignoring producer_byte_rate in /config/users/bob") == 1
            assert source.rejected == 2

            # other bad content is logged again; fixed, it applies
            writer.set("/config/clients/broken", b'{"version":1,"config":')
            notify(writer, "clients/broken")
            await until(lambda: logged(quota_log, "/config/clients/broken does not hold") == 2,
                        what="the new bad content logged")
            assert source.rejected == 3 and source.healthy
            writer.set("/config/clients/broken", znode({"request_rate": "5"}))
            notify(writer, "clients/broken")
            await until(lambda: updates.last == dict(good, **{"clients/broken": {"request_rate": 5.0}}),
                        what="the fixed znode applied")
            assert source.rejected == 3 and source.healthy
        finally:
            await source.stop()

    asyncio.run(scenario())


@needs_zookeeper
def test_a_change_whose_entity_cannot_be_read_is_retried_not_dropped(
        zookeeper, writer, chroot, quota_log):
    from kazoo.security import OPEN_ACL_UNSAFE, make_digest_acl

    writer.create("/config/clients/open", znode({"producer_byte_rate": "1000"}), makepath=True)
    writer.ensure_path("/config/changes")

    async def scenario():
        updates = Updates()
        source = ZooKeeperQuotaSource(zookeeper.hosts + chroot, retry_interval=0.2)
        await source.start(updates)
        try:
            assert updates.last == {"clients/open": {"producer_byte_rate": 1000.0}}
            # readable by "admin" only: the source's read of it fails (NoAuth)
            writer.create("/config/clients/locked", znode({"request_rate": "7"}),
                          acl=[make_digest_acl("admin", "secret", all=True)])
            notify(writer, "clients/locked")
            await until(lambda: logged(quota_log, "failed (NoAuthError"), what="the failed read")
            await until(lambda: not source.healthy, what="unhealthy")
            await asyncio.sleep(0.5)  # retries meanwhile fail quietly
            assert logged(quota_log, "failed (NoAuthError") == 1
            assert "clients/locked" not in updates.last

            # readable now, with no further notification: the retry picks it up
            writer.set_acls("/config/clients/locked", OPEN_ACL_UNSAFE)
            await until(lambda: updates.last.get("clients/locked") == {"request_rate": 7.0},
                        timeout=10, what="the entity read on a retry")
            await until(lambda: source.healthy, what="healthy again")
            assert updates.last["clients/open"] == {"producer_byte_rate": 1000.0}
            assert source.rejected == 0

            # and notifications flow again
            writer.set("/config/clients/open", znode({"producer_byte_rate": "2000"}))
            notify(writer, "clients/open")
            await until(lambda: updates.last["clients/open"] == {"producer_byte_rate": 2000.0},
                        what="a later change")
        finally:
            await source.stop()

    asyncio.run(scenario())


@needs_zookeeper
def test_a_lost_connection_keeps_the_quotas_and_the_reconnect_resyncs(
        zookeeper, relay, writer, chroot, quota_log):
    writer.create("/config/clients/a", znode({"producer_byte_rate": "1000"}), makepath=True)
    writer.ensure_path("/config/changes")

    async def scenario():
        updates = Updates()
        source = ZooKeeperQuotaSource("127.0.0.1:%d%s" % (relay.port, chroot))
        await source.start(updates)
        try:
            assert updates.last == {"clients/a": {"producer_byte_rate": 1000.0}}
            relay.stop()
            await until(lambda: not source.healthy, timeout=15, what="the connection lost")
            assert logged(quota_log, "the last known quotas stay in force until it is back") == 1
            # changed meanwhile without notifications: only a full re-read finds them
            writer.set("/config/clients/a", znode({"producer_byte_rate": "2000"}))
            writer.create("/config/users/bob", znode({"request_rate": "3"}), makepath=True)
            await asyncio.sleep(0.5)
            assert len(updates.snapshots) == 1
            relay.start()
            await until(lambda: source.healthy, timeout=15, what="reconnected")
            assert updates.last == {"clients/a": {"producer_byte_rate": 2000.0},
                                    "users/bob": {"request_rate": 3.0}}
            assert logged(quota_log, "ZooKeeper is back") == 1
        finally:
            await source.stop()

    asyncio.run(scenario())
