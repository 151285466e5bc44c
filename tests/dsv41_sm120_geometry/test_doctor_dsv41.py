"""``vllm-mla-fixes doctor`` on the DeepSeek-V4.1 fix's releases: its serve-line
checklist, its remedies and the geometry it names (the shared checks are in
``tests/test_doctor.py``)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from doctor_runs import accepted_by_vllm, findings_of, predict_line, run_doctor
from fix_releases import covered, newest, oldest

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_dsv41_line_checklist_and_corrected_page_32_attribution():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import INFO

    model = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
    proc = run_doctor(
        "--json",
        "--",
        "vllm",
        "serve",
        str(model),
        "--attention-backend",
        "FLASHINFER_MLA_SPARSE_DSV41",
        "--kv-cache-dtype",
        "fp8",
        "--block-size",
        "128",
        "--attention-config.indexer_kv_dtype=mxfp4",
        "--moe-backend",
        "triton",
    )
    findings = [f for f in findings_of(proc) if f["topic"] == INFO.name]
    text = " | ".join(f["message"] for f in findings)
    # upstream's own layout for the line, held against the kernels' own envelopes: on
    # 0.32.0 FlashInfer 0.7.0.post1's SM120 sparse MLA is what rejects the 32-row
    # sliding-window page (not DeepGEMM, as the original report said); 0.33.0's
    # FlashInfer takes it, and DeepGEMM's host check rejects the 128-row indexer page
    rejected_first = {
        "0.32.0": "FlashInfer SM120 sparse-MLA decode, primary (sliding-window) cache rejects "
        "the sliding-window KV pages of 32 rows",
        "0.33.0": "DeepGEMM SM120 paged MQA logits, FP8 indexer cache rejects the indexer K, "
        "compress ratio 1 pages of 128 rows",
    }
    rejected = rejected_first[version("vllm")]
    assert f"upstream's --block-size 128 layout starts, but {rejected}" in text
    assert "indexer_kv_dtype='mxfp4' requires SM10x" in text
    assert "--moe-backend triton is not supported on SM120" in text
    assert "U+FFFD" in text
    assert proc.returncode == 2  # mxfp4 and triton block this line on SM120
    assert json.loads(proc.stdout)["verdict"] == "WILL FAIL"
    # it points to the self-test and the smoke check, the two commands tests run
    (check,) = [f for f in findings if f["message"].startswith("prove the KV layouts")]
    assert check["advice"] == (
        "vllm-mla-fixes selftest; then vllm-mla-fixes smoke http://<host>:<port>"
    )


@pytest.mark.parametrize("release", covered(DSV41))
def test_remedy_cuda_python_pair_is_what_the_release_locks_pin(release):
    """The releases' test environments are built with this pair, and their
    DeepSeek-V4.1 tests import the modules the clash breaks."""
    from vllm_mla_fixes.doctor import CUDA_PYTHON_PAIR

    lock = (ROOT / "envs" / f"vllm-{release}.txt").read_text().splitlines()
    assert {f"cuda-python=={CUDA_PYTHON_PAIR}", f"cuda-bindings=={CUDA_PYTHON_PAIR}"} <= set(lock)


@pytest.mark.vllm_release(oldest(DSV41), newest(DSV41))
def test_remedy_flashinfer_commands_are_flashinfers_own():
    """doctor's FlashInfer remedies are commands of the installed
    flashinfer-python's CLI, run here with --dry-run: the jit-cache shim and
    its sm120f provider (the report's "4 KB shim with --no-deps") come from
    FlashInfer's own wheel index at flashinfer-python's version; flashinfer-cubin too."""
    from importlib.metadata import version

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.doctor import (
        FLASHINFER_CUBIN_COMMAND,
        JIT_CACHE_COMMAND,
    )

    flashinfer = version("flashinfer-python")
    cli = str(Path(sys.executable).parent / "flashinfer")

    def dry_run(command: str, *more: str) -> subprocess.CompletedProcess:
        argv = [cli, *shlex.split(command)[1:], *more, "--dry-run"]
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"}
        )

    cubin = dry_run(FLASHINFER_CUBIN_COMMAND)
    assert cubin.returncode == 0, cubin.stdout + cubin.stderr
    assert f"flashinfer-cubin=={flashinfer}" in cubin.stdout
    assert "--index-url https://flashinfer.ai/whl " in cubin.stdout
    # all providers (the shim's dependencies): where the shim comes from, no download
    shim = dry_run(JIT_CACHE_COMMAND.replace("--mode minimal --sm sm120f", "--mode all"))
    assert shim.returncode == 0, shim.stdout + shim.stderr
    assert f"flashinfer-jit-cache=={flashinfer}+cu13" in shim.stdout
    assert "https://flashinfer.ai/whl/cu13" in shim.stdout
    # minimal mode reads the provider list from the shim itself, downloaded
    # from that index: with it, the command names the sm120f provider and
    # --no-deps; without the network (this project's CI), FlashInfer stops there
    minimal = dry_run(JIT_CACHE_COMMAND)
    if minimal.returncode == 0:
        assert "--no-deps" in minimal.stdout
        assert f"flashinfer-jit-cache-sm120f=={flashinfer}+cu13" in minimal.stdout
    else:
        assert "Could not resolve the flashinfer-jit-cache shim" in minimal.stderr, (
            minimal.stdout + minimal.stderr
        )


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_remedy_dsv41_flags_are_valid_serve_flags():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.doctor import INDEXER_FP8_FLAG, MOE_MARLIN_FLAG

    for flag in (INDEXER_FP8_FLAG, MOE_MARLIN_FLAG):
        accepted_by_vllm(flag)


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_dsv41_diagnosis_names_the_geometry_a_line_gets():
    """doctor's geometry finding is the fix's own decision on the line's engine
    config (``diagnose`` runs the same prediction in its own process)."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor as dsv41_doctor

    model = str(ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41")

    def geometry_line(*flags: str) -> str:
        predicted = predict_line(["vllm", "serve", model, *flags])
        (line,) = [
            f.message
            for f in dsv41_doctor.prediction_findings(predicted)
            if "geometry:" in f.message
        ]
        return line

    assert f"gets the {dsv41.SPLIT} geometry: default on SM12x" in geometry_line(
        "--block-size", "64"
    )
    assert f"gets the {dsv41.PER_RATIO} geometry: speculative method mtp" in geometry_line(
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'
    )
    dspark = geometry_line(
        "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}'
    )
    assert f"gets the {dsv41.SPLIT} geometry: default on SM12x" in dspark
    assert "with DSpark: no drafter layer owns or reads a ratio-1" in dspark
    # vLLM's CPU offloading moves whole packed blocks: the split stays
    assert f"gets the {dsv41.SPLIT} geometry" in geometry_line("--kv-offloading-size", "4")
    # vLLM's own checks speak for a line it would refuse: its config, and its
    # planner (DeepSeek-V4.1's sliding-window caches cannot take DCP)
    with pytest.raises(ValueError, match="tp_size=1 must be divisible by dcp_size=2"):
        predict_line(["vllm", "serve", model, "-dcp", "2"])
    with pytest.raises(AssertionError, match="DCP not support sliding window"):
        predict_line(["vllm", "serve", model, "-tp", "2", "-dcp", "2"])


@pytest.mark.vllm_release(newest(DSV41))
def test_the_remedy_follows_the_cause_where_vllm_plugins_leaves_the_plugin_out():
    """Issue 44: with VLLM_PLUGINS=lora_filesystem_resolver and VLLM_MLA_FIXES
    unset, the line whose upstream layout fails said "the fix is not enabled
    here -> export VLLM_MLA_FIXES=all"; the cause is VLLM_PLUGINS, and its remedy
    is the one the plugin check gives (tests/test_doctor.py runs it: status
    then says applied)."""
    from doctor_runs import serve_of

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor as dsv41_doctor
    from vllm_mla_fixes.report import ENABLE_ALL_ADVICE, Environment, plugins_advice

    env = Environment(
        packages={"vllm": version("vllm"), "vllm-mla-fixes": "0.1.0"},
        gpu=None,
        capability=None,
        torch_cuda=None,
        vllm_plugins="lora_filesystem_resolver",
        mla_fixes=None,
        fix_states={},
    )
    model = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
    findings = dsv41_doctor.diagnose(
        env, serve_of(["vllm", "serve", str(model), "--block-size", "128"])
    )
    failing = [f for f in findings if f.message.startswith("upstream's --block-size 128 layout")]
    assert failing and failing[0].level == "error", findings
    assert "VLLM_PLUGINS='lora_filesystem_resolver' does not name mla_fixes" in failing[0].message
    assert failing[0].advice == plugins_advice("lora_filesystem_resolver")
    assert not [f for f in findings if f.advice == ENABLE_ALL_ADVICE], findings
