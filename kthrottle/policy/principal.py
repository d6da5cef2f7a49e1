"""The principal of a TLS client: its certificate's subject, mapped by rules
in the syntax of Kafka's ``ssl.principal.mapping.rules`` (KIP-371).

Rules are tried in order; the first whose pattern matches the whole
distinguished name (RFC 2253, as Kafka writes it: ``CN=alice,OU=team,O=org``)
gives the principal: ``RULE:pattern/replacement/`` with ``$1``-style groups,
an optional ``L`` or ``U`` after the last slash to lower- or upper-case the
result, and ``DEFAULT`` for the whole name unchanged. When no rule matches,
the client has no principal and is refused, as Kafka refuses it.

The name the rules see is the one Kafka sees: Java's
``X500Principal.getName()`` of the certificate's subject
(:func:`x500_principal_name`), not Python's RFC 4514 string.
"""
import re

DEFAULT_RULES = "DEFAULT"


class NoMatchingRule(ValueError):
    pass


class _Rule:
    __slots__ = ("pattern", "replacement", "case")

    def __init__(self, pattern=None, replacement=None, case=""):
        self.pattern = pattern
        self.replacement = replacement
        self.case = case

    def apply(self, name):
        if self.pattern is None:  # DEFAULT
            return name
        match = self.pattern.fullmatch(name)
        if match is None:
            return None
        result = match.expand(self.replacement)
        if self.case == "L":
            return result.lower()
        if self.case == "U":
            return result.upper()
        return result


def _java_replacement(text):
    """Java's ``$1`` groups and ``\\x`` escapes as Python's re.expand wants them."""
    out = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            out.append("\\\\" if text[i + 1] == "\\" else text[i + 1])  # a literal
            i += 2
        elif ch == "$" and i + 1 < len(text) and text[i + 1].isdigit():
            j = i + 1
            while j < len(text) and text[j].isdigit():
                j += 1
            out.append("\\g<%s>" % text[i + 1 : j])
            i = j
        else:
            out.append("\\\\" if ch == "\\" else ch)
            i += 1
    return "".join(out)


def _until_slash(text, pos, what):
    """The text up to the next unescaped '/', and the position after it."""
    out = []
    while pos < len(text):
        ch = text[pos]
        if ch == "\\" and pos + 1 < len(text):
            out.append(text[pos : pos + 2])
            pos += 2
            continue
        if ch == "/":
            return "".join(out), pos + 1
        out.append(ch)
        pos += 1
    raise ValueError("%s of a RULE is not closed by '/'" % what)


def parse_rules(text):
    """A rules string as Kafka takes it; raises ValueError naming the problem."""
    rules = []
    pos = 0
    text = text.strip()
    if not text:
        raise ValueError("no principal mapping rules (use DEFAULT)")
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\n":
            pos += 1
        if text.startswith("DEFAULT", pos):
            rules.append(_Rule())
            pos += len("DEFAULT")
        elif text.startswith("RULE:", pos):
            pattern, pos = _until_slash(text, pos + len("RULE:"), "the pattern")
            replacement, pos = _until_slash(text, pos, "the replacement")
            case = ""
            if pos < len(text) and text[pos] in "LU":
                case = text[pos]
                pos += 1
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError("RULE pattern %r is not a valid regular expression: %s"
                                 % (pattern, exc)) from None
            rules.append(_Rule(compiled, _java_replacement(replacement), case))
        else:
            raise ValueError("principal mapping rule must be DEFAULT or RULE:pattern/"
                             "replacement/[LU], at %r" % text[pos : pos + 30])
        while pos < len(text) and text[pos] in " \t\n":
            pos += 1
        if pos < len(text):
            if text[pos] != ",":
                raise ValueError("principal mapping rules are separated by commas, at %r"
                                 % text[pos : pos + 30])
            pos += 1
    return rules


class PrincipalMapper:
    def __init__(self, rules=DEFAULT_RULES):
        self.rules = parse_rules(rules)

    def principal(self, distinguished_name):
        for rule in self.rules:
            result = rule.apply(distinguished_name)
            if result is not None:
                return result
        raise NoMatchingRule("no principal mapping rule matches %r" % distinguished_name)


