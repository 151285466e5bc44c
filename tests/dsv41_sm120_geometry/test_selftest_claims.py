"""The self-test's verdict claims only what its run recorded (issue 44, defect 1).

``selftest --geometry split`` once ended with "the control was caught in every
case" although the control never ran.  The verdict line and the JSON are built
from the recorded results: for every subset of the geometries, the verdict
names exactly the fix's geometries and the control that ran, and lists the
others as not run.  The report is built from recorded results, as the run
hands them to it, without running a geometry.
"""

from __future__ import annotations

import itertools
import re

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41_INFO
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.layout import GEOMETRIES

DSV41 = fix_releases.covered(DSV41_INFO)
CPU = kn.Device("cpu", torch.device("cpu"), "CPU")


def _recorded(name: str, fails: bool) -> harness.GeometryResult:
    """Geometry ``name``'s result as a run records it: every case compared,
    every case failed where ``fails`` (the control's expected outcome)."""
    result = harness.new_result(name)
    result.block_size = 64
    for tally in result.cases.values():
        tally.note(0.0, 0.0)
        if fails:
            tally.fail("step: a read off its page")
    return result


def _report(names: tuple[str, ...], broken: str | None = None):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.report import Report

    kernels = kn.Kernels(CPU, {k: "real (named here)" for k in (*kn.READERS, *kn.WRITERS)})
    results = [_recorded(n, (GEOMETRIES[n].role == "control") != (n == broken)) for n in names]
    return Report("0.34.0", CPU, kernels, results)


def _claimed(verdict: str) -> tuple[set[str], set[str]]:
    """(geometries the verdict's claims name, geometries it lists as not run)."""
    claims, _, not_run = verdict.partition("; not run: ")
    words = set(re.findall(r"[a-z]+(?:-[a-z]+)*", claims))  # dspark-long-prefill whole
    return words & set(GEOMETRIES) - {"upstream"}, set(filter(None, not_run.split(", ")))


SUBSETS = [
    names
    for size in range(1, len(GEOMETRIES) + 1)
    for names in itertools.combinations(tuple(GEOMETRIES), size)
]


@pytest.mark.vllm_release(*DSV41)
def test_the_verdict_names_exactly_the_geometries_that_ran():
    for names in SUBSETS:
        report = _report(names)
        verdict = report.verdict_line()
        claimed, not_run = _claimed(verdict)
        checked = {n for n in names if GEOMETRIES[n].role in ("fix", "control", "dspark")}
        assert claimed == checked, (names, verdict)
        assert not_run == set(GEOMETRIES) - set(names), (names, verdict)
        assert verdict.startswith("verdict: PASS" if checked else "verdict: NOT RUN"), verdict
        assert ("control was caught" in verdict) == ("control" in names), verdict
        assert report.text().splitlines()[-2] == verdict
        document = report.as_json()
        assert document["verdict"] == verdict
        assert document["not_run"] == [n for n in GEOMETRIES if n not in names]


@pytest.mark.vllm_release(*DSV41)
def test_a_failed_verdict_names_what_failed_and_what_did_not_run():
    verdict = _report(("split", "control"), broken="control").verdict_line()
    assert verdict.startswith("verdict: FAIL (control MISSED) - do not serve"), verdict
    assert verdict.endswith("; not run: fallback, upstream, dspark-long-prefill"), verdict
    verdict = _report(("fallback",), broken="fallback").verdict_line()
    assert verdict.startswith("verdict: FAIL (fallback FAIL)"), verdict
