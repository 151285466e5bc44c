"""``vllm-mla-fixes doctor`` on real environments (issues 3, 6 and 11).

Every command doctor prints as a remedy is run here, or checked by the
installed release's own code: see the ``test_remedy_*`` tests."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doctor_runs import accepted_by_vllm, findings_of, run_doctor
from fix_releases import covered_by, fixed_in_by

ROOT = Path(__file__).resolve().parent.parent
GLM_LINE = [
    "vllm",
    "serve",
    str(ROOT / "vllm_mla_fixes" / "models" / "tiny_glm_moe_dsa"),
    "--kv-cache-dtype",
    "fp8",
    "--attention-backend",
    "FLASHMLA_SPARSE",
    "--block-size",
    "64",
    "--max-num-seqs",
    "16",
]


# the fp8 fix's tests here are deselected everywhere once that fix is retired
@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_glm_line_on_025_is_covered_and_enforce_eager_is_called_out():
    proc = run_doctor("--json", "--", *GLM_LINE, "--enforce-eager", "--enable-prefix-caching")
    report = json.loads(proc.stdout)
    findings = [f for f in report["findings"] if f["topic"] == "fp8-ds-mla-reshape"]
    messages = " | ".join(f["message"] for f in findings)
    assert "shape '[32, 64, 576]' is invalid for input of size 1343488" in messages
    assert "--enforce-eager does not avoid this crash" in messages
    assert "not a factor" in messages
    assert findings[-1] == {
        "level": "ok",
        "topic": "fp8-ds-mla-reshape",
        "message": "the fix is applied in this environment",
        "advice": "",
        "facts": None,
        "runs_elsewhere": "",
    }
    # the fix is applied: no WARN about the failure it covers beside that
    assert {f["level"] for f in findings} <= {"ok", "info"}, findings
    # FA4's fix cannot probe without vLLM's CUDA build; with no GPU visible,
    # doctor judges the SM100 node, where its source screen arms it
    (fa4,) = [f for f in report["findings"] if f["message"].startswith("on an SM100/SM103")]
    assert fa4["topic"] == "fa4-compile-strides" and fa4["level"] == "ok"
    assert (
        "the plugin arms the fix (its source screen finds FA4's compile-only specs)"
        in (fa4["message"])
    )
    assert (report["verdict"], report["exit_status"], proc.returncode) == ("READY", 0, 0)


# As an operator may set it (issue 43): a space after a comma, which vLLM keeps
# (so " mla_fixes" is another name), an escape sequence and a byte that is not UTF-8.
HOSTILE_PLUGINS = "lora_filesystem_resolver, mla_fixes,\x1b[31m\udcff"


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_glm_line_without_the_plugin_is_an_error_with_the_way_out():
    proc = run_doctor("--", *GLM_LINE, VLLM_PLUGINS=HOSTILE_PLUGINS)
    assert proc.returncode == 2
    assert proc.stdout.isascii() and "\x1b" not in proc.stderr  # nothing raw reaches a terminal
    verdict = proc.stdout.splitlines()[-1]
    assert verdict.startswith(
        "WILL FAIL: environment: VLLM_PLUGINS='lora_filesystem_resolver, mla_fixes,"
        "\\x1b[31m\\udcff' excludes this plugin (vLLM splits it at commas and keeps the spaces"
    ), verdict
    assert "[FAIL] fp8-ds-mla-reshape: vLLM 0.25.1 + sparse MLA" in proc.stdout
    # One shell word, the spaces gone, the bytes escaped as bash reads them back.
    remedy = "export VLLM_PLUGINS=$'lora_filesystem_resolver,mla_fixes,\\x1b[31m\\xff'"
    assert f"-> {remedy}   (or unset VLLM_PLUGINS" in proc.stdout
    # The remedy works: run by bash, then vLLM's loader applies the fix.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    status = subprocess.run(
        ["bash", "-c", f'{remedy} && exec "$0" -m vllm_mla_fixes status --json', sys.executable],
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    states = {f["name"]: f["state"] for f in json.loads(status.stdout)["fixes"]}
    assert states["fp8-ds-mla-reshape"] == "applied"


@pytest.mark.vllm_release(*fixed_in_by("fp8-ds-mla-reshape"))
def test_glm_line_on_fixed_release_needs_nothing():
    proc = run_doctor("--json", "--", *GLM_LINE)
    assert proc.returncode == 0 and json.loads(proc.stdout)["verdict"] == "READY"
    (finding,) = [f for f in findings_of(proc) if f["topic"] == "fp8-ds-mla-reshape"]
    assert (
        finding["level"] == "ok"
        and "not needed: fixed upstream in vLLM 0.26.0" in finding["message"]
    )


@pytest.mark.vllm_release("0.25.1")
def test_environment_report_lists_the_checklist():
    proc = run_doctor("--json")
    env = json.loads(proc.stdout)["environment"]
    assert env["packages"]["vllm"] == "0.25.1"
    assert env["packages"]["nvidia-cutlass-dsl"] == "4.5.2"
    for key in ("torch", "flashinfer-python", "quack-kernels", "torchaudio"):
        assert key in env["packages"]
    assert {"gpu", "capability", "torch_cuda", "vllm_plugins", "mla_fixes", "fix_states"} <= set(
        env
    )


@pytest.mark.vllm_release("0.25.1")
def test_without_vllm_installed_doctor_says_so(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            str(venv / "bin" / "python"),
            "packaging==25.0",
            "--no-deps",
            "-e",
            str(ROOT),
        ],
        check=True,
    )
    proc = run_doctor("--", *GLM_LINE, python=str(venv / "bin" / "python"))
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[-1] == (
        "WILL FAIL: environment: vLLM is not installed in this environment"
    )
    assert "Traceback" not in proc.stdout + proc.stderr


# -- every remedy doctor prints is run here, or checked by the release's own code ------


def _scratch_venv(path: Path, *requirements: str) -> Path:
    """A virtual environment with pip (doctor's remedies say `pip ...`)."""
    subprocess.run(["uv", "venv", "-q", "--seed", "-p", sys.executable, str(path)], check=True)
    if requirements:
        subprocess.run(
            ["uv", "pip", "install", "-q", "--python", str(path / "bin" / "python"), *requirements],
            check=True,
        )
    return path


def _run_remedy(venv: Path, advice: str) -> None:
    """Run a `pip ... [&& pip ...]` remedy exactly as printed, with the environment's own pip."""
    for part in advice.split(" && "):
        command = shlex.split(part)
        assert command[0] == "pip", advice
        subprocess.run([str(venv / "bin" / "pip"), *command[1:]], check=True, timeout=600)


@pytest.mark.vllm_release("0.32.0")
def test_remedy_cuda_python_pair_repairs_the_clash(tmp_path):
    """The clash `pip install vllm==0.32.0` can leave (cuda-python 12.6.2.post1's
    cuda/bindings files over cuda-bindings 13.5.0), found by doctor in that very
    environment, and repaired by the command doctor prints."""
    venv = _scratch_venv(tmp_path / "venv", "cuda-bindings==13.5.0", "packaging==25.0")
    python = str(venv / "bin" / "python")
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            python,
            "--no-deps",
            "--reinstall",
            "cuda-python==12.6.2.post1",
        ],
        check=True,
    )  # written last: its files win
    has_library_type = [
        python,
        "-c",
        "import cuda.bindings.runtime as r; print(hasattr(r, 'cudaLibrary_t'))",
    ]
    assert (
        subprocess.run(has_library_type, capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )

    proc = run_doctor("--json", python=python, PYTHONPATH=str(ROOT))
    (clash,) = [
        f
        for f in findings_of(proc)
        if "cuda-python 12.6.2.post1 beside cuda-bindings 13.5.0" in f["message"]
    ]
    assert clash["advice"] == (
        "pip uninstall -y cuda-python cuda-bindings && "
        "pip install cuda-python==13.4.4 cuda-bindings==13.4.4"
    )
    _run_remedy(venv, clash["advice"])
    assert (
        subprocess.run(has_library_type, capture_output=True, text=True, check=True).stdout.strip()
        == "True"
    )


@pytest.mark.vllm_release("0.32.0")
def test_remedy_torchaudio_uninstall(tmp_path):
    """A torchaudio that does not import (here: installed without the torch it
    was built for) is found by doctor in that very environment, and removed
    by the command doctor prints."""
    venv = _scratch_venv(tmp_path / "venv", "packaging==25.0")
    python = str(venv / "bin" / "python")
    subprocess.run(
        ["uv", "pip", "install", "-q", "--python", python, "--no-deps", "torchaudio==2.11.0"],
        check=True,
    )
    proc = run_doctor("--json", python=python, PYTHONPATH=str(ROOT))
    (finding,) = [f for f in findings_of(proc) if "torchaudio" in f["message"]]
    assert finding["level"] == "warn"
    assert finding["message"].startswith("torchaudio 2.11.0 does not import here (")
    _run_remedy(venv, finding["advice"])
    left = subprocess.run(
        ["uv", "pip", "show", "--python", python, "torchaudio"], capture_output=True, text=True
    )
    assert left.returncode != 0 and "not found" in left.stderr


@pytest.mark.vllm_release("0.25.1")
def test_remedy_fa4_workaround_flags_are_valid_serve_flags():
    from vllm_mla_fixes.fixes import fa4_compile_strides as fa4

    for flag in fa4.WORKAROUND_FLAGS:
        accepted_by_vllm(flag)


def test_every_pip_remedy_is_one_of_the_checked_ones():
    """A new `pip ...` remedy must come with a test above: the list of the
    checked ones is closed."""
    sources = [
        ROOT / "vllm_mla_fixes" / "doctor.py",
        ROOT / "vllm_mla_fixes" / "report.py",
        *sorted((ROOT / "vllm_mla_fixes" / "fixes").rglob("*.py")),
    ]
    remedies = sorted(
        {
            line.split('"', 2)[1].split("{")[0].strip()
            for path in sources
            for line in path.read_text().splitlines()
            if '"pip ' in line or 'f"pip ' in line
        }
    )
    assert remedies == [
        "pip install",  # report.install_advice: the cli contract test runs it
        "pip install cuda-python==",
        "pip uninstall -y cuda-python cuda-bindings &&",
        "pip uninstall -y torchaudio",
    ], remedies


def test_each_fix_diagnoses_itself_and_doctor_names_no_fix():
    """Deleting a fix is deleting its module and its ALL_FIXES entry: doctor
    loops over ALL_FIXES, and the report types live in a leaf module."""
    from vllm_mla_fixes.fixes import ALL_FIXES

    doctor_source = (ROOT / "vllm_mla_fixes" / "doctor.py").read_text()
    for fix in ALL_FIXES:
        assert callable(fix.diagnose) and callable(fix.probe) and callable(fix.apply)
        assert (
            fix.INFO.name not in doctor_source
            and fix.INFO.name.replace("-", "_") not in doctor_source
        )
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, vllm_mla_fixes.report, vllm_mla_fixes.fixes; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm_mla_fixes')))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "vllm_mla_fixes.doctor" not in imported and "vllm_mla_fixes.cli" not in imported
