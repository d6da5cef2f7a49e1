"""Kafka's ACL decision (StandardAuthorizer, KIP-11/290/679/801) re-implemented in
kthrottle.policy.acls: each rule, Kafka's quirks, and randomized cross-checks
against a plain scan. Pure: no I/O."""
import random

import pytest

from kthrottle.policy import acls
from kthrottle.policy.acls import (
    CLUSTER_NAME,
    WILDCARD,
    WILDCARD_PRINCIPAL,
    AclBinding,
    Authorizer,
    Operation as Op,
    PatternType,
    Permission,
    ResourceType as RT,
    java_host_address,
    parse_super_users,
)

pytestmark = pytest.mark.unit

LIT, PRE = PatternType.LITERAL, PatternType.PREFIXED
ALLOW, DENY = Permission.ALLOW, Permission.DENY
ALICE, BOB = "User:alice", "User:bob"
HOST, OTHER_HOST = "10.0.0.7", "10.0.0.8"


def acl(name, op, permission=ALLOW, principal=ALICE, host=WILDCARD, pattern=LIT, rt=RT.TOPIC):
    return AclBinding(rt, name, pattern, principal, host, op, permission)


def ok(authorizer, name, op, principal=ALICE, host=HOST, rt=RT.TOPIC):
    return authorizer.allowed(principal, host, rt, name, op)


# Codes and config parsing

def test_wire_codes():
    assert (RT.UNKNOWN, RT.ANY, RT.TOPIC, RT.GROUP, RT.CLUSTER, RT.TRANSACTIONAL_ID,
            RT.DELEGATION_TOKEN, RT.USER) == tuple(range(8))
    assert [op.value for op in acls.Operation] == list(range(16))
    assert (Op.ALL, Op.READ, Op.DESCRIBE, Op.IDEMPOTENT_WRITE, Op.TWO_PHASE_COMMIT) == (
        2, 3, 8, 12, 15)
    assert (PatternType.MATCH, LIT, PRE) == (2, 3, 4)
    assert (DENY, ALLOW) == (2, 3)
    assert CLUSTER_NAME == "kafka-cluster" and WILDCARD == "*" and WILDCARD_PRINCIPAL == "User:*"


def test_parse_super_users():
    assert parse_super_users("User:admin;User:bob") == {"User:admin", "User:bob"}
    assert parse_super_users(" User:admin ; ;User:bob;\t") == {"User:admin", "User:bob"}
    assert parse_super_users("") == frozenset()
    assert parse_super_users(None) == frozenset()
    assert parse_super_users(";;") == frozenset()
    # Only the first colon separates type from name.
    assert parse_super_users("User:CN=a:b") == {"User:CN=a:b"}
    with pytest.raises(ValueError):
        parse_super_users("User:admin;bob")


def test_java_host_address():
    assert java_host_address("10.0.0.7") == "10.0.0.7"
    assert java_host_address("::1") == "0:0:0:0:0:0:0:1"
    assert java_host_address("2001:DB8::0a") == "2001:db8:0:0:0:0:0:a"
    assert java_host_address("::ffff:10.0.0.7") == "10.0.0.7"
    assert java_host_address("fe80::1%eth0") == "fe80:0:0:0:0:0:0:1%eth0"
    assert java_host_address("not-an-ip") == "not-an-ip"


def test_bindings_kept_as_given():
    given = [tuple(acl("t", Op.READ)), acl("u", Op.WRITE, DENY)]
    authorizer = Authorizer(given)
    assert authorizer.bindings == (acl("t", Op.READ), acl("u", Op.WRITE, DENY))
    assert isinstance(authorizer.bindings, tuple)


@pytest.mark.parametrize("bad", [
    acl("t", Op.READ, rt=RT.ANY),
    acl("t", Op.READ, rt=RT.UNKNOWN),
    acl("t", Op.READ, pattern=PatternType.MATCH),
    acl("t", Op.READ, pattern=PatternType.ANY),
    acl("t", Op.ANY),
    acl("t", Op.UNKNOWN),
    acl("t", Op.READ, Permission.ANY),
    acl("t", Op.READ, Permission.UNKNOWN),
    acl("", Op.READ),
])
def test_acls_kafka_never_stores_are_refused(bad):
    with pytest.raises(ValueError):
        Authorizer([bad])


