"""KIP-599 controller_mutation_rate with real admin clients (kafka-python,
confluent-kafka, aiokafka) through a real kthrottle process in front of a
real Tansu broker. The proxy authenticates users (SASL PLAIN) so that quotas
are per user: each test's user has a bucket of its own.

kafka-python sends CreateTopics v7 (strict: refused with
THROTTLING_QUOTA_EXCEEDED), confluent-kafka and aiokafka older versions
(permissive: the client is throttled). Tansu has no CreatePartitions."""
import asyncio
import threading
import time
import uuid
import warnings

import pytest

from kthrottle.embedded import free_port
from kthrottle_testkit.clients import scram_credentials_file
from kthrottle_testkit.proxy import ProxyProcess

pytestmark = pytest.mark.integration

RATE = 5.0  # partitions per second; the token bucket lets a burst of 1 s of it
PARTITIONS = 2  # per topic created
USERS = {name: name + "-secret"
         for name in ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")}
THROTTLING_QUOTA_EXCEEDED = 89


@pytest.fixture(scope="module")
def proxy(broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mutations")
    creds = scram_credentials_file(tmp / "credentials.toml", USERS, mechanisms=("SCRAM-SHA-256",))
    quotas = tmp / "quotas.toml"
    quotas.write_text(
        "[users.alice]\ncontroller_mutation_rate = %s\n\n"  # kafka-python's storm
        "[users.carol]\ncontroller_mutation_rate = %s\n\n"  # confluent-kafka
        "[users.dave]\ncontroller_mutation_rate = %s\n\n"  # aiokafka
        "[users.grace]\ncontroller_mutation_rate = %s\n\n"  # one request at a time
        "[users.heidi]\ncontroller_mutation_rate = %s\n\n"  # deletions
        "[users.erin]\ncontroller_mutation_rate = 1000\n\n"  # well under its quota
        "[users.frank]\ncontroller_mutation_rate = %s\nobserve_only = true\n"
        % ((RATE,) * 6))
    p = ProxyProcess(broker.bootstrap, tmp / "proxy.log",
                     ["--security-protocol", "SASL_PLAINTEXT", "--credentials-file", str(creds),
                      "--quota-file", str(quotas), "--admin-listen", "127.0.0.1:%d" % free_port()])
    p.start()
    yield p
    p.stop()


def _names(prefix, n):
    run = uuid.uuid4().hex[:6]
    return ["%s-%s-%d" % (prefix, run, i) for i in range(n)]


def _broker_partitions(broker, names):
    """{topic: partitions} of ``names`` as the broker itself has them."""
    from confluent_kafka.admin import AdminClient

    topics = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10).topics
    return {n: len(topics[n].partitions) for n in names if n in topics}


def _kafka_python_admin(proxy, user):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka.admin import KafkaAdminClient
    return KafkaAdminClient(bootstrap_servers=proxy.bootstrap, client_id="mutations",
                            security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                            sasl_plain_username=user, sasl_plain_password=USERS[user])


def _kafka_python_storm(proxy, user, seconds):
    """Create one topic per request as fast as the client is let, for
    ``seconds``: (created names, refused names, elapsed). kafka-python
    honours throttle_time_ms by refusing to send (NodeNotReadyError) until
    it has passed: the storm retries then, as an application would."""
    from kafka.errors import NodeNotReadyError

    admin = _kafka_python_admin(proxy, user)
    created, refused = [], []
    names = iter(_names("storm-" + user, 10000))
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            name = next(names)
            try:
                answer = admin.create_topics(
                    {name: {"num_partitions": PARTITIONS, "replication_factor": 1}},
                    raise_errors=False)
            except NodeNotReadyError:
                time.sleep(0.02)
                continue
            code = answer["topics"][0]["error_code"]
            assert code in (0, THROTTLING_QUOTA_EXCEEDED), answer
            (created if code == 0 else refused).append(name)
    finally:
        elapsed = time.monotonic() - t0
        admin.close()
    return created, refused, elapsed


def test_a_create_topics_storm_is_refused_with_89_and_held_to_its_rate(proxy, broker):
    created, refused, elapsed = _kafka_python_storm(proxy, "alice", 3.0)
    assert refused, "no request was refused"
    # at most the burst, the quota over the storm, and the one request that
    # crossed the quota (let through, as a broker does); a slow machine only
    # makes the storm slower
    assert len(created) * PARTITIONS <= RATE * 1.0 + RATE * elapsed + PARTITIONS
    assert len(created) * PARTITIONS >= RATE  # held to its rate, not starved
    on_broker = _broker_partitions(broker, created + refused)
    assert on_broker == {n: PARTITIONS for n in created}  # the refused never reached it


def test_the_refusal_carries_throttle_time_ms(proxy):
    """The same, one request at a time with kafka-python's protocol classes
    over a SASL connection kafka-python makes, to read the whole answer."""
    admin = _kafka_python_admin(proxy, "grace")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kafka.protocol.admin import CreateTopicsRequest
    try:
        request = CreateTopicsRequest[7]
        a, b = _names("raw", 2)
        big = request(topics=[request.CreatableTopic(
            name=a, num_partitions=20, replication_factor=1, assignments=[], configs=[])],
            timeout_ms=10000, validate_only=False)

        def send(req):
            return admin._manager.run(admin._send_request_to_controller, req,
                                      lambda r: (), False)

        first = send(big)
        assert [t.error_code for t in first.topics] == [0]
        assert first.throttle_time_ms == 0  # the request that crosses goes through
        small = request(topics=[request.CreatableTopic(
            name=b, num_partitions=1, replication_factor=1, assignments=[], configs=[])],
            timeout_ms=10000, validate_only=False)
        second = send(small)
        assert [(t.name, t.error_code) for t in second.topics] == [(b, THROTTLING_QUOTA_EXCEEDED)]
        # 15 partitions owed at 5/s, less the time since
        assert 2000 < second.throttle_time_ms <= 3000
    finally:
        admin.close()


def test_another_user_and_a_user_under_its_quota_are_unaffected(proxy, broker):
    """bob has no quota, erin one far above what she does: both create
    topics while alice storms, never refused."""
    results = {}

    def steady(user):
        admin = _kafka_python_admin(proxy, user)
        names = _names("steady-" + user, 6)
        try:
            answers = [admin.create_topics({n: {"num_partitions": PARTITIONS,
                                                "replication_factor": 1}}, raise_errors=False)
                       for n in names]
        finally:
            admin.close()
        results[user] = [a["topics"][0]["error_code"] for a in answers], names

    storm = {}
    thread = threading.Thread(
        target=lambda: storm.update(zip(("created", "refused", "elapsed"),
                                        _kafka_python_storm(proxy, "alice", 2.0))))
    thread.start()
    try:
        steady("bob")
        steady("erin")
    finally:
        thread.join(30)
    assert storm["refused"]  # alice was held meanwhile
    for user in ("bob", "erin"):
        codes, names = results[user]
        assert codes == [0] * len(names), (user, codes)
        assert _broker_partitions(broker, names) == {n: PARTITIONS for n in names}


def test_confluent_kafka_is_throttled_at_its_version_and_reports_it(proxy, broker):
    from confluent_kafka.admin import AdminClient, NewTopic

    throttles = []
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap,
                         "security.protocol": "SASL_PLAINTEXT",
                         "sasl.mechanism": "PLAIN", "sasl.username": "carol",
                         "sasl.password": USERS["carol"],
                         "throttle_cb": lambda e: throttles.append(e.throttle_time)})
    names = _names("confluent", 8)
    t0 = time.monotonic()
    for name in names:
        admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(30)  # never refused
        admin.poll(0)
    elapsed = time.monotonic() - t0
    admin.poll(0.5)
    # 16 partitions, 5 of them from the burst, the last one's throttle after
    # it: the rest at 5/s at the least
    assert elapsed >= 0.9 * (len(names) * PARTITIONS - RATE - PARTITIONS) / RATE
    assert any(t > 0 for t in throttles), throttles  # throttle_time_ms, as the client read it
    assert _broker_partitions(broker, names) == {n: PARTITIONS for n in names}


