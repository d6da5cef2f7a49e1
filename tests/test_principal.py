"""ssl.principal.mapping.rules (KIP-371), with the examples of Kafka's docs."""
import pytest

from kthrottle.policy.principal import NoMatchingRule, PrincipalMapper, parse_rules

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
