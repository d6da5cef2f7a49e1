"""The share-group offset admin APIs (KIP-932) at a terminating proxy that enforces the
cluster's ACLs for each client's principal (--authorization acls): Kafka's own Java Admin
client (tests/java/ShareOffsetsAdmin.java) as alice through the proxy, on a real Apache Kafka
4.4 broker with StandardAuthorizer, where the proxy logs in as the super user admin.

Each entry is answered as Kafka 4.4's broker answers it for alice, instead of the connection
being closed: AlterShareGroupOffsets (91) READ on the group, then READ on each topic;
DeleteShareGroupOffsets (92) DELETE on the group, READ on each topic; DescribeShareGroupOffsets
(90, Admin.listShareGroupOffsets) DESCRIBE on the group and each topic, a group listing no
topics getting only those she may describe.

Share groups need no setting of their own on this broker: Kafka 4.4's storage tool finalizes
share.version=2 by default (kafka_kit: test_share_groups.py runs share consumers on the same
kind of node). The broker knows only the admin's password: alice cannot log in to it, so a
Java client that left the proxy (an address not rewritten) would fail, not pass unchecked.
"""
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from kthrottle.kafka_kit import Listener, compile_java, kafka_lib
from kthrottle_testkit.brokers import started_kafka
from test_authorization import SASL, USERS, acl, authorizing_proxy

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

RUN = uuid.uuid4().hex[:6]
ALICE_TOPIC, BOB_TOPIC = "alice-shares-%s" % RUN, "bob-shares-%s" % RUN
ALICE_GROUP, BOB_GROUP = "alice-g-%s" % RUN, "bob-g-%s" % RUN
# a group alice may describe (so FindCoordinator answers her) but neither read nor delete: the
# refusal comes from the proxy's group check of 91 and 92 themselves
DESCRIBE_ONLY_GROUP = "desc-g-%s" % RUN
SOURCE = Path(__file__).resolve().parent / "java" / "ShareOffsetsAdmin.java"


@pytest.fixture(scope="module")
def kafka_shares(tmp_path_factory):
    """The broker: SASL_PLAINTEXT (PLAIN for admin), StandardAuthorizer, the ACLs of
    alice and bob, their topics with a few records each, written as admin."""
    import confluent_kafka

    kafka = started_kafka(tmp_path_factory, "kafka-share-authz", users={"admin": USERS["admin"]},
                          authorizer=True, listeners=[Listener(SASL, SASL, ("PLAIN",))])
    try:
        admin = kafka.admin(**kafka.client_config(SASL, "PLAIN", "admin"))
        for topic in (ALICE_TOPIC, BOB_TOPIC):
            kafka.create_topic(topic)
        bindings = []
        for user in ("alice", "bob"):
            for op in ("READ", "WRITE", "DESCRIBE"):
                bindings.append(acl("TOPIC", "%s-" % user, "User:%s" % user, op))
            for op in ("READ", "DELETE"):
                bindings.append(acl("GROUP", "%s-" % user, "User:%s" % user, op))
        bindings.append(acl("GROUP", DESCRIBE_ONLY_GROUP, "User:alice", "DESCRIBE",
                            pattern="LITERAL"))
        for future in admin.create_acls(bindings).values():
            future.result(30)
        producer = confluent_kafka.Producer(kafka.client_config(SASL, "PLAIN", "admin"))
        for topic in (ALICE_TOPIC, BOB_TOPIC):
            for i in range(3):
                producer.produce(topic, b"%s-%d" % (topic.encode(), i))
        assert producer.flush(30) == 0
        del producer, admin  # librdkafka's clients gone now, not at the broker's stop
        # a share group starts at the latest offset unless told otherwise (KIP-932): earliest,
        # so that alice's share consumer has a record at once
        kafka.set_group_config(ALICE_GROUP, share_auto_offset_reset="earliest")
    except BaseException:
        kafka.stop()
        raise
    yield kafka
    kafka.stop()


@pytest.fixture(scope="module")
def share_proxy(kafka_shares, tmp_path_factory):
    p = authorizing_proxy(kafka_shares, tmp_path_factory.mktemp("share-authz-proxy"))
    yield p
    p.stop()


def properties(path, config):
    path.write_text("".join("%s=%s\n" % kv for kv in config.items()))
    return path


class Run:
    """What ShareOffsetsAdmin printed: ``outcomes[(step, group, what)]``, its output."""

    def __init__(self, stdout, stderr, code, took):
        self.stdout, self.stderr, self.code, self.took = stdout, stderr, code, took
        self.outcomes = {}
        for line in stdout.splitlines():
            fields = line.split(" ")
            if len(fields) == 4 and fields[0] != "retry":
                self.outcomes[tuple(fields[:3])] = fields[3]

    def __getitem__(self, key):
        assert key in self.outcomes, "no outcome %s in:\n%s" % (key, self)
        return self.outcomes[key]

    def step(self, step, group):
        """{what: outcome} of one step."""
        return {what: outcome for (s, g, what), outcome in self.outcomes.items()
                if (s, g) == (step, group)}

    def __str__(self):
        return "exit %s after %.1f s; stdout:\n%s\nstderr (end):\n%s" % (
            self.code, self.took, self.stdout, self.stderr[-4000:])


