"""The TOML quota file (no I/O; ``kthrottle quotas`` against a file:
test_quota_file_command.py)."""
import tomllib

import pytest

from kthrottle.policy.entities import (
    CONSUMER_BYTE_RATE,
    DEFAULT,
    PRODUCER_BYTE_RATE,
    REQUEST_RATE,
    entity_path,
)
from kthrottle.policy.quota_file import (
    QuotaFileError,
    altered,
    document_text,
    snapshot_from_document,
)
from kthrottle.policy.quotas import QuotaConfig
from kthrottle.sources import QuotaStoreError
from kthrottle.sources.file import FileQuotaStore

pytestmark = pytest.mark.unit

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
    ("[teams.a]\nx = 1\n", "unknown section 'teams'"),
    ("[groups.a]\nproducer_byte_rate = 1\n", "[groups.\"a\"]: members must be a list"),
    ("[groups.a]\nmembers = [\"alice\"]\nproducer_byte_rate = 1\n",
     "a group member is User:<principal> or client-id:<client-id>"),
    ("[groups.a]\nmembers = [\"User:alice\"]\n", "[groups.\"a\"]: no quota"),
    ("[groups.a]\nmembers = [\"User:alice\"]\nconnection_creation_rate = 1\n",
     "connection_creation_rate is not a quota of client entities"),
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


# An operator's file: comments everywhere, clients before users, no blank
# line in places. TABLES are its tables as written, by entity path.
TABLES = {
    "clients/reporting": "[clients.reporting]\nconsumer_byte_rate = 300  # 300 B/s\n",
    "users/alice": ("[users.alice]\nproducer_byte_rate = 1_048_576  # 1 MiB/s\n"
                    "request_rate = 100\n"),
    "users/alice/clients/app": "[users.alice.clients.app]\n# a note inside\nrequest_rate = 50.5\n",
    "users/<default>": '[ users . "<default>" ]\nconsumer_byte_rate = 2097152\n',
    "users/<default>/clients/<default>": '[users."<default>".clients."<default>"]\n'
                                         "producer_byte_rate = 1000\n",
    "static": '[static]\n"quota.producer.default" = 10485760\n',
}
HAND_WRITTEN = (
    "# staging cluster quotas\n# owner: platform team\n\n"
    "# batch jobs share one client-id\n" + TABLES["clients/reporting"] + "\n"
    "# alice runs the ETL\n" + TABLES["users/alice"] + "\n"
    "# alice's app\n" + TABLES["users/alice/clients/app"]
    + TABLES["users/<default>"] + "\n"
    "# every client of every user\n" + TABLES["users/<default>/clients/<default>"] + "\n"
    "# server.properties defaults\n" + TABLES["static"] + "\n# end of file\n"
)
QUOTED = entity_path(user="CN=bob,O=x y")


def comment_lines(text):
    return [line for line in text.splitlines() if line.startswith("#")]


def alter_file(tmp_path, changes, text=HAND_WRITTEN):
    """``changes`` made to ``text`` in a file by the store, one by one ->
    (the text written, the snapshot expected)."""
    path = tmp_path / "quotas.toml"
    path.write_text(text)
    store = FileQuotaStore(path)
    expected = store.read()
    for entity, add, delete in changes:
        config = store.alter(entity, add, delete)
        expected[entity] = altered(expected.get(entity, {}), add, delete)
        assert config == expected[entity]
        if not config:
            del expected[entity]
    return path.read_text(), expected


def assert_kept(before, after, touched, expected):
    """Every comment line of ``before`` is in ``after``, in order; each table
    not touched is there byte for byte, in the same order; ``after`` reads
    as what the whole-file writer would write for ``expected``."""
    comments = comment_lines(before)
    assert [line for line in comment_lines(after) if line in comments] == comments, after
    kept = [TABLES[p] for p in TABLES if p not in touched]
    assert all(table in after for table in kept), after
    assert sorted(kept, key=after.index) == kept
    assert snapshot_from_document(tomllib.loads(after)) == \
        snapshot_from_document(tomllib.loads(document_text(expected)))


