"""Kafka's ACL decision, as a KRaft broker's StandardAuthorizer makes it.

The proxy answers for a client principal what the broker would answer: given
one snapshot of the cluster's ACLs (as DescribeAcls returns them), its
``super.users`` and ``allow.everyone.if.no.acl.found``, may ``User:alice``
connecting from ``10.0.0.7`` do READ on topic ``orders``?

Kafka's rules (KIP-11 ACLs, KIP-290 prefixed patterns, KIP-801 KRaft authorizer):

- a super user (the exact principal string listed in ``super.users``) may do
  anything, whatever the ACLs say;
- an ACL applies to a resource of its own type when it is LITERAL and names it,
  LITERAL ``*`` (any name, but see below), or PREFIXED with a prefix of the name;
- an applying ACL matches the request when its principal is the client's or
  ``User:*`` (which Kafka matches against every principal, whatever its type),
  its host is ``*`` or the client's address as text, and its operation is ALL,
  the requested one, or, for an ALLOW only, one implying it: READ, WRITE,
  DELETE and ALTER imply DESCRIBE; ALTER_CONFIGS implies DESCRIBE_CONFIGS.
  A DENY of READ does not deny DESCRIBE;
- any matching DENY refuses, whatever ALLOWs match; else a matching ALLOW
  allows; else, when no ACL at all applies to the resource (for anyone, any
  operation), ``allow.everyone.if.no.acl.found`` decides; else refused.

One quirk, kept because the broker has it (KRaft's StandardAuthorizer, seen in
3.9 and 4.4): LITERAL ``*`` does not apply to a name that starts with ``*``
but is longer (``*x``, ``**``). Its scan of the name-sorted ACLs treats ``*``
as a LITERAL ACL whose name is a proper prefix of the resource's, and skips it.
Topic names cannot hold ``*``; group and transactional ids can.

The client's host is compared as text with what Java's getHostAddress gives
(``java_host_address``): IPv6 addresses in full, uncompressed form, and
IPv4-mapped IPv6 addresses as plain IPv4.

Pure: no I/O, no clock. An Authorizer holds one ACL snapshot and never changes
(a new snapshot makes a new Authorizer, its decision cache going with the old).
"""
import enum
import ipaddress
from typing import NamedTuple


