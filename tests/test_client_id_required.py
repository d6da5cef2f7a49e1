"""``--client-id-required`` and ``--client-id-pattern``
(``proxy/filters/client_id_required.py``, the example of a filter added by
its module, its registration, its docs page and its tests) in a whole
pipeline without I/O: a request without a client.id, or with one that does
not match, closes its connection and reaches no broker."""
import struct

import pytest

from kthrottle.codecs import apis
from kthrottle.config import ConfigError, build_config, load_toml
from kthrottle.proxy import filters as registry
from kthrottle.proxy.filter import Services
from kthrottle.proxy.filters.client_id_required import (
    REFUSED_CLIENT_ID_REQUIRED,
    ClientIdRequired,
    parse_pattern,
)
from test_pipeline import (
    Harness,
    advertise,
    cids,
    metadata_req,
    metadata_resp,
    produce_req,
    produce_resp,
    raw_request,
    req_cids,
)

pytestmark = pytest.mark.unit

BASE = {"bootstrap_servers": [("127.0.0.1", 9)]}


def harness(pattern=None):
    return Harness(filters=registry.standard_filters(advertise) + [ClientIdRequired(pattern)])


def null_client_id_request(cid, api_key=apis.METADATA, version=1, body=b"\x00\x00\x00\x00"):
    """A request header whose client_id is null (length -1), as Kafka allows."""
    payload = struct.pack(">hhih", api_key, version, cid, -1) + body
    return struct.pack(">i", len(payload)) + payload


def built(**values):
    services = Services()
    services.advertise = advertise
    return [f.name for f in registry.build_filters(build_config({}, dict(BASE, **values)),
                                                   services)]


# the configuration -------------------------------------------------------------------

def test_it_is_built_only_when_asked_for():
    assert "client-id-required" not in built()
    assert "client-id-required" in built(client_id_required=True)
    assert "client-id-required" in built(client_id_pattern=parse_pattern("app-.*"))


def test_the_options_are_flags_and_toml_keys(tmp_path):
    from kthrottle.cli import make_parser

    args = make_parser().parse_args(["proxy", "--client-id-required",
                                     "--client-id-pattern", "^app-[0-9]+$"])
    assert args.client_id_required is True and args.client_id_pattern.pattern == "^app-[0-9]+$"
    path = tmp_path / "kthrottle.toml"
    path.write_text('bootstrap-server = ["127.0.0.1:9092"]\nclient-id-required = true\n'
                    'client-id-pattern = "svc-.*"\n')
    config = build_config(load_toml(path), {})
    assert config.client_id_required is True and config.client_id_pattern.pattern == "svc-.*"
    path.write_text('bootstrap-server = ["127.0.0.1:9092"]\nclient-id-pattern = "svc-("\n')
    with pytest.raises(ConfigError, match="client-id-pattern: 'svc-\\(' is not a regular"):
        load_toml(path)


# in the pipeline ---------------------------------------------------------------------

def test_requests_with_a_client_id_pass_as_they_are():
    h = harness()
    h.client(metadata_req(1, client_id="app-1") + produce_req(2, client_id="app-1"))
    assert req_cids(h.take_broker()) == [1, 2] and h.closed is None
    h.broker(metadata_resp(1) + produce_resp(2))
    assert cids(h.take_client()) == [1, 2]


@pytest.mark.parametrize("request_frame", [
    raw_request(7, apis.METADATA, 1, b"\x00\x00\x00\x00", client_id=b""),
    null_client_id_request(7),
], ids=["empty", "null"])
def test_a_request_without_a_client_id_closes_its_connection_and_reaches_no_broker(
        request_frame):
    h = harness()
    h.client(metadata_req(1))
    h.client(request_frame)
    assert req_cids(h.take_broker()) == [1]  # the one before it went on
    assert h.refused == REFUSED_CLIENT_ID_REQUIRED
    assert "no client.id (api key 3 v1, principal ANONYMOUS)" in h.closed


def test_a_produce_without_a_client_id_is_refused_too():
    h = harness()
    h.client(produce_req(1, client_id=""))
    assert h.take_broker() == b"" and h.refused == REFUSED_CLIENT_ID_REQUIRED


def test_with_a_pattern_the_whole_client_id_must_match():
    h = harness(parse_pattern("app-[0-9]+"))
    h.client(metadata_req(1, client_id="app-42"))
    assert req_cids(h.take_broker()) == [1] and h.closed is None
    h.client(metadata_req(2, client_id="app-42-canary"))  # matches a prefix only
    assert h.take_broker() == b"" and h.refused == REFUSED_CLIENT_ID_REQUIRED
    assert "client.id 'app-42-canary' does not match --client-id-pattern app-[0-9]+" in h.closed
