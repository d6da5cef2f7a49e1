"""throttle_time_ms in every response that has one (kthrottle/codecs/throttle.py),
checked on real responses: kafka-python's schema classes filled generically
(kthrottle_testkit.frames.filled_response), every field set, arrays non-empty."""
import random

import pytest

from kthrottle.codecs import ProtocolError, apis, unsupported_api_versions_response
from kthrottle.codecs.frames import HEAD_SIZE
from kthrottle.codecs.throttle import (
    INT32_MAX,
    WALK,
    _OFFSETS,
    raise_throttle_time,
    throttle_time_at,
    throttle_time_offset,
    throttle_time_patch,
)
from kthrottle.codecs.wire import INT32
from kthrottle_testkit.frames import filled_response

pytestmark = pytest.mark.unit

THROTTLE = 12345
OTHER = 0x0A0B0C0D  # differs from THROTTLE in each of its 4 bytes

# Every (api key, version) whose response has throttle_time_ms, per
# kafka-python's schemas (the table throttle.py builds; ShareFetch and
# ShareAcknowledge, which they lack, are checked in tests/test_share_codec.py).
CASES = sorted(case for case in _OFFSETS if case[0] in apis.ALL_RESPONSES)

# (api key, version) -> why the generic filler cannot build it. Empty: all
# build. A test fails if this set changes (new kafka-python, new schemas).
KNOWN_UNBUILDABLE = {}

BUILDABLE = [case for case in CASES if case not in KNOWN_UNBUILDABLE]
WALKED = [case for case in CASES if _OFFSETS[case] is WALK]


def case_id(case):
    return "%s-v%d" % (apis.ALL_RESPONSES[case[0]].name, case[1])


def build(api_key, version, throttle_ms=THROTTLE, repeat=1):
    return filled_response(apis.ALL_RESPONSES[api_key], version, repeat=repeat,
                           throttle_time_ms=throttle_ms)


def decode(api_key, version, frame):
    return apis.ALL_RESPONSES[api_key].decode(frame, version=version, header=True, framed=True)


def field_offset(api_key, version, repeat=1):
    """Where the field is, found without the codec: the only bytes that
    differ between two builds that differ only in throttle_time_ms."""
    a, b = build(api_key, version, THROTTLE, repeat), build(api_key, version, OTHER, repeat)
    assert len(a) == len(b)
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    assert diff == list(range(diff[0], diff[0] + 4))
    return a, diff[0]


def reframe(frame, cut):
    body = frame[4:cut]
    return len(body).to_bytes(4, "big") + body


def test_the_table_covers_every_api_kafka_python_knows():
    assert len(CASES) > 200
    assert {k for k, _ in CASES} >= {0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 22,
                                     60, 75}
    # variable-length data before the field only in Produce and ApiVersions,
    # which throttle.py walks
    assert {k for k, _ in WALKED} == {apis.PRODUCE, apis.API_VERSIONS}


def test_the_list_of_responses_that_cannot_be_built_does_not_grow():
    failures = {}
    for api_key, version in CASES:
        try:
            build(api_key, version)
        except Exception as exc:  # anything kafka-python or the filler raises
            failures[api_key, version] = repr(exc)
    assert failures.keys() == KNOWN_UNBUILDABLE.keys(), failures


@pytest.mark.parametrize("case", BUILDABLE, ids=case_id)
def test_throttle_time_is_found_raised_and_patched_in_place(case):
    api_key, version = case
    frame, where = field_offset(api_key, version)
    assert len(frame) > 12  # a real body, not just a header

    pos = throttle_time_at(frame, api_key, version)
    assert pos == where
    assert INT32.unpack_from(frame, pos)[0] == THROTTLE
    offset = throttle_time_offset(api_key, version)
    if offset is not WALK:  # fixed: from the start of the body
        body = filled_response(apis.ALL_RESPONSES[api_key], version, framed=False,
                               throttle_time_ms=THROTTLE)
        assert frame.endswith(body) and pos == len(frame) - len(body) + offset

    # raised: only those 4 bytes change, and the response says the new value
    raised = raise_throttle_time(frame, api_key, version, 54321)
    assert len(raised) == len(frame)
    assert raised[:pos] == frame[:pos] and raised[pos + 4 :] == frame[pos + 4 :]
    before, after = decode(api_key, version, frame), decode(api_key, version, raised)
    assert after.throttle_time_ms == 54321
    after.throttle_time_ms = THROTTLE
    assert after == before
    # never lowered, capped at the int32 maximum
    assert raise_throttle_time(frame, api_key, version, THROTTLE) is None
    assert raise_throttle_time(frame, api_key, version, 100) is None
    capped = raise_throttle_time(bytearray(frame), api_key, version, 2**40)
    assert decode(api_key, version, capped).throttle_time_ms == INT32_MAX

    # cut-through: the field is patched in the head only when it lies there
    head = frame[: min(len(frame), HEAD_SIZE)]
    assert throttle_time_patch(head, api_key, version) == pos
    for size in range(4, len(frame) + 1):
        expected = pos if pos + 4 <= size else None
        assert throttle_time_patch(memoryview(frame)[:size], api_key, version) == expected, size


