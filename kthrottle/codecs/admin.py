"""The quota and SCRAM admin APIs the proxy can answer itself: KIP-546
(DescribeClientQuotas 48, AlterClientQuotas 49) and KIP-554
(DescribeUserScramCredentials 50, AlterUserScramCredentials 51).

Requests are decoded and answers encoded with kafka-python's schema-generated
classes (every version, flexible ones included); what a malformed request
makes them raise becomes the codecs' ProtocolError. Requests come out as plain
tuples, answers go in as plain tuples: no kafka-python object leaves here.
"""
import struct
import warnings
from typing import NamedTuple

from ..redacted import redacted_repr
from .errors import ProtocolError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from kafka.protocol.admin import (
        AlterClientQuotasRequest,
        AlterClientQuotasResponse,
        AlterUserScramCredentialsRequest,
        AlterUserScramCredentialsResponse,
        DescribeClientQuotasRequest,
        DescribeClientQuotasResponse,
        DescribeUserScramCredentialsRequest,
        DescribeUserScramCredentialsResponse,
    )

DESCRIBE_CLIENT_QUOTAS = 48
ALTER_CLIENT_QUOTAS = 49
DESCRIBE_USER_SCRAM_CREDENTIALS = 50
ALTER_USER_SCRAM_CREDENTIALS = 51

_REQUESTS = {
    DESCRIBE_CLIENT_QUOTAS: DescribeClientQuotasRequest,
    ALTER_CLIENT_QUOTAS: AlterClientQuotasRequest,
    DESCRIBE_USER_SCRAM_CREDENTIALS: DescribeUserScramCredentialsRequest,
    ALTER_USER_SCRAM_CREDENTIALS: AlterUserScramCredentialsRequest,
}
_RESPONSES = {
    DESCRIBE_CLIENT_QUOTAS: DescribeClientQuotasResponse,
    ALTER_CLIENT_QUOTAS: AlterClientQuotasResponse,
    DESCRIBE_USER_SCRAM_CREDENTIALS: DescribeUserScramCredentialsResponse,
    ALTER_USER_SCRAM_CREDENTIALS: AlterUserScramCredentialsResponse,
}
QUOTA_APIS = (DESCRIBE_CLIENT_QUOTAS, ALTER_CLIENT_QUOTAS)
SCRAM_APIS = (DESCRIBE_USER_SCRAM_CREDENTIALS, ALTER_USER_SCRAM_CREDENTIALS)

# the versions the proxy answers: every one kafka-python's schemas (Kafka's
# own JSON) describe, for requests and answers alike
VERSIONS = {key: (max(cls.min_version, _RESPONSES[key].min_version),
                  min(cls.max_version, _RESPONSES[key].max_version))
            for key, cls in _REQUESTS.items()}

# requests, as plain values ---------------------------------------------------

class Component(NamedTuple):
    """A DescribeClientQuotas filter component."""

    entity_type: str
    match_type: int  # 0 exact, 1 default, 2 any
    match: str | None


class DescribeQuotas(NamedTuple):
    components: tuple
    strict: bool


class QuotaOp(NamedTuple):
    key: str
    value: float
    remove: bool


class QuotaAlteration(NamedTuple):
    entity: tuple  # ((entity type, name or None for the default), ...)
    ops: tuple  # QuotaOp, ...


class AlterQuotas(NamedTuple):
    entries: tuple  # QuotaAlteration, ...
    validate_only: bool


class ScramDeletion(NamedTuple):
    name: str
    mechanism: int


class ScramUpsertion(NamedTuple):
    name: str
    mechanism: int
    iterations: int
    salt: bytes
    salted_password: bytes

    __repr__ = redacted_repr("name", "mechanism", "iterations")


class AlterScram(NamedTuple):
    deletions: tuple
    upsertions: tuple


# what kafka-python's decoders raise on malformed bytes (a null where a value
# must be makes a TypeError or AttributeError of what reads it)
_DECODE_ERRORS = (struct.error, IndexError, ValueError, TypeError, AttributeError,
                  UnicodeDecodeError, KeyError)


def _text(value, what):
    if not isinstance(value, str):
        raise ProtocolError("malformed request: null %s" % what)
    return value