# Principals, hosts, super users

def test_exact_principal_only():
    authorizer = Authorizer([acl("t", Op.READ)])
    assert ok(authorizer, "t", Op.READ)
    assert not ok(authorizer, "t", Op.READ, principal=BOB)
    assert not ok(authorizer, "t", Op.READ, principal="User:alicex")
    assert not ok(authorizer, "t", Op.READ, principal="Group:alice")


def test_wildcard_principal_matches_every_principal():
    authorizer = Authorizer([acl("t", Op.READ, principal=WILDCARD_PRINCIPAL)])
    assert ok(authorizer, "t", Op.READ, principal=ALICE)
    assert ok(authorizer, "t", Op.READ, principal=BOB)
    # Kafka adds User:* to every principal's matches, whatever its type.
    assert ok(authorizer, "t", Op.READ, principal="Group:ops")


def test_only_user_star_is_a_wildcard_principal():
    authorizer = Authorizer([acl("t", Op.READ, principal="Group:*")])
    assert not ok(authorizer, "t", Op.READ, principal="Group:ops")
    assert ok(authorizer, "t", Op.READ, principal="Group:*")


def test_host_specific_acls():
    authorizer = Authorizer([acl("t", Op.READ, host=HOST)])
    assert ok(authorizer, "t", Op.READ, host=HOST)
    assert not ok(authorizer, "t", Op.READ, host=OTHER_HOST)
    denied = Authorizer([acl("t", Op.READ), acl("t", Op.READ, DENY, host=OTHER_HOST)])
    assert ok(denied, "t", Op.READ, host=HOST)
    assert not ok(denied, "t", Op.READ, host=OTHER_HOST)


def test_host_is_compared_as_text():
    # Kafka compares with Java's getHostAddress: "::1" in an ACL never matches.
    authorizer = Authorizer([acl("t", Op.READ, host="::1")])
    assert not ok(authorizer, "t", Op.READ, host=java_host_address("::1"))
    full = Authorizer([acl("t", Op.READ, host="0:0:0:0:0:0:0:1")])
    assert ok(full, "t", Op.READ, host=java_host_address("::1"))


def test_super_users_pass_every_deny():
    authorizer = Authorizer(
        [acl(WILDCARD, Op.ALL, DENY, principal=WILDCARD_PRINCIPAL)],
        super_users=parse_super_users("User:admin"))
    assert authorizer.allowed("User:admin", HOST, RT.TOPIC, "t", Op.WRITE)
    assert authorizer.allowed("User:admin", HOST, RT.CLUSTER, CLUSTER_NAME, Op.ALTER)
    assert not ok(authorizer, "t", Op.WRITE)
    # Exact string: no wildcard, no case folding.
    star = Authorizer([], super_users={WILDCARD_PRINCIPAL})
    assert not star.allowed(ALICE, HOST, RT.TOPIC, "t", Op.READ)
    assert not Authorizer([], super_users={"User:Admin"}).allowed(
        "User:admin", HOST, RT.TOPIC, "t", Op.READ)


def test_super_user_ignores_no_acl_default():
    authorizer = Authorizer([], super_users={"User:admin"})
    assert authorizer.allowed("User:admin", HOST, RT.GROUP, "g", Op.READ)
    assert not ok(authorizer, "g", Op.READ, rt=RT.GROUP)


# Resource patterns

def test_literal_name_must_be_equal():
    authorizer = Authorizer([acl("orders", Op.READ)])
    assert ok(authorizer, "orders", Op.READ)
    assert not ok(authorizer, "orders2", Op.READ)
    assert not ok(authorizer, "order", Op.READ)


def test_literal_wildcard_matches_every_name():
    authorizer = Authorizer([acl(WILDCARD, Op.READ)])
    for name in ("orders", "x", "*", "a*"):
        assert ok(authorizer, name, Op.READ)


