"""SASL/SCRAM credentials as Kafka stores them, for a proxy that verifies
clients itself.

A credential is what a SCRAM server keeps (RFC 5802 section 3): the salt, the
iteration count, StoredKey = H(HMAC(SaltedPassword, "Client Key")) and
ServerKey = HMAC(SaltedPassword, "Server Key"); never the password. Kafka
writes one per mechanism (SCRAM-SHA-256, RFC 7677; SCRAM-SHA-512) as
``salt=<b64>,stored_key=<b64>,server_key=<b64>,iterations=N`` under the
mechanism's name in the user's config (Kafka docs, "Authentication using
SASL/SCRAM"). They live in a TOML file::

    [users.alice]
    "SCRAM-SHA-256" = "salt=...,stored_key=...,server_key=...,iterations=4096"

or in ZooKeeper, in the user znodes ``/config/users/<url-encoded user>``
beside the user's quotas, changes announced in ``/config/changes``. Both are
followed live as the quota sources are (``on_update`` gets a Credentials).

The SCRAM computations are the ``scramp`` library's. Nothing here depends on
the proxy.
"""
import base64
import binascii
import hmac
import json
import logging
import os
from collections import OrderedDict
from types import MappingProxyType
from typing import NamedTuple

from ..policy.entities import DEFAULT, entity_path, parse_entity_path
from ..policy.quota_file import _toml_key
from ..redacted import redacted_repr
from .file import FollowedStoreFile, TomlFileStore
from .zookeeper import (
    CONFIG_ROOT,
    ZooKeeperFollower,
    ZooKeeperQuotaStore,
    _config_json,
    config_entries,
)

log = logging.getLogger("kthrottle.credentials")

MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")  # weakest first
# Kafka's bounds (ScramMechanism; KIP-554 refuses more than 16384)
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 16384
_KEY_BYTES = {"SCRAM-SHA-256": 32, "SCRAM-SHA-512": 64}  # the hash's output
MIN_SALT_BYTES = 12  # what scramp's server accepts (Kafka's own salts are ~26)
_FIELDS = ("salt", "stored_key", "server_key", "iterations")


class ScramCredential(NamedTuple):
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    __repr__ = redacted_repr("iterations")


def _mechanism(mechanism):
    if mechanism not in MECHANISMS:
        raise ValueError("unknown SASL/SCRAM mechanism %r (known: %s)"
                         % (mechanism, ", ".join(MECHANISMS)))
    return mechanism


def _check_iterations(iterations):
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError("iterations must be between %d and %d (Kafka's bounds), got %d"
                         % (MIN_ITERATIONS, MAX_ITERATIONS, iterations))


