"""The self-test's kernel timing (issue 27, issue 33).

* ``selftest/clock.py``: interleaved rounds (the order reversed every other
  round), warm-up rounds dropped, the median of the per-round ratios of two
  calls with its quartiles; a scripted timer and the host clock, on CPU.
* ``selftest/pairing.py`` on CPU, on the real vLLM: the fix's default layout
  and upstream's own run up to the timed step in one process, their reading
  kernels' launches (recorded at the kernel boundary) timed alone against each
  other; both sides launch the same layers, batch and rows.  The dense
  baseline (for GPUs where upstream's layout does not run) launches the same
  kernels on a packed copy of the pages each launch reads: it reads exactly
  what the fix's launch reads.  The stand-in readers are timed on the host
  clock here, which only shows the mechanics (a run of the self-test on CPU says
  "not timed (no GPU)").
* The report: per-kernel microseconds of both layouts, the ratio and its spread.
"""

from __future__ import annotations

import functools
import json

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes import dsv41_sm120_geometry
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import clock

DSV41 = fix_releases.covered(dsv41_sm120_geometry.INFO)


def test_time_rounds_interleaves_reverses_and_drops_the_warm_up_rounds():
    """A scripted timer: each call's 'elapsed' is the next value of its script;
    the warm-up values are huge (JIT, cold caches)."""
    scripts = {
        "upstream": iter([9e6, 9e6, 10.0, 12.0, 11.0, 500.0, 13.0]),
        "fix": iter([8e6, 8e6, 20.0, 21.0, 19.0, 22.0, 900.0]),
    }
    order = []

    def scripted(call):
        name = call()
        order.append(name)
        return next(scripts[name])

    calls = {"upstream": lambda: "upstream", "fix": lambda: "fix"}
    rounds = clock.time_rounds(calls, torch.device("cpu"), warmup=2, repeats=5, timer=scripted)
    assert rounds == {"upstream": [10.0, 12.0, 11.0, 500.0, 13.0], "fix": [20, 21, 19, 22, 900]}
    # every call once per round, warm-up included; A B, then B A
    assert order == ["upstream", "fix", "fix", "upstream"] * 3 + ["upstream", "fix"]
    assert clock.median(rounds["upstream"]) == 12.0
    ratio, low, high = clock.paired_ratio(rounds["fix"], rounds["upstream"])
    # per round: 2.0, 1.75, 1.727, 0.044, 69.2 -> median 1.75, quartiles 1.727 and 2.0
    assert (ratio, low, high) == pytest.approx((1.75, 19 / 11, 2.0))


def test_time_rounds_times_torch_work_on_the_host_clock_without_a_gpu():
    a = torch.randn(64, 64)
    rounds = clock.time_rounds({"matmul": lambda: a @ a}, torch.device("cpu"), 1, 3)
    assert len(rounds["matmul"]) == 3 and min(rounds["matmul"]) > 0
    assert clock.timer_for(torch.device("cpu")) is clock.host_clock_us
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        clock.time_rounds({"matmul": lambda: a @ a}, torch.device("cpu"), 1, 0)
    assert clock.paired_ratio([3.0], [2.0]) == (1.5, 1.5, 1.5)


def _report_with(timing):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.report import Report

    device = kn.Device("sm12x", torch.device("cuda", 0), "an SM120 GPU", (12, 0))
    kernels = kn.Kernels(device, {k: "real (named here)" for k in (*kn.READERS, *kn.WRITERS)})
    return Report("0.34.0", device, kernels, [], kernel_timing=timing)


def test_report_gives_each_kernels_time_for_both_layouts_and_the_ratio_with_its_spread():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.pairing import (
        DecodeTiming,
        KernelTiming,
    )

    work = {kn.ATTENTION_DECODE: {"layers": [0, 1, 2], "launches": 3, "rows": 12}}
    timing = DecodeTiming(
        "upstream", None, work, {kn.ATTENTION_DECODE: KernelTiming(150.0, 100.0, 1.5, (1.4, 1.6))}
    )
    report = _report_with(timing)
    document = report.kernel_timing_json()
    assert document["timed"] is True and document["baseline"] == "upstream"
    assert document["work"] == work
    assert document["what"].startswith("the reading kernels alone")
    assert document["kernels"] == {
        kn.ATTENTION_DECODE: {
            "fix_us": 150.0,
            "baseline_us": 100.0,
            "ratio_fix_over_baseline": 1.5,
            "ratio_quartiles": [1.4, 1.6],
        }
    }
    lines = report.timing_lines()
    assert "the fix's layout against upstream's own layout, run in the same process" in lines[1]
    assert (
        f"    {kn.ATTENTION_DECODE}: fix 150.0 | baseline 100.0 | "
        "fix/baseline 1.500 (quartiles 1.400-1.600)" in lines
    )
    assert f"    {kn.INDEXER_LOGITS}: not timed (stand-in)" in lines
    assert json.loads(json.dumps(document)) == document
    untimed = _report_with(DecodeTiming.not_timed("not timed (no GPU)")).kernel_timing_json()
    assert (untimed["timed"], untimed["note"], untimed["kernels"]) == (
        False,
        "not timed (no GPU)",
        {},
    )


