"""fa4-compile-strides on real vLLM releases (issue 4).

Every check runs vLLM's own FA4 code in a child interpreter
(``python -m vllm_mla_fixes.reproductions.fa4_compile_strides``): it stands a
bare package in for ``vllm.vllm_flash_attn``'s CUDA-only ``__init__`` and
answers ``torch.cuda`` device queries for a B200, which must not leak into
other tests; and a failed kernel launch without a driver must happen at most
once per process (the harness forks one child per call).

Default CI: the gate on every release (no compiling) and one full
reproduce-then-fix on 0.25.1 with a 75-composition sweep over the four
context-chunk kernels of vLLM's warm-up (5 CuTe compiles, ~15-25 s each on 2
cores).  ``VLLM_MLA_FIXES_FA4_FULL=1`` adds the whole warm-up plan (16
kernels) with a larger sweep, and the on-disk cache check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fix_releases import covered, first_covered_after

from vllm_mla_fixes.fixes import fa4_compile_strides as fix
from vllm_mla_fixes.reproductions import fa4_compile_strides as repro

AFFECTED = covered(fix.INFO)
FULL = os.environ.get("VLLM_MLA_FIXES_FA4_FULL") == "1"
needs_full = pytest.mark.skipif(
    not FULL, reason="set VLLM_MLA_FIXES_FA4_FULL=1 (compiles 16+ kernels)"
)


def run_harness(tmp_path: Path, *args: str, timeout: float, env: dict | None = None) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", repro.__name__, *args, "--json", str(out)],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="", **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "version, admitted",
    [
        ("0.23.1rc1.dev1133+g1b2c3d4", True),  # a nightly with the compile-only API
        ("0.24.0", True),  # admitted; the probe says not needed
        ("0.25.0", True),
        ("0.25.1", True),
        ("0.25.2rc1.dev7+gabcdef0", True),  # a nightly after 0.25.1: the probe decides
        ("0.26.0rc1", False),  # PEP 440: "<0.26.0" excludes 0.26.0's pre-releases
        ("0.23.0", False),
        ("0.26.0", False),
        ("0.32.0", False),
    ],
)
def test_release_range_admits_the_nightlies(version, admitted):
    assert fix.INFO.admits(version) is admitted


def test_upstream_error_text_is_the_reports():
    text = repro.upstream_error(repro.REPORT_STRIDE)
    assert repro.REPORT_STRIDE == 132096
    assert text.startswith(
        "ValueError: Mismatched mO.strides[0] on argument #3 when calling: `__call__("
    )
    assert text.endswith("output_scale: None)`, expected to be 132096")


@pytest.mark.vllm_release(*AFFECTED)
def test_gate_applies_on_affected_release_without_importing_cutlass(tmp_path):
    """register() in a process that never runs FA4 imports no CuTe code (no
    cuInit); the fix lands when vLLM imports FA4's interface, and reverts."""
    gate = run_harness(tmp_path, "--gate", timeout=600)
    assert gate["status"] == "applied", gate
    assert gate["register_imported"] == {"cutlass": False, fix.INTERFACE_MODULE: False}
    assert gate["deferred_outcome"] == "patched"
    assert gate["functional_probe"] == {"needed": True, "reason": None}
    for module in (
        fix.UTILS_MODULE,
        fix.INTERFACE_MODULE,
        "vllm.vllm_flash_attn.cute.block_sparsity",
    ):
        assert gate["patched"][module] is True, module
    assert gate["cache"] == {"type": "JITCache", "entries": 0, "path": None}
    assert gate["reverted"] == {"cache_restored": True, "target_restored": True}


@pytest.mark.vllm_release("0.23.0")
def test_gate_not_needed_on_0_23_0(tmp_path):
    """Before the compile-only API: the range excludes it, and its code agrees."""
    gate = run_harness(tmp_path, "--gate", timeout=600)
    assert gate["admitted"] is False and gate["status"] == "not-needed"
    assert gate["functional_probe"]["needed"] is False
    assert "no compile-only tensor specs" in gate["functional_probe"]["reason"]


