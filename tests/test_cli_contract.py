"""The CLI as an operator gets it (issue 11): an environment made of vLLM and
this package's own metadata -- not the test lock, which adds ``wheel``,
``pytest`` and ``uv`` -- and machine output that is exactly one JSON document.

The environment: ``uv venv``, ``uv pip install vllm==X pip`` (the lock only
as constraints, so uv hard-links the versions it already has), then the
command doctor prints when vllm-mla-fixes is missing (``pip install
<checkout>``), run with that environment's pip.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from fix_releases import first_covered_after, newest_of_earliest_fix

from vllm_mla_fixes.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parent.parent
STATES = {"applied", "not-needed", "disabled", "skipped"}
pytestmark = pytest.mark.vllm_release(
    newest_of_earliest_fix(), *first_covered_after(newest_of_earliest_fix())
)


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES", "VLLM_LOGGING_STREAM", "PYTHONPATH")
    }
    env.update(CUDA_VISIBLE_DEVICES="", **extra)
    return env


@pytest.fixture(scope="module")
def user_env(request, tmp_path_factory) -> Path:
    release = request.config.vllm_release
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # pip for the remedy below; not `uv venv --seed`, which adds setuptools and wheel on Python 3.11
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            python,
            f"vllm=={release}",
            "pip",
            "-c",
            str(ROOT / "envs" / f"vllm-{release}.txt"),
        ],
        check=True,
        timeout=1200,
    )

    # Before the package is installed, doctor run from the checkout's sources says
    # how to install it.  (A link to the package alone: the checkout's
    # *.egg-info, left by editable installs, would pass for an installation.)
    sources = venv.parent / "sources"
    sources.mkdir()
    (sources / "vllm_mla_fixes").symlink_to(ROOT / "vllm_mla_fixes")
    proc = subprocess.run(
        [python, "-m", "vllm_mla_fixes", "doctor", "--json"],
        cwd=venv.parent,
        env=_env(PYTHONPATH=str(sources)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(proc.stdout)
    assert report["environment"]["packages"]["vllm-mla-fixes"] is None
    advice = {
        f["advice"].split(";")[0]
        for f in report["findings"]  # fa4 appends its workarounds
        if "not installed where vLLM runs" in f["message"]
    }
    assert advice == {f"pip install {shlex.quote(str(ROOT))}"}, report["findings"]
    command = shlex.split(advice.pop())
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", *command[2:]], check=True, timeout=600
    )
    return venv


def cli(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "vllm-mla-fixes"), *args],
        env=_env(**env),
        cwd=venv.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_environment_is_the_users_not_the_test_lock(user_env):
    proc = subprocess.run(
        [
            str(user_env / "bin" / "python"),
            "-c",
            "import importlib.util as u, vllm_mla_fixes; "
            "print(u.find_spec('wheel') is None, vllm_mla_fixes.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=user_env.parent,
    )
    no_wheel, location = proc.stdout.split()
    assert no_wheel == "True"  # the package `wheel` is absent, as in a uv-made environment
    assert location.startswith(str(user_env))  # the installed copy, not this checkout


@pytest.mark.parametrize("logging_stream", [None, "ext://sys.stdout"])
def test_status_json_stdout_is_exactly_the_document(user_env, request, logging_stream):
    extra = {"VLLM_LOGGING_STREAM": logging_stream} if logging_stream else {}
    proc = cli(user_env, "status", "--json", **extra)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # fails on any log line before or after the document
    assert report["vllm"] == request.config.vllm_release
    for fix in report["fixes"]:
        assert fix["state"] in STATES and fix["reason"] and fix["reason"] not in fix["state"]
    states = {f["name"]: f["state"] for f in report["fixes"]}
    for fix in ALL_FIXES:
        if states[fix.INFO.name] == "applied":  # its log line went to stderr
            assert f"vllm-mla-fixes: applied {fix.INFO.name}" in proc.stderr
        if request.config.vllm_release not in fix.INFO.covered_releases:
            assert states[fix.INFO.name] == "not-needed", fix.INFO.name


def test_status_json_of_disabled_fixes(user_env):
    report = json.loads(cli(user_env, "status", "--json", VLLM_MLA_FIXES="none").stdout)
    assert {(f["state"], f["reason"]) for f in report["fixes"]} == {
        ("disabled", "not selected by VLLM_MLA_FIXES")
    }


def test_doctor_json_stdout_is_exactly_the_document(user_env, request):
    model = ROOT / "vllm_mla_fixes" / "models" / "tiny_glm_moe_dsa"
    proc = cli(
        user_env, "doctor", "--json", "--", "vllm", "serve", str(model), "--kv-cache-dtype", "fp8"
    )
    report = json.loads(proc.stdout)
    assert report["environment"]["packages"]["vllm"] == request.config.vllm_release
    assert report["environment"]["packages"]["vllm-mla-fixes"] == "0.1.0"
    for state in report["environment"]["fix_states"].values():
        assert state["state"] in STATES
    levels = {f["level"] for f in report["findings"]}
    verdict = (
        "WILL FAIL" if "error" in levels else "READY WITH WARNINGS" if "warn" in levels else "READY"
    )
    assert (report["verdict"], report["exit_status"]) == (verdict, proc.returncode)
    assert proc.returncode == {"READY": 0, "READY WITH WARNINGS": 1, "WILL FAIL": 2}[verdict]


def test_doctor_human_report(user_env):
    proc = cli(user_env, "doctor")
    assert "Findings" in proc.stdout
    verdict = proc.stdout.splitlines()[-1]
    assert (verdict.split(":")[0], proc.returncode) in (
        ("READY", 0),
        ("READY WITH WARNINGS", 1),
        ("WILL FAIL", 2),
    ), verdict
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args, env, says, code",
    [
        (
            ["status"],
            {"VLLM_MLA_FIXES": "fp8,bogus"},
            "VLLM_MLA_FIXES='fp8,bogus' is not allowed (unknown fix names 'fp8', 'bogus')",
            2,
        ),
        (
            ["doctor", "--", "serve", "m", "--block-size", "sixty-four"],
            {},
            "argument --block-size: invalid int value: 'sixty-four'",  # vLLM's own words
            2,
        ),
        (
            [
                "build-wheel",
                "--vllm-wheel",
                "/nonexistent/vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl",
            ],
            {},
            "no such file",
            2,
        ),
    ],
)
def test_user_errors_get_one_line_not_a_traceback(user_env, args, env, says, code):
    proc = cli(user_env, *args, **env)
    assert proc.returncode == code
    assert says in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_build_wheel_bad_inputs_in_the_users_environment(user_env, tmp_path):
    misnamed = tmp_path / "vllm.whl"
    misnamed.write_bytes(b"")
    proc = cli(
        user_env, "build-wheel", "--vllm-wheel", str(misnamed), "--out", str(tmp_path / "out")
    )
    assert proc.returncode == 2 and "is not a wheel file name" in proc.stderr
    not_a_wheel = tmp_path / "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    not_a_wheel.write_bytes(b"not a zip")
    proc = cli(
        user_env, "build-wheel", "--vllm-wheel", str(not_a_wheel), "--out", str(tmp_path / "out")
    )
    assert proc.returncode == 1 and "is not a valid wheel (zip) file" in proc.stderr
    assert not list((tmp_path / "out").glob("*.whl"))  # no half-written wheel left
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    proc = cli(
        user_env, "build-wheel", "--vllm-wheel", str(not_a_wheel), "--out", str(blocked / "out")
    )
    # refused as a bad argument before the wheel is read (issue 35: cheap checks first)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert f"--out {blocked / 'out'}: '{blocked}' is a file" in proc.stderr


@pytest.mark.vllm_release("0.25.1")
def test_build_wheel_without_the_wheel_package(user_env, tmp_path):
    """The issue's case: vLLM 0.25.1 installed by uv, no `wheel` package."""
    import vllm_mla_fixes
    from vllm_mla_fixes import wheel as wheel_builder

    upstream = wheel_builder.download_verified("0.25.1")
    proc = cli(user_env, "build-wheel", "--vllm-wheel", str(upstream), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    label = f"+mlafixes.{vllm_mla_fixes.__version__}"  # the plugin release the wheel carries
    patched = tmp_path / upstream.name.replace("vllm-0.25.1-", f"vllm-0.25.1{label}-")
    assert patched.is_file()
    assert f"sha256   {wheel_builder._sha256(patched)}  {patched.name}" in proc.stdout