@pytest.mark.parametrize("case", WALKED, ids=case_id)
def test_a_walked_field_beyond_the_head_is_left_for_the_whole_frame(case):
    api_key, version = case
    frame, where = field_offset(api_key, version, repeat=100)
    assert where > HEAD_SIZE
    assert throttle_time_patch(frame[:HEAD_SIZE], api_key, version) is None
    assert throttle_time_at(frame, api_key, version) == where
    raised = raise_throttle_time(frame, api_key, version, 99999)
    assert decode(api_key, version, raised).throttle_time_ms == 99999


@pytest.mark.parametrize("case", BUILDABLE, ids=case_id)
def test_truncated_frames_raise_protocol_error(case):
    api_key, version = case
    frame = build(api_key, version)
    pos = throttle_time_at(frame, api_key, version)
    for cut in range(8, pos + 4):
        with pytest.raises(ProtocolError):
            throttle_time_at(reframe(frame, cut), api_key, version)
        with pytest.raises(ProtocolError):
            raise_throttle_time(reframe(frame, cut), api_key, version, 99999)
        # a head that is the whole (short) frame is garbled; a partial one is not
        assert throttle_time_patch(frame[:cut], api_key, version) is None
        with pytest.raises(ProtocolError):
            throttle_time_patch(reframe(frame, cut), api_key, version)
    with pytest.raises(ProtocolError):  # the size prefix disagrees with the bytes
        throttle_time_at(frame[:-1], api_key, version)
    with pytest.raises(ProtocolError):
        throttle_time_at(frame[:7], api_key, version)


@pytest.mark.parametrize("case", WALKED, ids=case_id)
def test_garbled_walks_raise_only_protocol_error(case):
    api_key, version = case
    rng = random.Random(api_key * 100 + version)
    frame = build(api_key, version, repeat=3)
    for _ in range(300):
        garbled = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            garbled[rng.randrange(8, len(garbled))] = rng.randrange(256)
        for call in (lambda: throttle_time_at(garbled, api_key, version),
                     lambda: throttle_time_patch(garbled[:40], api_key, version),
                     lambda: raise_throttle_time(garbled, api_key, version, 5000)):
            try:
                result = call()
            except ProtocolError:
                continue
            assert result is None or isinstance(result, (int, bytes))
            if isinstance(result, int):
                assert 8 <= result <= len(garbled) - 4


def test_responses_without_the_field_are_left_alone():
    checked = 0
    for api_key, cls in apis.ALL_RESPONSES.items():
        for version in range(cls.max_version + 1):
            if (api_key, version) in _OFFSETS:
                continue
            frame = filled_response(cls, version)
            assert throttle_time_offset(api_key, version) is None
            assert throttle_time_at(frame, api_key, version) is None
            assert raise_throttle_time(frame, api_key, version, 99999) is None
            assert throttle_time_patch(frame[:HEAD_SIZE], api_key, version) is None
            checked += 1
    assert checked >= 30  # Fetch v0, Metadata v0-2, ApiVersions v0, SaslHandshake...
    # and versions or APIs kafka-python does not know: nothing is guessed
    frame = build(apis.FETCH, 4)
    for api_key, version in [(apis.FETCH, 99), (9999, 0)]:
        assert throttle_time_at(frame, api_key, version) is None
        assert throttle_time_patch(frame, api_key, version) is None


@pytest.mark.parametrize("version", range(1, apis.MAX_DECODABLE_VERSION[apis.API_VERSIONS] + 1))
def test_api_versions_unsupported_version_answer_has_no_throttle_time(version):
    # Asked with a version it does not know, a broker answers in the v0
    # layout (KIP-511): error 35 and the versions to retry with, no
    # throttle_time_ms, whatever version was asked for.
    ours = unsupported_api_versions_response(5)
    cls = apis.ALL_RESPONSES[apis.API_VERSIONS]
    broker = cls[0](error_code=35, api_keys=[cls.ApiVersion(api_key=18, min_version=0, max_version=3)])
    broker.with_header(correlation_id=6)
    broker = bytes(broker.encode(header=True, framed=True))
    for frame in (ours, broker):
        assert decode(apis.API_VERSIONS, version, frame).error_code == 35  # kafka-python reads it as v0
        assert throttle_time_at(frame, apis.API_VERSIONS, version) is None
        assert raise_throttle_time(frame, apis.API_VERSIONS, version, 99999) is None
        assert throttle_time_patch(frame, apis.API_VERSIONS, version) is None
    # a successful answer of the same version does have it
    ok = build(apis.API_VERSIONS, version)
    assert INT32.unpack_from(ok, throttle_time_at(ok, apis.API_VERSIONS, version))[0] == THROTTLE