# ------------------------------------------------------------------ the pairing, on CPU

PLANS_NAMES = ("C prefill", "C decode")


def _plans():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import StepPlan

    return (
        StepPlan(PLANS_NAMES[0], (("C", None),), ()),
        StepPlan(PLANS_NAMES[1], (("C", 1),), ()),
    )


@functools.cache
def _cpu():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    device = kn.detect_device()
    return device, kn.Kernels.for_device(device)


@pytest.mark.vllm_release("0.34.0")  # where upstream's own layout reads back exactly on CPU
def test_fix_and_upstream_are_timed_in_one_process_on_equal_work():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.pairing import (
        UPSTREAM,
        time_decode_step,
    )
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timed_step import TIMED_KERNELS

    device, kernels = _cpu()
    timing = time_decode_step(
        device, kernels, UPSTREAM, TIMED_KERNELS, _plans(), PLANS_NAMES[1], 1, 3
    )
    assert (timing.baseline, timing.note) == (UPSTREAM, None)
    # the backbone's layers only: the fix's drafter layer (3) is left out
    assert timing.work == {
        kn.ATTENTION_DECODE: {"layers": [0, 1, 2], "launches": 3, "rows": 3},
        kn.INDEXER_LOGITS: {"layers": [0, 1], "launches": 2, "rows": 2},
    }
    assert set(timing.kernels) == set(TIMED_KERNELS)
    for kernel, t in timing.kernels.items():
        assert t.fix_us > 0 and t.baseline_us > 0, kernel
        assert t.ratio_quartiles[0] <= t.ratio <= t.ratio_quartiles[1], kernel


def _read(kernel: str, launch):
    """What ``launch`` reads: the attention output it fills, or the logits it returns."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    if kernel != kn.ATTENTION_DECODE:
        return launch()
    out = torch.full_like(launch.kwargs["out"], float("nan"))
    kn.Launch(launch.kernel, launch.args, {**launch.kwargs, "out": out})()
    return out


def _cache(kernel: str, launch) -> torch.Tensor:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    return launch.kwargs["swa_kv_cache"] if kernel == kn.ATTENTION_DECODE else launch.args[1]


@pytest.mark.vllm_release(*DSV41)
def test_the_dense_baseline_reads_what_the_fix_reads_on_packed_pages():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.harness import timed_step_launches
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.pairing import (
        DENSE,
        dense_launch,
        time_decode_step,
    )
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timed_step import TIMED_KERNELS

    device, kernels = _cpu()
    result, launches = timed_step_launches("split", device, kernels, _plans(), PLANS_NAMES[1])
    assert result.clean
    for kernel in TIMED_KERNELS:
        assert launches[kernel], kernel
        for timed in launches[kernel]:
            dense = dense_launch(kernel, timed.launch)
            assert torch.equal(_read(kernel, timed.launch), _read(kernel, dense)), kernel
            # only the pages the launch reads, one after another, each strided as before
            paged, packed = _cache(kernel, timed.launch), _cache(kernel, dense)
            assert packed.shape[0] < paged.shape[0] and packed.stride() == paged.stride()

    timing = time_decode_step(device, kernels, DENSE, TIMED_KERNELS, _plans(), PLANS_NAMES[1], 1, 3)
    assert timing.baseline == DENSE and set(timing.kernels) == set(TIMED_KERNELS)


def test_a_baseline_that_is_neither_is_refused():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.pairing import time_decode_step

    device, kernels = _cpu()
    with pytest.raises(ValueError, match="one of upstream, dense"):
        time_decode_step(device, kernels, "other")
