"""vllm-mla-fixes: in-place fixes for known MLA failures of vLLM.

vLLM calls :func:`register` in every process it starts (entry point
``vllm.general_plugins: mla_fixes``).  It applies each fix whose gate says the
installed build needs it, never raises, and records a status per fix.
"""

from __future__ import annotations

import logging
import threading
from typing import cast

from vllm_mla_fixes import settings
from vllm_mla_fixes.fixes import ALL_FIXES, FIX_NAMES, FIXES_BY_NAME, SELECTION, SETTINGS
from vllm_mla_fixes.patching import AppliedFix, FixStatus, State, installed_vllm_version, run_fix

__all__ = ["installed_vllm_version", "register", "status", "revert_all"]

ENV_VAR = SELECTION.name
PLUGIN_NAME = "mla_fixes"  # the vllm.general_plugins entry point
__version__ = "0.1.0"

_lock = threading.Lock()
_results: dict[str, AppliedFix] = {}


def _logger() -> logging.Logger:
    try:  # vLLM's own logger, so our lines carry vLLM's format and level
        from vllm.logger import init_logger
    except Exception:
        return logging.getLogger("vllm.mla_fixes")
    return cast(logging.Logger, init_logger("vllm.mla_fixes"))


def register() -> None:
    """vLLM general-plugin entry point: apply every needed fix; idempotent; never raises."""
    try:
        _register()
    except Exception as exc:  # the plugin must never take vLLM down
        logging.getLogger("vllm.mla_fixes").warning(
            "vllm-mla-fixes: internal error, no further fixes applied: %s: %s",
            type(exc).__name__,
            exc,
        )


def _register() -> None:
    log = _logger()
    with _lock:
        settings.warn_invalid(log, SETTINGS)
        selected = settings.value(SELECTION)
        if selected is None:
            selected = frozenset(FIX_NAMES)
        version = installed_vllm_version()
        for fix in ALL_FIXES:
            name = fix.INFO.name
            if name in _results and _results[name].status.state is State.APPLIED:
                continue
            if name not in selected:
                _results[name] = AppliedFix(
                    FixStatus(name, State.DISABLED, f"not selected by {ENV_VAR}")
                )
                continue
            if version is None:
                _results[name] = AppliedFix(FixStatus(name, State.SKIPPED, "vLLM is not installed"))
                continue
            result = run_fix(fix, version)
            previous = _results.get(name)
            _results[name] = result
            if previous is not None and previous.status == result.status:
                continue  # said once in this process already (vLLM may load plugins again)
            if result.status.state is State.APPLIED:
                log.info("vllm-mla-fixes: applied %s (%s)", name, result.status.reason)
            elif result.status.state is State.SKIPPED:
                log.warning(
                    "vllm-mla-fixes: %s not applied, vLLM left untouched: %s",
                    name,
                    result.status.reason,
                )


def status() -> list[FixStatus]:
    """One record per known fix, in order; ``not evaluated`` before :func:`register` ran."""
    with _lock:
        return [_status_of(fix.INFO.name) for fix in ALL_FIXES]


def _status_of(name: str) -> FixStatus:
    result = _results.get(name)
    if result is None:
        return FixStatus(name, State.SKIPPED, _why_not_evaluated())
    if result.patch is not None and result.patch.failed:
        return FixStatus(
            name, State.SKIPPED, f"{result.patch.failed}; reverted, vLLM left as it was"
        )
    if result.status.state is State.APPLIED:
        # A fix whose choice is made per engine after register() says what it chose.
        return FIXES_BY_NAME[name].status_in_process(result.status)
    return result.status


def _why_not_evaluated() -> str:
    allowed = settings.environment_variable("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        # vLLM's loader takes exactly the names VLLM_PLUGINS lists, split at commas
        return (
            f"not loaded: VLLM_PLUGINS={settings.shown(allowed)} does not name {PLUGIN_NAME}, "
            "so vLLM does "
            f"not load this plugin; add {PLUGIN_NAME} to it, or unset it to load every plugin"
        )
    return "not evaluated: the plugin has not run in this process"


def revert_all() -> None:
    """Undo every applied fix in this process (tests use it)."""
    with _lock:
        for name in reversed(list(_results)):
            patch = _results[name].patch
            if patch is not None:
                patch.revert()
        _results.clear()
        settings.forget_warnings()