def test_literal_wildcard_misses_longer_names_starting_with_star():
    # Kafka's StandardAuthorizer skips LITERAL "*" for "*x": its sorted scan
    # takes it for a literal ACL naming a proper prefix of "*x" (checked
    # against Kafka 4.4's own authorizer).
    authorizer = Authorizer([acl(WILDCARD, Op.READ)])
    assert ok(authorizer, "*", Op.READ, rt=RT.GROUP) is False  # other type
    assert ok(authorizer, "*", Op.READ)
    assert not ok(authorizer, "*x", Op.READ)
    assert not ok(authorizer, "**", Op.READ)
    # ... and so it does not count as an ACL on "*x" for the no-ACL default,
    default = Authorizer([acl(WILDCARD, Op.READ, DENY, principal=WILDCARD_PRINCIPAL)],
                         allow_everyone_if_no_acl_found=True)
    assert not ok(default, "x", Op.READ)
    assert ok(default, "*x", Op.READ)
    # ... while PREFIXED "*" covers them.
    assert ok(Authorizer([acl(WILDCARD, Op.READ, pattern=PRE)]), "*x", Op.READ)


def test_prefixed_matches_names_starting_with_it():
    authorizer = Authorizer([acl("ord", Op.READ, pattern=PRE)])
    assert ok(authorizer, "ord", Op.READ)
    assert ok(authorizer, "orders", Op.READ)
    assert not ok(authorizer, "or", Op.READ)
    assert not ok(authorizer, "xorders", Op.READ)


def test_prefixed_star_is_not_a_wildcard():
    authorizer = Authorizer([acl(WILDCARD, Op.READ, pattern=PRE)])
    assert ok(authorizer, "*x", Op.READ)
    assert not ok(authorizer, "orders", Op.READ)


def test_resource_types_must_be_equal():
    authorizer = Authorizer([acl(WILDCARD, Op.READ, rt=RT.GROUP)])
    assert ok(authorizer, "g", Op.READ, rt=RT.GROUP)
    assert not ok(authorizer, "g", Op.READ, rt=RT.TOPIC)
    assert not ok(authorizer, "g", Op.READ, rt=RT.TRANSACTIONAL_ID)


def test_many_prefix_lengths():
    authorizer = Authorizer([acl("a" * n, Op.READ, pattern=PRE, principal=f"User:u{n}")
                             for n in range(1, 30)])
    name = "a" * 12 + "b"
    for n in range(1, 30):
        assert ok(authorizer, name, Op.READ, principal=f"User:u{n}") == (n <= 12)


# Operations

def test_all_matches_every_operation():
    authorizer = Authorizer([acl("t", Op.ALL)])
    for op in (Op.READ, Op.WRITE, Op.DESCRIBE, Op.ALTER_CONFIGS, Op.TWO_PHASE_COMMIT):
        assert ok(authorizer, "t", op)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE, Op.DELETE, Op.ALTER, Op.DESCRIBE])
def test_allow_implies_describe(op):
    assert ok(Authorizer([acl("t", op)]), "t", Op.DESCRIBE)


@pytest.mark.parametrize("op", [Op.CREATE, Op.ALTER_CONFIGS, Op.DESCRIBE_CONFIGS,
                                Op.CLUSTER_ACTION, Op.IDEMPOTENT_WRITE])
def test_other_allows_do_not_imply_describe(op):
    assert not ok(Authorizer([acl("t", op)]), "t", Op.DESCRIBE)


def test_alter_configs_implies_describe_configs():
    assert ok(Authorizer([acl("t", Op.ALTER_CONFIGS)]), "t", Op.DESCRIBE_CONFIGS)
    assert not ok(Authorizer([acl("t", Op.ALTER)]), "t", Op.DESCRIBE_CONFIGS)
    assert not ok(Authorizer([acl("t", Op.DESCRIBE_CONFIGS)]), "t", Op.ALTER_CONFIGS)


def test_implication_is_one_way():
    authorizer = Authorizer([acl("t", Op.DESCRIBE)])
    assert not ok(authorizer, "t", Op.READ)
    assert not ok(authorizer, "t", Op.WRITE)
    assert not ok(Authorizer([acl("t", Op.READ)]), "t", Op.WRITE)


def test_deny_of_read_does_not_deny_describe():
    # Only ALLOWs imply DESCRIBE: Kafka's findResult requires a DENY's own
    # operation (or ALL) to equal the requested one.
    authorizer = Authorizer([acl("t", Op.ALL), acl("t", Op.READ, DENY)])
    assert not ok(authorizer, "t", Op.READ)
    assert ok(authorizer, "t", Op.DESCRIBE)
    configs = Authorizer([acl("t", Op.ALL), acl("t", Op.ALTER_CONFIGS, DENY)])
    assert ok(configs, "t", Op.DESCRIBE_CONFIGS)


