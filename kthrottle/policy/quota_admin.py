"""The admin API's quota and SCRAM rules, as Kafka's brokers apply them
(KIP-546: DescribeClientQuotas, AlterClientQuotas; KIP-554:
DescribeUserScramCredentials, AlterUserScramCredentials): which entities a
filter matches, which alterations are valid, and the per-entry errors with
Kafka's own codes and messages. Pure: snapshots in, answers out, no I/O.

Entities on the wire are ((entity type, name), ...) with a null name for
the default entity; here they become the quota paths of ``entities``. The
types are Kafka's (user, client-id, ip) and kthrottle's own ``topic``.
"""
import hashlib
import hmac
from typing import NamedTuple

from .entities import (
    CONNECTION_CREATION_RATE,
    CONSUMER_BYTE_RATE,
    DEFAULT,
    OBSERVE_ONLY,
    PRODUCER_BYTE_RATE,
    QUOTA_KEYS,
    REQUEST_RATE,
    entity_kind,
    keys_for,
    parse_entity,
    path_of_entity,
)

USER = "user"
CLIENT_ID = "client-id"
IP = "ip"
TOPIC = "topic"  # kthrottle's own: no Kafka broker has it
ENTITY_TYPES = (USER, CLIENT_ID, IP, TOPIC)

# DescribeClientQuotas match types
EXACT, DEFAULT_NAME, ANY = 0, 1, 2

# Kafka's error codes (org.apache.kafka.common.protocol.Errors)
NONE = 0
UNKNOWN_SERVER_ERROR = -1
CLUSTER_AUTHORIZATION_FAILED = 31
UNSUPPORTED_SASL_MECHANISM = 33
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42
RESOURCE_NOT_FOUND = 91
DUPLICATE_RESOURCE = 92
UNACCEPTABLE_CREDENTIAL = 93

CLUSTER_AUTHORIZATION_FAILED_MESSAGE = "Cluster authorization failed."  # Errors' default

# Quota keys Kafka has that kthrottle does not enforce: refused by name
# rather than stored and silently ignored.
KAFKA_ONLY_KEYS = {
    "request_percentage": "request_percentage (a share of the brokers' request-handler time) "
                          "is not enforced by kthrottle: use %s, requests per second" % REQUEST_RATE,
}
# Kafka's whole-number quota keys (QuotaConfigs: LONG, and connection_creation_rate
# an INT) on the wire's float64
LONG_KEYS = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE)
INT_KEYS = (CONNECTION_CREATION_RATE,)
INT_MAX = 2 ** 31 - 1


class AdminError(Exception):
    """One refusal: a Kafka error code and its message."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


# DescribeClientQuotas ------------------------------------------------------------

_DUPLICATE_COMPONENT = {USER: "user", CLIENT_ID: "client", IP: "ip", TOPIC: "topic"}


def _filter(components):
    """The components by entity type, checked as Kafka's ZkAdminManager
    does; AdminError for a bad filter."""
    by_type = {}
    for component in components:
        entity_type = component.entity_type
        if entity_type == "":
            raise AdminError(INVALID_REQUEST, "Unexpected empty filter component entity type")
        if entity_type not in ENTITY_TYPES:
            raise AdminError(UNSUPPORTED_VERSION,
                             "Custom entity type '%s' not supported" % entity_type)
        if entity_type in by_type:
            raise AdminError(INVALID_REQUEST, "Duplicate %s filter component entity type"
                             % _DUPLICATE_COMPONENT[entity_type])
        match_type = component.match_type
        if match_type == EXACT:
            if component.match is None:
                raise AdminError(INVALID_REQUEST, "an exact match (match_type 0) needs a name")
            wanted = component.match
        elif match_type == DEFAULT_NAME:
            wanted = DEFAULT
        elif match_type == ANY:
            wanted = ANY
        else:
            raise AdminError(INVALID_REQUEST, "Unexpected match type: %d" % match_type)
        by_type[entity_type] = wanted
    if IP in by_type and (USER in by_type or CLIENT_ID in by_type):
        raise AdminError(INVALID_REQUEST, "Invalid entity filter component combination, IP "
                         "filter component should not be used with user or clientId filter "
                         "component.")
    if TOPIC in by_type and len(by_type) > 1:
        raise AdminError(INVALID_REQUEST, "Invalid entity filter component combination, topic "
                         "filter component should not be used with any other component.")
    return by_type


def _matches(wanted, name, strict):
    """Kafka's match of one entity type: ``wanted`` a name, DEFAULT or ANY
    (None: the filter has no component of that type); ``name`` the entity's
    (None: it has none of that type)."""
    if wanted is None:
        return name is None or not strict
    if wanted is ANY:
        return name is not None
    return name == wanted


def wire_entity(names):
    """``{entity type: name or DEFAULT}`` (entities.parse_entity) as on the
    wire: ((type, name or None), ...) in Kafka's order of types."""
    return tuple((t, None if names[t] == DEFAULT else names[t])
                 for t in ENTITY_TYPES if t in names)


