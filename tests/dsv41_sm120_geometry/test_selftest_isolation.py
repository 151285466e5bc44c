"""The self-test's geometries are isolated from each other, and ``--jobs`` on a GPU (issue 27).

* A CUDA-style fault in one geometry leaves the others' verdicts intact, and
  the report names the geometry and the kernel.  On CPU: ``vllm-mla-fixes
  selftest --json --jobs 2`` runs as an operator runs it, with a
  ``sitecustomize`` that shortens every geometry to the timeline's first step
  and (a) makes the split geometry's compressed KV writer raise PyTorch's
  illegal-memory-access error, sticky as on a GPU: every later kernel call in
  that process raises it too; (b) kills upstream's process in its SWA writer.
  The control's entry must equal the one of a run without either fault.
* ``--jobs 2`` where a GPU is visible (the device detection answers with an
  H200) is refused with one line that names the cause and the way out.
* Upstream's layout runs on an SM12x GPU, the device it is laid out for, and
  last; on another GPU it is left out with a note.  Its result there is a
  finding, and the exit status stays about the fix's layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41_INFO
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness, plan_geometries
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import CASES

ROOT = Path(__file__).resolve().parents[2]
DSV41 = fix_releases.covered(DSV41_INFO)
# The faulted run takes about 4 minutes of CPU: on the newest release only (the
# isolation is the plugin's code, the same on every release).
ISOLATED_RUN_ON = "0.34.0"
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"
FAULTS = f"""\
# Test faults for the self-test's geometries (tests/dsv41_sm120_geometry/test_selftest_isolation.py).
import os
import signal

import torch

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import TIMELINE

_run_geometry = harness.run_geometry
_faulted = []  # a CUDA error is sticky: once raised, every later call in the process raises


def _sticky(method):
    def call(*args, **kwargs):
        if _faulted:
            raise torch.AcceleratorError({ILLEGAL_ADDRESS!r})
        return method(*args, **kwargs)

    return call


def _faulty(*args, **kwargs):
    _faulted.append(True)
    raise torch.AcceleratorError({ILLEGAL_ADDRESS!r})


def _killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def run_geometry(name, device, kernels=None, **kwargs):
    if os.environ.get("SELFTEST_FAULTS") == "1":
        if name == "split":
            kn.Kernels.write_compressed = staticmethod(_faulty)
        if name == "upstream":
            kn.Kernels.write_swa = _killed
    return _run_geometry(name, device, kernels, plans=TIMELINE[:1], **kwargs)


for _name in ("write_swa", "write_compressed", "write_indexer", "paged_logits", "gather_k"):
    _method = kn.Kernels.__dict__[_name]
    if isinstance(_method, staticmethod):
        setattr(kn.Kernels, _name, staticmethod(_sticky(_method.__func__)))
    else:
        setattr(kn.Kernels, _name, _sticky(_method))