def test_deny_of_all_or_the_operation_denies():
    assert not ok(Authorizer([acl("t", Op.ALL), acl("t", Op.ALL, DENY)]), "t", Op.DESCRIBE)
    assert not ok(Authorizer([acl("t", Op.ALL), acl("t", Op.DESCRIBE, DENY)]), "t", Op.DESCRIBE)
    assert ok(Authorizer([acl("t", Op.ALL), acl("t", Op.WRITE, DENY)]), "t", Op.READ)


# DENY over ALLOW

def test_deny_for_everyone_beats_allow_for_alice():
    authorizer = Authorizer([acl("t", Op.READ),
                             acl("t", Op.READ, DENY, principal=WILDCARD_PRINCIPAL)])
    assert not ok(authorizer, "t", Op.READ)


def test_wildcard_deny_beats_literal_allow():
    authorizer = Authorizer([acl("t", Op.WRITE), acl(WILDCARD, Op.WRITE, DENY)])
    assert not ok(authorizer, "t", Op.WRITE)


def test_prefixed_deny():
    authorizer = Authorizer([acl(WILDCARD, Op.READ),
                             acl("secret-", Op.READ, DENY, pattern=PRE)])
    assert ok(authorizer, "public", Op.READ)
    assert not ok(authorizer, "secret-plans", Op.READ)
    assert not ok(authorizer, "secret-", Op.READ)
    assert ok(authorizer, "secret", Op.READ)


def test_literal_deny_beats_prefixed_allow():
    authorizer = Authorizer([acl("ord", Op.READ, pattern=PRE),
                             acl("orders-private", Op.READ, DENY)])
    assert ok(authorizer, "orders", Op.READ)
    assert not ok(authorizer, "orders-private", Op.READ)


def test_deny_for_another_principal_does_not_apply():
    authorizer = Authorizer([acl("t", Op.READ), acl("t", Op.READ, DENY, principal=BOB)])
    assert ok(authorizer, "t", Op.READ)
    assert not ok(authorizer, "t", Op.READ, principal=BOB)


# allow.everyone.if.no.acl.found

def test_no_acl_found_default_deny():
    authorizer = Authorizer([acl("other", Op.READ)])
    assert not ok(authorizer, "t", Op.READ)
    assert not ok(Authorizer([]), "t", Op.READ)


def test_no_acl_found_allows_when_configured():
    authorizer = Authorizer([acl("other", Op.READ, principal=BOB), acl("g", Op.READ, rt=RT.GROUP)],
                            allow_everyone_if_no_acl_found=True)
    assert ok(authorizer, "t", Op.WRITE)
    assert ok(authorizer, "g", Op.DELETE)  # a GROUP ACL does not cover topic "g"


def test_any_acl_on_the_resource_disables_the_default():
    # An ACL for someone else, or another operation, still "applies to the
    # resource": Kafka then refuses whoever no ACL allows.
    for other in (acl("t", Op.READ, principal=BOB), acl("t", Op.WRITE),
                  acl("t", Op.READ, host=OTHER_HOST), acl("t", Op.READ, DENY, principal=BOB),
                  acl("t", Op.READ, principal=BOB, pattern=PRE),
                  acl(WILDCARD, Op.READ, principal=BOB)):
        authorizer = Authorizer([other], allow_everyone_if_no_acl_found=True)
        assert not ok(authorizer, "t", Op.READ), other
        assert ok(authorizer, "unrelated-other", Op.READ, rt=RT.GROUP)


# allowed_any: Kafka's default Authorizer.authorizeByResourceType

def any_ok(authorizer, op=Op.WRITE, principal=ALICE, host=HOST, rt=RT.TOPIC):
    return authorizer.allowed_any(principal, host, rt, op)


def test_any_super_user_despite_deny():
    authorizer = Authorizer([acl(WILDCARD, Op.ALL, DENY, principal=WILDCARD_PRINCIPAL)],
                            super_users={"User:admin"})
    assert any_ok(authorizer, principal="User:admin")
    assert not any_ok(authorizer)


