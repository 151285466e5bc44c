"""What ``doctor`` reads, refused where vLLM refuses it, in vLLM's words (issue 35).

The model folder's config is read through the release's own engine-config
build (``create_engine_config``: transformers' AutoConfig through vLLM's
reader, heads against the tensor-parallel size, the speculative method), so
a line vLLM cannot serve is WILL FAIL, exit status 2, never READY.  Each case
here was READY, READY WITH WARNINGS or a traceback before.  Every invalid
``VLLM_MLA_FIXES*`` setting is a WARN of the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fix_releases import newest_covered, newest_of_earliest_fix

from vllm_mla_fixes import doctor, settings
from vllm_mla_fixes.fixes import ALL_FIXES

pytestmark = pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())
ROOT = Path(__file__).resolve().parent.parent
TINY_GLM = ROOT / "vllm_mla_fixes" / "models" / "tiny_glm_moe_dsa"  # 16 attention heads


def _model(folder: Path, config: bytes | None) -> str:
    """A model folder holding ``config`` as its config.json (the tiny GLM's when None)."""
    folder.mkdir()
    (folder / "config.json").write_bytes(
        (TINY_GLM / "config.json").read_bytes() if config is None else config
    )
    return str(folder)


def _glm_with(**fields) -> bytes:
    config = json.loads((TINY_GLM / "config.json").read_text())
    return json.dumps({**config, **fields}).encode()


def _judged(argv: list[str]) -> tuple[str, str]:
    _, _, findings = doctor.diagnose(["vllm", "serve", *argv], load_plugins=False)
    judged = doctor.verdict(findings)
    return judged.label, judged.reason


CONFIGS = {
    # (config.json bytes, what vLLM says)
    "not JSON": (b"{not json", "is not a valid JSON file"),
    "not UTF-8": (_glm_with(x=1).replace(b'"x"', b'"\xff"'), "is not a valid JSON file"),
    "architectures a string": (
        _glm_with(architectures="GlmMoeDsaForCausalLM"),
        "ModelConfig: architectures: Input should be a valid list",
    ),
    "architectures an int": (
        _glm_with(architectures=5),
        "ModelConfig: architectures: Input should be a valid list",
    ),
    "nested 100,000 deep": (
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "RecursionError: maximum recursion depth exceeded",
    ),
}


@pytest.mark.parametrize("case", CONFIGS, ids=str)
def test_a_config_vllm_cannot_read_will_fail_in_its_words(case, tmp_path):
    config, says = CONFIGS[case]
    label, reason = _judged([_model(tmp_path / "model", config)])
    assert label == doctor.WILL_FAIL, reason
    assert reason.startswith("serve line: vLLM ") and says in reason, reason


LINES = {
    # (flags after the tiny GLM's folder, what vLLM says)
    "-tp 3 for 16 heads": (
        ["-tp", "3"],
        "Total number of attention heads (16) must be divisible by tensor parallel size (3).",
    ),
    "an unknown speculative method": (
        ["--speculative-config", '{"method": "bogus", "num_speculative_tokens": 1}'],
        "SpeculativeConfig: method: ",
    ),
}


@pytest.mark.parametrize("case", LINES, ids=str)
def test_a_line_vllm_refuses_for_its_model_will_fail_in_its_words(case):
    flags, says = LINES[case]
    label, reason = _judged([str(TINY_GLM), *flags])
    assert label == doctor.WILL_FAIL and says in reason, reason


def test_a_model_folder_that_does_not_exist_will_fail(tmp_path):
    label, reason = _judged([str(tmp_path / "no-such-model")])
    assert label == doctor.WILL_FAIL and "no-such-model" in reason, reason


def test_the_same_folder_with_a_good_config_is_accepted(tmp_path):
    from importlib.metadata import version

    line = ["vllm", "serve", _model(tmp_path / "model", None), "-tp", "2"]
    finding, _ = doctor.check_with_vllm(line, version("vllm"))
    assert finding.level == "ok", finding
    assert "its engine config built from the model's config" in finding.message


def test_a_config_file_with_a_yaml_error_will_fail_in_its_words(tmp_path):
    """``vllm serve --config FILE``: vLLM's parser reads the YAML and stops on it."""
    bad = tmp_path / "serve.yaml"
    bad.write_text("model: [unclosed\n  tp: : 3\n")
    label, reason = _judged([str(TINY_GLM), "--config", str(bad)])
    assert label == doctor.WILL_FAIL and "while parsing a flow sequence" in reason, reason


def _without_dac_override():
    """In the child: drop root's right to read any file (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH), so a file of mode 000 refuses it as it refuses a
    service user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # PR_CAPBSET_DROP = 24
        if libc.prctl(24, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MLA_FIXES")}
    full.pop("VLLM_PLUGINS", None)
    full.update(CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "doctor", *args],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
    )


def test_an_unreadable_config_will_fail_and_json_says_so(tmp_path):
    """As a process: exit status 2, the JSON report on stdout, no traceback;
    every invalid setting a WARN of the same report."""
    model = _model(tmp_path / "model", None)
    Path(model, "config.json").chmod(0)
    bad = {
        settings.FIXES_VARIABLE: "all,bogus",
        **{s.name: "bogus" for fix in ALL_FIXES for s in fix.SETTINGS},  # each fix's own
        settings.CACHE_DIR.name: "/etc/passwd/sub",
    }
    proc = _doctor("--json", "--", "vllm", "serve", model, **bad)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["verdict"], report["exit_status"], proc.returncode) == ("WILL FAIL", 2, 2)
    assert "PermissionError" in report["reason"] and "config.json" in report["reason"], report
    warned = [f["message"] for f in report["findings"] if f["topic"] == "settings"]
    assert {f["level"] for f in report["findings"] if f["topic"] == "settings"} == {"warn"}
    for name, value in bad.items():
        assert len([m for m in warned if m.startswith(f"{name}={value!r} is not allowed")]) == 1


def test_a_deeply_nested_config_in_json_mode_prints_the_report(tmp_path):
    model = _model(tmp_path / "model", CONFIGS["nested 100,000 deep"][0])
    proc = _doctor("--json", "--", "vllm", "serve", model)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["verdict"], proc.returncode) == ("WILL FAIL", 2)
    assert "RecursionError" in report["reason"]
