"""The package's command line run as a careful operator's bad input would
run it: the helpers of ``test_bad_inputs.py`` and of the fixes' own
``bad_input_cases.py`` and bad-input tests (issue 29)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path


def operator_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any of the package's settings or vLLM's plugin
    selection, no GPU, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_MLA_FIXES") and k not in ("VLLM_PLUGINS", "VLLM_LOGGING_STREAM")
    }
    env.update(CUDA_VISIBLE_DEVICES="", **(extra or {}))
    return env


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", *args],
        cwd=cwd,
        env=operator_env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_one_error(proc: subprocess.CompletedProcess, status: int, says: str) -> None:
    """Exit status, one error line on stderr naming the cause, no traceback,
    and the same error as the JSON document where --json was asked for."""
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-3000:]
    assert proc.returncode == status, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("vllm-mla-fixes") and says in errors[0], errors[0]
    own_args = proc.args[: proc.args.index("--")] if "--" in proc.args else proc.args
    if "--json" in own_args:
        document = json.loads(proc.stdout)
        assert document["exit_status"] == status and says in document["error"], document
    else:
        assert proc.stdout == "", proc.stdout


@dataclasses.dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    status: int
    says: str

    def __str__(self) -> str:
        return " ".join(self.argv) or "(nothing)"


def case(argv: str, status: int, says: str) -> Case:
    return Case(tuple(argv.split(" ")) if argv else (), status, says)
