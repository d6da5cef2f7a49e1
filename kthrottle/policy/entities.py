"""Quota entities as Kafka names them (KIP-55, KIP-612) and their configuration values.

A quota entity is a config path: ``users/<user>``, ``users/<user>/clients/<client-id>``
or ``clients/<client-id>`` (the client quotas), ``ips/<ip>`` (connection creation,
KIP-612) or ``topics/<topic>`` (kthrottle's own per-topic byte rates; no Kafka
release has them), where ``<default>`` stands for "any". User and client names in
paths are sanitized (URL-encoded, as Kafka stores user principals and client-ids as
ZooKeeper node names); ip addresses and topic names are written as they are. A
quota source hands the policy a snapshot: ``{entity path: {quota key: value}}``.
"""
import ipaddress
import re
from urllib.parse import unquote

DEFAULT = "<default>"

PRODUCER_BYTE_RATE = "producer_byte_rate"
CONSUMER_BYTE_RATE = "consumer_byte_rate"
REQUEST_RATE = "request_rate"
CONTROLLER_MUTATION_RATE = "controller_mutation_rate"  # KIP-599: partitions per second
CONNECTION_CREATION_RATE = "connection_creation_rate"  # KIP-612: connections per second
# Not a rate: a quota of an entity holding observe_only = 1 is measured and
# reported (what it would have delayed) but delays no one: a dry run.
OBSERVE_ONLY = "observe_only"

# The rates each kind of entity may hold.
CLIENT_QUOTA_KEYS = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, REQUEST_RATE,
                     CONTROLLER_MUTATION_RATE)
IP_QUOTA_KEYS = (CONNECTION_CREATION_RATE,)
TOPIC_QUOTA_KEYS = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE)
RATE_KEYS = CLIENT_QUOTA_KEYS + IP_QUOTA_KEYS
# Every key an entity's config may hold (which of them a given entity may
# hold: keys_for).
QUOTA_KEYS = RATE_KEYS + (OBSERVE_ONLY,)

# Entity kinds (entity_kind) and the entity types of Kafka's admin API
# (KIP-546: user, client-id, ip; "topic" is kthrottle's own).
CLIENT = "client"
IP = "ip"
TOPIC = "topic"
USER_TYPE = "user"
CLIENT_ID_TYPE = "client-id"
IP_TYPE = "ip"
TOPIC_TYPE = "topic"
ENTITY_TYPES = (USER_TYPE, CLIENT_ID_TYPE, IP_TYPE, TOPIC_TYPE)
_KEYS_OF_KIND = {CLIENT: CLIENT_QUOTA_KEYS + (OBSERVE_ONLY,),
                 IP: IP_QUOTA_KEYS + (OBSERVE_ONLY,),
                 TOPIC: TOPIC_QUOTA_KEYS + (OBSERVE_ONLY,)}

# Broker-wide static defaults for client-ids (server.properties names), applied
# after every dynamic level (KIP-55 step 8). Deprecated in Kafka, still honoured.
STATIC_DEFAULT_KEYS = {
    "quota.producer.default": PRODUCER_BYTE_RATE,
    "quota.consumer.default": CONSUMER_BYTE_RATE,
}

_UNRESERVED = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
)


def sanitize(name):
    """URL-encode a principal or client-id the way Kafka's Sanitizer does:
    java.net.URLEncoder (UTF-8), then '*' as %2A and space as %20."""
    out = []
    for ch in name:
        if ch in _UNRESERVED:
            out.append(ch)
        else:
            out.extend("%%%02X" % b for b in ch.encode("utf-8"))
    return "".join(out)


def desanitize(name):
    return unquote(name)


def entity_path(user=None, client_id=None):
    """The config path of an entity. ``user`` and ``client_id`` are names as
    they are (sanitized here) or DEFAULT."""
    if user is None and client_id is None:
        raise ValueError("a quota entity needs a user, a client-id or both")
    parts = []
    if user is not None:
        parts += ["users", user if user == DEFAULT else sanitize(user)]
    if client_id is not None:
        parts += ["clients", client_id if client_id == DEFAULT else sanitize(client_id)]
    return "/".join(parts)


def parse_entity_path(path):
    """``users/alice/clients/app`` -> ("alice", "app"); sanitized names are
    decoded; DEFAULT stays DEFAULT. Raises ValueError on anything else."""
    parts = path.strip("/").split("/")
    user = client_id = None
    if len(parts) == 4 and parts[0] == "users" and parts[2] == "clients":
        user, client_id = parts[1], parts[3]
    elif len(parts) == 2 and parts[0] == "users":
        user = parts[1]
    elif len(parts) == 2 and parts[0] == "clients":
        client_id = parts[1]
    else:
        raise ValueError(
            "not a quota entity path: %r (users/U, users/U/clients/C or clients/C)" % path
        )
    if user is not None and not user:
        raise ValueError("empty user name in %r" % path)
    if client_id is not None and not client_id:
        raise ValueError("empty client-id in %r" % path)
    if user not in (None, DEFAULT):
        user = desanitize(user)
    if client_id not in (None, DEFAULT):
        client_id = desanitize(client_id)
    return user, client_id


