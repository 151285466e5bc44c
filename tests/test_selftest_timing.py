"""The self-test's kernel timing (issue 27): the median after warm-up of
``selftest/clock.py``, checked on CPU with a scripted timer and on the host
clock, and the report's fix/upstream ratio per timed kernel."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_mla_fixes.selftest import clock


def test_time_calls_drops_the_warm_up_rounds_and_takes_the_median():
    """A scripted timer: each call's 'elapsed' is the next value of its script;
    the warm-up values are huge (JIT, cold caches), the rest hold one outlier."""
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
    medians = clock.time_calls(calls, torch.device("cpu"), warmup=2, repeats=5, timer=scripted)
    assert medians == {"upstream": 12.0, "fix": 21.0}
    # interleaved rounds: every call once per round, warm-up included
    assert order == ["upstream", "fix"] * 7
    assert clock.ratio(medians["fix"], medians["upstream"]) == pytest.approx(1.75)
    assert clock.ratio(None, 12.0) is None and clock.ratio(21.0, None) is None


def test_time_calls_times_torch_work_on_the_host_clock_without_a_gpu():
    a = torch.randn(64, 64)
    medians = clock.time_calls({"matmul": lambda: a @ a}, torch.device("cpu"), 1, 3)
    assert medians["matmul"] > 0
    assert clock.timer_for(torch.device("cpu")) is clock.host_clock_us
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        clock.time_calls({"matmul": lambda: a @ a}, torch.device("cpu"), 1, 0)


def test_report_gives_the_fix_over_upstream_ratio_of_each_timed_kernel():
    """On a GPU: µs per decode step per geometry, the fix's default layout over
    upstream's, and "not timed" where a kernel was not (a stand-in)."""
    from vllm_mla_fixes.selftest import kernels as kn
    from vllm_mla_fixes.selftest.harness import GeometryResult
    from vllm_mla_fixes.selftest.report import Report

    device = kn.Device("sm12x", torch.device("cuda", 0), "an SM120 GPU", (12, 0))
    kernels = kn.Kernels(device, {k: "real (named here)" for k in (*kn.READERS, *kn.WRITERS)})
    split = GeometryResult("split", "fix, default", "fix")
    split.decode_step_us = {kn.ATTENTION_DECODE: 150.0, kn.INDEXER_LOGITS: 30.0}
    upstream = GeometryResult("upstream", "upstream", "upstream")
    upstream.decode_step_us = {kn.ATTENTION_DECODE: 100.0, kn.INDEXER_LOGITS: None}
    upstream.timing_note = "not timed (stand-in or not called): " + kn.INDEXER_LOGITS
    report = Report("0.34.0", device, kernels, [split, upstream])
    timing = report.decode_timing()
    assert timing["timed"] is True
    assert timing["ratio_fix_over_upstream"] == {
        kn.ATTENTION_DECODE: 1.5,
        kn.INDEXER_LOGITS: None,
    }
    lines = report.timing_lines()
    assert f"    {kn.ATTENTION_DECODE}: split 150 | upstream 100 | fix/upstream 1.5" in lines
    assert (
        f"    {kn.INDEXER_LOGITS}: split 30 | upstream not timed | fix/upstream not timed" in lines
    )
    assert json.loads(json.dumps(timing)) == timing