_KIND_ORDER = {USER: 0, CLIENT_ID: 0, IP: 1, TOPIC: 2}


def describe_quotas(snapshot, components, strict):
    """The entries of ``snapshot`` ({path: {key: value}}) a DescribeClientQuotas
    filter matches: ((entity, ((key, value), ...)), ...) in a stable order
    (users and clients, ips, topics). As in Kafka, a filter with no
    component of a type matches entities without one, and without
    ``strict`` any entity. AdminError for a bad filter (the whole answer's
    error)."""
    by_type = _filter(components)
    found = []
    for path, config in snapshot.items():
        if path in ("static", "groups") or not config:  # not entities of Kafka's admin API
            continue
        try:
            names = parse_entity(path)
        except ValueError:
            continue
        if all(_matches(by_type.get(t), names.get(t), strict) for t in ENTITY_TYPES):
            values = tuple((key, float(config[key])) for key in QUOTA_KEYS if key in config)
            if values:
                found.append((wire_entity(names), values))
    found.sort(key=lambda entry: (_KIND_ORDER[entry[0][0][0]],
                                  [(t, n is None, n or "") for t, n in entry[0]]))
    return tuple(found)


# AlterClientQuotas -----------------------------------------------------------------

class QuotaChange(NamedTuple):
    """A valid alteration: the entity's path, what to set, what to remove."""

    path: str
    add: dict
    delete: tuple


def entity_text(entity):
    """An entity as Kafka's ClientQuotaEntity prints in its messages."""
    return "ClientQuotaEntity(entries={%s})" % ", ".join(
        "%s=%s" % (t, "null" if n is None else n) for t, n in entity)


def quota_change(entity, ops):
    """One AlterClientQuotas entry -> QuotaChange; AdminError with Kafka's
    code and message (ClientQuotaControlManager, ZkAdminManager) otherwise.
    ``ops``: (key, value, remove) each."""
    if not entity:
        raise AdminError(INVALID_REQUEST, "Invalid empty client quota entity")
    names = {}
    for entity_type, name in entity:
        if entity_type in names:
            raise AdminError(INVALID_REQUEST, "Invalid empty client quota entity, duplicate "
                             "entity entry %s" % entity_type)
        if entity_type not in ENTITY_TYPES:
            raise AdminError(INVALID_REQUEST, "Unhandled client quota entity type: %s"
                             % entity_type)
        if name is not None and name == "":
            raise AdminError(INVALID_REQUEST, "Empty %s not supported" % entity_type)
        if name == DEFAULT:
            raise AdminError(INVALID_REQUEST, "%s is how kthrottle's sources write the default "
                             "%s: send a null name for it" % (DEFAULT, entity_type))
        names[entity_type] = DEFAULT if name is None else name
    if IP in names and len(names) > 1:
        raise AdminError(INVALID_REQUEST, "Invalid quota entity combination, IP entity "
                         "should not be used with user/client ID entity.")
    if TOPIC in names and len(names) > 1:
        raise AdminError(INVALID_REQUEST, "Invalid quota entity combination, topic entity "
                         "should not be used with any other entity.")
    try:
        path = path_of_entity(names)
    except ValueError as exc:  # an ip that is not an address, a topic name Kafka refuses
        raise AdminError(INVALID_REQUEST, str(exc)) from None
    allowed = keys_for(path)
    add, delete = {}, []
    seen = set()
    for key, value, remove in ops:
        if key in seen:
            raise AdminError(INVALID_REQUEST, "Duplicate quota key %s not updating quota for "
                             "this entity %s" % (key, entity_text(entity)))
        seen.add(key)
        if remove:
            if key in QUOTA_KEYS:  # removing what is not there is no change (as in Kafka)
                delete.append(key)
            continue
        if key in KAFKA_ONLY_KEYS:
            raise AdminError(INVALID_REQUEST, KAFKA_ONLY_KEYS[key])
        if key not in QUOTA_KEYS:
            raise AdminError(INVALID_REQUEST, "Invalid configuration key %s" % key)
        if key not in allowed:
            raise AdminError(INVALID_REQUEST, "%s is not a quota of %s entities (they hold: %s)"
                             % (key, entity_kind(path), ", ".join(allowed)))
        if key == OBSERVE_ONLY:
            if value not in (0.0, 1.0):
                raise AdminError(INVALID_REQUEST, "%s must be 1 (true) or 0 (false), got %r"
                                 % (key, value))
            add[key] = value
            continue
        if not value > 0 or value == float("inf"):  # NaN too
            raise AdminError(INVALID_REQUEST, "%s must be a positive finite number, got %r"
                             % (key, value))
        if key in INT_KEYS and value > INT_MAX:
            raise AdminError(INVALID_REQUEST, "Proposed value for %s is too large for an INT."
                             % key)
        if (key in LONG_KEYS or key in INT_KEYS) and abs(int(value + 1e-6) - value) > 1e-6:
            raise AdminError(INVALID_REQUEST, "Configuration %s must be a %s value"
                             % (key, "Long" if key in LONG_KEYS else "Integer"))
        add[key] = value
    return QuotaChange(path, add, tuple(delete))


