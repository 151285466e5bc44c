"""``vllm-mla-fixes review`` of the DeepSeek-V4.1 fix on the real vLLM 0.33.0 and
0.34.0 wheels from PyPI (the shared review tests are in ``tests/test_review.py``)."""

from __future__ import annotations

import re

import pytest
from review_runs import run_cli

from vllm_mla_fixes import patching, review, wheel
from vllm_mla_fixes.fixes import ALL_FIXES, dsv41_sm120_geometry

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


def test_gate_rule_and_scope():
    decision, in_scope = review.gate(dsv41_sm120_geometry.FIX, "99.0.0")
    assert in_scope and decision.startswith("skipped: not reviewed: vLLM 99.0.0 is newer than")
    # as of 0.33.0 nothing newer was reviewed, whatever the registry holds today
    decision, in_scope = review.gate(dsv41_sm120_geometry.FIX, "0.34.0", against="0.33.0")
    assert in_scope and decision.startswith(
        "skipped: not reviewed: vLLM 0.34.0 is newer than 0.33.0"
    )


def fix_section(output: str, name: str) -> str:
    start = output.index(f"\n{name}: ")
    end = output.find("\n\n", start + 1)
    return output[start:end]


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
    for name in (f.INFO.name for f in ALL_FIXES if f.INFO.fixed_in == "0.26.0"):
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