def decode_request(api_key, api_version, frame):
    """A framed request of one of the four APIs -> DescribeQuotas,
    AlterQuotas, a tuple of user names (None: every user) for
    DescribeUserScramCredentials, or AlterScram. ProtocolError when it does
    not decode."""
    cls = _REQUESTS[api_key]
    name = cls.__name__
    try:
        request = cls[api_version].decode(bytes(frame[4:]), header=True)
        if api_key == DESCRIBE_CLIENT_QUOTAS:
            components = tuple(Component(_text(c.entity_type, "entity_type"), int(c.match_type),
                                         c.match) for c in _list(request.components))
            return DescribeQuotas(components, bool(request.strict))
        if api_key == ALTER_CLIENT_QUOTAS:
            entries = tuple(
                QuotaAlteration(
                    tuple((_text(e.entity_type, "entity_type"), e.entity_name)
                          for e in _list(entry.entity)),
                    tuple(QuotaOp(_text(op.key, "key"), float(op.value), bool(op.remove))
                          for op in _list(entry.ops)))
                for entry in _list(request.entries))
            return AlterQuotas(entries, bool(request.validate_only))
        if api_key == DESCRIBE_USER_SCRAM_CREDENTIALS:
            if request.users is None:
                return None
            return tuple(_text(u.name, "user name") for u in request.users)
        deletions = tuple(ScramDeletion(_text(d.name, "user name"), int(d.mechanism))
                          for d in _list(request.deletions))
        upsertions = tuple(
            ScramUpsertion(_text(u.name, "user name"), int(u.mechanism), int(u.iterations),
                           bytes(u.salt or b""), bytes(u.salted_password or b""))
            for u in _list(request.upsertions))
        return AlterScram(deletions, upsertions)
    except ProtocolError as exc:
        raise ProtocolError("malformed %s v%d: %s" % (name, api_version, exc)) from None
    except _DECODE_ERRORS as exc:
        raise ProtocolError("malformed %s v%d: %s" % (name, api_version, exc)) from None


def _list(items):
    if items is None:  # none of these arrays is nullable (the JSON schemas)
        raise ProtocolError("a null array")
    return items


# answers -----------------------------------------------------------------------

def _framed(message, correlation_id):
    message.with_header(correlation_id=correlation_id)
    return bytes(message.encode(header=True, framed=True))


def _entity(cls, entity):
    return [cls(entity_type=t, entity_name=n) for t, n in entity]


def describe_quotas_response(version, correlation_id, entries, error_code=0,
                             error_message=None):
    """``entries``: ((entity, ((key, value), ...)), ...) with entity as in
    QuotaAlteration; None (with an error) for no entries at all."""
    cls = DescribeClientQuotasResponse[version]
    entry_cls = cls.EntryData
    data = None
    if entries is not None:
        data = [entry_cls(entity=_entity(entry_cls.EntityData, entity),
                          values=[entry_cls.ValueData(key=k, value=float(v)) for k, v in values])
                for entity, values in entries]
    return _framed(cls(throttle_time_ms=0, error_code=error_code, error_message=error_message,
                       entries=data), correlation_id)


def alter_quotas_response(version, correlation_id, results):
    """``results``: ((entity, error_code, error_message), ...), one per entry."""
    cls = AlterClientQuotasResponse[version]
    entry_cls = cls.EntryData
    data = [entry_cls(error_code=code, error_message=message,
                      entity=_entity(entry_cls.EntityData, entity))
            for entity, code, message in results]
    return _framed(cls(throttle_time_ms=0, entries=data), correlation_id)


def describe_scram_response(version, correlation_id, results, error_code=0,
                            error_message=None):
    """``results``: ((user, error_code, error_message, ((mechanism type,
    iterations), ...)), ...)."""
    cls = DescribeUserScramCredentialsResponse[version]
    result_cls = cls.DescribeUserScramCredentialsResult
    data = [result_cls(user=user, error_code=code, error_message=message,
                       credential_infos=[result_cls.CredentialInfo(mechanism=m, iterations=i)
                                         for m, i in infos])
            for user, code, message, infos in results]
    return _framed(cls(throttle_time_ms=0, error_code=error_code, error_message=error_message,
                       results=data), correlation_id)


def alter_scram_response(version, correlation_id, results):
    """``results``: ((user, error_code, error_message), ...)."""
    cls = AlterUserScramCredentialsResponse[version]
    result_cls = cls.AlterUserScramCredentialsResult
    data = [result_cls(user=user, error_code=code, error_message=message)
            for user, code, message in results]
    return _framed(cls(throttle_time_ms=0, results=data), correlation_id)


def refusal(api_key, version, correlation_id, request, error_code, message):
    """The answer a broker gives when every part of ``request`` (decoded) is
    refused with the same error: per entry, per user, as Kafka's handlers
    answer an unauthorized request."""
    if api_key == DESCRIBE_CLIENT_QUOTAS:
        return describe_quotas_response(version, correlation_id, None, error_code, message)
    if api_key == ALTER_CLIENT_QUOTAS:
        return alter_quotas_response(version, correlation_id,
                                     [(e.entity, error_code, message) for e in request.entries])
    if api_key == DESCRIBE_USER_SCRAM_CREDENTIALS:
        return describe_scram_response(version, correlation_id, [], error_code, message)
    users = []
    for item in request.deletions + request.upsertions:
        if item.name not in users:
            users.append(item.name)
    return alter_scram_response(version, correlation_id,
                                [(user, error_code, message) for user in users])