def quota_changes(entries):
    """Every entry of an AlterClientQuotas request ((entity, ops), ...) ->
    ((entity, QuotaChange or AdminError), ...): each judged alone, as Kafka
    answers per entry; an entity given twice is refused the second time."""
    out = []
    seen = set()
    for entity, ops in entries:
        key = frozenset(entity)
        if key in seen:
            out.append((entity, AdminError(INVALID_REQUEST, "Ignoring duplicate entity %s"
                                           % entity_text(entity))))
            continue
        seen.add(key)
        try:
            out.append((entity, quota_change(entity, ops)))
        except AdminError as exc:
            out.append((entity, exc))
    return tuple(out)


# SCRAM credentials (KIP-554) -----------------------------------------------------

# mechanisms by their KIP-554 type (ScramMechanism; 0 is UNKNOWN)
SCRAM_MECHANISMS = {1: "SCRAM-SHA-256", 2: "SCRAM-SHA-512"}
SCRAM_TYPES = {name: code for code, name in SCRAM_MECHANISMS.items()}
_HASHES = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}
MIN_ITERATIONS = 4096  # ScramMechanism's minIterations, both mechanisms
MAX_ITERATIONS = 16384  # KIP-554
MIN_SALT_BYTES = 12  # kthrottle's credential stores' floor (what scramp's server accepts)

USERNAME_EMPTY = "Username must not be empty"


def describe_scram(credentials, users):
    """DescribeUserScramCredentials against a snapshot (``users``: names,
    None or empty for every user) -> ((user, error code, message,
    ((mechanism type, iterations), ...)), ...), as ZkAdminManager answers."""
    def infos(user):
        return tuple((SCRAM_TYPES[m], credentials.scram(m, user).iterations)
                     for m in credentials.mechanisms(user))

    if not users:
        return tuple((user, NONE, None, infos(user)) for user in credentials.users
                     if credentials.mechanisms(user))
    results = []
    counts = {}
    for user in users:
        counts[user] = counts.get(user, 0) + 1
    for user in counts:  # each user once, in request order
        if not user:
            results.append((user, RESOURCE_NOT_FOUND, USERNAME_EMPTY, ()))
        elif counts[user] > 1:
            results.append((user, DUPLICATE_RESOURCE, "Cannot describe SCRAM credentials for "
                            "the same user twice in a single request: %s" % user, ()))
        elif user == DEFAULT or not credentials.mechanisms(user):
            results.append((user, RESOURCE_NOT_FOUND, "Attempt to describe a user credential "
                            "that does not exist: %s" % user, ()))
        else:
            results.append((user, NONE, None, infos(user)))
    return tuple(results)


def scram_keys(mechanism, salted_password):
    """(stored_key, server_key) from a SaltedPassword (RFC 5802 section 3),
    as Kafka's ScramFormatter.generateCredential computes them."""
    digest = _HASHES[mechanism]
    client_key = hmac.new(salted_password, b"Client Key", digest).digest()
    server_key = hmac.new(salted_password, b"Server Key", digest).digest()
    return digest(client_key).digest(), server_key


class ScramChange(NamedTuple):
    """A valid alteration of one user's credentials: ``add`` {mechanism:
    (salt, stored_key, server_key, iterations)}, ``delete`` mechanisms."""

    user: str
    add: dict
    delete: tuple


