"""doctor's verdict on the DeepSeek-V4.1 report's line (the shared verdict
tests are in ``tests/test_doctor_verdict.py``)."""

from __future__ import annotations

import json

import pytest
from doctor_runs import DSV41_LINE, run_doctor


@pytest.mark.vllm_release("0.32.0")
def test_will_fail_dsv41_block_64_with_the_fix_disabled(tmp_path):
    """The report's line on vLLM 0.32.0 with VLLM_MLA_FIXES=none: vLLM rejects
    --block-size 64 on SM12x and nothing fixes it.  The hub is offline and
    the model is not downloaded: doctor still names its architecture."""
    proc = run_doctor("--", *DSV41_LINE, hub=tmp_path / "hf", VLLM_MLA_FIXES="none")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("WILL FAIL: dsv41-sm120-geometry: ")
    assert "model deepseek-ai/DeepSeek-V4.1-Flash (DeepseekV41ForCausalLM; by its name" in (
        proc.stdout
    )


@pytest.mark.vllm_release("0.32.0")
def test_dsv41_line_is_judged_as_the_sm12x_node_sees_it(tmp_path):
    """No GPU here, so the plugin leaves this process alone; on an SM12x node it
    applies the fix.  doctor judges that node: nothing it prints about the
    line is contradicted by a later line (no WARN of the failure the fix covers
    beside "the fix applies")."""
    proc = run_doctor("--json", "--", *DSV41_LINE, hub=tmp_path / "hf")
    report = json.loads(proc.stdout)  # stdout is the JSON document alone
    assert report["environment"]["fix_states"]["dsv41-sm120-geometry"]["state"] == "not-needed"
    findings = [f for f in report["findings"] if f["topic"] == "dsv41-sm120-geometry"]
    assert findings[-1]["level"] == "ok"
    assert findings[-1]["message"].startswith("on an SM12x serving node the plugin loads the fix")
    assert not [f for f in findings if f["level"] in ("warn", "error")], findings
    assert any("gets the interleaved-split geometry" in f["message"] for f in findings)
    # no network here: the one warning is that the model's config cannot be read (issue 44)
    assert (report["verdict"], report["exit_status"]) == ("READY WITH WARNINGS", 1)
    assert report["reason"].startswith("model: cannot check the model's config: offline")
    assert proc.returncode == 1
