"""The package's command line run in a child process: the helper of
``test_wheel_inputs*.py`` here and in the fixes' own test folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    return subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", *args],
        cwd=cwd,
        env={**full, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
