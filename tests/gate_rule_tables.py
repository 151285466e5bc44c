"""What the release rule decides, per fix and release (``test_gate_rule.py``),
for each fix in ``ALL_FIXES``: every fix keeps its rows in its own test
folder, ``tests/<fix>/gate_rule_expected.py`` (``EXPECTED``: version -> the
state, or ``PROBE`` where the rule leaves the release to the fix's probe)."""

from __future__ import annotations

import importlib

from fix_releases import fix_test_folder

from vllm_mla_fixes.fixes import ALL_FIXES

PROBE = "probe"


def expected_decisions() -> dict[str, dict[str, str]]:
    """Each fix's rows, in the order of ``ALL_FIXES``."""
    return {
        fix.INFO.name: importlib.import_module(
            f"{fix_test_folder(fix.INFO).name}.gate_rule_expected"
        ).EXPECTED
        for fix in ALL_FIXES
    }
