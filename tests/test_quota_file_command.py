"""``kthrottle quotas`` against a TOML quota file, as a process (the file itself, no I/O:
test_quota_file.py)."""
import tomllib

import pytest

from kthrottle.policy.entities import CONSUMER_BYTE_RATE, PRODUCER_BYTE_RATE
from kthrottle.policy.quota_file import snapshot_from_document
from kthrottle_testkit.clients import kthrottle_quotas
from test_quota_file import HAND_WRITTEN, assert_kept

pytestmark = pytest.mark.integration


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


def test_the_quotas_command_keeps_the_operators_comments(tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text(HAND_WRITTEN)
    out = kthrottle_quotas("alter", "--quota-file", str(path), "--entity-type", "users",
                           "--entity-name", "bob", "--entity-type", "clients", "--entity-name",
                           "etl", "--add-config", "producer_byte_rate=1024")
    assert out.returncode == 0, out.stderr
    out = kthrottle_quotas("delete", "--quota-file", str(path), "--entity-type", "clients",
                           "--entity-name", "reporting")
    assert out.returncode == 0, out.stderr
    after = path.read_text()
    assert "[users.bob.clients.etl]\nproducer_byte_rate = 1024\n" in after
    expected = snapshot_from_document(tomllib.loads(HAND_WRITTEN))
    del expected["clients/reporting"]
    expected["users/bob/clients/etl"] = {PRODUCER_BYTE_RATE: 1024.0}
    assert_kept(HAND_WRITTEN, after, {"clients/reporting"}, expected)
