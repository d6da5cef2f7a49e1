"""The admin API's pure parts: Kafka's entity matching and validation
(policy.quota_admin) and the wire codecs (codecs.admin), without I/O."""
import hashlib
import hmac
import warnings

import pytest

from kthrottle.codecs import ProtocolError
from kthrottle.codecs import admin as wire
from kthrottle.codecs.versions import splice_api_ranges, with_api_ranges
from kthrottle.policy import quota_admin as rules
from kthrottle.sources.credentials import Credentials, scram_from_password

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import AlterClientQuotasRequest, DescribeClientQuotasRequest
    from kafka.protocol.metadata import ApiVersionsResponse

pytestmark = pytest.mark.unit

SNAPSHOT = {
    "users/alice": {"producer_byte_rate": 1000.0},
    "users/alice/clients/app": {"consumer_byte_rate": 2000.0},
    "users/<default>": {"request_rate": 5.0},
    "users/<default>/clients/<default>": {"producer_byte_rate": 7.0},
    "clients/app": {"producer_byte_rate": 3000.0},
    "clients/<default>": {"consumer_byte_rate": 4000.0},
    "static": {"producer_byte_rate": 1.0},
}


def C(entity_type, match_type, match=None):
    return wire.Component(entity_type, match_type, match)


def described(components, strict=False):
    return {entity for entity, _ in rules.describe_quotas(SNAPSHOT, components, strict)}


U, CL = rules.USER, rules.CLIENT_ID


def test_no_component_matches_everything_unless_strict():
    assert len(described([])) == 6
    assert described([], strict=True) == set()


def test_exact_default_and_any_matches_as_kafka():
    assert described([C(U, 0, "alice")]) == {((U, "alice"),), ((U, "alice"), (CL, "app"))}
    assert described([C(U, 0, "alice")], strict=True) == {((U, "alice"),)}
    assert described([C(U, 1)], strict=True) == {((U, None),)}
    assert described([C(U, 1)]) == {((U, None),), ((U, None), (CL, None))}
    assert described([C(U, 2)], strict=True) == {((U, "alice"),), ((U, None),)}
    assert described([C(CL, 0, "app")], strict=True) == {((CL, "app"),)}
    assert described([C(U, 2), C(CL, 2)]) == {((U, "alice"), (CL, "app")),
                                               ((U, None), (CL, None))}
    assert described([C(U, 1), C(CL, 1)], strict=True) == {((U, None), (CL, None))}
    assert described([C(CL, 1)]) == {((CL, None),), ((U, None), (CL, None))}
    assert described([C(rules.IP, 2)]) == set()  # the snapshot has no ip entity


def test_values_are_the_entity_quotas():
    entries = dict(rules.describe_quotas(SNAPSHOT, [C(U, 0, "alice")], True))
    assert entries == {((U, "alice"),): (("producer_byte_rate", 1000.0),)}


@pytest.mark.parametrize("components, code, message", [
    ([C("", 2)], 42, "Unexpected empty filter component entity type"),
    ([C("group", 2)], 35, "Custom entity type 'group' not supported"),
    ([C(U, 2), C(U, 1)], 42, "Duplicate user filter component entity type"),
    ([C(CL, 2), C(CL, 1)], 42, "Duplicate client filter component entity type"),
    ([C(U, 2), C(rules.IP, 2)], 42, "Invalid entity filter component combination, IP filter "
                                    "component should not be used with user or clientId filter "
                                    "component."),
    ([C(U, 7)], 42, "Unexpected match type: 7"),
])
def test_bad_filters_get_kafkas_errors(components, code, message):
    with pytest.raises(rules.AdminError) as exc:
        rules.describe_quotas(SNAPSHOT, components, False)
    assert (exc.value.code, exc.value.message) == (code, message)


def ops(*items):
    return tuple(wire.QuotaOp(k, v, r) for k, v, r in items)


