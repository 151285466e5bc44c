"""``vllm-mla-fixes doctor`` on real environments (issues 3, 6 and 11).

Every command doctor prints as a remedy is run here, or checked by the
installed release's own code: see the ``test_remedy_*`` tests."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from fix_releases import DSV41, covered, newest, oldest

from vllm_mla_fixes.reproductions.fp8_ds_mla import TINY_GLM_DSA

ROOT = Path(__file__).resolve().parent.parent
GLM_LINE = [
    "vllm",
    "serve",
    str(TINY_GLM_DSA.parent),
    "--kv-cache-dtype",
    "fp8",
    "--attention-backend",
    "FLASHMLA_SPARSE",
    "--block-size",
    "64",
    "--max-num-seqs",
    "16",
]


def doctor(*args: str, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    full_env.update(CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(
        [python, "-m", "vllm_mla_fixes", "doctor", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def _findings(proc) -> list[dict]:
    return json.loads(proc.stdout)["findings"]  # stdout is the JSON document alone


@pytest.mark.vllm_release("0.25.1")
def test_glm_line_on_025_is_covered_and_enforce_eager_is_called_out():
    proc = doctor("--json", "--", *GLM_LINE, "--enforce-eager", "--enable-prefix-caching")
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


@pytest.mark.vllm_release("0.25.1")
def test_glm_line_without_the_plugin_is_an_error_with_the_way_out():
    proc = doctor("--", *GLM_LINE, VLLM_PLUGINS="lora_filesystem_resolver")
    assert proc.returncode == 2
    verdict = proc.stdout.splitlines()[-1]
    assert verdict.startswith("WILL FAIL: environment: VLLM_PLUGINS='lora_filesystem_resolver'")
    assert "[FAIL] fp8-ds-mla-reshape: vLLM 0.25.1 + sparse MLA" in proc.stdout
    remedy = "export VLLM_PLUGINS=lora_filesystem_resolver,mla_fixes"
    assert remedy in proc.stdout
    # The remedy works: with that setting vLLM's loader applies the fix.
    status = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "status", "--json"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_PLUGINS": remedy.split("=", 1)[1]},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    states = {f["name"]: f["state"] for f in json.loads(status.stdout)["fixes"]}
    assert states["fp8-ds-mla-reshape"] == "applied"


@pytest.mark.vllm_release("0.26.0")
def test_glm_line_on_fixed_release_needs_nothing():
    proc = doctor("--json", "--", *GLM_LINE)
    assert proc.returncode == 0 and json.loads(proc.stdout)["verdict"] == "READY"
    (finding,) = [f for f in _findings(proc) if f["topic"] == "fp8-ds-mla-reshape"]
    assert (
        finding["level"] == "ok"
        and "not needed: fixed upstream in vLLM 0.26.0" in finding["message"]
    )


@pytest.mark.vllm_release("0.25.1")
def test_environment_report_lists_the_checklist():
    proc = doctor("--json")
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
    proc = doctor("--", *GLM_LINE, python=str(venv / "bin" / "python"))
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[-1] == (
        "WILL FAIL: environment: vLLM is not installed in this environment"
    )
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_dsv41_line_checklist_and_corrected_page_32_attribution():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import INFO

    model = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
    proc = doctor(
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
    findings = [f for f in _findings(proc) if f["topic"] == INFO.name]
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

    proc = doctor("--json", python=python, PYTHONPATH=str(ROOT))
    (clash,) = [
        f
        for f in _findings(proc)
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


@pytest.mark.parametrize("release", covered(DSV41))
def test_remedy_cuda_python_pair_is_what_the_release_locks_pin(release):
    """The releases' test environments are built with this pair, and their
    DeepSeek-V4.1 tests import the modules the clash breaks."""
    from vllm_mla_fixes.doctor import CUDA_PYTHON_PAIR

    lock = (ROOT / "envs" / f"vllm-{release}.txt").read_text().splitlines()
    assert {f"cuda-python=={CUDA_PYTHON_PAIR}", f"cuda-bindings=={CUDA_PYTHON_PAIR}"} <= set(lock)


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
    proc = doctor("--json", python=python, PYTHONPATH=str(ROOT))
    (finding,) = [f for f in _findings(proc) if "torchaudio" in f["message"]]
    assert finding["level"] == "warn"
    assert finding["message"].startswith("torchaudio 2.11.0 does not import here (")
    _run_remedy(venv, finding["advice"])
    left = subprocess.run(
        ["uv", "pip", "show", "--python", python, "torchaudio"], capture_output=True, text=True
    )
    assert left.returncode != 0 and "not found" in left.stderr


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


def _accepted_by_vllm(flag: str) -> None:
    """Build the config object vLLM builds from this serve flag (it validates
    names and values with pydantic, as `vllm serve` does)."""
    from vllm.config import AttentionConfig, KernelConfig

    option, value = shlex.split(flag)
    if option == "--moe-backend":
        assert KernelConfig(moe_backend=value).moe_backend == value
        return
    config_class = {"--attention-config": AttentionConfig, "--kernel-config": KernelConfig}[option]
    fields = json.loads(value)
    config = config_class(**fields)
    for key, wanted in fields.items():
        assert str(getattr(config, key)).split(".")[-1] == str(wanted), (flag, getattr(config, key))


@pytest.mark.vllm_release("0.25.1")
def test_remedy_fa4_workaround_flags_are_valid_serve_flags():
    from vllm_mla_fixes.fixes import fa4_compile_strides as fa4

    for flag in fa4.WORKAROUND_FLAGS:
        _accepted_by_vllm(flag)


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_remedy_dsv41_flags_are_valid_serve_flags():
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41

    for flag in (dsv41.INDEXER_FP8_FLAG, dsv41.MOE_MARLIN_FLAG):
        _accepted_by_vllm(flag)


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


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_dsv41_diagnosis_names_the_geometry_a_line_gets():
    """doctor's geometry finding is the fix's own decision on the line's engine
    config (``diagnose`` runs the same prediction in its own process)."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor as dsv41_doctor
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.prediction import predict

    model = str(ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41")

    def geometry_line(*flags: str) -> str:
        predicted = predict(["vllm", "serve", model, *flags])
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
        predict(["vllm", "serve", model, "-dcp", "2"])
    with pytest.raises(AssertionError, match="DCP not support sliding window"):
        predict(["vllm", "serve", model, "-tp", "2", "-dcp", "2"])


def test_each_fix_diagnoses_itself_and_doctor_names_no_fix():
    """Deleting a fix is deleting its module and its ALL_FIXES entry: doctor
    loops over ALL_FIXES, and the report types live in a leaf module."""
    from vllm_mla_fixes.fixes import ALL_FIXES

    doctor_source = (ROOT / "vllm_mla_fixes" / "doctor.py").read_text()
    for fix in ALL_FIXES:
        assert callable(fix.diagnose) and callable(fix.probe) and callable(fix.apply)
        assert (
            fix.INFO.name not in doctor_source
            and fix.__name__.rsplit(".", 1)[1] not in doctor_source
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