def test_any_some_literal_allow():
    authorizer = Authorizer([acl("t", Op.WRITE)])
    assert any_ok(authorizer)
    assert not any_ok(authorizer, principal=BOB)
    assert not any_ok(authorizer, op=Op.READ)
    assert not any_ok(authorizer, rt=RT.GROUP)
    assert not any_ok(Authorizer([acl("t", Op.WRITE, host=OTHER_HOST)]))
    assert any_ok(Authorizer([acl("t", Op.ALL)]))
    assert any_ok(Authorizer([acl("t", Op.WRITE, principal=WILDCARD_PRINCIPAL)]))


def test_any_wildcard_deny_refuses():
    authorizer = Authorizer([acl("t", Op.WRITE), acl(WILDCARD, Op.WRITE, DENY)])
    assert not any_ok(authorizer)
    everyone = Authorizer([acl("t", Op.WRITE),
                           acl(WILDCARD, Op.ALL, DENY, principal=WILDCARD_PRINCIPAL)])
    assert not any_ok(everyone)


def test_any_wildcard_allow_despite_other_denies():
    authorizer = Authorizer([acl(WILDCARD, Op.WRITE), acl("t", Op.WRITE, DENY),
                             acl("a", Op.WRITE, DENY, pattern=PRE)])
    assert any_ok(authorizer)


def test_any_literal_allow_with_same_literal_deny():
    assert not any_ok(Authorizer([acl("t", Op.WRITE), acl("t", Op.WRITE, DENY)]))
    assert any_ok(Authorizer([acl("t", Op.WRITE), acl("t", Op.WRITE, DENY),
                              acl("u", Op.WRITE)]))


def test_any_prefix_deny_dominates():
    # Literal allow "orders" under prefixed deny "ord": refused.
    assert not any_ok(Authorizer([acl("orders", Op.WRITE),
                                  acl("ord", Op.WRITE, DENY, pattern=PRE)]))
    # Prefixed allow "orders" under prefixed deny "ord" or "orders": refused.
    assert not any_ok(Authorizer([acl("orders", Op.WRITE, pattern=PRE),
                                  acl("ord", Op.WRITE, DENY, pattern=PRE)]))
    assert not any_ok(Authorizer([acl("orders", Op.WRITE, pattern=PRE),
                                  acl("orders", Op.WRITE, DENY, pattern=PRE)]))
    # A longer prefixed deny does not dominate a shorter prefixed allow.
    assert any_ok(Authorizer([acl("ord", Op.WRITE, pattern=PRE),
                              acl("orders", Op.WRITE, DENY, pattern=PRE)]))


def test_any_literal_deny_does_not_dominate_prefixed_allow():
    assert any_ok(Authorizer([acl("orders", Op.WRITE, pattern=PRE),
                              acl("orders", Op.WRITE, DENY)]))


def test_any_operation_must_be_equal_or_all():
    # No implied DESCRIBE in the scan ...
    assert not any_ok(Authorizer([acl("t", Op.READ)]), op=Op.DESCRIBE)
    # ... but the first step is a plain decision on topic "hardcode", where
    # implication (and any ACL covering that name) counts.
    assert any_ok(Authorizer([acl("hard", Op.READ, pattern=PRE)]), op=Op.DESCRIBE)
    assert any_ok(Authorizer([acl("hardcode", Op.READ)]), op=Op.DESCRIBE)


def test_any_denies_for_others_or_other_ops_ignored():
    assert any_ok(Authorizer([acl("t", Op.WRITE),
                              acl(WILDCARD, Op.WRITE, DENY, principal=BOB),
                              acl(WILDCARD, Op.READ, DENY),
                              acl(WILDCARD, Op.WRITE, DENY, host=OTHER_HOST)]))


def test_any_no_acl_found_counts_only_through_the_probe_name():
    assert any_ok(Authorizer([], allow_everyone_if_no_acl_found=True))
    assert not any_ok(Authorizer([], allow_everyone_if_no_acl_found=False))
    # ACLs for bob on some topics: "hardcode" has none, so it is allowed.
    assert any_ok(Authorizer([acl("t", Op.WRITE, principal=BOB)],
                             allow_everyone_if_no_acl_found=True))
    # A wildcard ACL for bob covers "hardcode": alice has nothing.
    assert not any_ok(Authorizer([acl(WILDCARD, Op.WRITE, principal=BOB)],
                                 allow_everyone_if_no_acl_found=True))


