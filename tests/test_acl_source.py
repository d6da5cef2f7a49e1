"""The cluster's ACLs, read with DescribeAcls (and the brokers' super.users and
allow.everyone.if.no.acl.found with DescribeConfigs) on the event loop, so
that the proxy can enforce them per client principal.

Against real Apache Kafka: the session's node without an authorizer, and a
node of this module's own with StandardAuthorizer and a SASL_PLAINTEXT
listener (PLAIN), whose ACLs are created and deleted with confluent-kafka's
AdminClient as the super user "admin"."""
import asyncio
import base64
import logging
import time

import pytest

from kthrottle.kafka_kit import Listener
from kthrottle.embedded import free_port
from kthrottle.security import KafkaClientSecurity
from kthrottle.sources.acls import (
    AclSnapshot,
    AclsRefused,
    KafkaAclSource,
    parse_super_users,
)
from kthrottle_testkit.brokers import started_kafka

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

USERS = {"admin": "admin-secret", "alice": "alice-secret", "bob": "bob-secret",
         "carol": "carol-secret"}
SASL = "SASL_PLAINTEXT"

# Kafka's codes
TOPIC, GROUP, CLUSTER = 2, 3, 4
LITERAL, PREFIXED = 3, 4
READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS = 3, 4, 8, 10
DENY, ALLOW = 2, 3


@pytest.fixture(scope="module")
def kafka_acl(tmp_path_factory):
    """One Apache Kafka node with StandardAuthorizer; super users admin and
    ANONYMOUS (the PLAINTEXT listener), USERS on SASL_PLAINTEXT with PLAIN."""
    kafka = started_kafka(tmp_path_factory, "kafka-acls", users=USERS, authorizer=True,
                           listeners=[Listener(SASL, SASL, ("PLAIN",))])
    yield kafka
    kafka.stop()


def security_as(user):
    return KafkaClientSecurity(SASL, sasl_mechanism="PLAIN", sasl_username=user,
                               sasl_password=USERS[user])


def admin_client(kafka):
    from confluent_kafka.admin import AdminClient

    return AdminClient(kafka.client_config(SASL, "PLAIN", "admin"))


def binding(resource_type, name, pattern, principal, host, operation, permission,
            filter=False):
    """confluent-kafka's AclBinding (AclBindingFilter) of Kafka's codes, in
    AclSnapshot's field order."""
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    cls = AclBindingFilter if filter else AclBinding
    return cls(ResourceType(resource_type), name, ResourcePatternType(pattern),
                      principal, host, AclOperation(operation), AclPermissionType(permission))


def create_acls(kafka, *bindings):
    admin = admin_client(kafka)  # kept until the answers are in
    for future in admin.create_acls([binding(*b) for b in bindings],
                                    request_timeout=20).values():
        future.result()


def delete_acls(kafka, *bindings):
    filters = [binding(*b, filter=True) for b in bindings]
    admin = admin_client(kafka)
    for future in admin.delete_acls(filters, request_timeout=20).values():
        future.result()


class Follower:
    """A KafkaAclSource started on a loop of the test's own (``asyncio.run`` per
    scenario), its on_update calls kept."""

    def __init__(self, **settings):
        self.source = KafkaAclSource(**settings)
        self.updates = []

    async def start(self):
        await self.source.start(self.updates.append)
        return self

    async def until(self, predicate, timeout):
        """Wait until ``predicate(snapshot)``; the time it took."""
        began = time.monotonic()
        while not (self.source.snapshot is not None and predicate(self.source.snapshot)):
            if time.monotonic() - began > timeout:
                raise AssertionError("not within %gs; last snapshot %r" % (
                    timeout, self.source.snapshot))
            await asyncio.sleep(0.05)
        return time.monotonic() - began


def of(snapshot, principal):
    return {b for b in snapshot.bindings if b[3] == principal}


# pure --------------------------------------------------------------------------------

def test_super_users_are_split_as_kafka_splits_them():
    assert parse_super_users("User:admin;User:ANONYMOUS") == {"User:admin", "User:ANONYMOUS"}
    assert parse_super_users(" User:a ; User:CN=x,O=y;") == {"User:a", "User:CN=x,O=y"}
    assert parse_super_users("") == parse_super_users(None) == frozenset()


# against Apache Kafka -------------------------------------------------------------------

