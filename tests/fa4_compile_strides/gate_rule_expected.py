"""What the release rule decides for fa4-compile-strides on each version
(``tests/test_gate_rule.py``): its state, or ``PROBE`` where the rule leaves
the release to the fix's probe."""

from gate_rule_tables import PROBE

EXPECTED = {
    "0.23.0": "not-needed",
    "0.23.1rc1.dev1133+g1234abc": PROBE,
    "0.24.0": PROBE,
    "0.25.1": PROBE,
    "0.26.0": "not-needed",
    "0.26.1.dev3+gabcdef0": "not-needed",
    "0.40.0": "not-needed",
}
