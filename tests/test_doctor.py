"""``vllm-mla-fixes doctor`` on real environments (issues 3 and 6)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla_fixes.reproductions.fp8_ds_mla import TINY_GLM_DSA

ROOT = Path(__file__).resolve().parent.parent
GLM_LINE = ["vllm", "serve", str(TINY_GLM_DSA.parent), "--kv-cache-dtype", "fp8",
            "--attention-backend", "FLASHMLA_SPARSE", "--block-size", "64", "--max-num-seqs", "16"]


def doctor(*args: str, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    full_env.update(CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run([python, "-m", "vllm_mla_fixes", "doctor", *args], env=full_env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _findings(proc) -> list[dict]:
    out = proc.stdout
    return json.loads(out[out.index("{\n"):])["findings"]


@pytest.mark.vllm_release("0.25.1")
def test_glm_line_on_025_is_covered_and_enforce_eager_is_called_out():
    proc = doctor("--json", "--", *GLM_LINE, "--enforce-eager", "--enable-prefix-caching")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    findings = [f for f in _findings(proc) if f["topic"] == "fp8-ds-mla-reshape"]
    messages = " | ".join(f["message"] for f in findings)
    assert "shape '[32, 64, 576]' is invalid for input of size 1343488" in messages
    assert "--enforce-eager does not avoid this crash" in messages
    assert "not a factor" in messages
    assert findings[-1] == {"level": "ok", "topic": "fp8-ds-mla-reshape",
                            "message": "the fix is applied in this environment",
                            "advice": "run the same serve line"}


@pytest.mark.vllm_release("0.25.1")
def test_glm_line_without_the_plugin_is_an_error_with_the_way_out():
    proc = doctor("--", *GLM_LINE, VLLM_PLUGINS="lora_filesystem_resolver")
    assert proc.returncode == 1
    assert "VLLM_PLUGINS='lora_filesystem_resolver'" in proc.stdout
    assert "add mla_fixes to VLLM_PLUGINS" in proc.stdout


@pytest.mark.vllm_release("0.26.0")
def test_glm_line_on_fixed_release_needs_nothing():
    proc = doctor("--json", "--", *GLM_LINE)
    assert proc.returncode == 0
    (finding,) = [f for f in _findings(proc) if f["topic"] == "fp8-ds-mla-reshape"]
    assert finding["level"] == "ok" and "does not have this bug" in finding["message"]


@pytest.mark.vllm_release("0.25.1")
def test_environment_report_lists_the_checklist():
    proc = doctor("--json")
    env = json.loads(proc.stdout[proc.stdout.index("{\n"):])["environment"]
    assert env["packages"]["vllm"] == "0.25.1"
    assert env["packages"]["nvidia-cutlass-dsl"] == "4.5.2"
    for key in ("torch", "flashinfer-python", "quack-kernels", "torchaudio"):
        assert key in env["packages"]
    assert {"gpu", "capability", "torch_cuda", "vllm_plugins", "mla_fixes", "fix_states"} <= set(env)


@pytest.mark.vllm_release("0.25.1")
@pytest.mark.parametrize("bad, says", [
    (["serve", "m", "--block-size", "sixty-four"], "cannot parse the serve arguments"),
    (["serve", "m", "--kernel-config", "{enable_cutedsl_warmup: false"], "--kernel-config is not valid JSON"),
    (["serve", "m", "--attention-config", "[1]"], "--attention-config must be a JSON object"),
])
def test_bad_serve_line_gets_one_clear_line(bad, says):
    proc = doctor("--", *bad)
    assert proc.returncode == 2
    assert says in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.vllm_release("0.25.1")
def test_without_vllm_installed_doctor_says_so(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                    "packaging==25.0", "--no-deps", "-e", str(ROOT)], check=True)
    proc = doctor("--", *GLM_LINE, python=str(venv / "bin" / "python"))
    assert proc.returncode == 1
    assert "vLLM is not installed in this environment" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.vllm_release("0.32.0", "0.33.0")
def test_dsv41_line_checklist_and_corrected_page_32_attribution():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import INFO

    model = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
    proc = doctor("--json", "--", "vllm", "serve", str(model), "--attention-backend",
                  "FLASHINFER_MLA_SPARSE_DSV41", "--kv-cache-dtype", "fp8", "--block-size", "128",
                  "--attention-config.indexer_kv_dtype=mxfp4", "--moe-backend", "triton")
    findings = [f for f in _findings(proc) if f["topic"] == INFO.name]
    text = " | ".join(f["message"] for f in findings)
    assert "32-token sliding-window cache of a SWA-only layer (not a ratio-2 page" in text
    assert "indexer_kv_dtype='mxfp4' requires SM10x" in text
    assert "--moe-backend triton is not supported on SM120" in text
    assert "U+FFFD" in text
    assert proc.returncode == 1  # mxfp4 and triton block this line on SM120
