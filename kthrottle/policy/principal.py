"""The principal of a TLS client: its certificate's subject, mapped by rules
in the syntax of Kafka's ``ssl.principal.mapping.rules`` (KIP-371).

Rules are tried in order; the first whose pattern matches the whole
distinguished name (RFC 2253, as Kafka writes it: ``CN=alice,OU=team,O=org``)
gives the principal: ``RULE:pattern/replacement/`` with ``$1``-style groups,
an optional ``L`` or ``U`` after the last slash to lower- or upper-case the
result, and ``DEFAULT`` for the whole name unchanged. When no rule matches,
the client has no principal and is refused, as Kafka refuses it.
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