def parse_scram(text, mechanism=None):
    """Kafka's ``salt=<b64>,stored_key=<b64>,server_key=<b64>,iterations=N``
    (ScramCredentialUtils; any order) -> ScramCredential. With
    ``mechanism``, the keys must be that hash's size. ValueError says what
    is wrong, without echoing the keys."""
    if not isinstance(text, str):
        raise ValueError("a SCRAM credential is a string, got %s" % type(text).__name__)
    fields = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")  # base64 ends in '=': split at the first
        if not sep or not name:
            raise ValueError("a SCRAM credential is salt=...,stored_key=...,server_key=...,"
                             "iterations=N; found an item without a name=value")
        if name not in _FIELDS:
            raise ValueError("unknown field %r in a SCRAM credential (known: %s)"
                             % (name[:40], ", ".join(_FIELDS)))
        if name in fields:
            raise ValueError("%s given twice in a SCRAM credential" % name)
        fields[name] = value.strip()
    missing = [f for f in _FIELDS if f not in fields]
    if missing:
        raise ValueError("a SCRAM credential needs %s; %s missing"
                         % (", ".join(_FIELDS), ", ".join(missing)))
    decoded = {}
    for name in _FIELDS[:3]:
        try:
            decoded[name] = base64.b64decode(fields[name], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("%s is not base64" % name) from None
        if not decoded[name]:
            raise ValueError("%s is empty" % name)
    digits = fields["iterations"]
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError("iterations must be a whole number, got %r" % digits[:20])
    iterations = int(digits)
    _check_iterations(iterations)
    if len(decoded["salt"]) < MIN_SALT_BYTES:
        raise ValueError("salt is %d bytes, fewer than %d" % (len(decoded["salt"]), MIN_SALT_BYTES))
    sizes = {len(decoded["stored_key"]), len(decoded["server_key"])}
    expected = {_KEY_BYTES[_mechanism(mechanism)]} if mechanism else None
    if len(sizes) != 1 or sizes - set(_KEY_BYTES.values()) or expected and sizes != expected:
        raise ValueError("stored_key and server_key must be %s bytes, got %s" % (
            " or ".join(str(n) for n in sorted(expected or set(_KEY_BYTES.values()))),
            " and ".join(str(n) for n in sorted(sizes))))
    return ScramCredential(decoded["salt"], decoded["stored_key"], decoded["server_key"],
                           iterations)


def format_scram(cred):
    """A credential in Kafka's string form (what parse_scram reads)."""
    def b64(data):
        return base64.b64encode(data).decode("ascii")

    return "salt=%s,stored_key=%s,server_key=%s,iterations=%d" % (
        b64(cred.salt), b64(cred.stored_key), b64(cred.server_key), cred.iterations)


def scram_from_password(mechanism, password, iterations=MIN_ITERATIONS, salt=None):
    """The credential a SCRAM server keeps for ``password`` (RFC 5802
    section 3; RFC 7677 for SHA-256), computed by scramp; a random salt
    unless one is given. ValueError for a bad mechanism, iteration count,
    salt or password."""
    from scramp import ScramException, ScramMechanism
    from scramp.utils import saslprep

    _mechanism(mechanism)
    if isinstance(iterations, bool) or not isinstance(iterations, int):
        raise ValueError("iterations must be a whole number, got %r" % (iterations,))
    _check_iterations(iterations)
    if not isinstance(password, str) or not password:
        raise ValueError("the password must be a non-empty string")
    # scramp SASLpreps the password (RFC 5802 section 2.2); Kafka's clients
    # hash it as UTF-8 as it is: only a password SASLprep leaves alone gives
    # the same keys on both sides
    try:
        same = saslprep(password) == password
    except ScramException as exc:
        raise ValueError("the password is not usable with SCRAM (SASLprep, RFC 4013: %s)"
                         % exc) from None
    if not same:
        raise ValueError("the password changes under SASLprep (RFC 4013), so Kafka clients, "
                         "which do not apply it, would not match: choose another")
    if salt is not None and (not isinstance(salt, bytes) or len(salt) < MIN_SALT_BYTES):
        raise ValueError("the salt must be at least %d bytes" % MIN_SALT_BYTES)
    try:
        return ScramCredential(*ScramMechanism(mechanism).make_auth_info(
            password, iteration_count=iterations, salt=salt))
    except ScramException as exc:
        raise ValueError("cannot make a %s credential: %s" % (mechanism, exc)) from None


def verify_password(mechanism, cred, password):
    """Whether ``password`` is the one ``cred`` was made from: SaltedPassword
    -> ClientKey -> StoredKey (RFC 5802 section 3, by scramp), compared in
    constant time. For SASL/PLAIN checked against a SCRAM credential. An
    unusable password is simply false; an unknown mechanism is ValueError."""
    from scramp import ScramException, ScramMechanism

    _mechanism(mechanism)
    if isinstance(password, (bytes, bytearray)):
        try:
            password = bytes(password).decode("utf-8")
        except UnicodeDecodeError:
            return False
    if not isinstance(password, str) or not password:
        return False
    try:
        _, stored_key, _, _ = ScramMechanism(mechanism).make_auth_info(
            password, iteration_count=cred.iterations, salt=cred.salt)
    except ScramException:
        return False
    return hmac.compare_digest(stored_key, cred.stored_key)


class Credentials:
    """An immutable snapshot: {user: {mechanism: ScramCredential}}. Users are
    named as clients authenticate (not URL-encoded)."""

    __slots__ = ("_users", "_verified", "_refused", "_key")

    # wrong (user, password) pairs remembered per snapshot, so that a client
    # retrying one wrong password costs one key derivation, not one per try
    REFUSED_KEPT = 4096

    def __init__(self, users=None):
        frozen = {}
        for user, mechanisms in (users or {}).items():
            if not isinstance(user, str) or not user:
                raise ValueError("a user name is a non-empty string, got %r" % (user,))
            entry = {}
            for mechanism, cred in mechanisms.items():
                _mechanism(mechanism)
                if not isinstance(cred, ScramCredential):
                    raise TypeError("%s of %r is not a ScramCredential" % (mechanism, user))
                entry[mechanism] = cred
            if entry:
                frozen[user] = MappingProxyType(entry)
        object.__setattr__(self, "_users", MappingProxyType(frozen))
        # PLAIN logins verified against this snapshot: user -> HMAC of the
        # password under a key of this snapshot's own (see check_plain)
        object.__setattr__(self, "_verified", {})
        object.__setattr__(self, "_refused", OrderedDict())
        object.__setattr__(self, "_key", os.urandom(32))

    def __setattr__(self, name, value):
        raise AttributeError("Credentials are immutable")

    def scram(self, mechanism, user):
        """The user's credential for the mechanism, None if there is none."""
        try:
            mechanisms = self._users.get(user)
        except TypeError:  # an unhashable "user"
            return None
        return mechanisms.get(mechanism) if mechanisms else None

    def decoy(self, mechanism, user):
        """A made-up credential for a user that has none, the same for the
        same user within this snapshot: a SCRAM exchange for an unknown user
        goes on with it and fails at the proof, like a wrong password."""
        seed = hmac.new(self._key, ("%s\0%s" % (mechanism, user)).encode("utf-8", "replace"),
                        "sha512").digest()
        size = _KEY_BYTES[_mechanism(mechanism)]
        return ScramCredential(seed[:16], seed[16:16 + size].ljust(size, b"\0"),
                               seed[-size:], MIN_ITERATIONS)

    def check_plain(self, user, password):
        """SASL/PLAIN: whether any SCRAM credential of the user (strongest
        first) was made from ``password``. Unknown user, or any bad input:
        False.

        A refusal costs one PBKDF2 per mechanism (``iterations`` HMACs, a few
        ms) whether the user exists or not, and whichever credentials it has
        (a missing one is stood in for by a decoy), so the time taken does
        not tell who exists. The password last verified for a
        user, and recent wrong pairs, are recognised by a keyed hash instead,
        so a client that reconnects often, or retries one wrong password,
        does not cost a PBKDF2 each time. The key is random per snapshot and
        lives only in memory; a changed credential makes a new snapshot, and
        so forgets both."""
        try:
            digest = self._digest(password)
            verdict = self._remembered(user, digest)
            if verdict is not None:
                return verdict
            refused = self._refused
            key = (user, digest)
            mechanisms = self._users.get(user) or {}
            for mechanism in reversed(MECHANISMS):  # strongest first
                cred = mechanisms.get(mechanism)
                if cred is None:  # the same work as for a credential that is there
                    verify_password(mechanism, self.decoy(mechanism, str(user)), password)
                elif verify_password(mechanism, cred, password):
                    self._verified[user] = digest
                    return True
            if len(refused) >= self.REFUSED_KEPT:
                refused.popitem(last=False)
            refused[key] = True
        except Exception:  # never let a client's input raise
            return False
        return False

    def check_plain_remembered(self, user, password):
        """check_plain's answer when it needs no key derivation (the
        password last verified, or a wrong pair seen recently), else None: a
        microsecond check for the event loop, before a derivation is sent to
        a worker."""
        try:
            return self._remembered(user, self._digest(password))
        except Exception:
            return None

    def _digest(self, password):
        if isinstance(password, str):
            password = password.encode("utf-8")
        return hmac.new(self._key, bytes(password), "sha256").digest()

    def _remembered(self, user, digest):
        known = self._verified.get(user)
        if known is not None and hmac.compare_digest(known, digest):
            return True
        if (user, digest) in self._refused:
            return False
        return None

    def mechanisms(self, user):
        """The mechanisms the user has a credential for, weakest first."""
        mechanisms = self._users.get(user) or {}
        return tuple(m for m in MECHANISMS if m in mechanisms)

    @property
    def users(self):
        return tuple(sorted(self._users))

    def as_dict(self):
        return {user: dict(m) for user, m in self._users.items()}

    def __contains__(self, user):
        return user in self._users

    def __len__(self):
        return len(self._users)

    def __eq__(self, other):
        return isinstance(other, Credentials) and self.as_dict() == other.as_dict()

    __hash__ = None

    def __repr__(self):
        return "Credentials(%d users)" % len(self._users)


# the credentials file ------------------------------------------------------

class CredentialFileError(ValueError):
    """A credentials file that does not hold credentials; the message says where."""


def credentials_from_document(doc):
    """Parsed TOML -> Credentials. Only salted credentials are accepted."""
    users = {}
    for section, body in doc.items():
        if section != "users":
            raise CredentialFileError("unknown section %r (only users)" % section)
        if not isinstance(body, dict):
            raise CredentialFileError("[users] must be a table of users")
        for user, table in body.items():
            where = "[users.%s]" % _toml_key(user)
            if not isinstance(table, dict):
                raise CredentialFileError("%s must be a table of SCRAM credentials" % where)
            if user == DEFAULT or not user:
                raise CredentialFileError("%s: SCRAM credentials are for a named user" % where)
            entry = {}
            for mechanism, value in table.items():
                if mechanism not in MECHANISMS:
                    hint = ("; clear passwords are never kept: write a salted credential with "
                            "kthrottle quotas alter --credentials-file PATH --entity-type users "
                            "--entity-name NAME --add-config 'SCRAM-SHA-256=[password=...]'"
                            if "password" in mechanism.lower() else "")
                    raise CredentialFileError("%s: unknown key %r (known: %s)%s" % (
                        where, mechanism, ", ".join(MECHANISMS), hint))
                try:
                    entry[mechanism] = parse_scram(value, mechanism)
                except ValueError as exc:
                    raise CredentialFileError("%s %s: %s" % (where, mechanism, exc)) from None
            if entry:
                users[user] = entry
    return Credentials(users)


def credentials_text(credentials):
    """Credentials as credentials-file text, users in a stable order."""
    lines = ["# kthrottle SASL/SCRAM credentials: salted, as Kafka stores them (never "
             "passwords);", "# see `kthrottle quotas alter --help`."]
    for user in credentials.users:
        lines.append("")
        lines.append("[users.%s]" % _toml_key(user))
        for mechanism in credentials.mechanisms(user):
            lines.append('"%s" = "%s"' % (mechanism, format_scram(credentials.scram(mechanism, user))))
    return "\n".join(lines) + "\n"


def _altered(entry, add=None, delete=()):
    """A user's {mechanism: credential} with ``add`` set and ``delete``
    removed; ValueError naming the bad mechanism, changing nothing."""
    add = dict(add or {})
    for mechanism, cred in add.items():
        _mechanism(mechanism)
        if not isinstance(cred, ScramCredential):
            raise TypeError("%s: not a ScramCredential" % mechanism)
    for mechanism in delete:
        _mechanism(mechanism)
        if mechanism in add:
            raise ValueError("%s is both added and deleted" % mechanism)
    out = {m: c for m, c in entry.items() if m not in delete}
    out.update(add)
    return out


def _check_user(user):
    if not isinstance(user, str) or not user or user == DEFAULT:
        raise ValueError("SCRAM credentials are for a named user (not the default user)")


class FileCredentialStore(TomlFileStore):
    """Blocking access to a credentials file."""

    kind = "credentials file"
    section = "credentials"
    document_error = CredentialFileError
    empty = Credentials
    start_text = credentials_text(Credentials())

    @staticmethod
    def from_document(doc):
        return credentials_from_document(doc)

    def alter(self, user, add=None, delete=()):
        """Set ``add`` ({mechanism: ScramCredential}) and remove ``delete``
        for ``user``; only the user's table changes, the file keeps its
        comments and layout (a new file is 0600). Returns the user's
        credentials now."""
        written = self.alter_users([(user, add, delete)])
        return self.parse(written, empty_ok=True).as_dict().get(user, {})

    def alter_users(self, changes):
        """Alter several users (``changes``: (user, add, delete) each) in one
        edit of the file; returns the bytes written."""
        def update(credentials):
            users = credentials.as_dict()
            for user, add, delete in changes:
                _check_user(user)
                entry = _altered(users.get(user, {}), add, delete)
                if entry:
                    users[user] = entry
                else:
                    users.pop(user, None)
            tables = [(("users", user), {m: json.dumps(format_scram(users[user][m]))
                                         for m in MECHANISMS if m in users.get(user, {})})
                      for user in dict.fromkeys(user for user, _, _ in changes)]
            return Credentials(users), tables

        return self.edit(update, key_text=json.dumps)


class FileCredentialSource(FollowedStoreFile):
    """The credentials file followed live, as the quota file is (see
    FollowedFile): a bad entry at start raises QuotaStoreError; a bad version
    later is logged once and counted, the last good credentials stay."""

    noun = "credentials"
    log = log
    store_class = FileCredentialStore
    what = "credentials file"

    def summary(self, credentials):
        return "%d users" % len(credentials)

    def alter_users(self, changes):
        """Blocking (a worker thread): ``changes`` ((user, add, delete) each)
        in one edit of the file -> ({user: error message}, then): ``then()``
        on the event loop puts the new credentials in force at once."""
        from . import QuotaStoreError

        return self._write(self.store.alter_users, changes, (QuotaStoreError, ValueError))


# ZooKeeper -------------------------------------------------------------------

def entity_credentials(znode, data):
    """A user znode's data -> (credentials, problems): the SCRAM keys that
    parse, and a message per one that does not (never echoing its value).
    Other keys (quotas) are left alone. QuotaStoreError if the data is not
    Kafka's config JSON."""
    return _scram_entries(znode, _config_json(znode, data))


def _scram_entries(znode, config):
    return config_entries(znode, config, MECHANISMS, lambda key, value: parse_scram(value, key))


def with_scram(full, add=None, delete=()):
    """A user znode's full config map with SCRAM credentials set (``add``:
    {mechanism: ScramCredential}) and removed; other keys kept."""
    _altered({}, add, delete)  # validates
    out = {k: v for k, v in full.items() if k not in delete}
    out.update({m: format_scram(c) for m, c in (add or {}).items()})
    return out


def _user_path(path):
    """The user of a ``users/<user>`` entity path, else None."""
    parts = path.split("/")
    if len(parts) != 2 or parts[0] != "users" or parts[1] == DEFAULT:
        return None
    return parse_entity_path(path)[0]


class ZooKeeperCredentialStore:
    """Credentials in the user znodes, as kafka-configs --zookeeper writes
    them. ``store`` shares the connection of a ZooKeeperQuotaStore."""

    def __init__(self, hosts=None, timeout=10.0, store=None):
        self.zk_store = store or ZooKeeperQuotaStore(hosts, timeout)
        self._own = store is None

    def connect(self):
        self.zk_store.connect()
        return self

    def close(self):
        if self._own:
            self.zk_store.close()

    def read(self):
        """Every user's credentials; a value that does not parse is logged
        and left out, a znode that is not Kafka's JSON raises QuotaStoreError."""
        users = {}
        for name in self.zk_store.children("%s/users" % CONFIG_ROOT):
            path = "users/%s" % name
            user = _user_path(path)
            data = self.zk_store.entity_data(path) if user else None
            if data is None:
                continue
            entry, problems = entity_credentials("%s/%s" % (CONFIG_ROOT, path), data)
            for problem in problems:
                log.error(problem)
            if entry:
                users[user] = entry
        return Credentials(users)

    def alter(self, user, add=None, delete=()):
        """Rewrite the user znode (keeping its quotas) and announce the
        change, as kafka-configs does. Returns the user's credentials now."""
        _check_user(user)
        path = entity_path(user=user)
        full = self.zk_store.alter_config(path, lambda full: with_scram(full, add, delete))
        return _scram_entries("%s/%s" % (CONFIG_ROOT, path), full)[0]


class ZooKeeperCredentialSource(ZooKeeperFollower):
    """The SCRAM keys of the user znodes, followed through Kafka's change
    notifications (entity_path ``users/<user>``) with the quota source's
    machinery (see ZooKeeperFollower). A malformed value is skipped with a
    log line (once per content) and counted in ``rejected``; the rest apply."""

    noun = "credentials"
    log = log

    def entity_paths(self):
        return ["users/%s" % name for name in self.store.children("%s/users" % CONFIG_ROOT)
                if name != DEFAULT]

    def follows(self, path):
        return _user_path(path) is not None

    def parse_entity(self, znode, data):
        return entity_credentials(znode, data)

    def handed(self, snapshot):
        return Credentials({parse_entity_path(path)[0]: entry for path, entry in snapshot.items()})

    def summary(self, snapshot):
        return "%d users" % len(snapshot)

    def alter_users(self, changes):
        """Blocking (a worker thread): each of ``changes`` ((user, add,
        delete)) written to its user znode as kafka-configs does, then read
        back at once -> ({user: error message}, None)."""
        store = ZooKeeperCredentialStore(store=self.store)
        return self.alter_entities(
            changes, lambda change: store.alter(*change),
            path_of=lambda change: entity_path(user=change[0]))

    def change_text(self, path, entry):
        return "credentials change for user %r: %s" % (
            parse_entity_path(path)[0],
            ", ".join(m for m in MECHANISMS if m in (entry or {})) or "no SCRAM credentials")
