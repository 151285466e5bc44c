"""``vllm-mla-fixes selftest``: the DeepSeek-V4.1 KV page geometry, proven on this machine.

A tiny DeepSeek-V4.1 KV layout (both compress ratios, sliding window, kv and
index sources) is planned, allocated, bound and given metadata by the
installed vLLM's own code, with ``dsv41-sm120-geometry`` applied as the plugin
applies it on SM12x.  A serving timeline (:mod:`.timeline`: chunked prefill,
a prefix-cache hit with SWA bounded replay, decoder replay, a CUDA-graph
padded decode, freed blocks reused after zeroing) writes random latents with
the writers vLLM uses on this device and reads them back with the readers:
FlashInfer's SM120 sparse-MLA decode and prefill, DeepGEMM's paged MQA logits
and the indexer-K gather on an SM12x GPU, PyTorch stand-ins for whatever the
device lacks (:mod:`.kernels`).  Every read is compared with a dense PyTorch
reference, and a sentinel fill accounts for every byte (:mod:`.harness`,
:mod:`.accounting`).

Geometries: the fix's default (interleaved split) and its fallback (per-ratio)
must pass; the control (the split with untranslated ratio-1 writer slots, the
bug class of vLLM PR #56509) must be caught in every case; upstream's own
layout is run where it starts, for information, and last.  On a GPU each
geometry runs in a process of its own (:mod:`.isolation`), as on a CPU with
more than one job, so a CUDA fault in one layout cannot change another's
verdict.  Exit status: 0 pass, 1 a mismatch or a missed control, 2 cannot run
here (the reason is printed).

On a machine without a GPU call :func:`.env.prepare_process_env` before vLLM is
imported (the CLI does): vLLM's Triton kernels then run in Triton's interpreter.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kernels import Device
    from .pairing import DecodeTiming
    from .report import Report

from .isolation import DEFAULT_LIMIT_SECONDS
from .verdicts import EXIT_OK

DEFAULT_GEOMETRIES = ("split", "fallback", "control", "upstream")


def _preflight(device: Device) -> str | None:
    """Why the self-test cannot run here, or None."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.patching import (
        CannotProbe,
        TargetMismatch,
        installed_vllm_version,
        release_decision,
    )

    version = installed_vllm_version()
    if version is None:
        return "vLLM is not installed in this environment"
    decided = release_decision(fix.INFO, version)
    if decided is not None:
        return (
            f"{fix.INFO.name} is {decided.state.value} on vLLM {version}: {decided.reason}. "
            f"The self-test proves that fix's geometry, which covers vLLM "
            f"{', '.join(fix.INFO.covered_releases)}"
        )
    if device.kind == "cpu":
        from .env import interpreter_problem

        problem = interpreter_problem()
        if problem is not None:
            return f"vLLM's Triton kernels cannot run on this CPU: {problem}"
    try:
        reason = fix.probe((12, 0))
    except (CannotProbe, TargetMismatch) as exc:
        return f"{fix.INFO.name} does not apply to this vLLM build: {exc}"
    if reason is not None:
        return f"{fix.INFO.name} finds nothing to fix in this vLLM build: {reason}"
    return None


def plan_geometries(
    device: Device, requested: tuple[str, ...]
) -> tuple[tuple[str, ...], list[str]]:
    """The geometries to run on ``device``, in the order they run, and notes on
    any left out.  Upstream's layout runs after the others: even where they
    share a process (a CPU run with one job), a fault in it comes after their rows."""
    notes = []
    names = tuple(g for g in requested if g != "upstream")
    if "control" in names and device.kind == "cuda" and _writes_mxfp8_records():
        # The control takes the split's ratio-1 slot translation out; the fix
        # lays out no split on a V4.1 MXFP8 record, so there is none to take out.
        names = tuple(g for g in names if g != "control")
        notes.append(
            "the control is not run on this GPU: vLLM writes the V4.1 MXFP8 KV record "
            "here, on which the fix lays out its per-ratio geometry (the interleaved "
            "split is proven on the V4 record only), so the control has no ratio-1 slot "
            "translation to take out"
        )
    if "upstream" in requested:
        if device.kind == "cuda":
            # vLLM lays out upstream's caches for the device it runs on: on an
            # SM12x GPU that is upstream's SM12x layout itself (the definitive
            # answer there); on another GPU it is not the layout in question.
            notes.append(
                "upstream's SM12x layout is not run on this GPU: vLLM lays out "
                "upstream's caches for the device it runs on, and this is not an SM12x GPU"
            )
        else:
            names += ("upstream",)
    return names, notes


