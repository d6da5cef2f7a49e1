"""The cluster's partition leaders for a quota callback (KIP-257's
``update_cluster_metadata``): read with Metadata, as the proxy's own
principal, at start and every ``refresh`` seconds; each read that differs
from the one before is handed on as a ``Cluster``. A read that fails keeps
the leaders last read (and says so once, then once when reads work again):
a callback's quotas never fall back because a broker went away."""
import asyncio
import logging

from ..policy.quota_callback import Cluster
from .async_kafka import PolledClient

log = logging.getLogger("kthrottle.leaders")

DEFAULT_REFRESH = 3.0  # seconds between two reads of the leaders
READ_TIMEOUT = 10.0


class LeaderReadError(Exception):
    pass


class PartitionLeaders(PolledClient):
    noun = "partition leaders"

    def __init__(self, bootstrap_servers, security, refresh=DEFAULT_REFRESH,
                 client_id="kthrottle-leaders", token=None):
        self.refresh = refresh
        self.timeout = READ_TIMEOUT
        self._reach(bootstrap_servers, security, client_id, token)
        self.cluster = None  # the last Cluster read
        self.reads = 0
        self.read_errors = 0
        self._failing = False

    async def read(self):
        """The cluster's brokers and partition leaders now; LeaderReadError
        when they cannot be read."""
        client, ok = await self._ask(_metadata_update, LeaderReadError, versions_pass=False)
        if not ok:
            raise LeaderReadError(self._unreachable("the metadata could not be updated"))
        from aiokafka.structs import TopicPartition

        metadata = client.cluster
        leaders = {}
        for topic in metadata.topics():
            for partition in metadata.partitions_for_topic(topic) or ():
                leaders[(topic, partition)] = metadata.leader_for_partition(
                    TopicPartition(topic, partition))
        return Cluster(frozenset(b.nodeId for b in metadata.brokers()), leaders)

    async def start(self, on_update):
        """Read once (a failure is logged, not raised: a callback starts with
        no leaders, as a broker's does), then follow."""
        await self._read_once(on_update)
        self._task = asyncio.ensure_future(self._follow(on_update))

    async def _read_once(self, on_update):
        try:
            cluster = await self.read()
        except LeaderReadError as exc:
            self.read_errors += 1
            if not self._failing:
                self._failing = True
                log.warning("%s; the quota callback keeps the leaders it has", exc)
            return
        self.reads += 1
        if self._failing:
            self._failing = False
            log.info("the partition leaders are read again from %s", self.describe)
        if cluster != self.cluster:
            self.cluster = cluster
            on_update(cluster)

    async def _follow(self, on_update):
        while True:
            await asyncio.sleep(self.refresh)
            await self._read_once(on_update)


async def _metadata_update(client):
    """The client, and whether it could update its metadata."""
    return client, await client.force_metadata_update()