kn.sparse_mla_stand_in = _sticky(kn.sparse_mla_stand_in)
harness.run_geometry = run_geometry
"""


def _selftest(site: Path, *args: str, faults: bool, **extra: str) -> subprocess.Popen:
    command = Path(sys.executable).with_name("vllm-mla-fixes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MLA_FIXES")}
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=f"{site}{os.pathsep}{ROOT}",
        SELFTEST_FAULTS="1" if faults else "0",
        **extra,
    )
    return subprocess.Popen(
        [str(command), "selftest", "--json", "--no-timing", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=1200)
    try:
        return proc.returncode, json.loads(out), err
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON document:\n{out[-3000:]}\nstderr:\n{err[-6000:]}")


@pytest.fixture(scope="module")
def faulted_and_clean(tmp_path_factory):
    site = tmp_path_factory.mktemp("faults")
    (site / "sitecustomize.py").write_text(FAULTS)
    geometries = ("--geometry", "split", "--geometry", "upstream", "--geometry", "control")
    faulted = _selftest(site, *geometries, "--jobs", "2", faults=True)
    clean = _selftest(site, "--geometry", "control", "--jobs", "1", faults=False)
    return _finish(faulted), _finish(clean)


def _geometry(report: dict, name: str) -> dict:
    return next(g for g in report["geometries"] if g["name"] == name)


def _comparable(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "seconds"}


@pytest.mark.vllm_release(ISOLATED_RUN_ON)
def test_a_cuda_fault_stays_in_its_geometry_and_is_named(faulted_and_clean):
    (status, report, err), _ = faulted_and_clean
    assert report["isolated"] is True, err[-3000:]
    assert [g["name"] for g in report["geometries"]] == ["split", "control", "upstream"]
    split = _geometry(report, "split")
    writer = kn.COMPRESSED_WRITER
    assert (split["verdict"], split["crashed_in"]) == ("FAIL", writer)
    assert split["aborted"].startswith(f"device fault in {writer} at step 'A prefill 1/3'")
    assert ILLEGAL_ADDRESS in split["aborted"]
    (row,) = [r for r in split["rows"] if r["kernel"] == writer]
    assert row["verdict"] == "FAIL" and ILLEGAL_ADDRESS in row["problems"][0]
    assert f"geometry split crashed in {writer}" in " ".join(report["findings"])
    # the fix's own layout failed: that, and only that, sets the exit status
    assert (status, report["exit_status"]) == (1, 1)


@pytest.mark.vllm_release(ISOLATED_RUN_ON)
def test_a_process_that_dies_is_named_with_the_kernel_it_was_in(faulted_and_clean):
    (_, report, _), _ = faulted_and_clean
    upstream = _geometry(report, "upstream")
    assert upstream["crashed_in"] == kn.SWA_WRITER
    assert upstream["aborted"] == (
        f"its process was killed by SIGKILL in {kn.SWA_WRITER} without reporting"
    )
    assert upstream["verdict"] == "bug reproduced" and upstream["seconds"] > 0
    assert "upstream" not in report["working_layouts"]


@pytest.mark.vllm_release(ISOLATED_RUN_ON)
def test_other_geometries_verdicts_are_intact(faulted_and_clean):
    (_, report, _), (clean_status, clean, err) = faulted_and_clean
    assert clean["isolated"] is False, err[-3000:]
    control = _geometry(report, "control")
    assert control["aborted"] is None and control["crashed_in"] is None
    assert not any("CUDA" in p for row in control["rows"] for p in row["problems"])
    assert _comparable(control) == _comparable(_geometry(clean, "control"))
    assert control["verdict"] == _geometry(clean, "control")["verdict"]


def _device(kind: str, capability: tuple[int, int] | None) -> kn.Device:
    if kind == "cpu":
        return kn.Device("cpu", torch.device("cpu"), "CPU")
    name = "NVIDIA RTX PRO 6000 Blackwell" if kind == "sm12x" else "NVIDIA H200"
    return kn.Device(kind, torch.device("cuda", 0), name, capability)


def test_upstream_runs_last_on_its_own_sm12x_gpu_and_is_left_out_on_another():
    everything = ("split", "fallback", "upstream", "control")
    for kind, capability in (("sm12x", (12, 0)), ("cpu", None)):
        names, notes = plan_geometries(_device(kind, capability), everything)
        assert (names, notes) == (("split", "fallback", "control", "upstream"), []), kind
    names, notes = plan_geometries(_device("cuda", (9, 0)), everything)
    assert names == ("split", "fallback", "control")
    assert notes == [
        "upstream's SM12x layout is not run on this GPU: vLLM lays out upstream's "
        "caches for the device it runs on, and this is not an SM12x GPU"
    ]


def _result(name: str, failed_case: str | None = None, block_size: int = 64):
    result = harness.new_result(name)
    result.block_size = block_size
    for case, tally in result.cases.items():
        tally.note(0.0, 0.0)
        if failed_case in (case, "all"):
            tally.fail("step: off")
    return result


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("upstream_fails", [False, True])
def test_upstream_on_an_sm12x_gpu_is_a_finding_not_the_exit_status(upstream_fails):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.report import Report

    device = _device("cpu", None)
    kernels = kn.Kernels.for_device(device)
    gpu = _device("sm12x", (12, 0))
    upstream = _result("upstream", next(iter(CASES)) if upstream_fails else None, block_size=128)
    report = Report(
        "0.34.0",
        gpu,
        kernels,
        [_result("split"), _result("control", "all"), upstream],
        isolated=True,
    )
    assert report.exit_status == 0
    text = report.text()
    works = "layouts that work on NVIDIA RTX PRO 6000 Blackwell (SM120): split (" in text
    assert works
    if upstream_fails:
        finding = (
            "finding: upstream's own layout (--block-size 128) fails on this GPU: "
            "serve with the fix's layout"
        )
        assert report.as_json()["working_layouts"] == ["split"]
    else:
        finding = (
            "finding: upstream's own layout (--block-size 128) is exact on this GPU: "
            "it needs no fix here"
        )
        assert report.as_json()["working_layouts"] == ["split", "upstream"]
    assert finding in text.splitlines()


@pytest.mark.vllm_release(*DSV41)
def test_jobs_on_a_visible_gpu_is_refused_in_one_line(monkeypatch, capsys):
    from vllm_mla_fixes import cli

    h200 = _device("cuda", (9, 0))
    monkeypatch.setattr(kn, "detect_device", lambda: h200)
    refusal = (
        "cannot run: --jobs 2: on a GPU (NVIDIA H200 (SM90)) the geometries run one after "
        "another, each in a process of its own, so that they do not share the GPU or "
        "disturb each other's timings; leave out --jobs (or pass --jobs 1)"
    )
    assert cli.main(["selftest", "--jobs", "2", "--no-timing"]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == refusal and "Traceback" not in out + err
    assert cli.main(["selftest", "--json", "--jobs", "2", "--no-timing"]) == 2
    document = json.loads(capsys.readouterr().out)
    assert "cannot run: " + document["cannot_run"] == refusal


def test_geometry_timeout_takes_positive_seconds_only(capsys):
    from vllm_mla_fixes import cli

    assert cli.main(["selftest", "--geometry-timeout", "0"]) == 2
    assert "0 is not a positive, finite number of seconds" in capsys.readouterr().err


@pytest.mark.vllm_release(*DSV41)
def test_the_control_is_left_out_where_the_fix_lays_out_no_split():
    """On SM100 the release writes the V4.1 MXFP8 KV record, on which the fix
    lays out its per-ratio geometry: the control (the split without its slot
    translation) would have nothing to take out and be reported missed, which
    would fail the self-test on a B200.  It is left out there with a note, and
    kept on SM12x, where the split is laid out."""
    import kernel_calls as kc

    everything = ("split", "fallback", "upstream", "control")
    with kc.pretend_gpu("sm100"):
        names, notes = plan_geometries(_device("cuda", (10, 0)), everything)
    assert names == ("split", "fallback")
    assert notes[0].startswith(
        "the control is not run on this GPU: vLLM writes the V4.1 MXFP8 KV record here"
    )
    with kc.pretend_gpu("sm120"):
        names, _ = plan_geometries(_device("sm12x", (12, 0)), everything)
    assert names == ("split", "fallback", "control", "upstream")


@pytest.mark.vllm_release(fix_releases.newest(DSV41_INFO))
@pytest.mark.parametrize("control_caught", [True, False])
def test_the_summary_claims_only_the_dspark_check_that_ran(control_caught):
    """``--geometry dspark-long-prefill`` alone: the verdict line speaks of
    that check and says its indexer was a stand-in (CPU kernels), claims no
    layout and no layout control; it passes only with its own control caught."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.report import Report
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.results import (
        DSPARK_CASE,
        DSPARK_CONTROL,
    )

    device = _device("cpu", None)
    result = harness.new_result("dspark-long-prefill")
    assert list(result.cases) == [DSPARK_CASE, DSPARK_CONTROL]
    result.case(DSPARK_CASE).note(0.0, 0.0)
    if control_caught:
        result.case(DSPARK_CONTROL).note(0.0, 0.0)
    report = Report("0.34.0", device, kn.Kernels.for_device(device), [result])
    text = report.text()
    (verdict,) = [line for line in text.splitlines() if line.startswith("verdict: ")]
    if not control_caught:
        assert report.exit_status == 1 and verdict.startswith("verdict: FAIL"), text
        assert "control MISSED" in text
        return
    assert report.exit_status == 0, text
    assert verdict.startswith("verdict: PASS - dspark-long-prefill: ") and "stand-in" in verdict
    assert "the control was caught" not in verdict and "serving case" not in verdict
    assert "layouts that work on CPU: not checked (no layout geometry ran)" in text
    assert report.as_json()["working_layouts"] == []