# Kafka's legal topic names (Topic.validate): at most 249 of these characters.
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def ip_name(ip):
    """An ip entity's name: DEFAULT, or an IPv4 or IPv6 address in its
    canonical text (so that ::1 and 0:0::1 are one entity); ValueError
    otherwise (Kafka refuses ip entities that are not addresses)."""
    if ip == DEFAULT:
        return ip
    try:
        return ipaddress.ip_address(str(ip).strip()).compressed
    except ValueError:
        raise ValueError("not an ip address: %r (an IPv4 or IPv6 address, or %s)"
                         % (ip, DEFAULT)) from None


def topic_name(topic):
    """A topic entity's name: DEFAULT or a legal Kafka topic name."""
    if topic == DEFAULT:
        return topic
    if not isinstance(topic, str) or not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        raise ValueError("not a topic name: %r (up to 249 of a-z A-Z 0-9 . _ -)" % (topic,))
    return topic


def ip_path(ip):
    return "ips/" + ip_name(ip)


def topic_path(topic):
    return "topics/" + topic_name(topic)


def entity_kind(path):
    """CLIENT (users/..., clients/...), IP (ips/...) or TOPIC (topics/...);
    ValueError for anything else."""
    head = path.strip("/").partition("/")[0]
    if head in ("users", "clients"):
        return CLIENT
    if head == "ips":
        return IP
    if head == "topics":
        return TOPIC
    raise ValueError("not a quota entity path: %r (users/U, users/U/clients/C, clients/C, "
                     "ips/IP or topics/T)" % path)


def parse_entity(path):
    """Any entity path -> ``{entity type: name}`` as Kafka's admin API names
    an entity (DEFAULT for a default): ``users/alice/clients/app`` ->
    {"user": "alice", "client-id": "app"}, ``ips/<default>`` -> {"ip":
    DEFAULT}, ``topics/orders`` -> {"topic": "orders"}. ValueError otherwise."""
    kind = entity_kind(path)
    parts = path.strip("/").split("/")
    if kind == CLIENT:
        user, client_id = parse_entity_path(path)
        entity = {}
        if user is not None:
            entity[USER_TYPE] = user
        if client_id is not None:
            entity[CLIENT_ID_TYPE] = client_id
        return entity
    if len(parts) != 2 or not parts[1]:
        raise ValueError("not a quota entity path: %r (%s/NAME)" % (path, parts[0]))
    if kind == IP:
        return {IP_TYPE: ip_name(parts[1])}
    return {TOPIC_TYPE: topic_name(parts[1])}


def path_of_entity(entity):
    """``{entity type: name}`` (parse_entity's form) -> the entity path.
    ValueError for a combination no quota has (an ip or a topic goes alone)."""
    types = set(entity)
    unknown = types - set(ENTITY_TYPES)
    if unknown:
        raise ValueError("unknown entity type %s (known: %s)"
                         % (", ".join(sorted(unknown)), ", ".join(ENTITY_TYPES)))
    if types <= {USER_TYPE, CLIENT_ID_TYPE} and types:
        return entity_path(user=entity.get(USER_TYPE), client_id=entity.get(CLIENT_ID_TYPE))
    if types == {IP_TYPE}:
        return ip_path(entity[IP_TYPE])
    if types == {TOPIC_TYPE}:
        return topic_path(entity[TOPIC_TYPE])
    raise ValueError("no quota entity is %s: user and client-id go alone or together, "
                     "ip and topic alone" % " + ".join(sorted(types)))


def keys_for(path):
    """The config keys an entity of this path may hold."""
    return _KEYS_OF_KIND[entity_kind(path)]


def parse_quota_value(key, value):
    """Validate one quota value; returns a float > 0 (observe_only: 1.0 or
    0.0). Kafka accepts numbers as strings in ZooKeeper, so numeric strings
    are accepted too."""
    if key not in QUOTA_KEYS:
        raise ValueError(
            "unknown quota key %r (known: %s)" % (key, ", ".join(QUOTA_KEYS))
        )
    if key == OBSERVE_ONLY:
        return parse_observe_only(value)
    if isinstance(value, bool):
        raise ValueError("%s must be a number, got %r" % (key, value))
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("%s must be a number, got %r" % (key, value)) from None
    if not number > 0 or number == float("inf"):
        raise ValueError("%s must be a positive finite number, got %r" % (key, value))
    return number


def parse_observe_only(value):
    """observe_only's value: true/false, 1/0 (the admin API carries doubles,
    ZooKeeper strings) -> 1.0 or 0.0."""
    text = str(value).strip().lower()
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if text in ("true", "1", "1.0"):
        return 1.0
    if text in ("false", "0", "0.0"):
        return 0.0
    raise ValueError("%s must be true or false (1 or 0), got %r" % (OBSERVE_ONLY, value))


def validate_quota_config(config, ignore_unknown=False, path=None):
    """``{key: value}`` -> ``{key: float}``. With ``ignore_unknown``, keys that
    are not quotas (a ZooKeeper user znode also holds SCRAM credentials) are
    skipped instead of refused. With ``path``, a key that entity cannot hold
    (a byte rate on an ip) is refused."""
    allowed = QUOTA_KEYS if path is None else keys_for(path)
    out = {}
    for key, value in config.items():
        if key not in QUOTA_KEYS and ignore_unknown:
            continue
        out[key] = parse_quota_value(key, value)
        if key not in allowed:
            raise ValueError("%s is not a quota of %s entities (they hold: %s)"
                             % (key, entity_kind(path), ", ".join(allowed)))
    return out


def observe_only(config):
    """Whether an entity's config marks its quotas observe-only."""
    return bool(config.get(OBSERVE_ONLY))
