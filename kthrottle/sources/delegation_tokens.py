"""Delegation tokens the proxy creates for its clients' principals
(``--upstream-identity delegation-token``), so that each client's broker
connections log in as that client and the brokers' own ACLs, quotas and
audit logs see alice, not the proxy.

Kafka's delegation tokens (KIP-48) are SCRAM credentials a principal gets
from the cluster; since Kafka 3.3 a principal allowed CREATE_TOKENS on
``User:alice`` may create one whose owner is alice (KIP-373). The broker
connection then logs in with SCRAM, the token id as the user name, its HMAC
(base64) as the password, and the ``tokenauth=true`` extension; the broker
takes the connection as the token's owner.

Tokens are created with the proxy's own login (aiokafka on the event loop,
the upstream security settings), one per principal, kept, and replaced by a
new one once RENEW_AT of its life has passed (the old one expires on its
own). The cluster needs ``delegation.token.secret.key`` and a SCRAM listener.
"""
import asyncio
import base64
import io
import logging
import struct
import time
from typing import NamedTuple

from ..codecs.wire import encode_string, write_uvarint
from .async_kafka import PolledClient, aiokafka_config, connection_error, watch_aiokafka_errors
from .kafka_publisher import describe_connection

log = logging.getLogger("kthrottle.auth")

CREATE_DELEGATION_TOKEN = 38
VERSION = 3  # owner principal (KIP-373)
RENEW_AT = 0.8  # of a token's life: a new one is made after that
# a new token reaches the brokers through the cluster's metadata a moment after
# CreateDelegationToken is answered: the first login with it waits this long, and
# a refused login forgets a token only once it is older than YOUNG
SETTLE = 1.0
YOUNG = 30.0
TIMEOUT = 10.0
KEPT = 10_000  # principals' tokens kept; past that the oldest are made again when needed


class TokenRefused(Exception):
    """The cluster would not create the token; the message says why."""


class Token(NamedTuple):
    owner: str
    token_id: str
    password: str  # the HMAC, base64: SCRAM's password
    renew_after: float  # time.time() past which a new one is made
    expires: float
    created: float


# CreateDelegationToken v3, by hand: kafka-python has no codec for it --------------

def _compact_string(text):
    return b"\x00" if text is None else encode_string(text, True)


def create_token_body(owner_type, owner_name, max_lifetime_ms=-1):
    """CreateDelegationTokenRequest v3's body (CreateDelegationTokenRequest.json):
    the owner, no other renewers, the lifetime (-1: the cluster's default)."""
    return (_compact_string(owner_type) + _compact_string(owner_name) + write_uvarint(1)
            + struct.pack(">q", max_lifetime_ms) + b"\x00")


def _read_uvarint(buf):
    shift = n = 0
    while True:
        byte = buf.read(1)
        if not byte:
            raise ValueError("truncated varint")
        n |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return n
        shift += 7


def _read_compact(buf):
    n = _read_uvarint(buf)
    if n == 0:
        return None
    data = buf.read(n - 1)
    if len(data) != n - 1:
        raise ValueError("truncated field")
    return data


def _skip_tags(buf):
    for _ in range(_read_uvarint(buf)):
        _read_uvarint(buf)
        buf.read(_read_uvarint(buf))


class CreatedToken(NamedTuple):
    error_code: int
    principal_type: str
    principal_name: str
    issue_ms: int
    expiry_ms: int
    max_ms: int
    token_id: str
    hmac: bytes
    throttle_time_ms: int


def parse_create_token(buf):
    """CreateDelegationTokenResponse v3's body from ``buf`` (a file-like)."""
    error_code = struct.unpack(">h", buf.read(2))[0]
    principal_type = (_read_compact(buf) or b"").decode("utf-8")
    principal_name = (_read_compact(buf) or b"").decode("utf-8")
    _read_compact(buf)  # the requester's principal type and name (v3)
    _read_compact(buf)
    issue_ms, expiry_ms, max_ms = struct.unpack(">qqq", buf.read(24))
    token_id = (_read_compact(buf) or b"").decode("utf-8")
    hmac = _read_compact(buf) or b""
    throttle = struct.unpack(">i", buf.read(4))[0]
    _skip_tags(buf)
    return CreatedToken(error_code, principal_type, principal_name, issue_ms, expiry_ms,
                        max_ms, token_id, hmac, throttle)


class _Header(NamedTuple):
    correlation_id: int