@pytest.fixture(scope="module")
def share_offsets_run(kafka_shares, share_proxy, tmp_path_factory):
    """ShareOffsetsAdmin run once, as alice through the proxy (and admin on the broker); its
    output kept in share-offsets-admin*/ (stdout.txt, stderr.txt)."""
    kafka = kafka_shares
    tmp = tmp_path_factory.mktemp("share-offsets-admin")
    classes = compile_java(SOURCE, tmp, kafka.lib or kafka_lib())
    alice = properties(tmp / "alice.properties", kafka.java_client_config(
        SASL, "SCRAM-SHA-512", "alice", password=USERS["alice"], bootstrap=share_proxy.bootstrap))
    admin = properties(tmp / "admin.properties", kafka.java_client_config(SASL, "PLAIN", "admin"))
    # as bin/kafka-run-class.sh runs a tool (warnings to stderr), with the class put first
    command = kafka.java_command("ShareOffsetsAdmin", alice, admin, ALICE_TOPIC, BOB_TOPIC,
                                 ALICE_GROUP, BOB_GROUP, DESCRIBE_ONLY_GROUP)
    cp = command.index("-cp") + 1
    command[cp] = "%s:%s" % (classes, command[cp])
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()  # by its own pid
        out, err = proc.communicate()
        err += "\n(killed after 180 s)"
    run = Run(out, err, proc.returncode, time.monotonic() - started)
    (tmp / "stdout.txt").write_text(out)
    (tmp / "stderr.txt").write_text(err)
    print("ShareOffsetsAdmin took %.1f s:\n%s" % (run.took, run.stdout))
    return run


def tp(topic):
    return "%s:0" % topic


def test_the_java_program_ran_to_its_end_quickly(share_offsets_run, share_proxy):
    run = share_offsets_run
    assert run.code == 0 and "done" in run.stdout.splitlines(), "%s\nproxy log:\n%s" % (
        run, share_proxy.log()[-3000:])
    assert run.took < 60, run


def test_the_share_group_was_made_by_her_share_consumer_through_the_proxy(share_offsets_run):
    run = share_offsets_run
    consumed = re.search(r"^consumed %s (\d+)$" % re.escape(ALICE_GROUP), run.stdout, re.M)
    assert consumed and int(consumed.group(1)) >= 1, run
    # and the super user set the group's offset of bob's topic, on the broker itself
    assert run[("admin-alter", ALICE_GROUP, tp(BOB_TOPIC))] == "OK", run


def test_alter_refuses_bobs_topic_per_partition_and_alters_hers(share_offsets_run):
    run = share_offsets_run
    assert run[("alter", ALICE_GROUP, tp(BOB_TOPIC))] == "TopicAuthorizationException", run
    # her own topic: altered (the group is empty: its member left with close())
    assert run[("alter", ALICE_GROUP, tp(ALICE_TOPIC))] == "OK", run


def test_list_gives_kafkas_own_topic_authorization_error_for_bobs_topic(share_offsets_run):
    """The Admin client leaves a partition answered with an error out of its listing and logs
    it (ListShareGroupOffsetsHandler: "Skipping return offset for TP due to error CODE");
    29 is TOPIC_AUTHORIZATION_FAILED."""
    run = share_offsets_run
    assert run[("list", ALICE_GROUP, tp(BOB_TOPIC))] == "absent", run
    assert re.search(r"Skipping return offset for %s-0 due to error 29: Topic authorization "
                     r"failed" % re.escape(BOB_TOPIC), run.stderr), run
    # hers: the start offset she has just altered it to
    assert run[("list", ALICE_GROUP, tp(ALICE_TOPIC))] == "0", run


def test_a_listing_of_all_the_groups_topics_leaves_out_those_she_may_not_describe(
        share_offsets_run):
    run = share_offsets_run
    # the group holds bob's topic (the super user sees it, on the broker itself)
    assert run[("admin-listall", ALICE_GROUP, tp(BOB_TOPIC))] == "0", run
    assert run[("admin-listall", ALICE_GROUP, tp(ALICE_TOPIC))] == "0", run
    # alice, through the proxy, gets hers only (no error, no entry for bob's)
    assert run.step("listall", ALICE_GROUP) == {tp(ALICE_TOPIC): "0"}, run


def test_delete_refuses_bobs_topic_and_deletes_hers(share_offsets_run):
    run = share_offsets_run
    assert run[("delete", ALICE_GROUP, BOB_TOPIC)] == "TopicAuthorizationException", run
    assert run[("delete", ALICE_GROUP, ALICE_TOPIC)] == "OK", run


def test_bobs_group_and_a_group_she_may_only_describe_are_refused(share_offsets_run):
    run = share_offsets_run
    for group in (BOB_GROUP, DESCRIBE_ONLY_GROUP):
        for topic in (ALICE_TOPIC, BOB_TOPIC):
            assert run[("alter", group, tp(topic))] == "GroupAuthorizationException", run
    for topic in (ALICE_TOPIC, BOB_TOPIC):
        assert run[("delete", DESCRIBE_ONLY_GROUP, topic)] == "GroupAuthorizationException", run


def test_the_proxy_answered_every_entry_and_closed_no_connection(share_offsets_run, share_proxy):
    """A proxy that closes the connection on one of them (as it did on 90 before, having no
    rule for it) leaves the Admin client retrying on new connections until its timeout."""
    run = share_offsets_run
    log = share_proxy.log()
    # a refusal that closes the connection is logged as "api key 91 v0 for principal
    # User:alice: ..." (a WARNING); a request it could not read as "malformed api key ..."
    assert not re.search(r"api key 9[012]\b", log), log[-3000:]
    assert not [line for line in log.splitlines() if "WARNING" in line and "alice" in line], \
        log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    # every connection closed was closed by its client (the program's end)
    closed = [line for line in log.splitlines() if re.search(r"connection \d+ closed", line)]
    assert all("client disconnected" in line for line in closed), "\n".join(closed)
    # a closed connection shows in the Java client as a disconnect, then a timeout
    assert not re.search(r"disconnected|TimeoutException", run.stdout + run.stderr), run
    assert share_proxy.alive()