class ResourceType(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5
    DELEGATION_TOKEN = 6
    USER = 7


class Operation(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12
    CREATE_TOKENS = 13
    DESCRIBE_TOKENS = 14
    TWO_PHASE_COMMIT = 15  # KIP-939


class PatternType(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    MATCH = 2
    LITERAL = 3
    PREFIXED = 4


class Permission(enum.IntEnum):
    UNKNOWN = 0
    ANY = 1
    DENY = 2
    ALLOW = 3


CLUSTER_NAME = "kafka-cluster"  # the one CLUSTER resource's name
WILDCARD = "*"  # a LITERAL resource name matching every name; also "any host"
WILDCARD_PRINCIPAL = "User:*"

# Ops an ALLOW of which also allows the key (only ALLOWs: a DENY of READ leaves
# DESCRIBE alone). Every op implies itself; ALL is handled apart.
_IMPLIED_BY = {
    Operation.DESCRIBE: frozenset((Operation.DESCRIBE, Operation.READ, Operation.WRITE,
                                   Operation.DELETE, Operation.ALTER)),
    Operation.DESCRIBE_CONFIGS: frozenset((Operation.DESCRIBE_CONFIGS,
                                           Operation.ALTER_CONFIGS)),
}

# Cleared when it grows past this many decisions.
CACHE_LIMIT = 100_000

# The name Kafka's authorizeByResourceType asks about first (a plain
# authorize call), so that super users pass whatever DENYs there are.
_PROBE_NAME = "hardcode"

# Java's String.trim: drops every char up to U+0020 at either end.
_JAVA_TRIM = "".join(map(chr, range(0x21)))

_ANY_NAME = object()  # cache key part for allowed_any (never a name)
_EVERY_NAME = object()  # ... and for allowed_every


class AclBinding(NamedTuple):
    """One ACL, as Kafka's admin API carries it (codes: the enums above)."""
    resource_type: int
    name: str
    pattern_type: int
    principal: str
    host: str
    operation: int
    permission: int


def parse_super_users(text):
    """``super.users`` as Kafka reads it: principals separated by ``;``, each
    trimmed, empty ones skipped. Each must be ``Type:name`` (Kafka refuses to
    start otherwise: ValueError here)."""
    if text is None:
        return frozenset()
    users = set()
    for part in str(text).split(";"):
        user = part.strip(_JAVA_TRIM)
        if not user:
            continue
        if ":" not in user:
            raise ValueError(f"super.users: expected Type:name, got {user!r}")
        users.add(user)
    return frozenset(users)


def java_host_address(ip):
    """The text Kafka compares ACL hosts with: Java's getHostAddress of the
    client's address. IPv4 as dotted quad; an IPv4-mapped IPv6 address as its
    IPv4 (Java makes it an Inet4Address); other IPv6 as eight lowercase hex
    groups without leading zeros and without ``::`` compression, any zone
    kept after ``%``. Text that is not an address is returned unchanged."""
    text = str(ip)
    address, _, zone = text.partition("%")
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return text
    if parsed.version == 4:
        return str(parsed)
    if parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    packed = parsed.packed
    groups = ":".join(format(packed[i] << 8 | packed[i + 1], "x") for i in range(0, 16, 2))
    return f"{groups}%{zone}" if zone else groups


def _check(binding):
    """Refuse what Kafka's controller never stores (so never returns)."""
    if binding.resource_type in (ResourceType.UNKNOWN, ResourceType.ANY):
        raise ValueError(f"ACL with resource type {binding.resource_type}: {binding}")
    if binding.pattern_type not in (PatternType.LITERAL, PatternType.PREFIXED):
        raise ValueError(f"ACL with pattern type {binding.pattern_type}: {binding}")
    if binding.operation in (Operation.UNKNOWN, Operation.ANY):
        raise ValueError(f"ACL with operation {binding.operation}: {binding}")
    if binding.permission not in (Permission.ALLOW, Permission.DENY):
        raise ValueError(f"ACL with permission {binding.permission}: {binding}")
    if not binding.name:
        raise ValueError(f"ACL with an empty resource name: {binding}")


def _entry_matches(binding, principal, host, operation):
    """The ACL's principal, host and operation match the request (its resource
    pattern is assumed to apply): None if not, else its permission."""
    if binding.principal != principal and binding.principal != WILDCARD_PRINCIPAL:
        return None
    if binding.host != WILDCARD and binding.host != host:
        return None
    op = binding.operation
    if op != Operation.ALL and op != operation:
        if binding.permission != Permission.ALLOW:
            return None
        if op not in _IMPLIED_BY.get(operation, ()):
            return None
    return binding.permission


class _TypeIndex:
    """The ACLs of one resource type: LITERAL ones by name (``*`` included),
    PREFIXED ones by prefix, with the prefix lengths present, so a name's
    prefixes are looked up only at lengths some ACL has."""

    __slots__ = ("bindings", "literal", "prefixed", "lengths")

    def __init__(self):
        self.bindings = []
        self.literal = {}
        self.prefixed = {}
        self.lengths = ()

    def add(self, binding):
        self.bindings.append(binding)
        table = self.literal if binding.pattern_type == PatternType.LITERAL else self.prefixed
        table.setdefault(binding.name, []).append(binding)

    def seal(self):
        self.lengths = tuple(sorted({len(prefix) for prefix in self.prefixed}))

    def applying(self, name):
        """The ACLs whose resource pattern covers ``name``."""
        found = list(self.literal.get(name, ()))
        if not name.startswith(WILDCARD):  # Kafka's quirk: see the module docstring
            found.extend(self.literal.get(WILDCARD, ()))
        size = len(name)
        for length in self.lengths:
            if length > size:
                break
            found.extend(self.prefixed.get(name[:length], ()))
        return found


class Authorizer:
    """Kafka's decisions for one ACL snapshot. ``bindings``: AclBinding (or any
    7-tuples in its field order); ``super_users``: principal strings (see
    parse_super_users); ``allow_everyone_if_no_acl_found``: the broker config."""

    def __init__(self, bindings, super_users=frozenset(), allow_everyone_if_no_acl_found=False):
        self.bindings = tuple(AclBinding(*b) for b in bindings)
        self.super_users = frozenset(super_users)
        self.allow_everyone_if_no_acl_found = bool(allow_everyone_if_no_acl_found)
        self._by_type = {}
        for binding in self.bindings:
            _check(binding)
            self._by_type.setdefault(binding.resource_type, _TypeIndex()).add(binding)
        for index in self._by_type.values():
            index.seal()
        self._cache = {}

    def _remember(self, key, result):
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = result
        return result

    def _cached(self, decide, key):
        """``decide(*key)``, remembered: ``key`` is (principal, host, resource type, name or
        a marker of its own, operation)."""
        result = self._cache.get(key)
        if result is None:
            result = self._remember(key, decide(*key))
        return result

    def allowed(self, principal, host, resource_type, name, operation):
        """Would the broker allow ``operation`` on the resource (type, LITERAL
        name) to ``principal`` connecting from ``host``?"""
        # _cached's lookup written out: this one is asked for every request checked
        key = (principal, host, resource_type, name, operation)
        result = self._cache.get(key)
        if result is None:
            result = self._remember(key, self._decide(principal, host, resource_type, name,
                                                      operation))
        return result

    def _decide(self, principal, host, resource_type, name, operation):
        if principal in self.super_users:
            return True
        index = self._by_type.get(resource_type)
        applying = index.applying(name) if index is not None else ()
        if not applying:
            return self.allow_everyone_if_no_acl_found
        allow = False
        for binding in applying:
            permission = _entry_matches(binding, principal, host, operation)
            if permission == Permission.DENY:
                return False
            if permission == Permission.ALLOW:
                allow = True
        # Some ACL applies to the resource: without an ALLOW, refused.
        return allow

    def allowed_any(self, principal, host, resource_type, operation):
        """Kafka's Authorizer.authorizeByResourceType (KIP-679): may the
        principal do ``operation`` on at least one resource of the type? The
        broker asks it when InitProducerId without a transactional id lacks
        IDEMPOTENT_WRITE on the cluster (then WRITE on any topic will do).

        Kafka's default, which the KRaft authorizer keeps: first a plain
        decision on the name ``hardcode`` (so super users pass; and
        ``allow.everyone.if.no.acl.found`` counts only through it); then,
        over the type's ACLs whose principal (exact or ``User:*``), host and
        operation (exactly, or ALL: no implied DESCRIBE here) match: a DENY of
        LITERAL ``*`` refuses; an ALLOW of LITERAL ``*`` allows; else any
        LITERAL ALLOW whose name has no LITERAL DENY of the same name and no
        PREFIXED DENY of one of its prefixes allows, and any PREFIXED ALLOW
        none of whose prefixes (itself included) has a PREFIXED DENY allows.
        A LITERAL DENY never outweighs a PREFIXED ALLOW."""
        return self._cached(self._decide_any, (principal, host, resource_type, _ANY_NAME,
                                               operation))

    def _decide_any(self, principal, host, resource_type, _name, operation):
        if self.allowed(principal, host, resource_type, _PROBE_NAME, operation):
            return True
        index = self._by_type.get(resource_type)
        if index is None:
            return False
        deny_literal, deny_prefixed = set(), set()
        allow_literal, allow_prefixed = set(), set()
        wildcard_allow = False
        for binding in index.bindings:
            if binding.host != host and binding.host != WILDCARD:
                continue
            if binding.principal != principal and binding.principal != WILDCARD_PRINCIPAL:
                continue
            if binding.operation != operation and binding.operation != Operation.ALL:
                continue
            literal = binding.pattern_type == PatternType.LITERAL
            if binding.permission == Permission.DENY:
                if literal and binding.name == WILDCARD:
                    return False
                (deny_literal if literal else deny_prefixed).add(binding.name)
            elif literal and binding.name == WILDCARD:
                wildcard_allow = True
            else:
                (allow_literal if literal else allow_prefixed).add(binding.name)
        if wildcard_allow:
            return True

        def prefix_denied(name):
            return any(name[:n] in deny_prefixed for n in range(1, len(name) + 1))

        for name in allow_literal:
            if name not in deny_literal and not prefix_denied(name):
                return True
        return any(not prefix_denied(name) for name in allow_prefixed)

    def allowed_every(self, principal, host, resource_type, operation):
        """True only if ``allowed`` is True for every name of the type, so a
        request's resource names need not be read. Exact for super users;
        otherwise True when no DENY of the type matches this principal, host
        and operation (under any name: conservative) and either
        ``allow.everyone.if.no.acl.found`` is set and the type has no ACLs at
        all, or an ALLOW on LITERAL ``*`` matches them (implied operations
        counted, as allowed does) and the names starting with ``*``, which
        that ALLOW misses (module docstring), are allowed too: by a matching
        ALLOW on PREFIXED ``*``, or by ``allow.everyone.if.no.acl.found`` when
        no ACL of the type but LITERAL ``*`` names anything starting with
        ``*``. Anything else is False, even where every name happens to be
        allowed."""
        return self._cached(self._decide_every, (principal, host, resource_type, _EVERY_NAME,
                                                 operation))

    def _decide_every(self, principal, host, resource_type, _name, operation):
        if principal in self.super_users:
            return True
        index = self._by_type.get(resource_type)
        if index is None:
            return self.allow_everyone_if_no_acl_found
        for binding in index.bindings:
            if (binding.permission == Permission.DENY
                    and _entry_matches(binding, principal, host, operation) is not None):
                return False

        def allows(found):
            return any(_entry_matches(binding, principal, host, operation) == Permission.ALLOW
                       for binding in found)

        if not allows(index.literal.get(WILDCARD, ())):
            return False
        if resource_type == ResourceType.TOPIC:
            return True  # a topic's name is [a-zA-Z0-9._-]+: none starts with "*"
        # Names starting with "*" (but "*" itself) are left to other ACLs.
        if allows(index.prefixed.get(WILDCARD, ())):
            return True
        return self.allow_everyone_if_no_acl_found and not any(
            binding.name.startswith(WILDCARD) for binding in index.bindings
            if (binding.name, binding.pattern_type) != (WILDCARD, PatternType.LITERAL))