class _CreateToken:
    """One CreateDelegationToken v3 as aiokafka's connection sends requests."""

    API_KEY = CREATE_DELEGATION_TOKEN
    API_VERSION = VERSION

    def __init__(self, owner):
        self.body = create_token_body("User", owner)
        self.RESPONSE_TYPE = self

    def prepare(self, versions):
        from aiokafka.errors import IncompatibleBrokerVersion

        low, high = versions.get(CREATE_DELEGATION_TOKEN, (0, -1))
        if not low <= VERSION <= high:
            raise IncompatibleBrokerVersion(
                "the broker does not create delegation tokens for other users "
                "(CreateDelegationToken v3, KIP-373, Kafka 3.3 and later)")
        return self

    def build_request_header(self, correlation_id, client_id):
        client = (client_id or "").encode("utf-8")
        header = struct.pack(">hhih", self.API_KEY, VERSION, correlation_id, len(client))
        return _Bytes(header + client + b"\x00")  # header v2: its tagged fields

    def encode(self):
        return self.body

    def parse_response_header(self, buffer):
        correlation_id = struct.unpack(">i", buffer.read(4))[0]
        _skip_tags(buffer)  # response header v1
        return _Header(correlation_id)

    def decode(self, buffer):
        return parse_create_token(buffer if hasattr(buffer, "read") else io.BytesIO(buffer))


class _Bytes:
    def __init__(self, data):
        self.data = data

    def encode(self):
        return self.data


class DelegationTokens(PolledClient):
    """Tokens for principals, created with the proxy's own login and kept."""

    noun = "delegation tokens"

    def __init__(self, bootstrap_servers, security, client_id="kthrottle", token=None,
                 clock=time.time):
        self.config = aiokafka_config(bootstrap_servers, client_id, security, TIMEOUT, token)
        self.secret = security.sasl_password
        self.describe = "the cluster at %s" % describe_connection(
            bootstrap_servers, security.security_protocol, security.sasl_mechanism,
            security.sasl_username, security.ssl_cert)
        self.clock = clock
        self.tokens = {}  # principal -> Token
        self._making = {}  # principal -> asyncio.Future of the Token being made
        self._client = None
        self.created = 0
        self.refused = 0

    def current(self, principal):
        """The principal's token if one is kept and not due for renewal, else None."""
        token = self.tokens.get(principal)
        if token is None or self.clock() >= token.renew_after:
            return None
        return token

    def forget(self, token):
        """A token the broker refused: made anew when next needed, unless it is
        young (not yet known to every broker, rather than expired or deleted)."""
        if self.tokens.get(token.owner) == token and self.clock() - token.created > YOUNG:
            del self.tokens[token.owner]

    async def get(self, principal):
        """The principal's token, made now if none is current (one creation
        at a time per principal). TokenRefused when the cluster says no."""
        token = self.current(principal)
        if token is not None:
            return token
        making = self._making.get(principal)
        if making is None:
            making = asyncio.ensure_future(self._create(principal))
            self._making[principal] = making
            making.add_done_callback(lambda _: self._making.pop(principal, None))
        return await asyncio.shield(making)

    async def _create(self, principal):
        from aiokafka.errors import for_code

        watch_aiokafka_errors()
        try:
            async with asyncio.timeout(TIMEOUT):
                client = await self._connected()
                answer = await client.send(client.get_random_node(), _CreateToken(principal))
        except (asyncio.TimeoutError, TimeoutError):
            await self._drop_client()
            raise TokenRefused(self._unreachable("no answer within %gs" % TIMEOUT)) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # aiokafka raises a variety; IncompatibleBrokerVersion too
            await self._drop_client()
            raise TokenRefused("cannot create a delegation token for User:%s at %s: %s"
                               % (principal, self.describe,
                                  connection_error(exc, self.secret))) from None
        if answer.error_code:
            self.refused += 1
            error = for_code(answer.error_code)
            hint = ""
            if error.__name__ in ("DelegationTokenAuthorizationFailedError",
                                  "DelegationTokenAuthorizationFailed"):
                hint = (" (the proxy's principal needs CREATE_TOKENS on User:%s: kafka-acls "
                        "--add --allow-principal <proxy> --operation CreateTokens "
                        "--user-principal User:%s)" % (principal, principal))
            raise TokenRefused("the cluster refused a delegation token for User:%s: %s%s"
                               % (principal, error.__name__, hint))
        now = self.clock()
        life = max((answer.expiry_ms - answer.issue_ms) / 1000.0, 1.0)
        token = Token(principal, answer.token_id,
                      base64.b64encode(answer.hmac).decode("ascii"),
                      now + RENEW_AT * life, answer.expiry_ms / 1000.0, now)
        self.created += 1
        log.info("delegation token %s created for User:%s (expires in %.0f s)",
                 token.token_id, principal, life)
        await asyncio.sleep(SETTLE)  # given out once the brokers are likely to know it
        if len(self.tokens) >= KEPT:
            self.tokens.clear()
        self.tokens[principal] = token
        return token
