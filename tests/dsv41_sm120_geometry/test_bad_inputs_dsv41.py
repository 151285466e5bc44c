"""``selftest``'s output path against bad input (issue 35): checked before any
long work, and the report printed before the file is written.  The rest of
the fix's bad-input cases are rows of ``tests/test_bad_inputs.py``
(``bad_input_cases.py`` here)."""

from __future__ import annotations

import json
import time

import pytest
from bad_input_runs import assert_one_error, cli

pytestmark = pytest.mark.vllm_release("0.25.1")


def test_selftest_report_of_an_empty_path_is_refused_at_once(tmp_path):
    started = time.monotonic()
    proc = cli("selftest", "--json", "--report", "", cwd=tmp_path)
    assert_one_error(proc, 2, "--report '': an empty path names no file")
    assert time.monotonic() - started < 30  # before torch, vLLM or any geometry


@pytest.mark.parametrize("raised", ["CannotWrite", "OSError"])
def test_selftest_prints_its_report_before_writing_it(tmp_path, monkeypatch, capsys, raised):
    """A report file that cannot be written after the run (the disk filled
    up meanwhile) loses nothing: the report is on stdout already, and one
    line says the file is missing -- whether the writer names the failure
    (CannotWrite, as it does for a failed write) or an OSError escapes it."""
    from vllm_mla_fixes import atomic
    from vllm_mla_fixes import cli as cli_module

    def disk_full(target, data):
        if raised == "CannotWrite":
            raise atomic.CannotWrite(target, "No space left on device")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "write_atomic", disk_full)
    status = cli_module.main(["selftest", "--json", "--report", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the whole report, printed first
    assert report["vllm"] == "0.25.1" and status == 2
    assert captured.err.strip().splitlines()[-1] == (
        f"vllm-mla-fixes selftest: error: --report '{tmp_path / 'r.json'}' not written "
        "(No space left on device); the report is printed above"
    )
