"""Secrets kept out of log lines and tracebacks."""


def redacted_repr(*shown):
    """A NamedTuple's ``__repr__`` that shows the fields ``shown`` and of the
    others (bytes: salts, keys, salted passwords) only their length."""

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join(
            "%s=%r" % (name, value) if name in shown else "%s=<%d bytes>" % (name, len(value))
            for name, value in zip(self._fields, self)))

    return __repr__
