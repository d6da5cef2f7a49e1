"""What every listener holds a client to before it costs anything: Kafka's
connection limits, and a log of refused connections that a flood cannot
turn into a flood of log lines."""
import logging
from collections import Counter

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
