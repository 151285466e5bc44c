"""What the release rule decides, per fix and release (``test_gate_rule.py``),
for each fix in ``ALL_FIXES``: a fix with a test folder of its own keeps its
rows there, in ``gate_rule_expected.py`` (``EXPECTED``); the others' rows are
here.  ``PROBE``: the rule leaves the release to the fix's probe."""

from __future__ import annotations

import importlib

from vllm_mla_fixes.fixes import ALL_FIXES

PROBE = "probe"

OWN_TABLES = {
    "fp8-ds-mla-reshape": {
        "0.24.0": "not-needed",
        "0.25.0": PROBE,
        "0.25.1": PROBE,
        "0.25.2rc1.dev1133+g1234abc": PROBE,
        "0.26.0": "not-needed",
        "0.26.0+cu130": "not-needed",
        "0.26.1.dev3+gabcdef0": "not-needed",
        "0.34.0": "not-needed",
        "0.40.0": "not-needed",
    },
    "fa4-compile-strides": {
        "0.23.0": "not-needed",
        "0.23.1rc1.dev1133+g1234abc": PROBE,
        "0.24.0": PROBE,
        "0.25.1": PROBE,
        "0.26.0": "not-needed",
        "0.26.1.dev3+gabcdef0": "not-needed",
        "0.40.0": "not-needed",
    },
}


def expected_decisions() -> dict[str, dict[str, str]]:
    """Each fix's rows, in the order of ``ALL_FIXES``."""
    tables = {}
    for fix in ALL_FIXES:
        name = fix.INFO.name
        if name in OWN_TABLES:
            tables[name] = OWN_TABLES[name]
        else:
            folder = fix.INFO.name.replace("-", "_")  # its module and test folder
            tables[name] = importlib.import_module(f"{folder}.gate_rule_expected").EXPECTED
    return tables
