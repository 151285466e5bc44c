"""A hung geometry is stopped at its time limit and named (issue 27).

A kernel that never returns (a GPU deadlock) would leave the operator with no
verdict at all.  ``vllm-mla-fixes selftest --geometry-timeout S`` stops a
geometry's process still running after S seconds and reports it hung in the
kernel it was in; the other geometries still report.  On CPU, with a
``sitecustomize`` whose fallback geometry enters the SWA writer and sleeps.
Its own file, so that the test's minute of waiting can run beside the
isolation tests' faulted run on another worker.
"""

from __future__ import annotations

import pytest
from test_selftest_isolation import ISOLATED_RUN_ON, _finish, _geometry, _selftest

from vllm_mla_fixes.selftest import kernels as kn

HANG = """\
# A geometry whose kernel never returns (tests/test_selftest_hang.py).
import time

from vllm_mla_fixes.selftest import harness
from vllm_mla_fixes.selftest import kernels as kn

def run_geometry(name, device, kernels=None, entering=None, **kwargs):
    if name == "fallback":
        entering(kn.SWA_WRITER)
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
    proc = _selftest(
        tmp_path,
        *("--geometry", "fallback", "--geometry", "control", "--jobs", "2"),
        *("--geometry-timeout", "60"),
        faults=False,
    )
    status, report, err = _finish(proc)
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
