"""What every listener holds a client to before it costs anything: Kafka's
connection limits, the connection_creation_rate of ip entities (KIP-612),
and a log of refused connections that a flood cannot turn into a flood of
log lines."""
import ipaddress
import itertools
import logging
from collections import Counter

from ..policy.rate import TokenBucket


log = logging.getLogger("kthrottle.proxy")

# Close.refused reasons raised here (the label of
# kthrottle_connections_refused_total; the pipeline has its own)
MAX_CONNECTIONS = "max_connections"
MAX_CONNECTIONS_PER_IP = "max_connections_per_ip"
TLS_HANDSHAKE = "tls_handshake"
HANDSHAKE_TIMEOUT = "handshake_timeout"
PROXY_PROTOCOL = "proxy_protocol"  # no valid PROXY protocol header, or none in time
UNMAPPED_NODE = "unmapped_node"  # a response named a node id that has no port
UNKNOWN_NODE = "unknown_node"  # a TLS server name naming a node the cluster has not named
CONNECTION_CREATION_RATE = "connection_creation_rate"  # over its ip entity's quota (KIP-612)
FAILED_LOGINS = "failed_logins"  # an address past its failed-login allowance (FailedLogins)
OPEN_FILES = "open_files"  # no file descriptor left for the client's broker connection


# descriptors the proxy holds besides its client connections' (listeners,
# its own broker and admin connections, files, the event loop's)
OWN_FILES = 64