def test_any_for_listing_groups():
    authorizer = Authorizer([acl("team-", Op.DESCRIBE, pattern=PRE, rt=RT.GROUP)])
    assert any_ok(authorizer, op=Op.DESCRIBE, rt=RT.GROUP)
    assert not any_ok(authorizer, op=Op.DESCRIBE, rt=RT.TOPIC)


# allowed_every

def every_ok(authorizer, op=Op.READ, principal=ALICE, host=HOST, rt=RT.TOPIC):
    return authorizer.allowed_every(principal, host, rt, op)


def test_every_super_user():
    authorizer = Authorizer([acl(WILDCARD, Op.ALL, DENY, principal=WILDCARD_PRINCIPAL)],
                            super_users={"User:admin"})
    assert every_ok(authorizer, principal="User:admin")
    assert not every_ok(authorizer)


def star(*given, **kw):
    """An Authorizer with ALLOWs on LITERAL "*" and on PREFIXED "*" (which
    names starting with "*" need) for each ACL given."""
    return Authorizer([b for a in given for b in (a, a._replace(pattern_type=PRE))], **kw)


def test_every_wildcard_allow():
    assert every_ok(star(acl(WILDCARD, Op.READ)))
    assert every_ok(star(acl(WILDCARD, Op.ALL)))
    assert every_ok(star(acl(WILDCARD, Op.WRITE)), op=Op.DESCRIBE)
    assert every_ok(star(acl(WILDCARD, Op.READ, principal=WILDCARD_PRINCIPAL)))
    assert every_ok(star(acl(WILDCARD, Op.READ, host=HOST)))
    assert not every_ok(star(acl(WILDCARD, Op.READ, host=OTHER_HOST)))
    assert not every_ok(star(acl(WILDCARD, Op.READ, principal=BOB)))
    assert not every_ok(star(acl(WILDCARD, Op.WRITE)))
    assert not every_ok(star(acl(WILDCARD, Op.READ, rt=RT.GROUP)))
    # PREFIXED "*" alone covers only names starting with "*".
    assert not every_ok(Authorizer([acl(WILDCARD, Op.READ, pattern=PRE)]))


def test_every_covers_names_starting_with_star():
    # LITERAL "*" misses "*x" (see above): allowed_every must not trust it alone for a
    # group (or transactional id), whose name may start with "*"
    G = RT.GROUP

    def g(name, op, **kw):
        return acl(name, op, rt=G, **kw)

    only = Authorizer([g(WILDCARD, Op.READ)])
    assert not ok(only, "*x", Op.READ, rt=G) and not every_ok(only, rt=G)
    both = Authorizer([g(WILDCARD, Op.READ), g(WILDCARD, Op.ALL, pattern=PRE)])
    assert ok(both, "*x", Op.READ, rt=G) and every_ok(both, rt=G)
    default = Authorizer([g(WILDCARD, Op.READ)], allow_everyone_if_no_acl_found=True)
    assert ok(default, "*x", Op.READ, rt=G) and every_ok(default, rt=G)
    star_acl = Authorizer([g(WILDCARD, Op.READ), g("*x", Op.READ, principal=BOB)],
                          allow_everyone_if_no_acl_found=True)
    assert not ok(star_acl, "*x", Op.READ, rt=G) and not every_ok(star_acl, rt=G)
    star_prefix = Authorizer([g(WILDCARD, Op.READ), g("*", Op.WRITE, pattern=PRE)],
                             allow_everyone_if_no_acl_found=True)
    assert not ok(star_prefix, "*x", Op.READ, rt=G) and not every_ok(star_prefix, rt=G)


def test_every_topic_is_covered_by_literal_star_alone():
    """A topic's name is [a-zA-Z0-9._-]+ (Kafka's Topic.validate): none starts with
    "*", so an ALLOW on LITERAL "*" covers every topic."""
    only = Authorizer([acl(WILDCARD, Op.READ)])
    assert every_ok(only)
    assert all(ok(only, name, Op.READ) for name in ("a", "orders", "x.y-z_1"))
    assert not every_ok(only, op=Op.WRITE)


def test_every_needs_a_wildcard_allow():
    assert not every_ok(Authorizer([acl("t", Op.READ)]))
    assert not every_ok(Authorizer([acl("a", Op.READ, pattern=PRE)]))