def test_a_valid_alteration_names_its_path():
    change = rules.quota_change(((U, "al ice"), (CL, None)),
                                ops(("producer_byte_rate", 1024.0, False),
                                    ("request_rate", 0.0, True)))
    assert change == rules.QuotaChange("users/al%20ice/clients/<default>",
                                       {"producer_byte_rate": 1024.0}, ("request_rate",))
    assert rules.quota_change(((CL, "x"),), ()).path == "clients/x"
    assert rules.quota_change(((U, None),), ()).path == "users/<default>"


@pytest.mark.parametrize("entity, op, message", [
    ((), ("request_rate", 1, False), "Invalid empty client quota entity"),
    (((U, "a"), (U, "b")), ("request_rate", 1, False),
     "Invalid empty client quota entity, duplicate entity entry user"),
    ((("group", "g"),), ("request_rate", 1, False), "Unhandled client quota entity type: group"),
    (((U, ""),), ("request_rate", 1, False), "Empty user not supported"),
    (((rules.IP, "1.2.3.4"), (U, "a")), ("request_rate", 1, False),
     "Invalid quota entity combination, IP entity should not be used with user/client ID "
     "entity."),
    (((rules.IP, "1.2.3.4"),), ("producer_byte_rate", 1, False),
     "producer_byte_rate is not a quota of ip entities"),
    (((rules.IP, "example.com"),), ("connection_creation_rate", 1, False),
     "not an ip address: 'example.com'"),
    (((rules.IP, None),), ("connection_creation_rate", 1.5, False),
     "Configuration connection_creation_rate must be a Integer value"),
    (((rules.IP, None),), ("connection_creation_rate", 2.0 ** 40, False),
     "Proposed value for connection_creation_rate is too large for an INT."),
    (((rules.TOPIC, "orders"), (U, "a")), ("producer_byte_rate", 1, False),
     "Invalid quota entity combination, topic entity should not be used with any other"),
    (((rules.TOPIC, "a/b"),), ("producer_byte_rate", 1, False), "not a topic name"),
    (((rules.TOPIC, "orders"),), ("request_rate", 1, False),
     "request_rate is not a quota of topic entities"),
    (((U, "a"),), ("connection_creation_rate", 1, False),
     "connection_creation_rate is not a quota of client entities"),
    (((U, "a"),), ("observe_only", 0.5, False), "observe_only must be 1 (true) or 0 (false)"),
    (((U, "a"),), ("producer_byte_rate", float("nan"), False),
     "producer_byte_rate must be a positive finite number"),
    (((U, "a"),), ("nonsense", 1, False), "Invalid configuration key nonsense"),
    (((U, "a"),), ("producer_byte_rate", 1.5, False),
     "Configuration producer_byte_rate must be a Long value"),
    (((U, "a"),), ("request_rate", -1, False), "request_rate must be a positive finite number"),
])
def test_bad_alterations_get_kafkas_errors(entity, op, message):
    with pytest.raises(rules.AdminError) as exc:
        rules.quota_change(entity, ops(op))
    assert exc.value.code == rules.INVALID_REQUEST and exc.value.message.startswith(message)


def test_request_percentage_is_refused_naming_request_rate():
    with pytest.raises(rules.AdminError) as exc:
        rules.quota_change(((U, "a"),), ops(("request_percentage", 50.0, False)))
    assert "request_rate" in exc.value.message and exc.value.code == 42


def test_duplicates_in_one_request():
    with pytest.raises(rules.AdminError, match="Duplicate quota key request_rate not updating "
                       r"quota for this entity ClientQuotaEntity\(entries=\{user=a\}\)"):
        rules.quota_change(((U, "a"),), ops(("request_rate", 1, False), ("request_rate", 2, False)))
    judged = rules.quota_changes([(((U, "a"),), ()), (((U, "a"),), ())])
    assert isinstance(judged[0][1], rules.QuotaChange)
    assert judged[1][1].message.startswith("Ignoring duplicate entity")


# SCRAM ---------------------------------------------------------------------------

def salted(password, salt, iterations, name="sha256"):
    return hashlib.pbkdf2_hmac(name, password.encode(), salt, iterations)


