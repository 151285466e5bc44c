"""The review command run as an operator runs it: the helper of
``test_review*.py`` here and in the fixes' own test folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CLI = Path(sys.executable).parent / "vllm-mla-fixes"  # the console script, as an operator runs it


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "review", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in os.environ.items() if k != "VLLM_MLA_FIXES"},
    )
