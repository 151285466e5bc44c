"""What the release rule decides for fp8-ds-mla-reshape on each version
(``tests/test_gate_rule.py``): its state, or ``PROBE`` where the rule leaves
the release to the fix's probe."""

from gate_rule_tables import PROBE

EXPECTED = {
    "0.24.0": "not-needed",
    "0.25.0": PROBE,
    "0.25.1": PROBE,
    "0.25.2rc1.dev1133+g1234abc": PROBE,
    "0.26.0": "not-needed",
    "0.26.0+cu130": "not-needed",
    "0.26.1.dev3+gabcdef0": "not-needed",
    "0.34.0": "not-needed",
    "0.40.0": "not-needed",
}