def test_keys_from_the_salted_password_are_the_ones_a_password_gives():
    salt = b"s" * 16
    made = scram_from_password("SCRAM-SHA-256", "pw", 4096, salt)
    stored, server = rules.scram_keys("SCRAM-SHA-256", salted("pw", salt, 4096))
    assert (stored, server) == (made.stored_key, made.server_key)


def up(name, mechanism=1, iterations=4096, salt=b"s" * 16, password="pw"):
    algo = "sha256" if mechanism != 2 else "sha512"
    return wire.ScramUpsertion(name, mechanism, iterations, salt,
                               salted(password, salt, 4096, algo))


def test_scram_alterations_are_judged_as_kafka_does():
    results, changes = rules.scram_changes(
        [wire.ScramDeletion("gone", 1), wire.ScramDeletion("x", 9)],
        [up(""), up("few", iterations=100), up("many", iterations=20000), up("odd", mechanism=3),
         up("twice"), up("twice"), up("ok"), up("ok", mechanism=2)],
        lambda user, mechanism: False)
    got = {user: (code, message) for user, code, message in results}
    assert got == {
        "": (93, "Username must not be empty"),
        "x": (33, "Unknown SCRAM mechanism"),
        "few": (93, "Too few iterations"),
        "many": (93, "Too many iterations"),
        "odd": (33, "Unknown SCRAM mechanism"),
        "twice": (92, "A user credential cannot be altered twice in the same request"),
        "gone": (91, "Attempt to delete a user credential that does not exist"),
    }
    assert [c.user for c in changes] == ["ok"]
    assert set(changes[0].add) == {"SCRAM-SHA-256", "SCRAM-SHA-512"}


def test_describe_scram():
    cred = scram_from_password("SCRAM-SHA-256", "pw", 8192)
    snapshot = Credentials({"alice": {"SCRAM-SHA-256": cred}})
    assert rules.describe_scram(snapshot, None) == (("alice", 0, None, ((1, 8192),)),)
    got = rules.describe_scram(snapshot, ["alice", "nobody", "", "bob", "bob"])
    assert got == (
        ("alice", 0, None, ((1, 8192),)),
        ("nobody", 91, "Attempt to describe a user credential that does not exist: nobody", ()),
        ("", 91, "Username must not be empty", ()),
        ("bob", 92, "Cannot describe SCRAM credentials for the same user twice in a single "
                    "request: bob", ()),
    )


def test_principals_in_kafkas_super_users_form():
    assert rules.parse_principals("User:admin;User:CN=a,OU=b") == {"admin", "CN=a,OU=b"}
    assert rules.parse_principals("User:admin, User:ANONYMOUS") == {"admin", "ANONYMOUS"}
    with pytest.raises(ValueError, match="User:NAME"):
        rules.parse_principals("admin")


# codecs ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", [0, 1])
def test_requests_decode_and_garbage_is_a_protocol_error(version):
    cls = DescribeClientQuotasRequest[version]
    request = cls(components=[cls.ComponentData(entity_type="user", match_type=1, match=None)],
                  strict=True)
    request.with_header(correlation_id=5, client_id="t")
    frame = bytes(request.encode(header=True, framed=True))
    assert wire.decode_request(48, version, frame) == wire.DescribeQuotas(
        (wire.Component("user", 1, None),), True)
    with pytest.raises(ProtocolError):
        wire.decode_request(48, version, frame[:-3])
    alter = AlterClientQuotasRequest[version]
    entry = alter.EntryData
    request = alter(entries=[entry(entity=[entry.EntityData(entity_type="client-id",
                                                            entity_name=None)],
                                   ops=[entry.OpData(key="k", value=1.0, remove=True)])],
                    validate_only=True)
    request.with_header(correlation_id=6, client_id="t")
    frame = bytes(request.encode(header=True, framed=True))
    assert wire.decode_request(49, version, frame) == wire.AlterQuotas(
        (wire.QuotaAlteration((("client-id", None),), (wire.QuotaOp("k", 1.0, True),)),), True)


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_api_versions_answers_get_the_admin_ranges(version):
    cls = ApiVersionsResponse[version]
    fields = {"error_code": 0, "api_keys": [(0, 0, 9), (18, 0, 3), (48, 0, 5)]}
    if version >= 1:
        fields["throttle_time_ms"] = 0
    response = cls(**fields)
    response.with_header(correlation_id=9)
    frame = bytes(response.encode(header=True, framed=True))
    new = splice_api_ranges(frame, version, {50: (0, 0)}, {48: 1})
    answer = cls.decode(new[4:], header=True)
    assert sorted((a.api_key, a.min_version, a.max_version) for a in answer.api_keys) == [
        (0, 0, 9), (18, 0, 3), (48, 0, 1), (50, 0, 0)]
    assert splice_api_ranges(frame, version, {}, {49: 1}) is None  # nothing to change
    assert with_api_ranges(((48, 0, 5), (0, 0, 9)), {49: (0, 1)}, {48: 1}) == (
        (0, 0, 9), (48, 0, 1), (49, 0, 1))


