"""--upstream-identity delegation-token: a terminating proxy logs each client's
broker connections in as that client, with a delegation token it creates for
it (KIP-48, KIP-373), so the broker's own authorizer decides, and logs, per
client. Apache Kafka with StandardAuthorizer and delegation tokens enabled;
the proxy's own principal may only create tokens for alice and bob."""
import time
import uuid

import pytest

from kthrottle.kafka_kit import Listener
from kthrottle_testkit.brokers import started_kafka
from kthrottle_testkit.clients import scram_credentials_file
from kthrottle_testkit.proxy import ProxyProcess
from test_authorization import acl, produce  # as alice or bob, through a proxy

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

SASL = "SASL_PLAINTEXT"
USERS = {"admin": "admin-secret", "tokens": "tokens-secret", "alice": "alice-secret",
         "bob": "bob-secret", "carol": "carol-secret"}
RUN = uuid.uuid4().hex[:6]
ALICE_TOPIC, BOB_TOPIC = "alice-dt-%s" % RUN, "bob-dt-%s" % RUN


@pytest.fixture(scope="module")
def kafka_tokens(tmp_path_factory):
    kafka = started_kafka(
        tmp_path_factory, "kafka-tokens", users=USERS, authorizer=True,
        listeners=[Listener(SASL, SASL, ("PLAIN", "SCRAM-SHA-512"))],
        config={"delegation.token.secret.key": "kthrottle-test-secret-%s" % RUN})
    admin = kafka.admin(**kafka.client_config(SASL, "PLAIN", "admin"))
    for topic in (ALICE_TOPIC, BOB_TOPIC):
        kafka.create_topic(topic)
    bindings = []
    for user in ("alice", "bob"):
        for op in ("WRITE", "READ", "DESCRIBE"):
            bindings.append(acl("TOPIC", "%s-" % user, "User:%s" % user, op))
    for future in admin.create_acls(bindings).values():
        future.result(30)
    # the proxy's principal may make tokens for alice and bob, nothing more (a User
    # resource: kafka-acls, as confluent-kafka has no such resource type)
    for user in ("alice", "bob"):
        kafka.tool("org.apache.kafka.tools.AclCommand", "--bootstrap-server", kafka.bootstrap,
                   "--add", "--allow-principal", "User:tokens", "--operation", "CreateTokens",
                   "--user-principal", "User:%s" % user, timeout=120)
    yield kafka
    kafka.stop()


@pytest.fixture(scope="module")
def proxy(kafka_tokens, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("token-proxy")
    creds = scram_credentials_file(tmp / "credentials.toml",
                                   {u: USERS[u] for u in ("alice", "bob", "carol")},
                                   mechanisms=("SCRAM-SHA-512",))
    password = tmp / "upstream-password"
    password.write_text(USERS["tokens"] + "\n")
    p = ProxyProcess(kafka_tokens.listener(SASL), tmp / "proxy.log", [
        "--security-protocol", SASL, "--sasl-enabled-mechanisms", "SCRAM-SHA-512",
        "--credentials-file", str(creds),
        "--upstream-security-protocol", SASL, "--upstream-sasl-mechanism", "SCRAM-SHA-512",
        "--upstream-sasl-username", "tokens", "--upstream-sasl-password-file", str(password),
        "--upstream-identity", "delegation-token"], node_id=kafka_tokens.node_id).start()
    yield p
    p.stop()


def test_the_broker_sees_alice_and_refuses_her_bobs_topic_itself(kafka_tokens, proxy):
    kafka = kafka_tokens
    log_start = kafka.log_path.stat().st_size
    assert produce(kafka, proxy, "alice", ALICE_TOPIC, b"as alice") is None, proxy.log()[-3000:]
    assert produce(kafka, proxy, "alice", BOB_TOPIC) == "TOPIC_AUTHORIZATION_FAILED"
    assert "delegation token" in proxy.log() and "created for User:alice" in proxy.log()
    # the refusal is the broker's own: its authorizer logged it for alice
    deadline = time.monotonic() + 10
    while True:
        logged = kafka.log_path.read_bytes()[log_start:].decode("utf-8", "replace")
        denied = [line for line in logged.splitlines()
                  if "User:alice" in line and "Denied" in line and BOB_TOPIC in line]
        if denied or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert denied, logged[-3000:]
    # bob's producer logs in with his own token
    assert produce(kafka, proxy, "bob", BOB_TOPIC, b"as bob") is None
    assert "created for User:bob" in proxy.log()


def test_a_user_the_proxy_may_not_make_tokens_for_is_turned_away_saying_why(
        kafka_tokens, proxy):
    assert produce(kafka_tokens, proxy, "carol", ALICE_TOPIC) is not None
    log = proxy.log()
    assert "refused a delegation token for User:carol" in log, log[-3000:]
    assert "CreateTokens" in log


def test_delegation_tokens_without_a_sasl_upstream_is_a_clear_start_error():
    import subprocess
    import sys
    from pathlib import Path

    kthrottle = Path(sys.executable).parent / "kthrottle"
    done = subprocess.run([str(kthrottle), "proxy", "--bootstrap-server", "127.0.0.1:9",
                           "--upstream-identity", "delegation-token"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "upstream-identity delegation-token needs a SASL upstream" in done.stderr


def test_the_create_token_codec_reads_kafkas_layout():
    """CreateDelegationToken v3 as CreateDelegationTokenRequest/Response.json lay it out."""
    import io
    import struct

    from kthrottle.sources.delegation_tokens import create_token_body, parse_create_token

    body = create_token_body("User", "alice")
    assert body == b"\x05User" + b"\x06alice" + b"\x01" + struct.pack(">q", -1) + b"\x00"
    answer = (struct.pack(">h", 0) + b"\x05User" + b"\x06alice" + b"\x05User" + b"\x07tokens"
              + struct.pack(">qqq", 1000, 87_401_000, 604_801_000) + b"\x04abc"
              + b"\x04\x01\x02\x03" + struct.pack(">i", 0) + b"\x00")
    token = parse_create_token(io.BytesIO(answer))
    assert (token.principal_name, token.token_id, token.hmac) == ("alice", "abc", b"\x01\x02\x03")
    assert (token.issue_ms, token.expiry_ms) == (1000, 87_401_000)
