"""ssl.principal.mapping.rules (KIP-371), with the examples of Kafka's docs,
and the certificate subject they are matched against."""
import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.name import _ASN1Type
from cryptography.x509.oid import NameOID

from kthrottle.policy.principal import NoMatchingRule, PrincipalMapper, parse_rules

pytestmark = pytest.mark.unit

SERVICE = "CN=serviceuser,OU=ServiceUsers,O=Unknown,L=Unknown,ST=Unknown,C=Unknown"
ADMIN = "CN=adminUser,OU=Admin,O=Unknown,L=Unknown,ST=Unknown,C=Unknown"


@pytest.mark.parametrize("rules,name,principal", [
    ("DEFAULT", ADMIN, ADMIN),
    ("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/,DEFAULT", SERVICE, "serviceuser"),
    ("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/,DEFAULT", ADMIN, ADMIN),
    ("RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/L", ADMIN, "adminuser@admin"),
    ("RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/L", "CN=Duke,OU=JavaSoft,O=Sun Microsystems", "duke"),
    ("RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/U", "CN=Duke,OU=JavaSoft,O=Sun Microsystems", "DUKE"),
    ("RULE:^CN=(.*?),OU=team,O=org$/$1/", "CN=alice,OU=team,O=org", "alice"),
    (r"RULE:^CN=([^,]*),.*$/user\/$1/", "CN=alice,O=org", "user/alice"),
    ("RULE:^CN=(.*?),O=org$/$1-\\$/ , DEFAULT", "CN=alice,O=org", "alice-$"),
])
def test_kafkas_rules(rules, name, principal):
    assert PrincipalMapper(rules).principal(name) == principal


def test_no_matching_rule_refuses_the_client():
    with pytest.raises(NoMatchingRule):
        PrincipalMapper("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/").principal(ADMIN)


@pytest.mark.parametrize("rules,message", [
    ("", "no principal mapping rules"),
    ("RULE:^CN=(.*$/$1/", "not a valid regular expression"),
    ("RULE:^CN=.*$", "not closed"),
    ("SOMETHING", "must be DEFAULT or RULE"),
    ("DEFAULT DEFAULT", "separated by commas"),
])
def test_bad_rules_are_refused_with_the_reason(rules, message):
    with pytest.raises(ValueError, match=message):
        parse_rules(rules)


# The subject as Kafka sees it: Java's X500Principal.getName(). Every expected
# string below is what OpenJDK 17's X500Principal.getName() printed for the
# same certificate (a throwaway Java program run against these certificates).
_A = x509.NameAttribute
_RDN = x509.RelativeDistinguishedName
EMAIL = x509.Name([_A(NameOID.COUNTRY_NAME, "US"), _A(NameOID.ORGANIZATION_NAME, "org"),
                   _A(NameOID.ORGANIZATIONAL_UNIT_NAME, "team"), _A(NameOID.COMMON_NAME, "Alice"),
                   _A(NameOID.EMAIL_ADDRESS, "alice@example.com")])
# built CN, OU, emailAddress; a certificate holds a SET in DER order (by encoding)
MULTI_VALUED = x509.Name([
    _RDN([_A(NameOID.ORGANIZATION_NAME, "org")]),
    _RDN([_A(NameOID.COMMON_NAME, "alice"), _A(NameOID.ORGANIZATIONAL_UNIT_NAME, "team"),
          _A(NameOID.EMAIL_ADDRESS, "alice@example.com")])])