def _writes_mxfp8_records() -> bool:
    """Whether the installed release writes the V4.1 MXFP8 KV record on this
    GPU (its layer's own ``_use_v41_mxfp8_kv_record``: SM100)."""
    from .layout import kv_records

    try:
        return kv_records().mxfp8
    except ImportError:  # no DeepSeek-V4.1 in this release: nothing runs anyway
        return False


def jobs_problem(device: Device, jobs: int | None) -> str | None:
    """Why ``--jobs`` cannot be honoured on ``device``, or None."""
    if device.kind == "cpu" or jobs is None or jobs == 1:
        return None
    return (
        f"--jobs {jobs}: on a GPU ({device.label}) the geometries run one after "
        "another, each in a process of its own, so that they do not share the GPU "
        "or disturb each other's timings; leave out --jobs (or pass --jobs 1)"
    )


def run_selftest(
    geometries: tuple[str, ...] | None = None,
    jobs: int | None = None,
    timing: bool = True,
    geometry_limit_seconds: float | None = None,
) -> Report:
    """Run the self-test on the local device; never raises for what it finds.
    ``timing=False`` skips every timing; ``geometry_limit_seconds`` bounds each
    process where the geometries (and on a GPU the kernel timing) run in
    processes of their own."""
    import vllm

    from .kernels import Kernels, detect_device
    from .report import Report
    from .timing import slot_translation_cost

    device = detect_device()
    kernels = Kernels.for_device(device)
    report = Report(str(vllm.__version__), device, kernels, [])
    report.cannot_run = jobs_problem(device, jobs) or _preflight(device)
    if report.cannot_run is not None:
        return report
    names, report.notes = plan_geometries(device, geometries or DEFAULT_GEOMETRIES)
    if device.kind == "cpu":
        jobs = jobs or min(len(names), os.cpu_count() or 1)
    report.isolated = device.kind != "cpu" or (jobs or 1) > 1
    limit = geometry_limit_seconds or DEFAULT_LIMIT_SECONDS
    if report.isolated:
        from .isolation import run_isolated

        report.results = run_isolated(names, device, jobs or 1, limit)
    else:
        from .harness import run_geometry

        report.results = [run_geometry(name, device, kernels) for name in names]
    report.kernel_timing = _kernel_timing(device, report, timing, limit)
    if timing:
        try:
            report.timing = slot_translation_cost(device)
        except Exception:  # the timing is a figure, not a verdict
            report.timing = []
            traceback.print_exc()
    return report


def _kernel_timing(device: Device, report: Report, timing: bool, limit: float) -> DecodeTiming:
    """The decode step's reading kernels timed on a GPU, the fix's default
    layout against upstream's where it read back exactly here, else against
    a dense layout of the same tokens (:mod:`.pairing`)."""
    from .clock import NOT_TIMED_CPU
    from .pairing import DENSE, FIX_GEOMETRY, UPSTREAM, DecodeTiming
    from .report import geometry_verdict
    from .verdicts import NO_BUG, PASS

    if device.kind == "cpu":
        return DecodeTiming.not_timed(NOT_TIMED_CPU)
    if not timing:
        return DecodeTiming.not_timed("not timed (--no-timing)")
    verdicts = {r.geometry: geometry_verdict(r) for r in report.results}
    if FIX_GEOMETRY not in verdicts:
        return DecodeTiming.not_timed("not timed: the fix's default layout did not run")
    if verdicts.get(FIX_GEOMETRY) != PASS:
        return DecodeTiming.not_timed("not timed: the fix's default layout did not pass here")
    from .isolation import run_timing

    return run_timing(device, UPSTREAM if verdicts.get(UPSTREAM) == NO_BUG else DENSE, limit)


def verify(report: Callable[[str], None]) -> bool:
    """``vllm-mla-fixes verify``'s correctness step for DeepSeek-V4.1: the
    self-test's default geometry and its control on this device."""
    from .report import geometry_verdict

    result = run_selftest(("split", "control"), timing=False)
    if result.cannot_run is not None:
        report(f"correctness: cannot run: {result.cannot_run}")
        return False
    for geometry in result.results:
        failed = geometry.failed_cases()
        report(
            f"correctness ({result.device.label}), {geometry.title}: "
            f"{geometry_verdict(geometry)}; serving cases failed: {', '.join(failed) or 'none'}; "
            f"foreign bytes {geometry.foreign_bytes}, stray bytes {geometry.stray_bytes}"
        )
    return result.exit_status == EXIT_OK