def test_a_cluster_without_an_authorizer_has_nothing_to_enforce(apache_kafka):
    async def scenario():
        f = await Follower(bootstrap_servers=[apache_kafka.bootstrap],
                           security=KafkaClientSecurity(), refresh=0.5).start()
        try:
            assert f.updates == [AclSnapshot(False, (), frozenset(), False)]
            assert f.source.snapshot == f.updates[0]
            assert f.source.healthy and f.source.reads == 1 and f.source.read_errors == 0
            await asyncio.sleep(1.3)  # reads again, the same: no further update
            assert f.source.reads >= 2 and len(f.updates) == 1
        finally:
            await f.source.stop()

    asyncio.run(scenario())


def test_the_acls_are_followed_with_kafkas_codes(kafka_acl, caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.acls")
    alice = "User:alice"
    orders = (TOPIC, "orders", LITERAL, alice, "*", READ, ALLOW)
    logs = (TOPIC, "logs-", PREFIXED, alice, "10.0.0.1", WRITE, DENY)
    configs = (CLUSTER, "kafka-cluster", LITERAL, alice, "*", DESCRIBE_CONFIGS, ALLOW)
    group = (GROUP, "app-", PREFIXED, alice, "*", READ, ALLOW)
    create_acls(kafka_acl, orders, logs, configs)

    async def scenario():
        f = await Follower(bootstrap_servers=[kafka_acl.listener(SASL)],
                           security=security_as("admin"), refresh=0.5).start()
        try:
            first = f.source.snapshot
            assert f.updates == [first] and f.source.healthy
            assert first.enabled
            assert of(first, alice) == {orders, logs, configs}
            assert first.bindings == tuple(sorted(first.bindings))
            # Kafka answers super.users as sensitive, without its value: not read, said once
            assert first.super_users == frozenset()
            assert first.allow_everyone_if_no_acl_found is False

            create_acls(kafka_acl, group)
            delete_acls(kafka_acl, logs)
            took = await f.until(lambda s: of(s, alice) == {orders, configs, group}, 5.0)
            assert took < 4 * 0.5 + 2.0
            assert f.updates[-1] == f.source.snapshot
            count = len(f.updates)
            await asyncio.sleep(1.3)  # unchanged: read, not handed over again
            assert len(f.updates) == count and f.source.reads >= 3
        finally:
            await f.source.stop()
            delete_acls(kafka_acl, orders, configs, group)

    asyncio.run(scenario())
    hidden = [r for r in caplog.records if r.levelno == logging.WARNING
              and "hides super.users" in r.getMessage()]
    assert len(hidden) == 1, [r.getMessage() for r in caplog.records]
    # allow.everyone.if.no.acl.found is not set: absent from the answer, false for certain
    assert "hides super.users (Kafka" in hidden[0].getMessage()
    assert "takes what it cannot read as not set (no super users" in hidden[0].getMessage()


def test_super_users_given_are_used_instead_of_the_hidden_setting(kafka_acl, caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.acls")

    async def scenario():
        f = await Follower(bootstrap_servers=[kafka_acl.listener(SASL)],
                           security=security_as("admin"), refresh=0.5,
                           super_users=["User:admin", "User:ANONYMOUS"]).start()
        try:
            snapshot = f.source.snapshot
            assert snapshot.enabled
            assert snapshot.super_users == {"User:admin", "User:ANONYMOUS"}
            assert snapshot.allow_everyone_if_no_acl_found is False
        finally:
            await f.source.stop()

    asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_refresh_soon_reads_at_once(kafka_acl):
    bob = (TOPIC, "soon", LITERAL, "User:bob", "*", READ, ALLOW)

    async def scenario():
        f = await Follower(bootstrap_servers=[kafka_acl.listener(SASL)],
                           security=security_as("admin"), refresh=60).start()
        try:
            assert bob not in f.source.snapshot.bindings
            create_acls(kafka_acl, bob)
            f.source.refresh_soon()
            assert await f.until(lambda s: bob in s.bindings, 5.0) < 5.0
            assert f.source.reads == 2
        finally:
            await f.source.stop()
            delete_acls(kafka_acl, bob)

    asyncio.run(scenario())


def test_a_topic_id_asked_for_is_read_with_every_topics_id(kafka_acl):
    """A request named a topic id this process has not seen: the source reads
    every topic's id once, and again only after TOPIC_IDS_INTERVAL."""
    from confluent_kafka.admin import NewTopic

    admin = admin_client(kafka_acl)
    for future in admin.create_topics([NewTopic("ids-a", 2, 1), NewTopic("ids-b", 1, 1)],
                                      request_timeout=20).values():
        future.result()
    described = admin.describe_topics(
        __import__("confluent_kafka").TopicCollection(["ids-a", "ids-b"]), request_timeout=20)
    expected = {name: str(f.result().topic_id) for name, f in described.items()}

    async def scenario():
        f = await Follower(bootstrap_servers=[kafka_acl.listener(SASL)],
                           security=security_as("admin"), refresh=60).start()
        got = []
        f.source.on_topic_ids = got.append
        try:
            f.source.topic_ids_soon()
            f.source.topic_ids_soon()  # asked twice at once: read once
            began = time.monotonic()
            while not got:
                assert time.monotonic() - began < 10, "no topic ids read"
                await asyncio.sleep(0.05)
            # confluent-kafka writes a topic id in base64 without padding
            names = {name: base64.b64encode(tid.bytes).rstrip(b"=").decode()
                     for tid, name in got[0].items()}
            assert {n: names.get(n) for n in expected} == expected
            await asyncio.sleep(0.3)
            assert f.source.topic_id_reads == 1
            f.source.topic_ids_soon()  # within the interval: read once it is over
            while len(got) < 2:
                assert time.monotonic() - began < 10, "not read again"
                await asyncio.sleep(0.05)
            assert time.monotonic() - began >= 1.0
            # that read found nothing new (an id that is in no topic, a probe): the
            # next may come only after twice the wait
            await asyncio.sleep(0.1)
            assert f.source.topic_ids_wait == 2.0
            second = time.monotonic()
            f.source.topic_ids_soon()
            while len(got) < 3:
                assert time.monotonic() - second < 10, "not read a third time"
                await asyncio.sleep(0.05)
            assert time.monotonic() - second >= 1.5
        finally:
            await f.source.stop()

    asyncio.run(scenario())


def test_a_principal_that_may_not_describe_acls_is_refused_at_start(kafka_acl):
    async def scenario():
        source = KafkaAclSource([kafka_acl.listener(SASL)], security_as("carol"), refresh=0.5)
        updates = []
        try:
            with pytest.raises(AclsRefused) as refused:
                await source.start(updates.append)
        finally:
            await source.stop()
        assert updates == [] and source.snapshot is None
        return str(refused.value)

    message = asyncio.run(scenario())
    assert "CLUSTER_AUTHORIZATION_FAILED" in message
    assert "principal User:carol needs DESCRIBE on the Cluster resource" in message
    assert "--authorization none" in message
    assert "carol-secret" not in message


def test_without_describe_configs_the_settings_fall_back_to_the_safe_side(kafka_acl, caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.acls")
    describe = (CLUSTER, "kafka-cluster", LITERAL, "User:bob", "*", DESCRIBE, ALLOW)
    create_acls(kafka_acl, describe)

    async def scenario():
        f = await Follower(bootstrap_servers=[kafka_acl.listener(SASL)],
                           security=security_as("bob"), refresh=0.5).start()
        try:
            snapshot = f.source.snapshot
            assert snapshot.enabled and describe in snapshot.bindings
            assert snapshot.super_users == frozenset()
            assert snapshot.allow_everyone_if_no_acl_found is False
            await asyncio.sleep(1.2)
            assert f.source.healthy and len(f.updates) == 1
        finally:
            await f.source.stop()
            delete_acls(kafka_acl, describe)

    asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "ClusterAuthorizationFailedError" in warnings[0]
    assert "User:bob needs DESCRIBE_CONFIGS on the Cluster resource" in warnings[0]
    assert "refusing what only a super user could do" in warnings[0]


def test_an_unreachable_cluster_is_a_warning_and_the_reads_go_on(caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.acls")

    async def scenario():
        port = free_port()  # nobody listens there
        source = KafkaAclSource(["127.0.0.1:%d" % port], KafkaClientSecurity(), refresh=0.3,
                                timeout=1.0)
        updates = []
        try:
            await source.start(updates.append)
            assert source.snapshot is None and not source.healthy
            assert updates == [] and source.read_errors == 1
            await asyncio.sleep(1.0)
            assert source.read_errors >= 2 and source.snapshot is None
        finally:
            await source.stop()

    asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "cannot read the ACLs from the cluster at 127.0.0.1:" in warnings[0]
    assert "requests wait until the cluster answers" in warnings[0]