def test_every_refused_by_any_matching_deny():
    for deny in (acl("t", Op.READ, DENY), acl("x", Op.READ, DENY, pattern=PRE),
                 acl("t", Op.ALL, DENY, principal=WILDCARD_PRINCIPAL),
                 acl("t", Op.READ, DENY, host=HOST)):
        assert not every_ok(star(acl(WILDCARD, Op.READ), deny)), deny
    # Denies that cannot match this principal, host or operation do not count
    # (a DENY of READ leaves DESCRIBE alone).
    for deny in (acl("t", Op.DESCRIBE, DENY, principal=BOB), acl("t", Op.WRITE, DENY),
                 acl("t", Op.DESCRIBE, DENY, host=OTHER_HOST),
                 acl("t", Op.DESCRIBE, DENY, rt=RT.GROUP), acl("t", Op.READ, DENY)):
        assert every_ok(star(acl(WILDCARD, Op.DESCRIBE)), op=Op.DESCRIBE)
        assert every_ok(Authorizer(star(acl(WILDCARD, Op.DESCRIBE)).bindings + (deny,)),
                        op=Op.DESCRIBE), deny


def test_every_no_acl_found():
    assert every_ok(Authorizer([], allow_everyone_if_no_acl_found=True))
    assert every_ok(Authorizer([acl("g", Op.READ, rt=RT.GROUP, principal=BOB)],
                               allow_everyone_if_no_acl_found=True))
    assert not every_ok(Authorizer([]))
    # Some topic has an ACL (for bob): alice is refused there.
    authorizer = Authorizer([acl("t", Op.READ, principal=BOB)],
                            allow_everyone_if_no_acl_found=True)
    assert not ok(authorizer, "t", Op.READ)
    assert not every_ok(authorizer)


# Cache

def test_cache_does_not_change_results():
    authorizer = Authorizer([acl("t", Op.READ), acl("s", Op.READ, DENY, pattern=PRE)])
    calls = [(ALICE, HOST, RT.TOPIC, "t", Op.READ), (ALICE, HOST, RT.TOPIC, "secret", Op.READ),
             (BOB, HOST, RT.TOPIC, "t", Op.READ), (ALICE, HOST, RT.TOPIC, "u", Op.READ)]
    first = [authorizer.allowed(*call) for call in calls]
    assert first == [True, False, False, False]
    assert [authorizer.allowed(*call) for call in calls] == first
    fresh = Authorizer(authorizer.bindings)
    assert [fresh.allowed(*call) for call in reversed(calls)] == first[::-1]
    assert any_ok(authorizer, op=Op.READ) == any_ok(authorizer, op=Op.READ) is True
    assert every_ok(authorizer) == every_ok(authorizer) is False


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(acls, "CACHE_LIMIT", 50)
    authorizer = Authorizer([acl("t1", Op.READ)])
    for n in range(500):
        assert ok(authorizer, f"t{n}", Op.READ) == (n == 1)
        assert len(authorizer._cache) <= 50
    assert ok(authorizer, "t1", Op.READ)


def test_probe_in_any_shares_cache_without_confusion():
    # allowed_any keys must not collide with a resource literally named like the probe.
    authorizer = Authorizer([acl("hardcode", Op.WRITE, DENY), acl("t", Op.WRITE)])
    assert not ok(authorizer, "hardcode", Op.WRITE)
    assert any_ok(authorizer)
    assert not ok(authorizer, "hardcode", Op.WRITE)


# Randomized cross-checks

NAMES = ["a", "ab", "abc", "abd", "b", "ba", "*", "*a", "hardcode", "x"]
PRINCIPALS = [ALICE, BOB, WILDCARD_PRINCIPAL]
HOSTS = [WILDCARD, HOST, OTHER_HOST]
OPS = [Op.ALL, Op.READ, Op.WRITE, Op.DESCRIBE, Op.ALTER_CONFIGS, Op.DESCRIBE_CONFIGS]
REQUEST_OPS = [Op.READ, Op.WRITE, Op.DESCRIBE, Op.ALTER_CONFIGS, Op.DESCRIBE_CONFIGS]
IMPLIES = {Op.DESCRIBE: {Op.READ, Op.WRITE, Op.DELETE, Op.ALTER},
           Op.DESCRIBE_CONFIGS: {Op.ALTER_CONFIGS}}