SUBJECTS = [
    (EMAIL, "1.2.840.113549.1.9.1=#1611616c696365406578616d706c652e636f6d,"
            "CN=Alice,OU=team,O=org,C=US"),
    (x509.Name([_A(NameOID.COUNTRY_NAME, "DE"), _A(NameOID.ORGANIZATION_NAME, "org"),
                _A(NameOID.COMMON_NAME, "Bob"), _A(NameOID.SERIAL_NUMBER, "4711")]),
     "2.5.4.5=#130434373131,CN=Bob,O=org,C=DE"),
    (x509.Name([_A(NameOID.DOMAIN_COMPONENT, "com"), _A(NameOID.DOMAIN_COMPONENT, "example"),
                _A(NameOID.ORGANIZATIONAL_UNIT_NAME, "people"), _A(NameOID.USER_ID, "alice")]),
     "UID=alice,OU=people,DC=example,DC=com"),
    (MULTI_VALUED,
     "OU=team+CN=alice+1.2.840.113549.1.9.1=#1611616c696365406578616d706c652e636f6d,O=org"),
    # Java escapes '#' and '=' anywhere, every leading/trailing space or CR, NUL as \00
    (x509.Name([_A(NameOID.STATE_OR_PROVINCE_NAME, "Zürich € 😀"),
                _A(NameOID.LOCALITY_NAME, "a\x00b"),
                _A(NameOID.ORGANIZATIONAL_UNIT_NAME, "trail\r"),
                _A(NameOID.ORGANIZATION_NAME, "  two leading"),
                _A(NameOID.COMMON_NAME, ' #lead,a+b;c<d>"e"\\f=g#h ')]),
     'CN=\\ \\#lead\\,a\\+b\\;c\\<d\\>\\"e\\"\\\\f\\=g\\#h\\ ,O=\\ \\ two leading,'
     'OU=trail\\\r,L=a\\00b,ST=Zürich € 😀'),
    # keywords only for RFC 2253's types, and only on string values Java decodes
    (x509.Name([_A(NameOID.ORGANIZATION_NAME, "printable", _ASN1Type.PrintableString),
                _A(NameOID.ORGANIZATIONAL_UNIT_NAME, "ia5", _ASN1Type.IA5String),
                _A(NameOID.LOCALITY_NAME, "visible", _ASN1Type.VisibleString),
                _A(NameOID.TITLE, "boss"), _A(NameOID.SURNAME, "Smith"),
                _A(NameOID.GIVEN_NAME, "Jo")]),
     "2.5.4.42=#0c024a6f,2.5.4.4=#0c05536d697468,2.5.4.12=#0c04626f7373,"
     "L=#1a0776697369626c65,OU=ia5,O=printable"),
    # Java 17 decodes a BMPString as UTF-8 (later JDKs as UTF-16: CN=bmp)
    (x509.Name([_A(NameOID.COMMON_NAME, "bmp", _ASN1Type.BMPString)]), "CN=\\00b\\00m\\00p"),
]


@pytest.fixture(scope="module")
def certificate_der():
    key = ec.generate_private_key(ec.SECP256R1())
    issuer = x509.Name([_A(NameOID.COMMON_NAME, "test ca")])

    def der(subject):
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(1)
                .not_valid_before(datetime.datetime(2020, 1, 1))
                .not_valid_after(datetime.datetime(2030, 1, 1)).sign(key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.DER)
    return der


@pytest.mark.parametrize("subject,java", SUBJECTS)
def test_certificate_subject_is_javas_x500_principal_name(certificate_der, subject, java):
    from kthrottle.proxy.tls import certificate_subject

    assert certificate_subject(certificate_der(subject)) == java


@pytest.mark.parametrize("subject,java", SUBJECTS)
def test_x500_principal_name_of_a_name_as_built(subject, java):
    from kthrottle.policy.principal import x500_principal_name

    assert x500_principal_name(subject) == java


def test_a_rule_written_for_kafka_maps_a_subject_with_an_email_address(certificate_der):
    from kthrottle.proxy.tls import certificate_subject

    rules = r"RULE:^1\.2\.840\.113549\.1\.9\.1=#16[0-9a-f]+,CN=([^,]+),OU=team,O=org,C=US$/$1/L"
    assert PrincipalMapper(rules).principal(certificate_subject(certificate_der(EMAIL))) == "alice"
