"""When a periodic operation that keeps failing is worth a log line.

A report published every few seconds, or a read retried, to a cluster that is
gone fails every time until it is back: one line per failure would bury
everything else in the log. ``Outage`` says which failures to log: the first
(with why), each reason not yet logged in the same outage, and the first
success after it, with how many failed meanwhile. The metrics count every
failure. No I/O, no clock.
"""
import re

# Reasons logged per outage at most: a reason that carries a changing detail
# must not turn into a line per failure.
MAX_REASONS = 5
# Numbers in a reason (a time waited, a count) do not make it another reason.
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


class Outage:
    def __init__(self, max_reasons=MAX_REASONS):
        self.max_reasons = max_reasons
        self.failures = 0  # in the current outage; 0 while the operation works
        self.reason = None  # of the last failure
        self._logged = []  # reasons logged in the current outage

    @property
    def failing(self):
        return self.failures > 0

    def failed(self, reason):
        """Count a failure; True when it is worth a line (the first of an
        outage, or a reason not logged yet in it)."""
        self.failures += 1
        self.reason = reason
        key = _NUMBER.sub("#", reason)
        if key in self._logged or len(self._logged) >= self.max_reasons:
            return False
        self._logged.append(key)
        return True

    def recovered(self):
        """A success: how many failed in the outage it ends (0: there was
        none, nothing to say)."""
        failures, self.failures = self.failures, 0
        self.reason = None
        self._logged = []
        return failures
