"""The TOML quota file (no I/O) and ``kthrottle quotas`` against a file."""
import tomllib

import pytest

from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE, REQUEST_RATE
from kthrottle.policy.quota_file import (
    QuotaFileError,
    altered,
    document_text,
    snapshot_from_document,
)
from kthrottle.policy.quotas import QuotaConfig
from quota_clients import kthrottle_quotas

EXAMPLE = """
[users.alice]
producer_byte_rate = 1048576
[users.alice.clients.app]
request_rate = 50.5
[users."<default>"]
consumer_byte_rate = 2097152
[users."<default>".clients."<default>"]
producer_byte_rate = 1000
[users."CN=bob,O=x y"]
producer_byte_rate = 7
[clients.reporting]
consumer_byte_rate = 300
[clients."<default>"]
request_rate = 20
[static]
"quota.producer.default" = 10485760
"quota.consumer.default" = 20971520
"""


def test_every_level_of_the_file_becomes_its_kafka_entity_path():
    snapshot = snapshot_from_document(tomllib.loads(EXAMPLE))
    assert snapshot == {
        "users/alice": {PRODUCER_BYTE_RATE: 1048576.0},
        "users/alice/clients/app": {REQUEST_RATE: 50.5},
        "users/<default>": {CONSUMER_BYTE_RATE: 2097152.0},
        "users/<default>/clients/<default>": {PRODUCER_BYTE_RATE: 1000.0},
        "users/CN%3Dbob%2CO%3Dx%20y": {PRODUCER_BYTE_RATE: 7.0},
        "clients/reporting": {CONSUMER_BYTE_RATE: 300.0},
        "clients/<default>": {REQUEST_RATE: 20.0},
        "static": {PRODUCER_BYTE_RATE: 10485760.0, CONSUMER_BYTE_RATE: 20971520.0},
    }
    config = QuotaConfig(snapshot)
    assert config.resolve("alice", "app", REQUEST_RATE).entity == "users/alice/clients/app"
    assert config.resolve("alice", "other", PRODUCER_BYTE_RATE).entity == "users/alice"
    assert config.resolve("CN=bob,O=x y", "c", PRODUCER_BYTE_RATE).limit == 7.0


def test_written_text_reads_back_as_the_same_snapshot():
    snapshot = snapshot_from_document(tomllib.loads(EXAMPLE))
    text = document_text(snapshot)
    assert snapshot_from_document(tomllib.loads(text)) == snapshot
    assert "[users.alice.clients.app]\nrequest_rate = 50.5\n" in text
    assert text.index("[users.alice]") < text.index('[users."<default>"]') < text.index("[clients")


@pytest.mark.parametrize("text,message", [
    ("[users.a]\nproducer_byte_rate = 0\n", 'users."a"]: producer_byte_rate must be a positive'),
    ("[users.a]\nproducer_byte_rate = true\n", "must be a number"),
    ("[clients.a]\nrequest_percentage = 5\n", "unknown quota key 'request_percentage'"),
    ("[users.a.topics.b]\nx = 1\n", "unknown table 'topics'"),
    ("[clients.a.clients.b]\nrequest_rate = 1\n", "unexpected table 'clients'"),
    ("[static]\n\"quota.request.default\" = 1\n", "[static]: unknown key 'quota.request.default'"),
    ("users = 5\n", "[users] must be a table"),
    ("[groups.a]\nx = 1\n", "unknown section 'groups'"),
])
def test_bad_files_name_the_place_and_the_reason(text, message):
    with pytest.raises(QuotaFileError) as err:
        snapshot_from_document(tomllib.loads(text))
    assert message in str(err.value)


def test_altered_validates_before_changing_anything():
    config = {PRODUCER_BYTE_RATE: 10.0, REQUEST_RATE: 5.0}
    assert altered(config, {"consumer_byte_rate": "20"}, [REQUEST_RATE]) == {
        PRODUCER_BYTE_RATE: 10.0, CONSUMER_BYTE_RATE: 20.0}
    for add, delete in (({"nope": 1}, []), ({}, ["nope"]), ({REQUEST_RATE: "x"}, []),
                        ({REQUEST_RATE: 1}, [REQUEST_RATE])):
        with pytest.raises(ValueError):
            altered(config, add, delete)
    assert config == {PRODUCER_BYTE_RATE: 10.0, REQUEST_RATE: 5.0}


def test_quotas_command_alters_describes_and_deletes_in_a_file(tmp_path):
    path = str(tmp_path / "quotas.toml")
    out = kthrottle_quotas("alter", "--quota-file", path, "--entity-type", "users", "--entity-name",
                           "alice", "--entity-type", "clients", "--entity-default",
                           "--add-config", "producer_byte_rate=1024,request_rate=50")
    assert out.returncode == 0, out.stderr
    assert "user-principal 'alice', the default client-id" in out.stdout
    # the other order of the flags names the same entity
    out = kthrottle_quotas("alter", "--quota-file", path, "--entity-type", "clients",
                           "--entity-default", "--entity-type", "users", "--entity-name", "alice",
                           "--delete-config", "request_rate")
    assert out.returncode == 0, out.stderr
    out = kthrottle_quotas("alter", "--quota-file", path, "--entity-type", "clients",
                           "--entity-name", "etl", "--add-config", "consumer_byte_rate=4096")
    assert out.returncode == 0, out.stderr
    with open(path, "rb") as f:
        assert snapshot_from_document(tomllib.load(f)) == {
            "users/alice/clients/<default>": {PRODUCER_BYTE_RATE: 1024.0},
            "clients/etl": {CONSUMER_BYTE_RATE: 4096.0},
        }
    out = kthrottle_quotas("describe", "--quota-file", path, "--entity-type", "clients")
    assert out.stdout == "Quotas for client-id 'etl' are consumer_byte_rate=4096\n"

    before = open(path).read()
    for args, message in (
        (["alter", "--entity-type", "clients", "--entity-name", "etl",
          "--add-config", "consumer_byte_rate=fast"], "consumer_byte_rate must be a number"),
        (["alter", "--entity-type", "clients", "--entity-name", "etl",
          "--add-config", "bytes=1"], "unknown quota key 'bytes'"),
        (["alter", "--entity-type", "clients", "--add-config", "request_rate=1"],
         "name the entity"),
        (["alter", "--entity-type", "clients", "--entity-name", "etl"], "needs --add-config"),
        (["alter", "--entity-name", "etl", "--add-config", "request_rate=1"],
         "needs an --entity-type"),
    ):
        out = kthrottle_quotas(args[0], "--quota-file", path, *args[1:])
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert open(path).read() == before  # nothing written

    out = kthrottle_quotas("delete", "--quota-file", path, "--entity-type", "clients",
                           "--entity-name", "etl")
    assert out.returncode == 0, out.stderr
    out = kthrottle_quotas("describe", "--quota-file", path)
    assert out.stdout == ("Quotas for user-principal 'alice', the default client-id are "
                          "producer_byte_rate=1024\n")