@pytest.mark.vllm_release("0.24.0")
def test_gate_not_needed_on_0_24_0(tmp_path):
    gate = run_harness(tmp_path, "--gate", timeout=600)
    assert gate["admitted"] is True  # the release range admits it: its code decides
    assert gate["status"] == "not-needed"
    assert "no compile-only tensor specs" in gate["status_reason"]
    assert gate["functional_probe"]["needed"] is False
    assert "no compile-only tensor specs" in gate["functional_probe"]["reason"]


assert fix.INFO.fixed_in is not None, "vLLM fixed the FA4 bug upstream"


@pytest.mark.vllm_release(
    fix.INFO.fixed_in, *first_covered_after(fix.INFO.fixed_in)
)  # and a later one
def test_gate_not_needed_on_fixed_releases(tmp_path):
    gate = run_harness(tmp_path, "--gate", timeout=600)
    assert gate["status"] == "not-needed"
    # their own to_cute_tensor, converting a real compile-only spec
    assert gate["functional_probe"] == {
        "needed": False,
        "reason": "to_cute_tensor already gives compile-only specs symbolic strides "
        "(the upstream fix is present)",
    }


@pytest.mark.vllm_release("0.33.0")
def test_gate_not_needed_on_0_33_0(tmp_path):
    gate = run_harness(tmp_path, "--gate", timeout=600)
    assert gate["status"] == "not-needed"
    assert gate["functional_probe"]["needed"] is not True


