"""Every API the proxy offers in front of Apache Kafka 4.4, one request each, sent to the broker
itself and through the proxy: what the broker does with it (answers, or closes the connection
on a request it refuses), the proxy lets happen alike. The requests are kafka-python's
schema-built codecs at their defaults (mostly empty: no topic, no group), at every version the
broker, the proxy and the codec share; an answer through the proxy must carry the
same top-level error code as the broker's own."""
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from kthrottle.kafka_kit import IPV4_ONLY_JVM_ARGS, KafkaMissing, compile_java
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

# not swept: ApiVersions itself (read first), the SASL exchange (a state machine of its own:
# test_sasl*), and the requests the proxy refuses by design, tested where they are refused
NOT_SWEPT = {17, 18, 36}
SILENT = "no answer within the wait"
# fields whose default would leave the broker nothing to answer: a Produce of acks=0
SETTINGS = {0: {"acks": 1, "timeout_ms": 1000}}
CLOSED = "connection closed"


def codecs():
    """{api key: kafka-python request class} of every API its codecs have."""
    from kthrottle.codecs.acl_requests import request_class, response_class

    return {key: request_class(key) for key in range(100)
            if request_class(key) is not None and response_class(key) is not None}


def exchange(address, frame, wait=3.0):
    """Send one framed request on a new connection: (correlation id, body) of the answer,
    or CLOSED / SILENT."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(frame)
        try:
            head = _read(sock, 4)
            if head is None:
                return CLOSED
            body = _read(sock, struct.unpack(">i", head)[0])
        except socket.timeout:
            return SILENT
        except ConnectionError:
            return CLOSED
        return CLOSED if body is None else body


def _read(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def api_ranges(address):
    request = codecs()[18][0]()  # ApiVersions v0: every broker answers it
    request.with_header(correlation_id=1, client_id="sweep")
    answer = exchange(address, bytes(request.encode(header=True, framed=True)))
    assert isinstance(answer, bytes), answer
    error, count = struct.unpack_from(">hi", answer, 4)
    assert error == 0
    ranges = {}
    for i in range(count):
        key, low, high = struct.unpack_from(">hhh", answer, 10 + 6 * i)
        ranges[key] = (low, high)
    return ranges


def top_level_error(cls, version, answer):
    """The response's top-level error_code, None where it has none or does not decode."""
    import sys

    response = getattr(sys.modules[cls.__module__], cls.__name__[:-len("Request")] + "Response",
                       None)
    try:
        decoded = response[version].decode(answer, header=True)
    except Exception:  # noqa: BLE001 (a codec that cannot read it: nothing to compare)
        return None
    return getattr(decoded, "error_code", None)


def outcome(cls, version, address):
    """What ``address`` does with ``cls``'s default request at ``version``: CLOSED, SILENT
    or ("answered", its top-level error code or None)."""
    request = cls[version](**SETTINGS.get(cls.API_KEY, {}))
    request.with_header(correlation_id=7, client_id="sweep")
    answer = exchange(address, bytes(request.encode(header=True, framed=True)))
    if not isinstance(answer, bytes):
        return answer
    return ("answered", top_level_error(cls, version, answer))


def test_every_api_the_proxy_offers_is_answered_through_it_as_directly(apache_kafka, tmp_path):
    kafka = apache_kafka
    proxy = ProxyProcess(kafka.bootstrap, tmp_path / "proxy.log", node_id=kafka.node_id).start()
    try:
        broker = api_ranges(kafka.bootstrap)
        offered = api_ranges(proxy.bootstrap)
        assert set(offered) <= set(broker)
        swept, differ, uncovered = [], [], []
        for key in sorted(set(offered) - NOT_SWEPT):
            cls = codecs().get(key)
            if cls is None:
                uncovered.append(key)
                continue
            top = min(offered[key][1], broker[key][1], cls.max_version)
            low = max(offered[key][0], broker[key][0], getattr(cls, "min_version", 0))
            if top < low:
                uncovered.append(key)
                continue
            for version in range(low, top + 1):
                direct = outcome(cls, version, kafka.bootstrap)
                through = outcome(cls, version, proxy.bootstrap)
                swept.append((key, version, direct))
                if direct != through:
                    differ.append((key, cls.__name__, version, direct, through))
        assert proxy.alive()
    finally:
        proxy.stop()
    report = "\n".join(map(str, swept))
    assert not differ, "answered otherwise through the proxy:\n%s\nall:\n%s" % (
        "\n".join(map(str, differ)), report)
    answered = {s[0] for s in swept if s[2] != CLOSED and s[2] != SILENT}
    # most of the client APIs a Kafka 4.4 broker offers, answered both ways
    assert len(answered) >= 40, report
    print("swept %d APIs in %d versions (%d APIs answered); not covered by the codecs: %s; "
          "closed or silent both ways: %s"
          % (len({s[0] for s in swept}), len(swept), len(answered), uncovered,
             sorted({(s[0], s[2]) for s in swept if s[2] in (CLOSED, SILENT)})))


