"""What the SASL filters share: Kafka's SASL APIs and error codes, the
enabled mechanisms, and safe decoding of the SASL messages.

Three filters use it: ``sasl_terminate`` (the proxy verifies clients),
``sasl_passthrough`` (the broker verifies them, the proxy binds the user it
named) and ``upstream_login`` (the proxy's own login to the brokers).
"""
import struct
import warnings

from ...codecs import ProtocolError
from ..filter import GATHER, HEAD, NOTHING, REFUSED_UNAUTHENTICATED_REQUEST, Filter, Refuse

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.sasl import (
        SaslAuthenticateRequest,
        SaslAuthenticateResponse,
        SaslHandshakeRequest,
        SaslHandshakeResponse,
    )

SASL_HANDSHAKE = 17
SASL_AUTHENTICATE = 36
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
OAUTHBEARER = "OAUTHBEARER"  # KIP-255: a JWT in RFC 7628's message

# Kafka's error codes
UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
SASL_AUTHENTICATION_FAILED = 58

# KIP-306: connection.failed.authentication.delay.ms
DEFAULT_FAILED_AUTHENTICATION_DELAY_MS = 100

FAILED = "Authentication failed during authentication due to invalid credentials with SASL mechanism %s"


class ClientSasl(Filter):
    """What both modes share: the enabled mechanisms, the SASL APIs gathered
    whole, every request seen (HEAD) while the connection authenticates.
    ``mode`` is the --sasl-mode that selects the subclass."""

    mode = None
    reads = ("sasl_enabled", "sasl_mode", "sasl_enabled_mechanisms",
             "failed_authentication_delay_ms")

    @classmethod
    def build(cls, config, services):
        """On a SASL listener in this filter's --sasl-mode."""
        if not config.sasl_enabled or config.sasl_mode != cls.mode:
            return None
        return cls(config.sasl_enabled_mechanisms,
                   failed_delay_ms=config.failed_authentication_delay_ms,
                   **cls.arguments(config, services))

    @classmethod
    def arguments(cls, config, services):
        """What else the subclass is made with, from its options and the
        proxy's services (keywords)."""
        return {}

    def __init__(self, mechanisms, failed_delay_ms):
        unknown = [m for m in mechanisms if m not in MECHANISMS]
        if unknown or not mechanisms:
            raise ValueError("SASL mechanisms must be among %s, got %s"
                             % (", ".join(MECHANISMS), ", ".join(mechanisms) or "none"))
        self.mechanisms = tuple(mechanisms)
        self.failed_delay_ms = failed_delay_ms
        # logins by mechanism, for /metrics (Kafka's successful- and
        # failed-authentication-total); "none": failed before one was agreed
        self.successful_logins = dict.fromkeys(self.mechanisms, 0)
        self.failed_logins = dict.fromkeys(self.mechanisms + ("none",), 0)

    def request_need(self, api_key, api_version):
        # after authentication: only a second exchange concerns this filter
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else NOTHING

    def authenticating_need(self, api_key, api_version):
        return GATHER if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else HEAD

    def failed(self, ctx, reason):
        self.count_login(self.mechanism_of(ctx.state), False)
        ctx.fail_authentication("authentication failed: %s" % reason, self.failed_delay_ms)

    def metrics(self, family):
        """Logins by mechanism (Kafka's successful- and
        failed-authentication-total)."""
        successful = family("kthrottle_successful_authentication_total")
        failed = family("kthrottle_failed_authentication_total")
        mechanisms = list(self.mechanisms) + sorted(set(self.failed_logins) - set(self.mechanisms))
        for mechanism in mechanisms:
            if mechanism in self.mechanisms:
                successful.add_metric([mechanism], self.successful_logins.get(mechanism, 0))
            failed.add_metric([mechanism], self.failed_logins.get(mechanism, 0))
        return (successful, failed)

    def count_login(self, mechanism, ok):
        if ok:
            self.successful_logins[mechanism] += 1
        else:
            self.failed_logins[mechanism if mechanism in self.mechanisms else "none"] += 1

    def mechanism_of(self, state):
        """The mechanism of the connection's exchange under way (None: none
        agreed)."""
        return state.mechanism


def before_authentication(head):
    return Refuse("request api key %d v%d before authentication"
                  % (head.api_key, head.api_version), REFUSED_UNAUTHENTICATED_REQUEST)


# what kafka-python's decoders raise on malformed bytes (a null field then
# makes a TypeError of what reads it)
_DECODE_ERRORS = (struct.error, IndexError, ValueError, TypeError, UnicodeDecodeError)


def decode(cls, buf, **kwargs):
    """A SASL request or answer decoded; malformed bytes are the codec's
    ProtocolError (the connection closes with the reason), never another
    exception."""
    try:
        message = cls.decode(bytes(buf), **kwargs)
    except _DECODE_ERRORS as exc:
        raise ProtocolError("malformed %s: %s" % (cls.__name__, exc)) from None
    if getattr(message, "mechanism", "") is None:
        raise ProtocolError("malformed %s: a null mechanism" % cls.__name__)
    return message


def auth_bytes(request):
    token = request.auth_bytes
    if token is None:  # a null BYTES field: no token at all
        raise ProtocolError("malformed SaslAuthenticate request: null auth_bytes")
    return bytes(token)
