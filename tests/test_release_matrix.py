"""Release-matrix safety (issue 6): in every release environment, each fix's
gate reaches the right state on the hardware it targets -- applied exactly on
the releases the fix names as affected, not-needed everywhere else.

The decisions are the real ones: each fix's release range and its probe of the
installed release's code.  Where the target hardware is absent here, the fix's
own test hook stands in for it (FA4: the harness's ``--gate`` child, which
imports vLLM's FA4 code without the CUDA extension; a fix that decides per GPU
(DeepSeek-V4.1's) offers ``for_capability``, and targets the GPUs its ``INFO.hardware`` names).
Each fix has its decider in ``DECIDERS``, by name, so a retired fix's is never read.
Set ``VLLM_MLA_FIXES_MATRIX_OUT`` to a folder to record the rows
(``benchmarks/release_matrix.py`` does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_mla_fixes import installed_vllm_version
from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import run_fix

ANY_GPU = "any GPU"  # a decision the fix takes alike on every GPU it runs on
FP8_DECISION = """
import json, sys
from vllm_mla_fixes.fixes import fp8_ds_mla_reshape
from vllm_mla_fixes.patching import run_fix
status = run_fix(fp8_ds_mla_reshape.FIX, sys.argv[1]).status
print("DECIDED=" + json.dumps([status.state.value, status.reason]))
"""


def _decide_fp8(version, tmp_path):
    """In a fresh interpreter, as a vLLM process decides it: no other test's
    imports or patches in this worker can reach the probe."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FP8_DECISION, version],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("DECIDED=")), None)
    assert line is not None, done.stderr[-3000:]
    state, reason = json.loads(line.removeprefix("DECIDED="))
    print(f"fp8-ds-mla-reshape on vLLM {version}: {state} ({reason})")
    return [(ANY_GPU, state)]


def _decide_fa4(version, tmp_path):
    from vllm_mla_fixes.reproductions import fa4_compile_strides as fa4_repro

    out = tmp_path / "gate.json"
    subprocess.run(
        [sys.executable, "-W", "ignore", "-m", fa4_repro.__name__, "--gate", "--json", str(out)],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        timeout=600,
    )
    gate = json.loads(out.read_text())
    return [("SM100", gate["status"])]


def _decide_per_capability(version, tmp_path):
    """The DeepSeek-V4.1 fix decides per device: its record for each capability."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry

    return [
        (f"SM{major}{minor}", run_fix(dsv41_sm120_geometry.for_capability((major, minor)), version))
        for major, minor in ((12, 0), (12, 1), (10, 0), (9, 0))
    ]


# Each fix's decider, by its name (a retired fix's entry is simply never read):
# (hardware, the decision) rows for the installed release.
DECIDERS = {
    "fp8-ds-mla-reshape": _decide_fp8,
    "fa4-compile-strides": _decide_fa4,
    "dsv41-sm120-geometry": _decide_per_capability,
}


def _state(result) -> str:
    if isinstance(result, str):
        return result
    if result.patch is not None:
        result.patch.revert()
    return result.status.state.value


def test_every_fix_reaches_the_right_state_on_this_release(tmp_path):
    version = installed_vllm_version()
    rows = []
    for fix in ALL_FIXES:
        assert fix.INFO.name in DECIDERS, f"{fix.INFO.name}: add its decider to DECIDERS here"
        for hardware, result in DECIDERS[fix.INFO.name](version, tmp_path):
            targeted = hardware == ANY_GPU or hardware in fix.INFO.hardware
            rows.append((fix.INFO, hardware, _state(result), targeted))
    assert {info.name for info, *_ in rows} == {m.INFO.name for m in ALL_FIXES}
    table = []
    for info, hardware, state, targeted in rows:
        expected = "applied" if targeted and version in info.covered_releases else "not-needed"
        table.append(
            {
                "release": version,
                "fix": info.name,
                "hardware": hardware,
                "state": state,
                "expected": expected,
            }
        )
    out = os.environ.get("VLLM_MLA_FIXES_MATRIX_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{version}.json").write_text(json.dumps(table, indent=1))
    wrong = [row for row in table if row["state"] != row["expected"]]
    assert not wrong, json.dumps(wrong)
