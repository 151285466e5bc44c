"""pytest plugin for vLLM's own unit tests (from the release sdist): a CPU host
that reports SM120, with ``dsv41-sm120-geometry`` applied or not.

Loaded with ``-p sm120_plugin`` (this folder on ``PYTHONPATH``) by the
``upstream-tests-0.34.0`` nox session, which runs the same modules twice and
compares the outcomes.  ``VLLM_MLA_FIXES_UPSTREAM_FIX`` is ``on`` or ``off``;
``VLLM_MLA_FIXES_UPSTREAM_OUTCOMES`` names the JSON file that receives one
outcome per test id (``passed``, ``failed``, ``skipped``, ``error``).

SM120 is pretended the way ``vllm-mla-fixes verify`` pretends it: vLLM's
current platform answers the capability and SM-count queries as an RTX PRO
6000 would, and vLLM's own capability logic runs on those answers.  The fix is
applied as on such a device (``for_capability((12, 0))``), so its probe reads
the installed sources exactly as on the GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

FIX_ENV = "VLLM_MLA_FIXES_UPSTREAM_FIX"
OUTCOMES_ENV = "VLLM_MLA_FIXES_UPSTREAM_OUTCOMES"

_session: dict = {"stack": None, "outcomes": {}}


def pytest_configure(config):
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.simulated import sm120_platform
    from vllm_mla_fixes.patching import State, run_fix

    mode = os.environ.get(FIX_ENV)
    if mode not in ("on", "off"):
        raise RuntimeError(f"{FIX_ENV} must be 'on' or 'off', not {mode!r}")
    stack = contextlib.ExitStack()
    stack.enter_context(sm120_platform((12, 0)))
    if mode == "on":
        import vllm

        result = run_fix(fix.for_capability((12, 0)), vllm.__version__)
        if result.status.state is not State.APPLIED:
            stack.close()
            raise RuntimeError(f"{fix.INFO.name} did not apply: {result.status.reason}")
        assert result.patch is not None  # an applied fix holds its patch
        stack.callback(result.patch.revert)
    _session["stack"] = stack


def pytest_runtest_logreport(report):
    outcomes = _session["outcomes"]
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if report.when != "call" and report.outcome == "failed":
            outcome = "error"
        # The first non-pass of a test (setup error, call failure) decides it.
        if outcomes.get(report.nodeid, "passed") == "passed":
            outcomes[report.nodeid] = outcome


def pytest_collectreport(report):
    if report.failed:  # a module that does not import here counts as one outcome
        _session["outcomes"][report.nodeid] = "error"


def pytest_sessionfinish(session, exitstatus):
    target = os.environ.get(OUTCOMES_ENV)
    if target:
        Path(target).write_text(json.dumps(_session["outcomes"], indent=1, sort_keys=True))


def pytest_unconfigure(config):
    stack = _session["stack"]
    if stack is not None:
        stack.close()
