"""The release rule's decisions for the DeepSeek-V4.1 fix: its rows of
``tests/test_gate_rule.py``'s table (read by ``tests/gate_rule_tables.py``)."""

from __future__ import annotations

from gate_rule_tables import PROBE

NOT_REVIEWED = "skipped: not reviewed: vLLM {v} is newer than 0.34.0"
NOT_COVERED = "skipped: bug present in vLLM {v}, not covered here; upgrade to 0.32.0+"

EXPECTED = {
    "0.26.0": "not-needed",
    "0.29.0": "not-needed",
    "0.30.0": NOT_COVERED,
    "0.31.0": NOT_COVERED,
    "0.31.1rc1.dev5+g1234abc": NOT_COVERED,
    "0.32.0": PROBE,
    "0.33.0": PROBE,
    "0.33.1.dev7+g1234abc": PROBE,
    "0.34.0": PROBE,
    "0.34.0+cu130": PROBE,
    "0.34.0rc2": PROBE,
    "0.34.1": NOT_REVIEWED,
    "0.34.1.dev12+g1234abc": NOT_REVIEWED,
    "0.35.0rc1.dev3+g1234abc": NOT_REVIEWED,
    "0.35.0": NOT_REVIEWED,
    "1.0.0": NOT_REVIEWED,
}
