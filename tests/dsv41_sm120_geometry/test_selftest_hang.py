"""A hung geometry is stopped at its time limit and named (issue 27).

A kernel that never returns (a GPU deadlock) would leave the operator with no
verdict at all.  ``vllm-mla-fixes selftest --geometry-timeout S`` stops a
geometry's process still running after S seconds and reports it hung in the
kernel it was in; the other geometries still report.  On CPU, with a
``sitecustomize`` whose fallback geometry enters the SWA writer, starts a
grandchild (as a JIT build starts its compilers) and sleeps: nothing of it may
remain once the self-test has reported (issue 33).  Its own file, so that the
test's minute of waiting can run beside the isolation tests' faulted run on
another worker.
"""

from __future__ import annotations

import os
import signal

import pytest
from test_selftest_children import _alive
from test_selftest_isolation import ISOLATED_RUN_ON, _finish, _geometry, _selftest

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

HANG = """\
# A geometry whose kernel never returns (tests/dsv41_sm120_geometry/test_selftest_hang.py).
import os
import subprocess
import time

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

def run_geometry(name, device, kernels=None, entering=None, **kwargs):
    if name == "fallback":
        entering(kn.SWA_WRITER)
        grandchild = subprocess.Popen(["sleep", "3600"])
        with open(os.environ["HUNG_PIDS"], "w") as out:
            out.write(f"{os.getpid()} {grandchild.pid}")
        time.sleep(3600)
    # the other geometry reports at once (an empty result: the isolation is under test)
    return harness.new_result(name)


harness.run_geometry = run_geometry
"""


@pytest.mark.vllm_release(ISOLATED_RUN_ON)
def test_a_hung_geometry_is_stopped_at_its_limit_and_named(tmp_path):
    """A kernel that never returns (a GPU deadlock) would leave the operator
    with no verdict at all.  Each geometry's process is stopped after
    ``--geometry-timeout`` seconds and reported hung in the kernel it was in;
    the other geometry's verdict still comes."""
    (tmp_path / "sitecustomize.py").write_text(HANG)
    hung_pids = tmp_path / "hung.pids"
    proc = _selftest(
        tmp_path,
        *("--geometry", "fallback", "--geometry", "control", "--jobs", "2"),
        *("--geometry-timeout", "60"),
        faults=False,
        HUNG_PIDS=str(hung_pids),
    )
    status, report, err = _finish(proc)
    worker, grandchild = map(int, hung_pids.read_text().split())
    left = _alive([worker, grandchild])  # the whole group ended, the grandchild too
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running: {left}"
    fallback = _geometry(report, "fallback")
    assert fallback["aborted"] == (
        f"its process was still running after 60 s in {kn.SWA_WRITER} and was stopped "
        "(raise the limit with --geometry-timeout if a first-run JIT build needs longer)"
    ), err[-3000:]
    assert fallback["crashed_in"] == kn.SWA_WRITER and fallback["verdict"] == "FAIL"
    assert 60 <= fallback["seconds"] < 120
    control = _geometry(report, "control")
    assert control["aborted"] is None and control["crashed_in"] is None, control
    assert control["seconds"] < 60
    assert (status, report["exit_status"]) == (1, 1)  # the fix's fallback layout has no verdict