def scram_changes(deletions, upsertions, has_credential):
    """An AlterUserScramCredentials request -> (results, changes): results
    ((user, error code, message), ...) for the users refused, and the
    ScramChange of each user that may be altered (their success is the
    caller's to report once written). The checks and messages are
    ZkAdminManager's; ``has_credential(user, mechanism)`` says what the
    store holds now."""
    refused = {}  # user -> (code, message), the last reason wins (as in Kafka)

    def mechanism_of(code):
        return SCRAM_MECHANISMS.get(code)

    for d in deletions:
        if not d.name:
            refused[d.name] = (UNACCEPTABLE_CREDENTIAL, USERNAME_EMPTY)
        elif mechanism_of(d.mechanism) is None:
            refused[d.name] = (UNSUPPORTED_SASL_MECHANISM, "Unknown SCRAM mechanism")
    for u in upsertions:
        mechanism = mechanism_of(u.mechanism)
        if not u.name:
            refused[u.name] = (UNACCEPTABLE_CREDENTIAL, USERNAME_EMPTY)
        elif mechanism is None:
            refused[u.name] = (UNSUPPORTED_SASL_MECHANISM, "Unknown SCRAM mechanism")
        elif u.iterations < MIN_ITERATIONS:
            refused[u.name] = (UNACCEPTABLE_CREDENTIAL, "Too few iterations")
        elif u.iterations > MAX_ITERATIONS:
            refused[u.name] = (UNACCEPTABLE_CREDENTIAL, "Too many iterations")
        elif u.name == DEFAULT:
            refused[u.name] = (UNACCEPTABLE_CREDENTIAL, "SCRAM credentials are for a named "
                               "user, not %s" % DEFAULT)
        elif len(u.salt) < MIN_SALT_BYTES:
            refused[u.name] = (UNACCEPTABLE_CREDENTIAL, "the salt must be at least %d bytes"
                               % MIN_SALT_BYTES)
        elif len(u.salted_password) != _HASHES[mechanism]().digest_size:
            refused[u.name] = (UNACCEPTABLE_CREDENTIAL, "a %s salted password is %d bytes, got %d"
                               % (mechanism, _HASHES[mechanism]().digest_size,
                                  len(u.salted_password)))
    results = [(user, code, message) for user, (code, message) in refused.items()]
    pairs = {}
    for item in list(deletions) + list(upsertions):
        if item.name not in refused:
            pairs[item.name, item.mechanism] = pairs.get((item.name, item.mechanism), 0) + 1
    duplicated = {user for (user, _), n in pairs.items() if n > 1}
    results += [(user, DUPLICATE_RESOURCE, "A user credential cannot be altered twice in the "
                 "same request") for user in sorted(duplicated)]
    skip = set(refused) | duplicated
    missing = []
    for d in deletions:
        if d.name not in skip and not has_credential(d.name, mechanism_of(d.mechanism)):
            if d.name not in missing:
                missing.append(d.name)
    results += [(user, RESOURCE_NOT_FOUND, "Attempt to delete a user credential that does not "
                 "exist") for user in missing]
    skip |= set(missing)
    changes = {}
    for d in deletions:
        if d.name not in skip:
            changes.setdefault(d.name, ({}, []))[1].append(mechanism_of(d.mechanism))
    for u in upsertions:
        if u.name not in skip:
            mechanism = mechanism_of(u.mechanism)
            stored_key, server_key = scram_keys(mechanism, u.salted_password)
            changes.setdefault(u.name, ({}, []))[0][mechanism] = (
                u.salt, stored_key, server_key, u.iterations)
    return tuple(results), tuple(ScramChange(user, add, tuple(delete))
                                 for user, (add, delete) in changes.items())


# who may --------------------------------------------------------------------------

def parse_principals(value):
    """Kafka's super.users form: ``User:admin;User:ops`` (Kafka's separator,
    which a TLS principal's commas need) or ``User:admin,User:ops``; a list
    in TOML -> frozenset of principal names. ValueError names a bad item."""
    if isinstance(value, str):
        items = value.split(";") if ";" in value else value.split(",")
    else:
        items = list(value)
    names = set()
    for item in items:
        if not isinstance(item, str):
            raise ValueError("%r is not a principal" % (item,))
        text = item.strip()
        if not text:
            continue
        kind, sep, name = text.partition(":")
        if not sep or kind != "User" or not name:
            raise ValueError("%r is not a principal: write User:NAME (Kafka's super.users "
                             "form), e.g. User:admin" % text)
        names.add(name)
    return frozenset(names)
