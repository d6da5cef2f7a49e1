"""Settings declared once.

An ``Option`` is one setting: its name is both the long flag (``--NAME``) and
the TOML key (``NAME``); it says how the flag's text and the TOML value are
read (its ``Kind``), its attribute name, default, help and metavar. An
``OptionGroup`` is a titled list of them: it puts them on an argparse parser
(one argument group in ``--help``) and reads them back from the parsed
namespace or from a TOML table. Commands and components declare the options
they read; nothing else repeats them.
"""
import argparse
import copy
import dataclasses
import re


class ConfigError(ValueError):
    """Bad configuration: the message says which key and why."""


def arg_type(parse):
    """An argparse ``type`` from ``parse(text)``: its ValueError (ConfigError
    included) becomes argparse's message, after "argument --NAME: "."""

    def check(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    check.__name__ = getattr(parse, "__name__", "value")
    return check


class CommandParser(argparse.ArgumentParser):
    """The parser of ``kthrottle`` and of each of its commands (argparse
    makes the subcommands' parsers of the top one's class).

    An error is one line naming the command it is about, then where to read
    more, as command-line tools have it::

        kthrottle proxy: error: argument --max-frame-size: invalid int value: 'x'
        Try 'kthrottle proxy --help' for more information.

    not argparse's whole usage first. An argument no parser knows is refused
    by the (sub)command that was given it (argparse leaves it to the top
    parser, whose message would name ``kthrottle`` and print its usage), so
    parse_known_args returns no extras: every caller here wants them refused.
    --help is argparse's own."""

    def error(self, message):
        self.exit(2, "%s: error: %s\nTry '%s --help' for more information.\n"
                  % (self.prog, message, self.prog))

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: %s" % " ".join(extras))
        return namespace, extras


# values shared by several commands --------------------------------------------------

def parse_host_port(value, what):
    """Parse ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6)."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError("%s must be HOST:PORT, got %r" % (what, value))
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port)
    except ValueError:
        raise ConfigError("%s has a port that is not a number: %r" % (what, value)) from None
    if not host or not 0 <= port <= 65535:
        raise ConfigError("%s must be HOST:PORT with a port in 0-65535, got %r" % (what, value))
    return host, port


def parse_zookeeper(value, what="zookeeper"):
    """Check ``HOST:PORT[,HOST:PORT...][/chroot]`` (ZooKeeper's connect string,
    as Kafka's zookeeper.connect takes it); returns it unchanged."""
    if not isinstance(value, str) or not value:
        raise ConfigError("%s must be HOST:PORT[,HOST:PORT...][/chroot]" % what)
    hosts, slash, chroot = value.partition("/")
    for host in hosts.split(","):
        parse_host_port(host, what)
    if slash and (not chroot or chroot.endswith("/") or "//" in chroot):
        raise ConfigError("%s has a bad chroot %r (like /kafka)" % (what, "/" + chroot))
    return value


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*$", re.I)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text):
    """Seconds from ``30s``, ``5m``, ``500ms``, ``1h`` or plain seconds (``30``,
    ``0.5``); ValueError if it is not a positive duration."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError("not a duration: %r (like 30s, 5m, 500ms or a number of seconds)"
                         % (text,))
    seconds = float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "s").lower()]
    if seconds <= 0:
        raise ValueError("a duration must be positive, got %r" % (text,))
    return seconds


def split_names(text):
    """``a, b,,c`` -> ["a", "b", "c"]."""
    return [name.strip() for name in text.split(",") if name.strip()]


# kinds: how a value is read ------------------------------------------------------

class Kind:
    """How one setting is read: ``flag(text, what)`` from a flag's text,
    ``toml(value, what)`` from a TOML value; ``what`` names the setting in
    messages (``--NAME`` for a flag, ``NAME`` for a TOML key)."""

    def toml(self, value, what):
        raise NotImplementedError

    def flag(self, text, what):
        return self.toml(text, what)

    def arg_type(self, what):
        """argparse's ``type`` for the flag (None: the text as it is)."""
        return arg_type(lambda text: self.flag(text, what))


class Text(Kind):
    """A string; in TOML a non-empty one."""

    def __init__(self, needs="a non-empty string"):
        self.needs = needs

    def toml(self, value, what):
        if not isinstance(value, str) or not value:
            raise ConfigError("%s must be %s" % (what, self.needs))
        return value

    def flag(self, text, what):
        return text

    def arg_type(self, what):
        return None


class Integer(Kind):
    def toml(self, value, what):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError("%s must be an integer, got %r" % (what, value))
        return value

    def arg_type(self, what):
        return int  # argparse's own "invalid int value"


class Number(Kind):
    def toml(self, value, what):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError("%s must be a number, got %r" % (what, value))
        return float(value)

    def arg_type(self, what):
        return float


class Names(Kind):
    """A list of names: a TOML list, or ``a,b`` (a flag's only form)."""

    def toml(self, value, what):
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError("%s must be a list of names" % what)
        return [v.strip() for v in value if v.strip()]

    def flag(self, text, what):
        return split_names(text)


class Choice(Kind):
    """One of ``choices``, in any case (Kafka's names are upper case)."""

    def __init__(self, choices):
        self.choices = tuple(choices)

    def toml(self, value, what):
        name = value.strip().upper() if isinstance(value, str) else value
        if name not in self.choices:
            raise ConfigError("%s must be one of %s, got %r"
                              % (what, ", ".join(self.choices), value))
        return name


class HostPort(Kind):
    def toml(self, value, what):
        return parse_host_port(value, what)


class HostPorts(HostPort):
    """Repeatable HOST:PORT: one per flag, a list (or one string) in TOML."""

    def toml(self, value, what):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError("%s must be a list of HOST:PORT strings" % what)
        return [parse_host_port(v, what) for v in value]

    def flag(self, text, what):
        return parse_host_port(text, what)


class Parsed(Kind):
    """Read by ``parse(value, what)``, for flags and TOML alike."""

    def __init__(self, parse):
        self.parse = parse

    def toml(self, value, what):
        return self.parse(value, what)


class Switch(Kind):
    """On or off: a flag without a value (``--NAME`` turns it on), a TOML
    boolean."""

    def toml(self, value, what):
        if not isinstance(value, bool):
            raise ConfigError("%s must be true or false, got %r" % (what, value))
        return value


class ClassWithConfig(Kind):
    """``module:Class``, or in TOML a table ``{class = "module:Class",
    config = {...}}`` (``[NAME]`` with ``class``, and ``[NAME.config]``):
    a dict {"class": ..., "config": {...}}."""

    def toml(self, value, what):
        if isinstance(value, str) and value:
            return {"class": value, "config": {}}
        if not isinstance(value, dict):
            raise ConfigError("%s must be \"module:Class\" or a table with class and config"
                              % what)
        unknown = set(value) - {"class", "config"}
        if unknown:
            raise ConfigError("[%s]: unknown key %s (known: class, config)"
                              % (what, ", ".join(sorted(map(repr, unknown)))))
        spec = value.get("class")
        if not isinstance(spec, str) or not spec:
            raise ConfigError("[%s]: class must be \"module:Class\"" % what)
        config = value.get("config", {})
        if not isinstance(config, dict):
            raise ConfigError("[%s.config] must be a table" % what)
        return {"class": spec, "config": config}

    def flag(self, text, what):
        return {"class": text, "config": None}  # None: the file's config, if any


TEXT, INTEGER, NUMBER, NAMES, HOST_PORT = Text(), Integer(), Number(), Names(), HostPort()
SWITCH = Switch()


# options and groups ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)  # one option is itself, a dict key
class Option:
    """One setting: flag ``--NAME``, TOML key ``NAME``, attribute ``attr``
    (NAME with - as _ unless given). ``repeat``: the flag may be given several
    times (a list). ``default`` is the configuration's, not the flag's: an
    absent flag reads as None, so that a file's value or the default holds."""

    name: str
    kind: Kind = TEXT
    attr: str = None
    default: object = None
    help: str = None
    metavar: str = None
    choices: tuple = None
    repeat: bool = False
    required: bool = False

    def __post_init__(self):
        if self.attr is None:
            object.__setattr__(self, "attr", self.name.replace("-", "_"))

    @property
    def flag(self):
        return "--" + self.name

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def default_value(self):
        return copy.deepcopy(self.default)  # a list or table of one's own

    def add_to(self, container, help=None):
        """Add the flag to a parser, an argument group or a mutually
        exclusive group."""
        if isinstance(self.kind, Switch):  # absent: None, so that a file's value holds
            container.add_argument(self.flag, dest=self.attr, action="store_const", const=True,
                                   help=self.help if help is None else help)
            return
        container.add_argument(
            self.flag, dest=self.attr, type=self.kind.arg_type(self.flag),
            action="append" if self.repeat else None, required=self.required,
            metavar=self.metavar, choices=self.choices,
            help=self.help if help is None else help)

    def from_toml(self, value):
        return self.kind.toml(value, self.name)


class OptionGroup:
    """Options shown together in ``--help`` under ``title`` (None: among the
    command's first options) with an optional ``description``."""

    def __init__(self, title, description=None, options=()):
        self.title = title
        self.description = description
        self.options = tuple(options)

    def add_to(self, parser, helps=None):
        """Add every flag; ``helps`` {name: text} replaces some help texts."""
        container = parser
        if self.title is not None:
            container = parser.add_argument_group(self.title, self.description)
        for option in self.options:
            option.add_to(container, (helps or {}).get(option.name))
        return container

    def from_args(self, namespace):
        """{attr: value} of the parsed flags (None where a flag was not given)."""
        return {o.attr: getattr(namespace, o.attr, None) for o in self.options}

    def from_toml(self, table):
        """{attr: value} of the keys of ``table`` that are this group's
        (other keys are left to the caller); ConfigError names the key."""
        return {o.attr: o.from_toml(table[o.name]) for o in self.options if o.name in table}

    def defaults(self):
        return {o.attr: o.default_value() for o in self.options}
