"""Quota entities as Kafka names them (KIP-55) and their configuration values.

A quota entity is a config path: ``users/<user>``, ``users/<user>/clients/<client-id>``
or ``clients/<client-id>``, where ``<default>`` stands for "any". Names in paths
are sanitized (URL-encoded, as Kafka stores user principals and client-ids as
ZooKeeper node names). A quota source hands the policy a snapshot:
``{entity path: {quota key: value}}``.
"""
from urllib.parse import unquote

DEFAULT = "<default>"

PRODUCER_BYTE_RATE = "producer_byte_rate"
CONSUMER_BYTE_RATE = "consumer_byte_rate"
REQUEST_RATE = "request_rate"
QUOTA_KEYS = (PRODUCER_BYTE_RATE, CONSUMER_BYTE_RATE, REQUEST_RATE)

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


def parse_quota_value(key, value):
    """Validate one quota value; returns a float > 0. Kafka accepts numbers as
    strings in ZooKeeper, so numeric strings are accepted too."""
    if key not in QUOTA_KEYS:
        raise ValueError(
            "unknown quota key %r (known: %s)" % (key, ", ".join(QUOTA_KEYS))
        )
    if isinstance(value, bool):
        raise ValueError("%s must be a number, got %r" % (key, value))
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("%s must be a number, got %r" % (key, value)) from None
    if not number > 0 or number == float("inf"):
        raise ValueError("%s must be a positive finite number, got %r" % (key, value))
    return number


def validate_quota_config(config, ignore_unknown=False):
    """``{key: value}`` -> ``{key: float}``. With ``ignore_unknown``, keys that
    are not quotas (a ZooKeeper user znode also holds SCRAM credentials) are
    skipped instead of refused."""
    out = {}
    for key, value in config.items():
        if key not in QUOTA_KEYS and ignore_unknown:
            continue
        out[key] = parse_quota_value(key, value)
    return out
