"""TLS for the proxy's listeners and towards the brokers: the contexts made
from the configuration, the certificate material followed live (TlsFiles),
a client certificate's subject as Kafka writes it, and the server name a
client asks for (SNI routing)."""
import logging
from typing import NamedTuple

from ..sources import QuotaStoreError
from ..sources.file import FollowedFile, read_file_bytes, stat_signature

log = logging.getLogger("kthrottle.proxy")


def tls_context(config):
    """The listeners' TLS: certificate and key, and client certificates
    checked against ``ssl_ca`` as Kafka's ssl.client.auth says."""
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.ssl_cert, config.ssl_key)
        if config.ssl_ca:
            context.load_verify_locations(config.ssl_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError("cannot load the listeners' TLS certificate, key or CA (%s, %s, %s): %s"
                         % (config.ssl_cert, config.ssl_key, config.ssl_ca, exc)) from None
    context.verify_mode = {"none": ssl.CERT_NONE, "requested": ssl.CERT_OPTIONAL,
                           "required": ssl.CERT_REQUIRED}[config.ssl_client_auth]
    return context


def certificate_subject(der):
    """A certificate's subject as Kafka writes it: Java's
    X500Principal.getName() (RFC 2253, most specific first:
    CN=alice,OU=team,O=org; emailAddress and other types without an RFC 2253
    keyword as OID=#hex), what ssl.principal.mapping.rules match (KIP-371)."""
    from cryptography import x509

    from ..policy.principal import x500_principal_name

    return x500_principal_name(x509.load_der_x509_certificate(der).subject)


def upstream_tls_context(config):
    """TLS towards the brokers: their certificates checked (host names too,
    as Kafka's ssl.endpoint.identification.algorithm=https), and the proxy's
    own certificate for brokers that require one."""
    import ssl

    try:
        context = ssl.create_default_context(cafile=config.upstream_ssl_ca)
        if config.upstream_ssl_cert:
            context.load_cert_chain(config.upstream_ssl_cert, config.upstream_ssl_key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError("cannot load the upstream TLS CA or certificate (%s, %s): %s"
                         % (config.upstream_ssl_ca, config.upstream_ssl_cert, exc)) from None
    return context




def note_server_name(ssl_object, server_name, context):
    """sni_callback: the TLS server name the client asked for, kept on the
    connection's SSLObject for RoutedConnection (None: none sent, as when a
    client connects by IP address)."""
    ssl_object.kthrottle_server_name = server_name


def with_sni(context, sni):
    """SNI routing (``sni``: the SniPattern, or None): the context notes the
    server name each client asks for (read once the handshake is done:
    RoutedConnection)."""
    if sni is not None:
        context.sni_callback = note_server_name
    return context


# TLS material followed live --------------------------------------------------

class LoadedTls(NamedTuple):
    context: object  # an ssl.SSLContext
    certificate: str  # its certificate's subject and expiry, for log lines


class TlsFiles(FollowedFile):
    """A certificate (chain), its key and a CA bundle, PEM files followed
    live as the quota file is (FollowedFile: by content, a version taken
    once two reads agree). A version whose files load together is handed
    on (``on_update(LoadedTls)``) for new connections to use; one that does
    not (a file unreadable or not PEM, a key that does not match the
    certificate) is logged once and the last good one stays in force.
    ``reload()`` (SIGHUP) looks at once."""

    noun = "TLS certificate and key"

    def __init__(self, what, paths, build, logger=log, poll_interval=1.0):
        super().__init__(_PemFiles(paths, build), "%s (%s)" % (what, ", ".join(paths)),
                         poll_interval)
        self.log = logger

    def summary(self, loaded):
        return loaded.certificate


class _PemFiles:
    """TlsFiles' store: the files' content tells a version; ``build()``
    loads them from their paths (Python's ssl reads a key only from a
    file), so a change between the two is a new version, loaded next."""

    kind = "TLS file"

    def __init__(self, paths, build):
        self.paths = list(paths)
        self.build = build

    def read_bytes(self):
        parts = [read_file_bytes(path, self.kind) for path in self.paths]
        return b"".join(len(part).to_bytes(8, "big") + part for part in parts)

    def signature(self):
        return tuple(stat_signature(path) for path in self.paths)

    def parse(self, data):
        from cryptography import x509

        from ..policy.principal import x500_principal_name

        pem = data[8:8 + int.from_bytes(data[:8], "big")]  # the certificate file
        try:
            cert = x509.load_pem_x509_certificates(pem)[0]
        except ValueError:
            raise QuotaStoreError("%s holds no PEM certificate" % self.paths[0]) from None
        try:
            context = self.build()
        except ValueError as exc:
            raise QuotaStoreError(str(exc)) from None
        return LoadedTls(context, "%s, valid until %s" % (
            x500_principal_name(cert.subject) or "no subject",
            cert.not_valid_after_utc.strftime("%Y-%m-%d %H:%M:%S UTC")))
