"""What ``status`` says of the fix in this process: each engine's decision.

``status --json`` and ``doctor --json`` show a decision through the same
:func:`engine_report`, so the object ``doctor`` predicts for a line is the one
the engine's own process shows for it."""

from __future__ import annotations

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import Decision
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import GAIN_TO_APPLY, GEOMETRY_ENV
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import Geometry
from vllm_mla_fixes.patching import FixStatus, State

RULE = (
    f"geometry chosen per engine when its model loads: {Geometry.UPSTREAM.value} (the fix "
    "steps aside) where upstream's layout for the line starts and every page is inside the "
    "installed kernels' own envelopes, unless the fix's layout, planned on the model's "
    f"layers, holds at least {GAIN_TO_APPLY:.2f}x its KV tokens; else "
    f"{Geometry.SPLIT.value} by default (also with DSpark drafters that read no ratio-1 "
    f"cache, ngram and suffix), {Geometry.PER_RATIO.value} with EAGLE-style or other "
    "speculative methods, a KV connector other than CPU offloading, DCP/PCP > 1, HiSparse, "
    "another KV record, ratio-1 caches that do not pair up, or "
    f"{GEOMETRY_ENV}=per-ratio"
)


def engine_report(engine: EngineConfig, decision: Decision) -> dict[str, object]:
    """One engine's decision as ``status --json`` and ``doctor --json`` show it."""
    return {"engine": engine.as_dict(), **decision.as_dict()}


def engine_reports() -> list[dict[str, object]]:
    """Every engine decided in this process, in the order they were decided."""
    reports = []
    for engine, decision in list(STATE.decisions.items()):
        report = engine_report(engine, decision)
        report["spec_mismatches"] = list(STATE.spec_mismatches.get(engine, ()))
        reports.append(report)
    return reports


def status_detail() -> str:
    """The decisions in force in this process, or the rule before any engine."""
    decided = list(STATE.decisions.values())
    if not decided:
        return RULE
    lines = [decision_detail(decision) for decision in decided]
    mismatches = [line for found in STATE.spec_mismatches.values() for line in found]
    if mismatches:
        lines.append(f"live specs that differ from the planned ones: {'; '.join(mismatches)}")
    return "; ".join(lines)


def decision_detail(decision: Decision) -> str:
    """One engine's decision, its reason and what could not be read for it."""
    line = f"geometry {decision.geometry.value} ({decision.reason})"
    if decision.evidence:
        line += f" [could not read: {'; '.join(decision.evidence)}]"
    return line


def status_in_process(applied: FixStatus) -> FixStatus:
    """The applied fix's status with this process's decisions: not-needed
    where every engine here kept upstream's own layout."""
    state = State.NOT_NEEDED if STATE.stepped_aside_everywhere() else State.APPLIED
    return FixStatus(applied.name, state, f"{applied.reason}; {status_detail()}")