def test_aiokafka_sees_throttle_time_ms_and_is_held(proxy):
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    async def run():
        admin = AIOKafkaAdminClient(bootstrap_servers=proxy.bootstrap,
                                    security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                                    sasl_plain_username="dave",
                                    sasl_plain_password=USERS["dave"])
        await admin.start()
        answers = []
        try:
            t0 = time.monotonic()
            for name in _names("aiokafka", 5):
                answers.append(await admin.create_topics([NewTopic(name, PARTITIONS, 1)]))
            return answers, time.monotonic() - t0
        finally:
            await admin.close()

    answers, elapsed = asyncio.run(run())
    assert all(code == 0 for a in answers for _, code, *_ in a.topic_errors)
    throttles = [a.throttle_time_ms for a in answers]
    # within the burst (2 + 2 of 5) none; past it, each is throttled
    assert throttles[:2] == [0, 0] and throttles[-1] > 0, throttles
    # 10 partitions: 5 from the burst, the last one's throttle after it
    assert elapsed >= 0.9 * (5 * PARTITIONS - RATE - PARTITIONS) / RATE


def test_an_observe_only_quota_refuses_nothing(proxy, broker):
    created, refused, _ = _kafka_python_storm(proxy, "frank", 1.5)
    assert refused == []
    assert len(created) * PARTITIONS > 3 * RATE  # well past what the quota would allow
    assert _broker_partitions(broker, created) == {n: PARTITIONS for n in created}


def test_deleted_topics_count_the_partitions_the_broker_had(proxy, broker):
    """DeleteTopics says no partition count: the proxy asks the broker.
    Three topics of 4 partitions, deleted one per request against a
    quota of 5/s: the first fits the burst, the second crosses the quota
    (let through), the third is refused and its topic stays."""
    names = _names("doomed", 3)
    for name in names:
        broker.create_topic(name, partitions=4)
    admin = _kafka_python_admin(proxy, "heidi")
    try:
        codes = [admin.delete_topics([n], raise_errors=False)["topics"][0]["error_code"]
                 for n in names]
    finally:
        admin.close()
    assert codes == [0, 0, THROTTLING_QUOTA_EXCEEDED]
    # Kafka answers DeleteTopics once the deletion is committed to its metadata log; the
    # broker's own Metadata may list the topic a moment longer
    deadline = time.monotonic() + 15
    while (left := _broker_partitions(broker, names)) != {names[2]: 4}:
        assert time.monotonic() < deadline and set(left) >= {names[2]}, left
        time.sleep(0.2)


def _metric(proxy, name, user, key=None):
    import urllib.request

    port = proxy.extra_args[proxy.extra_args.index("--admin-listen") + 1].rpartition(":")[2]
    with urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if (line.startswith(name + "{") and 'user="%s"' % user in line
                and (key is None or 'key="%s"' % key in line)):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_metrics_count_partitions_and_refusals(proxy):
    # after the tests above (module order): alice stormed, bob has no quota
    assert _metric(proxy, "kthrottle_controller_mutations_total", "alice") >= RATE
    assert _metric(proxy, "kthrottle_controller_mutation_quota", "alice") == RATE
    refused = _metric(proxy, "kthrottle_throttle_seconds_total", "alice",
                      key="controller_mutation_rate")
    assert refused is not None and refused > 0
    assert _metric(proxy, "kthrottle_controller_mutations_total", "bob") is None