@pytest.fixture(scope="module")
def api_sweep_class(apache_kafka, tmp_path_factory):
    """tests/java/ApiSweep.java compiled against the broker's kafka-clients jar."""
    folder = tmp_path_factory.mktemp("api-sweep")
    try:
        return compile_java(Path(__file__).parent / "java" / "ApiSweep.java", folder,
                            apache_kafka.lib)
    except KafkaMissing as e:
        pytest.fail(str(e), pytrace=False)


def java_sweep(kafka, classes, address, ranges):
    """{(key, version): outcome} of ApiSweep's default requests sent to ``address``."""
    specs = ["%d:%d-%d" % (key, low, high) for key, (low, high) in sorted(ranges.items())]
    command = kafka.java_command("ApiSweep", address, *specs, jvm_args=IPV4_ONLY_JVM_ARGS)
    at = command.index("-cp") + 1
    command[at] = "%s:%s" % (classes, command[at])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    found = {}
    for line in done.stdout.splitlines():
        key, version, what = line.split(" ", 2)
        found[int(key), int(version)] = what
    return found


def test_the_apis_python_cannot_build_are_answered_through_the_proxy_as_directly(
        apache_kafka, api_sweep_class, tmp_path):
    """The APIs kafka-python has no codec for (delegation tokens, KIP-848, KIP-932 share
    groups, KIP-1071 streams groups, raft voters, ...), built by Kafka's own generated
    message classes at their defaults, every version the broker and the proxy both offer:
    the answer through the proxy carries the same errors (Kafka's errorCounts: top level,
    per group, per topic) as the broker's, or both close or both stay silent."""
    kafka = apache_kafka
    proxy = ProxyProcess(kafka.bootstrap, tmp_path / "proxy.log", node_id=kafka.node_id).start()
    try:
        broker = api_ranges(kafka.bootstrap)
        offered = api_ranges(proxy.bootstrap)
        python = codecs()
        keys = sorted(k for k in set(offered) - NOT_SWEPT
                      if k not in python or python[k].max_version < offered[k][0])
        ranges = {k: (max(offered[k][0], broker[k][0]), min(offered[k][1], broker[k][1]))
                  for k in keys}
        ranges = {k: r for k, r in ranges.items() if r[0] <= r[1]}
        direct = java_sweep(kafka, api_sweep_class, kafka.bootstrap, ranges)
        through = java_sweep(kafka, api_sweep_class, proxy.bootstrap, ranges)
        assert proxy.alive()
    finally:
        proxy.stop()
    expected = {(k, v) for k, (low, high) in ranges.items() for v in range(low, high + 1)}
    assert set(direct) == expected and set(through) == expected
    report = "\n".join("%s %s" % (kv, direct[kv]) for kv in sorted(direct))
    differ = ["%s: direct %s, through %s" % (kv, direct[kv], through[kv])
              for kv in sorted(direct) if direct[kv] != through[kv]]
    assert not differ, "answered otherwise through the proxy:\n%s\nall:\n%s" % (
        "\n".join(differ), report)
    # the codec was Kafka's own: every answer read back (none "unbuildable"/"unreadable")
    assert all(what.split()[0] in ("answered", "closed", "silent")
               for what in direct.values()), report
    answered = {k for (k, v), what in direct.items() if what.startswith("answered")}
    assert len(answered) >= len(ranges) - 4, report
    print("Java-built sweep: %d APIs in %d versions, %d answered:\n%s"
          % (len(ranges), len(expected), len(answered), report))
