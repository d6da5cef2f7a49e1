"""SASL/SCRAM credentials as Kafka stores them: the computations against
RFC 7677's test vector and scramp's own client and server, the credentials
file and ZooKeeper followed live (real files, a real ZooKeeper), and
``kthrottle quotas alter`` writing them. No proxy."""
import asyncio
import base64
import json
import logging
import time
import uuid

import pytest
from scramp import ScramClient, ScramException, ScramMechanism

from kthrottle.sources import QuotaStoreError
from kthrottle.sources.credentials import (
    MECHANISMS,
    Credentials,
    FileCredentialSource,
    FileCredentialStore,
    ScramCredential,
    ZooKeeperCredentialSource,
    format_scram,
    parse_scram,
    scram_from_password,
    verify_password,
)
from kthrottle.sources.zookeeper import ZooKeeperQuotaSource
from kthrottle_testkit import zookeeper as zk_server
from kthrottle_testkit.clients import kthrottle_quotas

pytestmark = pytest.mark.integration

needs_zookeeper = pytest.mark.skipif(not zk_server.available(),
                                     reason="scripts/test installs ZooKeeper")

# RFC 7677 section 3: SCRAM-SHA-256 for user "user", password "pencil"
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_CLIENT_FINAL = ("c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    "p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_SERVER_FINAL = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def exchange(mechanism, user, password, credentials, c_nonce=None, s_nonce=None):
    """A whole SCRAM exchange, scramp's client against scramp's server that
    looks the user up in ``credentials``; returns (client-final, server-final)."""
    def lookup(name):
        cred = credentials.scram(mechanism, name)
        return None if cred is None else tuple(cred)

    client = ScramClient([mechanism], user, password, c_nonce=c_nonce)
    server = ScramMechanism(mechanism).make_server(lookup, s_nonce=s_nonce)
    server.set_client_first(client.get_client_first())
    client.set_server_first(server.get_server_first())
    client_final = client.get_client_final()
    server.set_client_final(client_final)
    server_final = server.get_server_final()
    client.set_server_final(server_final)  # the client checks the server's signature
    return client_final, server_final


def test_rfc7677_vector_from_the_stored_credential():
    cred = scram_from_password("SCRAM-SHA-256", "pencil", 4096, RFC_SALT)
    assert cred.salt == RFC_SALT and cred.iterations == 4096
    credentials = Credentials({"user": {"SCRAM-SHA-256": cred}})
    client_final, server_final = exchange("SCRAM-SHA-256", "user", "pencil", credentials,
                                          RFC_CLIENT_NONCE, RFC_SERVER_NONCE)
    assert client_final == RFC_CLIENT_FINAL
    assert server_final == RFC_SERVER_FINAL
    # the same credential through Kafka's string form
    again = Credentials({"user": {"SCRAM-SHA-256": parse_scram(format_scram(cred))}})
    assert exchange("SCRAM-SHA-256", "user", "pencil", again,
                    RFC_CLIENT_NONCE, RFC_SERVER_NONCE) == (RFC_CLIENT_FINAL, RFC_SERVER_FINAL)
    with pytest.raises(ScramException, match="invalid-proof"):
        exchange("SCRAM-SHA-256", "user", "pencil!", credentials)


def test_scram_sha_512_exchange():
    cred = scram_from_password("SCRAM-SHA-512", "alice-secret", iterations=8192)
    assert isinstance(cred, ScramCredential)
    assert len(cred.stored_key) == len(cred.server_key) == 64 and cred.iterations == 8192
    credentials = Credentials({"alice": {"SCRAM-SHA-512": cred}})
    exchange("SCRAM-SHA-512", "alice", "alice-secret", credentials)
    with pytest.raises(ScramException, match="invalid-proof"):
        exchange("SCRAM-SHA-512", "alice", "alice-secreT", credentials)
    with pytest.raises(ScramException, match="unknown-user|Unknown user"):
        exchange("SCRAM-SHA-512", "bob", "alice-secret", credentials)
    # a fresh random salt each time
    assert scram_from_password("SCRAM-SHA-512", "alice-secret").salt != cred.salt


def test_verify_password_and_check_plain():
    sha256 = scram_from_password("SCRAM-SHA-256", "pencil", 4096, RFC_SALT)
    sha512 = scram_from_password("SCRAM-SHA-512", "other")
    assert verify_password("SCRAM-SHA-256", sha256, "pencil")
    assert not verify_password("SCRAM-SHA-256", sha256, "pencil ")
    assert not verify_password("SCRAM-SHA-512", sha256, "pencil")  # another hash
    assert verify_password("SCRAM-SHA-256", sha256, "pencil".encode())
    with pytest.raises(ValueError, match="unknown SASL/SCRAM mechanism"):
        verify_password("SCRAM-SHA-1", sha256, "pencil")

    credentials = Credentials({"user": {"SCRAM-SHA-256": sha256, "SCRAM-SHA-512": sha512},
                               "solo": {"SCRAM-SHA-256": sha256}})
    assert credentials.check_plain("user", "other")  # the SHA-512 one
    assert credentials.check_plain("user", "pencil")  # the SHA-256 one
    assert credentials.check_plain("solo", "pencil")
    for user, password in (("user", "wrong"), ("nobody", "pencil"), ("user", ""),
                           ("user", None), ("user", 42), ("user", b"\xff\xfe"),
                           ("user", "pen\x00cil"), (None, "pencil"), (["user"], "pencil")):
        assert credentials.check_plain(user, password) is False, (user, password)


def test_a_verified_plain_password_is_not_derived_again(monkeypatch):
    import kthrottle.sources.credentials as module

    derived = []
    real = module.verify_password
    monkeypatch.setattr(module, "verify_password",
                        lambda *a: derived.append(a[0]) or real(*a))
    alice = scram_from_password("SCRAM-SHA-512", "alice-secret")
    credentials = Credentials({"alice": {"SCRAM-SHA-512": alice}})
    assert credentials.check_plain("alice", "alice-secret") and len(derived) == 1
    assert credentials.check_plain("alice", "alice-secret") and len(derived) == 1  # recognised
    # a refusal derives once per mechanism: the SHA-256 one against a decoy
    assert not credentials.check_plain("alice", "alice-secreT") and len(derived) == 3
    assert derived[1:] == ["SCRAM-SHA-512", "SCRAM-SHA-256"]
    assert not credentials.check_plain("alice", "alice-secreT") and len(derived) == 3  # remembered
    assert credentials.check_plain("alice", b"alice-secret") and len(derived) == 3
    # a changed credential is a new snapshot, which verifies afresh
    changed = Credentials({"alice": {"SCRAM-SHA-512": scram_from_password("SCRAM-SHA-512", "new")}})
    assert not changed.check_plain("alice", "alice-secret")
    assert changed.check_plain("alice", "new")


def test_parse_and_format_round_trip_in_kafkas_form():
    # Kafka's salts are ASCII (ScramFormatter: a random number in base 36)
    cred = scram_from_password("SCRAM-SHA-512", "x-secret", 4096, b"1vxv3x4d4c2qhgbt7mjbv0xqy4")
    text = format_scram(cred)
    fields = dict(item.split("=", 1) for item in text.split(","))
    assert list(fields) == ["salt", "stored_key", "server_key", "iterations"]
    assert base64.b64decode(fields["salt"]) == b"1vxv3x4d4c2qhgbt7mjbv0xqy4"
    assert parse_scram(text) == parse_scram(text, "SCRAM-SHA-512") == cred
    reordered = ",".join("%s=%s" % (k, fields[k])
                         for k in ("iterations", "server_key", "salt", "stored_key"))
    assert parse_scram(reordered) == cred
    assert fields["stored_key"] not in repr(cred)  # keys stay out of log lines
    assert fields["stored_key"] not in repr(Credentials({"x": {"SCRAM-SHA-512": cred}}))


GOOD = format_scram(scram_from_password("SCRAM-SHA-256", "pencil", 4096, RFC_SALT))
KEY = dict(item.split("=", 1) for item in GOOD.split(","))["stored_key"]


@pytest.mark.parametrize("text,message", [
    ("", "without a name=value"),
    ("salt=W22ZaJ0SNY7soEsUEjb6gQ==", "stored_key, server_key, iterations missing"),
    (GOOD + ",iterations=4096", "iterations given twice"),
    (GOOD + ",password=pencil", "unknown field 'password'"),
    (GOOD.replace("salt=", "salt=!"), "salt is not base64"),
    (GOOD.replace("stored_key=", "stored_key=%"), "stored_key is not base64"),
    (GOOD.replace("iterations=4096", "iterations=lots"), "iterations must be a whole number"),
    (GOOD.replace("iterations=4096", "iterations=1000"), "between 4096 and 16384"),
    (GOOD.replace("iterations=4096", "iterations=100000"), "between 4096 and 16384"),
    (GOOD.replace("W22ZaJ0SNY7soEsUEjb6gQ==", "c2FsdA=="), "salt is 4 bytes, fewer than 12"),
    (GOOD.replace(KEY, "a2V5"), "stored_key and server_key must be 32 or 64 bytes"),
    (None, "a SCRAM credential is a string"),
])
def test_bad_strings_are_rejected_clearly(text, message):
    with pytest.raises(ValueError) as err:
        parse_scram(text)
    assert message in str(err.value)
    assert KEY not in str(err.value)


def test_keys_must_fit_the_mechanism_and_bad_inputs_to_scram_from_password():
    with pytest.raises(ValueError, match="must be 64 bytes, got 32"):
        parse_scram(GOOD, "SCRAM-SHA-512")
    for args, message in (
        (("SCRAM-SHA-1", "pw"), "unknown SASL/SCRAM mechanism"),
        (("SCRAM-SHA-256", "pw", 2048), "between 4096 and 16384"),
        (("SCRAM-SHA-256", ""), "non-empty"),
        (("SCRAM-SHA-256", "pw", 4096, b"short"), "at least 12 bytes"),
        (("SCRAM-SHA-256", "a\u00a0b"), "changes under SASLprep"),  # a no-break space
        (("SCRAM-SHA-256", "bell\x07"), "not usable with SCRAM"),
    ):
        with pytest.raises(ValueError, match=message):
            scram_from_password(*args)


def test_credentials_are_an_immutable_snapshot():
    cred = scram_from_password("SCRAM-SHA-256", "pencil", 4096, RFC_SALT)
    mine = {"user": {"SCRAM-SHA-256": cred}}
    credentials = Credentials(mine)
    mine["user"]["SCRAM-SHA-512"] = cred  # the caller's dict, not the snapshot
    assert credentials.mechanisms("user") == ("SCRAM-SHA-256",)
    assert credentials.scram("SCRAM-SHA-512", "user") is None
    assert credentials.scram("SCRAM-SHA-256", "nobody") is None
    with pytest.raises(AttributeError):
        credentials._users = {}
    with pytest.raises(TypeError):
        credentials._users["eve"] = {}
    assert credentials == Credentials({"user": {"SCRAM-SHA-256": cred}})
    assert len(Credentials()) == 0 and Credentials({"x": {}}).users == ()


def credential_source(credentials_file=None, zookeeper=None):
    from types import SimpleNamespace

    from kthrottle.sources import CREDENTIAL_STORES, build_source

    return build_source(CREDENTIAL_STORES, SimpleNamespace(credentials_file=credentials_file,
                                                           zookeeper=zookeeper))


def test_the_registry_builds_the_store_the_configuration_names():
    assert credential_source() is None
    assert isinstance(credential_source(credentials_file="/c.toml"), FileCredentialSource)
    assert isinstance(credential_source(zookeeper="127.0.0.1:2181/kafka"), ZooKeeperCredentialSource)


# the credentials file ----------------------------------------------------------

class Updates:
    def __init__(self):
        self.values = []

    def __call__(self, value):
        asyncio.get_running_loop()  # raises unless called on the event loop
        assert isinstance(value, Credentials)
        self.values.append(value)

    @property
    def last(self):
        return self.values[-1]


from test_sources import until  # noqa: E402


@pytest.fixture
def cred_log(caplog):
    caplog.set_level(logging.INFO, logger="kthrottle.credentials")
    return caplog


def logged(caplog, text):
    return sum(text in r.getMessage() for r in caplog.records if r.name == "kthrottle.credentials")


def write(path, text):
    """Rewrite in place (same inode), as `cat > file` does."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(0)
        f.write(text.encode())


ALICE = scram_from_password("SCRAM-SHA-256", "alice-secret")
BOB = scram_from_password("SCRAM-SHA-512", "bob-secret")


def test_the_file_is_followed_live_and_a_bad_version_keeps_the_last_credentials(
        tmp_path, cred_log):
    path = tmp_path / "credentials.toml"
    write(path, '[users.alice]\n"SCRAM-SHA-256" = "%s"\n' % format_scram(ALICE))
    with_bob = ('[users.alice]\n"SCRAM-SHA-256" = "%s"\n[users."CN=bob,O=x"]\n'
                '"SCRAM-SHA-512" = "%s"\n' % (format_scram(ALICE), format_scram(BOB)))

    async def scenario():
        updates = Updates()
        source = FileCredentialSource(path, poll_interval=0.05)
        await source.start(updates)
        try:
            assert updates.last == Credentials({"alice": {"SCRAM-SHA-256": ALICE}})
            assert source.healthy and logged(cred_log, "credentials from credentials file")
            write(path, with_bob)
            await until(lambda: "CN=bob,O=x" in updates.last, what="bob applied")
            assert updates.last.check_plain("CN=bob,O=x", "bob-secret")
            good = updates.last

            write(path, with_bob.replace("iterations=4096", "iterations=many", 1))
            await until(lambda: source.rejected == 1, what="the bad version refused")
            await asyncio.sleep(0.3)  # more polls of the same bad file: no new line
            assert logged(cred_log, 'users.alice] SCRAM-SHA-256: iterations must be a whole '
                                    'number') == 1
            assert logged(cred_log, "the last known credentials stay in force") == 1
            assert not source.healthy and updates.last is good and len(updates.values) == 2

            write(path, '[users.alice]\n"SCRAM-SHA-512" = "%s"\n' % format_scram(BOB))
            await until(lambda: updates.last.mechanisms("alice") == ("SCRAM-SHA-512",),
                        what="the fixed file applied")
            assert source.healthy and source.rejected == 1
            assert "CN=bob,O=x" not in updates.last
        finally:
            await source.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("text,message", [
    ('[users.alice]\n"SCRAM-SHA-256" = "salt=xyz"\n',
     '[users.alice] SCRAM-SHA-256: a SCRAM credential needs'),
    ('[users.alice]\npassword = "alice-secret"\n',
     "unknown key 'password' (known: SCRAM-SHA-256, SCRAM-SHA-512); clear passwords are "
     "never kept"),
    ('[users."<default>"]\n"SCRAM-SHA-256" = "%s"\n' % GOOD, "are for a named user"),
    ('[users.alice]\n"SCRAM-SHA-512" = "%s"\n' % GOOD, "must be 64 bytes, got 32"),
    ("[groups.a]\n", "unknown section 'groups'"),
    ("", "is empty; to remove all credentials, write a file holding only a comment"),
])
def test_a_bad_file_at_start_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "credentials.toml"
    write(path, text)

    async def scenario():
        source = FileCredentialSource(path)
        with pytest.raises(QuotaStoreError) as err:
            await source.start(Updates())
        await source.stop()
        return str(err.value)

    error = asyncio.run(scenario())
    assert error.startswith("credentials file %s" % path) and message in error, error
    assert "\n" not in error


def test_the_command_writes_salted_credentials_to_the_file_and_never_the_password(tmp_path):
    creds, quotas = tmp_path / "credentials.toml", tmp_path / "quotas.toml"
    out = kthrottle_quotas("alter", "--credentials-file", str(creds), "--entity-type", "users",
                           "--entity-name", "alice", "--add-config",
                           "SCRAM-SHA-256=[password=alice-secret],"
                           "SCRAM-SHA-512=[iterations=8192,password=alice,secret]")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("Completed updating SCRAM credentials for user-principal 'alice': "
                          "SCRAM-SHA-256=iterations=4096, SCRAM-SHA-512=iterations=8192.\n")
    text = creds.read_text()
    assert "secret" not in text and creds.stat().st_mode & 0o077 == 0
    stored = FileCredentialStore(creds).read()
    assert stored.check_plain("alice", "alice-secret")
    # kafka-configs' rule: the password is everything after password=, commas too
    assert verify_password("SCRAM-SHA-512", stored.scram("SCRAM-SHA-512", "alice"), "alice,secret")

    # quotas and SCRAM in one alter: each to its own store; an error writes neither
    before = text
    for args, message in (
        (["--add-config", "SCRAM-SHA-256=[password=x],producer_byte_rate=fast"],
         "producer_byte_rate must be a number"),
        (["--add-config", "SCRAM-SHA-256=[iterations=1,password=x],request_rate=5"],
         "between 4096 and 16384"),
        (["--add-config", "SCRAM-SHA-256=[pass=alice-secret]"],
         "SCRAM-SHA-256 takes [password=PASSWORD] or [iterations=N,password=PASSWORD]"),
    ):
        out = kthrottle_quotas("alter", "--credentials-file", str(creds), "--quota-file",
                               str(quotas), "--entity-type", "users", "--entity-name", "alice",
                               *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "alice-secret" not in out.stderr
        assert creds.read_text() == before and not quotas.exists()
    out = kthrottle_quotas("alter", "--credentials-file", str(creds), "--entity-type", "clients",
                           "--entity-name", "app", "--add-config", "SCRAM-SHA-256=[password=x]")
    assert out.returncode == 2 and "SCRAM credentials are for a named user" in out.stderr
    out = kthrottle_quotas("alter", "--quota-file", str(quotas), "--entity-type", "users",
                           "--entity-name", "alice", "--add-config", "SCRAM-SHA-256=[password=x]")
    assert out.returncode == 2 and "go to --credentials-file PATH or --zookeeper" in out.stderr

    out = kthrottle_quotas("alter", "--credentials-file", str(creds), "--quota-file",
                           str(quotas), "--entity-type", "users", "--entity-name", "alice",
                           "--add-config", "request_rate=5", "--delete-config", "SCRAM-SHA-256")
    assert out.returncode == 0, out.stderr
    out = kthrottle_quotas("describe", "--credentials-file", str(creds), "--quota-file",
                           str(quotas))
    assert out.stdout == ("Quotas for user-principal 'alice' are request_rate=5\n"
                          "SCRAM credential configs for user-principal 'alice' are "
                          "SCRAM-SHA-512=iterations=8192\n")


# ZooKeeper -------------------------------------------------------------------------

@pytest.fixture
def chroot():
    return "/kthrottle-%s" % uuid.uuid4().hex[:8]


@pytest.fixture
def writer(zookeeper, chroot):
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=zookeeper.hosts + chroot)
    zk.start(timeout=10)
    yield zk
    zk.stop()
    zk.close()


def everything(zk, znode="/"):
    """The data of every znode under ``znode``."""
    data, _ = zk.get(znode)
    out = [data or b""]
    for child in zk.get_children(znode):
        out.extend(everything(zk, znode.rstrip("/") + "/" + child))
    return out


@needs_zookeeper
def test_the_command_writes_scram_to_zookeeper_and_a_running_source_picks_it_up(
        zookeeper, writer, chroot, cred_log):
    hosts = zookeeper.hosts + chroot
    alice_znode = "/config/users/CN%3Dalice%2COU%3Dteam"
    writer.create(alice_znode, json.dumps({"version": 1, "config": {
        "producer_byte_rate": "1024"}}).encode(), makepath=True)
    writer.create("/config/users/bob", json.dumps({"version": 1, "config": {
        "SCRAM-SHA-512": format_scram(BOB)}}).encode(), makepath=True)
    writer.ensure_path("/config/changes")

    def quotas_cmd(*args):
        return kthrottle_quotas(args[0], "--zookeeper", hosts, *args[1:])

    async def scenario():
        updates, quota_updates = Updates(), []
        source = ZooKeeperCredentialSource(hosts)
        quota_source = ZooKeeperQuotaSource(hosts)
        await source.start(updates)
        await quota_source.start(quota_updates.append)
        try:
            assert updates.last == Credentials({"bob": {"SCRAM-SHA-512": BOB}})
            assert source.healthy and source.rejected == 0

            out = await asyncio.to_thread(
                quotas_cmd, "alter", "--entity-type", "users", "--entity-name",
                "CN=alice,OU=team", "--add-config",
                "SCRAM-SHA-256=[password=alice-secret],"
                "SCRAM-SHA-512=[iterations=8192,password=alice-secret]")
            written = time.monotonic()
            assert out.returncode == 0, out.stderr
            await until(lambda: "CN=alice,OU=team" in updates.last, timeout=1.0,
                        what="the credentials within a second")
            assert time.monotonic() - written < 1.0
            alice = updates.last
            assert alice.mechanisms("CN=alice,OU=team") == MECHANISMS
            assert alice.scram("SCRAM-SHA-512", "CN=alice,OU=team").iterations == 8192
            assert alice.check_plain("CN=alice,OU=team", "alice-secret")
            assert not alice.check_plain("CN=alice,OU=team", "alice-secreT")
            assert alice.check_plain("bob", "bob-secret")
            exchange("SCRAM-SHA-256", "CN=alice,OU=team", "alice-secret", alice)

            # the quotas beside them are kept, and the quota source still has them
            config = json.loads(writer.get(alice_znode)[0])["config"]
            assert config["producer_byte_rate"] == "1024" and set(MECHANISMS) <= set(config)
            assert quota_updates[-1]["users/CN%3Dalice%2COU%3Dteam"] == {
                "producer_byte_rate": 1024.0}
            # the password is nowhere in ZooKeeper
            assert not any(b"alice-secret" in d for d in everything(writer))

            # quotas and SCRAM in one alter: one znode write, one notification
            before = len(writer.get_children("/config/changes"))
            out = await asyncio.to_thread(
                quotas_cmd, "alter", "--entity-type", "users", "--entity-name",
                "CN=alice,OU=team", "--add-config", "request_rate=7",
                "--delete-config", "SCRAM-SHA-256")
            assert out.returncode == 0, out.stderr
            assert len(writer.get_children("/config/changes")) == before + 1
            await until(lambda: updates.last.mechanisms("CN=alice,OU=team") == ("SCRAM-SHA-512",),
                        timeout=2, what="SCRAM-SHA-256 removed")
            config = json.loads(writer.get(alice_znode)[0])["config"]
            assert config["producer_byte_rate"] == "1024" and config["request_rate"] == "7"

            out = await asyncio.to_thread(quotas_cmd, "describe", "--entity-type", "users")
            assert out.returncode == 0, out.stderr
            assert "SCRAM credential configs for user-principal 'CN=alice,OU=team' are " \
                   "SCRAM-SHA-512=iterations=8192" in out.stdout.splitlines()
            assert "salt" not in out.stdout and "key" not in out.stdout

            # a malformed value is skipped, logged once and counted; the rest apply
            writer.set("/config/users/bob", json.dumps({"version": 1, "config": {
                "SCRAM-SHA-256": format_scram(ALICE),
                "SCRAM-SHA-512": "salt=c2FsdA==,stored_key=a2V5,server_key=c2Vy,iterations=4096",
                "consumer_byte_rate": "10"}}).encode())
            writer.create("/config/changes/config_change_",
                          b'{"version":2,"entity_path":"users/bob"}', sequence=True)
            await until(lambda: updates.last.mechanisms("bob") == ("SCRAM-SHA-256",),
                        timeout=2, what="bob's good credential applied")
            assert source.rejected == 1 and source.healthy
            assert logged(cred_log, "ignoring SCRAM-SHA-512 in /config/users/bob: salt is 4 "
                                    "bytes") == 1
            assert updates.last.check_plain("bob", "alice-secret")
            assert updates.last.mechanisms("CN=alice,OU=team") == ("SCRAM-SHA-512",)

            # a SCRAM alter of a clients entity is refused, nothing written
            out = await asyncio.to_thread(
                quotas_cmd, "alter", "--entity-type", "clients", "--entity-name", "app",
                "--add-config", "SCRAM-SHA-256=[password=x]")
            assert out.returncode == 2 and "SCRAM credentials are for a named user" in out.stderr
            assert not writer.exists("/config/clients/app")
        finally:
            await source.stop()
            await quota_source.stop()

    asyncio.run(scenario())


def test_an_unknown_user_costs_the_same_derivations_as_a_wrong_password(monkeypatch):
    """User enumeration by timing: a PLAIN login for a user that does not
    exist does the same key derivations, at the same iteration counts, as
    one with a wrong password."""
    import kthrottle.sources.credentials as module

    derived = []
    real = module.verify_password
    monkeypatch.setattr(module, "verify_password",
                        lambda m, cred, pw: derived.append((m, cred.iterations)) or real(m, cred, pw))
    credentials = Credentials({"alice": {"SCRAM-SHA-512": scram_from_password("SCRAM-SHA-512", "a"),
                                         "SCRAM-SHA-256": scram_from_password("SCRAM-SHA-256", "a")},
                               "solo": {"SCRAM-SHA-256": scram_from_password("SCRAM-SHA-256", "s")}})
    assert not credentials.check_plain("alice", "wrong")
    wrong = list(derived)
    for user in ("nobody", "solo"):
        derived.clear()
        assert not credentials.check_plain(user, "wrong")
        assert derived == wrong == [("SCRAM-SHA-512", 4096), ("SCRAM-SHA-256", 4096)]
    # a SCRAM exchange for an unknown user runs on a decoy, stable per user
    decoy = credentials.decoy("SCRAM-SHA-256", "nobody")
    assert decoy == credentials.decoy("SCRAM-SHA-256", "nobody") != credentials.decoy(
        "SCRAM-SHA-256", "other")
    assert len(decoy.stored_key) == 32 and decoy.iterations == 4096


def test_the_refused_pairs_remembered_are_bounded():
    credentials = Credentials({"alice": {"SCRAM-SHA-256": scram_from_password("SCRAM-SHA-256", "a")}})
    for i in range(Credentials.REFUSED_KEPT):  # as check_plain fills it, oldest first
        credentials._refused["u%d" % i, b""] = True
    assert not credentials.check_plain("nobody", "x")
    assert len(credentials._refused) == Credentials.REFUSED_KEPT
    assert ("u0", b"") not in credentials._refused and ("u1", b"") in credentials._refused


def test_the_file_store_changes_only_the_users_it_alters(tmp_path):
    carol = scram_from_password("SCRAM-SHA-256", "carol-secret")
    alice_table = '[users.alice]  # the ETL user\n"SCRAM-SHA-256" = "%s"\n' % format_scram(ALICE)
    bob_table = '[users."CN=bob,O=x y"]\nSCRAM-SHA-512 = "%s"\n' % format_scram(BOB)
    text = ("# staging users\n\n# alice first\n" + alice_table + "\n# then bob\n" + bob_table
            + "# end\n")
    path = tmp_path / "credentials.toml"
    path.write_text(text)
    store = FileCredentialStore(path)

    assert store.alter("carol", {"SCRAM-SHA-256": carol}) == {"SCRAM-SHA-256": carol}
    assert store.alter("alice", {"SCRAM-SHA-512": BOB}) == {"SCRAM-SHA-256": ALICE,
                                                             "SCRAM-SHA-512": BOB}
    store.alter("CN=bob,O=x y", delete=["SCRAM-SHA-512"])  # his only one: the table goes
    after = path.read_text()
    assert (alice_table + '"SCRAM-SHA-512" = "%s"\n' % format_scram(BOB)) in after
    assert '\n[users.carol]\n"SCRAM-SHA-256" = "%s"\n' % format_scram(carol) in after
    assert "CN=bob" not in after
    comments = ["# staging users", "# alice first", "# then bob", "# end"]
    assert [line for line in after.splitlines() if line.startswith("#")] == comments
    assert store.read() == Credentials({"alice": {"SCRAM-SHA-256": ALICE, "SCRAM-SHA-512": BOB},
                                        "carol": {"SCRAM-SHA-256": carol}})

    before = path.read_text()
    with pytest.raises(ValueError):
        store.alter_users([("dave", {"SCRAM-SHA-256": carol}, ()), ("<default>", {}, ())])
    assert path.read_text() == before  # nothing written
