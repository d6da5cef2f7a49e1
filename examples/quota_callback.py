"""An example quota callback for kthrottle (``--quota-callback``): teams'
budgets kept in a TOML file of their own, re-read when it changes.

    [quota-callback]
    class = "examples/quota_callback.py:TeamQuotas"
    [quota-callback.config]
    budgets = "/etc/kthrottle/teams.toml"

with ``/etc/kthrottle/teams.toml``::

    [teams.analytics]
    members = ["alice", "bob"]          # principal names
    producer_byte_rate = 1048576        # shared by every member, on every client
    consumer_byte_rate = 4194304

A principal in no team has no quota from this callback. The methods are
KIP-257's ClientQuotaCallback (kthrottle.policy.quota_callback): the proxy
asks for a client's tags once and caches the bucket they name, so these run
when a client first connects and after a change, never per request.
"""
import os
import tomllib

KEYS = {"PRODUCE": "producer_byte_rate", "FETCH": "consumer_byte_rate",
        "REQUEST": "request_rate", "CONTROLLER_MUTATION": "controller_mutation_rate"}


class TeamQuotas:
    def configure(self, config):
        self.path = config["budgets"]
        self._read()

    def _read(self):
        self.seen = os.stat(self.path).st_mtime_ns
        with open(self.path, "rb") as f:
            teams = tomllib.load(f).get("teams", {})
        self.team_of = {member: team for team, body in teams.items()
                        for member in body.get("members", ())}
        self.budgets = teams

    def quota_metric_tags(self, quota_type, principal, client_id):
        team = self.team_of.get(principal.name)
        return {"team": team} if team is not None else None  # None: no quota

    def quota_limit(self, quota_type, metric_tags):
        budget = self.budgets.get(metric_tags.get("team"), {})
        return budget.get(KEYS[quota_type])  # None: unlimited

    def update_quota(self, quota_type, entity, new_value):
        pass  # the budgets are this file's, not the quota source's

    def remove_quota(self, quota_type, entity):
        pass

    def quota_reset_required(self, quota_type):
        # asked once a second: a changed file is read again, and every
        # client's tags and every limit are asked for again
        try:
            changed = os.stat(self.path).st_mtime_ns != self.seen
        except OSError:
            return False  # gone for now: the budgets read last stay
        if changed:
            self._read()
        return changed

    def update_cluster_metadata(self, cluster):
        return False  # partition leaders do not matter here

    def close(self):
        pass