def reference_allowed(bindings, super_users, default, principal, host, rt, name, op):
    """A plain scan of every ACL, written from Kafka's rules."""
    if principal in super_users:
        return True
    applying = [b for b in bindings if b.resource_type == rt and (
        (b.pattern_type == LIT and (b.name == name
                                    or (b.name == "*" and not name.startswith("*"))))
        or (b.pattern_type == PRE and name.startswith(b.name)))]
    if not applying:
        return default
    matching = [b for b in applying if b.principal in (principal, "User:*")
                and b.host in (host, "*")]
    if any(b.permission == DENY and b.operation in (op, Op.ALL) for b in matching):
        return False
    return any(b.permission == ALLOW and (b.operation in (op, Op.ALL)
                                          or b.operation in IMPLIES.get(op, ()))
               for b in matching)


def random_authorizer(rng):
    bindings = [AclBinding(rng.choice([RT.TOPIC, RT.TOPIC, RT.GROUP]), rng.choice(NAMES),
                           rng.choice([LIT, LIT, PRE]), rng.choice(PRINCIPALS),
                           rng.choice(HOSTS), rng.choice(OPS),
                           rng.choice([ALLOW, ALLOW, ALLOW, DENY]))
                for _ in range(rng.randrange(0, 8))]
    super_users = {"User:admin"} if rng.random() < 0.2 else set()
    return Authorizer(bindings, super_users, rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(20))
def test_random_allowed_matches_plain_scan(seed):
    rng = random.Random(seed)
    for _ in range(100):
        authorizer = random_authorizer(rng)
        for _ in range(30):
            principal = rng.choice([ALICE, BOB, "User:admin", "Group:g"])
            host, rt = rng.choice([HOST, OTHER_HOST]), rng.choice([RT.TOPIC, RT.GROUP])
            name = rng.choice(NAMES + ["abcd", "c", "hard", "aa"])
            op = rng.choice(REQUEST_OPS)
            expected = reference_allowed(authorizer.bindings, authorizer.super_users,
                                         authorizer.allow_everyone_if_no_acl_found,
                                         principal, host, rt, name, op)
            assert authorizer.allowed(principal, host, rt, name, op) == expected
            assert authorizer.allowed(principal, host, rt, name, op) == expected  # cached


@pytest.mark.parametrize("seed", range(20))
def test_random_every_never_true_where_a_name_is_refused(seed):
    rng = random.Random(1000 + seed)
    # names a topic may have ([a-zA-Z0-9._-]+): what allowed_every speaks of for topics
    probe_names = [n for n in NAMES + ["abcd", "c", "hard", "aa", "zzz", "b*", "", "ab*"]
                   if n and "*" not in n]
    trues = 0
    for _ in range(150):
        authorizer = random_authorizer(rng)
        for principal in (ALICE, BOB, "User:admin"):
            for host in (HOST, OTHER_HOST):
                for op in REQUEST_OPS:
                    if authorizer.allowed_every(principal, host, RT.TOPIC, op):
                        trues += 1
                        for name in probe_names:
                            assert authorizer.allowed(principal, host, RT.TOPIC, name, op)
                    # allowed for every name implies allowed for some name
                    if authorizer.allowed_every(principal, host, RT.TOPIC, op):
                        assert authorizer.allowed_any(principal, host, RT.TOPIC, op)
    assert trues > 0  # the check did run


def test_index_agrees_with_scan_for_thousands_of_acls():
    rng = random.Random(7)
    letters = "abc"
    bindings = []
    for n in range(3000):
        name = "".join(rng.choice(letters) for _ in range(rng.randrange(1, 7)))
        bindings.append(AclBinding(RT.TOPIC, name, rng.choice([LIT, PRE]),
                                   f"User:u{n % 50}", WILDCARD, rng.choice(OPS),
                                   DENY if n % 11 == 0 else ALLOW))
    authorizer = Authorizer(bindings)
    for _ in range(500):
        principal = f"User:u{rng.randrange(50)}"
        name = "".join(rng.choice(letters) for _ in range(rng.randrange(1, 9)))
        op = rng.choice(REQUEST_OPS)
        assert authorizer.allowed(principal, HOST, RT.TOPIC, name, op) == reference_allowed(
            bindings, frozenset(), False, principal, HOST, RT.TOPIC, name, op)