def test_hmac_is_what_kafka_uses():  # RFC 5802: ServerKey = HMAC(SaltedPassword, "Server Key")
    sp = salted("pw", b"x" * 12, 4096)
    assert rules.scram_keys("SCRAM-SHA-256", sp)[1] == hmac.new(sp, b"Server Key",
                                                                "sha256").digest()


# ip and topic entities, the new keys -------------------------------------------

T = rules.TOPIC
KINDS = {
    "users/alice": {"controller_mutation_rate": 2.5, "observe_only": 1.0},
    "ips/<default>": {"connection_creation_rate": 10.0},
    "ips/10.0.0.1": {"connection_creation_rate": 100.0, "observe_only": 1.0},
    "topics/orders": {"producer_byte_rate": 4096.0},
    "topics/<default>": {"consumer_byte_rate": 2048.0},
}


def test_ip_and_topic_entities_are_described_as_kafka_names_them():
    def found(components, strict=False):
        return [entity for entity, _ in rules.describe_quotas(KINDS, components, strict)]

    # users and clients first, then ips, then topics
    assert found([]) == [((U, "alice"),), ((rules.IP, "10.0.0.1"),), ((rules.IP, None),),
                         ((T, "orders"),), ((T, None),)]
    assert found([C(rules.IP, 2)]) == [((rules.IP, "10.0.0.1"),), ((rules.IP, None),)]
    assert found([C(rules.IP, 1)], strict=True) == [((rules.IP, None),)]
    assert found([C(T, 0, "orders")]) == [((T, "orders"),)]
    assert found([C(U, 2)]) == [((U, "alice"),)]
    entries = dict(rules.describe_quotas(KINDS, [C(rules.IP, 0, "10.0.0.1")], True))
    assert entries == {((rules.IP, "10.0.0.1"),): (("connection_creation_rate", 100.0),
                                                   ("observe_only", 1.0))}
    with pytest.raises(rules.AdminError, match="topic filter component should not be used"):
        rules.describe_quotas(KINDS, [C(T, 2), C(rules.IP, 2)], False)


def test_ip_topic_and_new_key_alterations_name_their_paths():
    assert rules.quota_change(((rules.IP, "0:0::1"),), ops(
        ("connection_creation_rate", 5.0, False), ("observe_only", 1.0, False))) == \
        rules.QuotaChange("ips/::1", {"connection_creation_rate": 5.0, "observe_only": 1.0}, ())
    assert rules.quota_change(((rules.IP, None),), ops(("observe_only", 0.0, True))) == \
        rules.QuotaChange("ips/<default>", {}, ("observe_only",))
    assert rules.quota_change(((T, "orders"),), ops(("producer_byte_rate", 1024.0, False))) == \
        rules.QuotaChange("topics/orders", {"producer_byte_rate": 1024.0}, ())
    assert rules.quota_change(((U, "a"), (CL, None)), ops(
        ("controller_mutation_rate", 0.5, False))).add == {"controller_mutation_rate": 0.5}