@pytest.mark.parametrize("entity,add,delete,written", [
    ("users/alice", {PRODUCER_BYTE_RATE: "2048"}, [],  # an existing key keeps its comment
     "[users.alice]\nproducer_byte_rate = 2048  # 1 MiB/s\nrequest_rate = 100\n"),
    ("users/alice", {CONSUMER_BYTE_RATE: "10.5"}, [],  # a new key after the table's last
     TABLES["users/alice"] + "consumer_byte_rate = 10.5\n"),
    ("users/alice", {}, [REQUEST_RATE],
     "[users.alice]\nproducer_byte_rate = 1_048_576  # 1 MiB/s\n\n# alice's app\n"),
    ("users/bob", {CONSUMER_BYTE_RATE: "4096", REQUEST_RATE: "5"}, [],  # after the last user
     "producer_byte_rate = 1000\n\n[users.bob]\nconsumer_byte_rate = 4096\nrequest_rate = 5\n"
     "\n# server.properties defaults\n"),
    ("users/alice/clients/web", {REQUEST_RATE: "3"}, [],  # after alice's tables
     "request_rate = 50.5\n\n[users.alice.clients.web]\nrequest_rate = 3\n[ users"),
    ("users/<default>/clients/<default>", {REQUEST_RATE: "7"}, [],
     TABLES["users/<default>/clients/<default>"] + "request_rate = 7\n"),
    ("clients/<default>", {PRODUCER_BYTE_RATE: "64"}, [],  # after the other client-ids
     "# 300 B/s\n\n[clients.\"<default>\"]\nproducer_byte_rate = 64\n\n# alice runs"),
    (QUOTED, {PRODUCER_BYTE_RATE: "7"}, [], '\n[users."CN=bob,O=x y"]\nproducer_byte_rate = 7\n'),
    (entity_path(user="alice", client_id=DEFAULT), {REQUEST_RATE: "1"}, [],
     '[users.alice.clients."<default>"]\nrequest_rate = 1\n'),
    ("users/alice/clients/app", {}, [REQUEST_RATE],  # the whole table goes, its comments stay
     "request_rate = 100\n\n# alice's app\n# a note inside\n[ users"),
    ("clients/reporting", {}, [CONSUMER_BYTE_RATE],
     "# owner: platform team\n\n# batch jobs share one client-id\n\n# alice runs"),
])
def test_an_alteration_changes_only_its_table(tmp_path, entity, add, delete, written):
    after, expected = alter_file(tmp_path, [(entity, add, delete)])
    assert written in after, after
    assert_kept(HAND_WRITTEN, after, {entity}, expected)


def test_removing_a_users_quotas_keeps_its_clients_and_an_emptied_parent_goes(tmp_path):
    after, expected = alter_file(tmp_path,
                                 [("users/alice", {}, [PRODUCER_BYTE_RATE, REQUEST_RATE])])
    assert "[users.alice]" not in after and TABLES["users/alice/clients/app"] in after
    assert "1_048_576" not in after and "request_rate = 100" not in after
    assert_kept(HAND_WRITTEN, after, {"users/alice"}, expected)

    # [users.alice] written with no keys, its one client removed: both go
    text = "# top\n[users.alice]\n[users.alice.clients.app]\nrequest_rate = 1\n# next\n" \
           "[clients.c]\nrequest_rate = 2\n"
    after, expected = alter_file(tmp_path, [("users/alice/clients/app", {}, [REQUEST_RATE])], text)
    assert after == "# top\n# next\n[clients.c]\nrequest_rate = 2\n"

    # the last entity of a file removed: the file still says what it is
    after, expected = alter_file(tmp_path, [("clients/c", {}, [REQUEST_RATE])],
                                 "[clients.c]\nrequest_rate = 2\n")
    assert expected == {} and after == document_text({})


def test_several_alterations_in_one_edit(tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text(HAND_WRITTEN)
    store = FileQuotaStore(path)
    changes = [("users/bob", {PRODUCER_BYTE_RATE: "1"}, []),
               ("users/carol", {PRODUCER_BYTE_RATE: "2"}, []),
               ("users/alice", {REQUEST_RATE: "9"}, []),
               ("clients/reporting", {}, [CONSUMER_BYTE_RATE])]
    expected = store.read()
    for entity, add, delete in changes:
        expected[entity] = altered(expected.get(entity, {}), add, delete)
    del expected["clients/reporting"]
    data = store.alter_many(changes)
    after = path.read_text()
    assert data == after.encode("utf-8")
    assert after.index("[users.bob]") < after.index("[users.carol]") < after.index("# server")
    assert_kept(HAND_WRITTEN, after, {"users/alice", "clients/reporting"}, expected)


def test_a_missing_or_empty_file_is_started_afresh_and_bad_input_writes_nothing(tmp_path):
    path = tmp_path / "quotas.toml"
    store = FileQuotaStore(path)
    assert store.alter("users/alice", {PRODUCER_BYTE_RATE: "10"}) == {PRODUCER_BYTE_RATE: 10.0}
    assert path.read_text() == document_text({"users/alice": {PRODUCER_BYTE_RATE: 10.0}})
    path.write_text("")
    store.alter("users/alice", {PRODUCER_BYTE_RATE: "10"})
    assert path.read_text() == document_text({"users/alice": {PRODUCER_BYTE_RATE: 10.0}})

    path.write_text(HAND_WRITTEN)
    for add, delete in (({"nope": "1"}, []), ({REQUEST_RATE: "fast"}, []), ({}, ["nope"])):
        with pytest.raises(ValueError):
            store.alter("users/alice", add, delete)
        with pytest.raises(ValueError):
            store.alter_many([("users/bob", {REQUEST_RATE: "1"}, []), ("users/x", add, delete)])
    assert path.read_text() == HAND_WRITTEN


def test_an_entity_written_as_an_inline_table_is_refused_and_the_file_left_alone(tmp_path):
    path = tmp_path / "quotas.toml"
    text = "# inline\n[users]\nalice = { producer_byte_rate = 5 }\n"
    path.write_text(text)
    with pytest.raises(QuotaStoreError, match="cannot change it in place"):
        FileQuotaStore(path).alter("users/alice", {REQUEST_RATE: "1"})
    assert path.read_text() == text
