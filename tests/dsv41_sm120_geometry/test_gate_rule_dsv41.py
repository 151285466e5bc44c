"""The release rule on the DeepSeek-V4.1 fix, the one fix still open upstream
(the shared rule tests are in ``tests/test_gate_rule.py``; this fix's rows of
their table are in ``gate_rule_expected.py`` beside this file)."""

from __future__ import annotations

import logging

from log_records import KeptRecords

from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import State


def test_plugin_warns_naming_the_newest_reviewed_release(fresh_plugin, monkeypatch):
    import vllm
    import vllm.logger  # noqa: F401  its logging set-up clears child handlers: run it first

    handler = KeptRecords()
    records = handler.records
    logger = logging.getLogger("vllm.mla_fixes")
    logger.addHandler(handler)
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv("VLLM_MLA_FIXES", raising=False)
    try:
        fresh_plugin.register()
    finally:
        logger.removeHandler(handler)
    status = {s.name: s for s in fresh_plugin.status()}
    assert status["dsv41-sm120-geometry"].state is State.SKIPPED
    for fixed_upstream in (f.INFO.name for f in ALL_FIXES if f.INFO.fixed_in is not None):
        assert status[fixed_upstream].state is State.NOT_NEEDED
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "dsv41-sm120-geometry" in warnings[0] and "not reviewed" in warnings[0]
    assert "newer than 0.34.0, the newest release reviewed for this fix" in warnings[0]