def raise_open_files_limit(max_connections=None):
    """Raise this process's soft limit of open files to its hard limit: each
    client connection holds two descriptors (its own and its broker
    connection's), and a soft limit of 1,024, a common default, would turn
    clients away from about 500 on. Returns the limit now in force; a WARNING
    says when it leaves no room for ``max_connections`` (max.connections)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s",
                        soft, wanted, exc)
    if soft == resource.RLIM_INFINITY:
        return soft
    room = max((soft - OWN_FILES) // 2, 0)
    if max_connections is not None and max_connections > room:
        log.warning("the open-files limit (%d) leaves room for about %d client connections, "
                    "not max-connections=%d: raise it (ulimit -n, LimitNOFILE=) or lower "
                    "max-connections", soft, room, max_connections)
    else:
        log.debug("open-files limit %d: room for about %d client connections", soft, room)
    return soft


class ConnectionLimits:
    """Kafka's max.connections, max.connections.per.ip and
    max.connections.per.ip.overrides: a connection over a limit is closed at
    once. ``overrides`` maps an address to its own limit (host names are
    resolved by the caller)."""

    def __init__(self, max_connections=None, per_ip=None, overrides=None):
        self.max_connections = max_connections
        self.per_ip = per_ip
        self.overrides = dict(overrides or {})
        self.total = 0
        self.by_ip = Counter()

    def admit(self, ip):
        """Count a new connection from ``ip``; None, or (reason, message)
        when it is over a limit (and then not counted)."""
        over = self._over_per_ip(ip)
        if over is not None:
            return over
        if self.max_connections is not None and self.total >= self.max_connections:
            return MAX_CONNECTIONS, "%d connections open already (max-connections)" % self.total
        self.total += 1
        self.by_ip[ip] += 1
        return None

    def _over_per_ip(self, ip):
        limit = self.overrides.get(ip, self.per_ip)
        if limit is not None and self.by_ip[ip] >= limit:
            return MAX_CONNECTIONS_PER_IP, ("%d connections from %s already (max-connections-per-ip"
                                            "%s)" % (self.by_ip[ip], ip,
                                                     "-overrides" if ip in self.overrides else ""))
        return None

    def reserve(self):
        """Count a new connection whose client is not known yet (its PROXY
        protocol header is to come) against max-connections alone: None, or
        (reason, message). ``admit_reserved`` names the client once known;
        ``unreserve`` gives the place back if it never is."""
        if self.max_connections is not None and self.total >= self.max_connections:
            return MAX_CONNECTIONS, "%d connections open already (max-connections)" % self.total
        self.total += 1
        return None

    def admit_reserved(self, ip):
        """The client of a reserved connection is ``ip``: None, or (reason,
        message) when ``ip`` is over its limit (the place is then given back)."""
        over = self._over_per_ip(ip)
        if over is not None:
            self.total -= 1
            return over
        self.by_ip[ip] += 1
        return None

    def unreserve(self):
        self.total -= 1

    def release(self, ip):
        self.total -= 1
        left = self.by_ip[ip] - 1
        if left > 0:
            self.by_ip[ip] = left
        else:
            del self.by_ip[ip]


class ConnectionRate:
    """KIP-612's connection_creation_rate, per source address (ip entities:
    ``ips/<ip>``, else ``ips/<default>``, each address its own bucket). As
    Kafka's ConnectionQuotas does, a connection over the rate is recorded
    then un-recorded (it is not taken, so a flood does not push the
    address's next connections further out) and earns a throttle time, at
    most one quota window; the caller holds it unread that long, then closes
    it (Kafka's acceptor does the same: a client retrying at once does not
    spin). An observe-only quota takes every connection (the bucket counts
    what it would have throttled). Only a quota configuration with ip
    entities costs an accept a lookup: the answer is kept per generation."""

    def __init__(self, quotas):
        self.quotas = quotas  # policy QuotaManager, or None
        self._generation = None
        self._on = False

    def admit(self, address, now):
        """None: take the connection from ``address``; else (throttle ms,
        message saying why)."""
        quotas = self.quotas
        if quotas is None:
            return None
        if quotas.generation != self._generation:
            self._generation = quotas.generation
            self._on = quotas.config.has_ip_quotas
        if not self._on:
            return None
        bucket = quotas.connection_bucket(entity_name(address))
        if bucket is None:
            return None
        # a connection bucket holds at least one connection, and its throttle
        # is capped at one quota window, as Kafka caps it (policy.quotas.Bucket)
        ms = bucket.record(1, now)
        if not ms:
            return None
        bucket.unrecord(1, now)
        return ms, ("over %g connections/s (connection_creation_rate of %s): closed unread "
                    "after its throttle time (KIP-612)" % (bucket.limit, bucket.entity))


class FailedLogins:
    """A failed-login backoff per source address. Each failed authentication
    takes one from its address's bucket (RATE a second, BURST at once); while
    an address owes, its new connections are held unread for what it owes (at
    most one second, as KIP-612 caps a throttled connection) and then closed,
    so a client looping on a wrong password costs an accept and a close, not
    an authentication exchange and a key derivation each time. A client that
    mistypes a password now and then never owes; connections already open
    (authenticated) are never touched."""

    RATE = 5.0  # failed logins a second an address may go on with (--failed-login-rate)
    BURST_SECONDS = 10.0  # the burst: this many seconds of the rate
    MAX_HOLD = 1.0  # seconds a held connection waits before it is closed
    MAX_ADDRESSES = 10_000  # addresses followed at once; past that, those paid up go

    def __init__(self, rate=RATE):
        self.rate = rate  # 0: no backoff
        self.burst = rate * self.BURST_SECONDS
        self._by_ip = {}  # address -> TokenBucket

    def failed(self, ip, now):
        """A login from ``ip`` failed at ``now``."""
        if not self.rate:
            return
        bucket = self._by_ip.get(ip)
        if bucket is None:
            if len(self._by_ip) >= self.MAX_ADDRESSES:
                self._forget_paid(now)
            bucket = self._by_ip[ip] = TokenBucket(self.rate, self.burst)
        bucket.record(1, now)

    def admit(self, ip, now):
        """None: serve a new connection from ``ip``; else (hold ms, why)."""
        bucket = self._by_ip.get(ip)
        if bucket is None:
            return None
        owed = bucket.throttle_seconds(now)
        if owed <= 0:
            if bucket.full_at <= now:
                del self._by_ip[ip]  # paid up: forgotten
            return None
        return (max(1, int(min(owed, self.MAX_HOLD) * 1000 + 0.5)),
                "more than %g failed logins a second from this address: closed unread "
                "(a failed-login backoff, --failed-login-rate)" % self.rate)

    def _forget_paid(self, now):
        paid = [ip for ip, b in self._by_ip.items() if b.full_at <= now]
        for ip in paid:
            del self._by_ip[ip]
        if len(self._by_ip) >= self.MAX_ADDRESSES:
            self._by_ip.clear()  # a flood from everywhere: start over


def entity_name(address):
    """The ip entity name of a client address: its canonical text, an
    IPv4-mapped IPv6 address (a dual-stack listener's) as the IPv4 one, as
    Java names it; anything else as it is (it then falls to <default>)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).compressed


class HeldConnections:
    """Connections throttled by their connection_creation_rate: each held
    open and unread for its throttle time, then closed. At most MAX_HELD at
    once; past that one is closed at once, so that a flood from many
    addresses cannot take every file descriptor."""

    # a throttle is at most one quota window (1 s by default): this many held
    # is a flood of that many throttled connections a second
    MAX_HELD = 1000

    def __init__(self, call_later):
        self.call_later = call_later
        self._held = {}  # token -> (close, timer)
        self._tokens = itertools.count()

    def __len__(self):
        return len(self._held)

    def hold(self, close, ms):
        """Call ``close()`` in ``ms`` milliseconds (at once when full)."""
        if len(self._held) >= self.MAX_HELD:
            close()
            return
        token = next(self._tokens)
        self._held[token] = (close, self.call_later(ms / 1000.0, self._release, token))

    def _release(self, token):
        close, _ = self._held.pop(token)
        close()

    def close(self):
        held, self._held = self._held, {}
        for close, timer in held.values():
            timer.cancel()
            close()


class RefusalLog:
    """One WARNING line per refused connection, naming the client and the
    reason. From one address, within ``window`` seconds, a line that repeats
    one already written, or any past the first ``distinct`` different ones,
    is only counted, and the count is written in one line when the window
    closes. ``counts`` (reason -> refused connections) is
    kthrottle_connections_refused_total."""

    MAX_ADDRESSES = 10_000  # addresses followed at once; past that, one shared entry

    def __init__(self, call_later, window=60.0, distinct=5):
        self.call_later = call_later
        self.window = window
        self.distinct = distinct
        self.counts = Counter()
        self._recent = {}  # address -> [lines written, refusals not written, timer]

    def refused(self, address, client, reason, message):
        self.counts[reason] += 1
        key = address if len(self._recent) < self.MAX_ADDRESSES or address in self._recent \
            else "other addresses"
        entry = self._recent.get(key)
        if entry is None:
            entry = self._recent[key] = [set(), 0, self.call_later(self.window, self._summarise,
                                                                   key)]
        line = (reason, message)
        if line in entry[0] or len(entry[0]) >= self.distinct:
            entry[1] += 1
            return
        entry[0].add(line)
        log.warning("connection from %s refused (%s): %s", client, reason, message)

    def _summarise(self, key):
        _, more, _ = self._recent.pop(key)
        if more:
            log.warning("... and %d more refused from %s in the last %g s", more, key, self.window)

    def close(self):
        for key in list(self._recent):
            self._recent[key][2].cancel()
            self._summarise(key)