@pytest.mark.vllm_release(*AFFECTED)
def test_plugin_skips_where_vllm_flash_attn_does_not_import():
    """On this CPU machine vLLM's CUDA flash-attention extension does not load:
    the plugin reports 'cannot probe here' and touches nothing."""
    code = (
        "import importlib, json, sys, vllm_mla_fixes as m\n"
        "try:\n"
        "    importlib.import_module('vllm.vllm_flash_attn')\n"
        "    print(json.dumps({'extension_loads': True})); sys.exit(0)\n"
        "except ImportError:\n"
        "    pass\n"
        "m.register()\n"
        "s = {x.name: [x.state.value, x.reason] for x in m.status()}['fa4-compile-strides']\n"
        "print(json.dumps({'status': s, 'cute_imported': any(k.startswith('vllm.vllm_flash_attn.cute') "
        "for k in sys.modules)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result.get("extension_loads"):
        pytest.skip("vLLM's CUDA flash-attention extension loads on this machine")
    assert result["status"][0] == "skipped"
    assert result["status"][1].startswith(
        "cannot probe here: vllm.vllm_flash_attn does not import here"
    )
    assert result["cute_imported"] is False


@pytest.mark.vllm_release("0.25.1")
def test_disk_cache_moves_to_a_fresh_namespace(tmp_path):
    cache_dir = tmp_path / "cute-cache"
    gate = run_harness(
        tmp_path,
        "--gate",
        timeout=600,
        env={
            "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache_dir),
        },
    )
    assert gate["cache"]["type"] == "JITPersistentCache"
    path = Path(gate["cache"]["path"])
    assert path.name == "fwd" and path.parent.name.endswith(fix.DISK_NAMESPACE_SUFFIX)
    plain = path.parent.with_name(path.parent.name[: -len(fix.DISK_NAMESPACE_SUFFIX)])
    assert (plain / "fwd").is_dir()  # where unpatched processes keep theirs; left alone
    assert gate["reverted"]["cache_restored"] is True


def _print_numbers(result: dict) -> None:
    print()
    for c in result["compiles"]:
        print(
            f"compile {c['phase']:9} {c['probe']:22} {c['seconds']:6.1f} s  new kernels {c['new_kernels']}"
        )
    sweep = result.get("sweep")
    if sweep:
        print(
            f"sweep {sweep['kind']}: {sweep['reached_launch']}/{sweep['size']} reached launch, total_q "
            f"{sweep['total_q_range']}, num_splits {sweep['num_splits_seen']}, cache entries "
            f"{sweep['cache_entries_before']} -> {sweep['cache_entries_after']}, {sweep['seconds']} s"
        )


@pytest.mark.vllm_release("0.25.1")
def test_cpu_reproduction_then_fix(tmp_path):
    """The report's kernel, compiled by vLLM's warm-up, rejects total_q 130 and
    300 with the report's exact error; with the fix (applied through run_fix)
    they pass every argument check, and so do 75 batch compositions served by
    the four warmed context-chunk kernels, with no new kernel compiled."""
    result = run_harness(tmp_path, "--sweep", "default", timeout=2400)
    _print_numbers(result)
    assert result["versions"]["nvidia-cutlass-dsl"] == "4.5.2"
    calls = {(c["phase"], c["total_q"]): c for c in result["calls"]}

    # upstream: the warm-up shape passes, any other total_q fails exactly as reported
    assert calls["unpatched", 129]["outcome"] == "reached-launch"
    for q in (130, 300):
        assert calls["unpatched", q]["outcome"] == "argument-check-failed"
        assert calls["unpatched", q]["error"] == repro.upstream_error(132096)
        assert calls["unpatched", q]["num_splits"] > 1

    assert result["fix"] == "applied"
    assert result["cache_entries_after_fix"] == 0  # kernels compiled before the fix are gone
    for q in (130, 300):
        assert calls["fixed", q]["outcome"] == "reached-launch", calls["fixed", q]
        assert "cudaError" in calls["fixed", q]["error"]
    fixed_compile = [c for c in result["compiles"] if c["phase"] == "fixed"][0]
    assert fixed_compile["new_kernels"] == 1  # recompiled, not the stale kernel

    sweep = result["sweep"]
    assert sweep["size"] >= 50
    assert sweep["failures"] == []
    assert sweep["reached_launch"] == sweep["size"]
    assert sweep["new_kernels"] == 0 and sweep["cache_entries_after"] == 4
    assert sweep["total_q_range"][0] <= 128 < sweep["total_q_range"][1]  # both q_stage kernels
    assert 1 in sweep["num_splits_seen"] and len(sweep["num_splits_seen"]) >= 5  # split and not
    assert repro.summarize(result, lambda line: None) is True


@pytest.mark.vllm_release("0.25.1")
@needs_full
def test_full_warmup_plan_sweep(tmp_path):
    """Every kernel of vLLM's warm-up plan, then 178 compositions: all served
    from the warm cache, all pass."""
    result = run_harness(tmp_path, "--no-reproduce", "--sweep", "full", timeout=3600)
    _print_numbers(result)
    sweep = result["sweep"]
    assert sweep["size"] >= 100
    assert sweep["failures"] == []
    assert sweep["new_kernels"] == 0
    assert 1 in sweep["num_splits_seen"] and max(sweep["num_splits_seen"]) > 1


@pytest.mark.vllm_release("0.25.1")
@needs_full
def test_disk_cache_does_not_serve_kernels_compiled_before_the_fix(tmp_path):
    cache_dir = tmp_path / "cute-cache"
    result = run_harness(
        tmp_path,
        "--sweep",
        "none",
        timeout=2400,
        env={
            "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(cache_dir),
        },
    )
    _print_numbers(result)
    stale = [
        p
        for p in cache_dir.rglob("*.o")
        if not p.parent.parent.name.endswith(fix.DISK_NAMESPACE_SUFFIX)
    ]
    fresh = [
        p
        for p in cache_dir.rglob("*.o")
        if p.parent.parent.name.endswith(fix.DISK_NAMESPACE_SUFFIX)
    ]
    assert len(stale) == 1 and len(fresh) == 1  # the unpatched kernel stays where it was
    calls = {(c["phase"], c["total_q"]): c for c in result["calls"]}
    assert calls["unpatched", 130]["error"] == repro.upstream_error(132096)
    assert calls["fixed", 130]["outcome"] == "reached-launch"
    assert calls["fixed", 300]["outcome"] == "reached-launch"