# Java's X500Principal.getName() (format RFC2253) of a certificate subject: the
# string Kafka's SSL principal builder hands to ssl.principal.mapping.rules
# (KIP-371), so rules written for a broker work here unchanged.
#
# RFC 2253 s2.3 lets an implementation pick which attribute types get a
# keyword; Java names only those of RFC 2253 s2.3 itself (the list below) and
# writes every other type as its dotted OID followed by '#' and the hex of the
# value's DER encoding (RFC 2253 s2.4), e.g. emailAddress as
# 1.2.840.113549.1.9.1=#16...
_RFC2253_KEYWORDS = {
    "2.5.4.3": "CN",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.6": "C",
    "2.5.4.9": "STREET",
    "0.9.2342.19200300.100.1.25": "DC",
    "0.9.2342.19200300.100.1.1": "UID",
}
# The DER string types Java writes as text (PrintableString, T61String,
# IA5String, GeneralString, BMPString, UTF8String); any other type of value
# (NumericString, VisibleString, UniversalString, BIT STRING, ...) is written
# in the '#' hex form even under a keyword.
_TEXT_TAGS = frozenset((0x13, 0x14, 0x16, 0x1B, 0x1E, 0x0C))
# Characters Java prefixes with a backslash: RFC 2253 s2.4's list plus '=' and
# '#' wherever they occur (RFC 2253 only requires a leading '#').
_BACKSLASHED = frozenset(',=+<>#;"\\')
# Java's UTF-8 decoder (java.lang.String) takes ED followed by A0..BF, the
# start of an encoded UTF-16 surrogate, as one malformed sequence of up to
# three bytes where Python's takes one per byte: one U+FFFD for it, as Java.
_SURROGATE_PREFIX = re.compile(rb"\xed[\xa0-\xbf][\x80-\xbf]?")


def _der_elements(data):
    """The (tag, whole encoding, contents) of consecutive DER elements."""
    pos = 0
    while pos < len(data):
        tag = data[pos]
        if tag & 0x1F == 0x1F:
            raise ValueError("multi-byte DER tags do not occur in a Name")
        length = data[pos + 1]
        start = pos + 2
        if length & 0x80:
            size = length & 0x7F
            length = int.from_bytes(data[start : start + size], "big")
            start += size
        end = start + length
        if end > len(data):
            raise ValueError("truncated DER element")
        yield tag, data[pos:end], data[start:end]
        pos = end


def _oid_text(contents):
    """An OBJECT IDENTIFIER's contents as the dotted decimal string."""
    arcs = []
    value = 0
    for byte in contents:
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            arcs.append(value)
            value = 0
    first = min(arcs[0] // 40, 2)
    return ".".join(map(str, [first, arcs[0] - 40 * first] + arcs[1:]))


def _java_text(contents):
    r"""A string value as Java writes it: decoded as UTF-8 whatever its string
    type (Java 17's sun.security.x509.AVA; malformed bytes become U+FFFD),
    RFC 2253 s2.4's escapes, NUL as \00, and every leading or trailing space
    or CR escaped, not only the first and last."""
    chars = []
    text = _SURROGATE_PREFIX.sub("\ufffd".encode(), contents).decode("utf-8", "replace")
    for ch in text:
        if ch in _BACKSLASHED:
            chars.append("\\")
            chars.append(ch)
        elif ch == "\0":
            chars.extend("\\00")
        else:
            chars.append(ch)
    lead = 0
    while lead < len(chars) and chars[lead] in " \r":
        lead += 1
    trail = len(chars)
    while trail > lead and chars[trail - 1] in " \r":
        trail -= 1
    return ("".join("\\" + ch for ch in chars[:lead]) + "".join(chars[lead:trail])
            + "".join("\\" + ch for ch in chars[trail:]))


def x500_principal_name(name):
    """The subject ``name`` (a ``cryptography.x509.Name``) exactly as Java's
    ``X500Principal.getName()`` writes it, which is what Kafka matches
    ``ssl.principal.mapping.rules`` against: RDNs last to first joined by ','
    (RFC 2253 s2.1), the attributes of a multi-valued RDN joined by '+' in
    their DER order (a SET OF sorted by encoding, the order Java reads them
    from the certificate; cryptography refuses certificates whose sets are out
    of that order), keywords only for RFC 2253's types, other types as
    ``OID=#hex`` of the DER value.

    Java 17 decodes every text type as UTF-8; later Java releases decode
    BMPString as UTF-16 and the 8-bit types as ISO-8859-1, which differs only
    for BMPStrings and non-ASCII bytes in the 8-bit types (rare in client
    certificates). This follows Java 17, the oldest Java a Kafka 4 broker
    runs on (KIP-1013)."""
    ((_, _, sequence),) = _der_elements(name.public_bytes())
    rdns = []
    for tag, _, rdn in _der_elements(sequence):
        if tag != 0x31:
            raise ValueError("a Name is a sequence of SETs")
        written = []
        for _, _, attribute in _der_elements(rdn):
            (_, _, oid), (value_tag, value, contents) = _der_elements(attribute)
            oid = _oid_text(oid)
            keyword = _RFC2253_KEYWORDS.get(oid)
            if keyword is None or value_tag not in _TEXT_TAGS:
                written.append("%s=#%s" % (keyword or oid, value.hex()))
            else:
                written.append("%s=%s" % (keyword, _java_text(contents)))
        rdns.append("+".join(written))
    return ",".join(reversed(rdns))
