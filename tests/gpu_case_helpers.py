"""What ``test_gpu_cases*_on_cpu.py`` (here and in the fixes' own test
folders) share: the GPU tests' folder, a CPU-only environment, and the GPU
tests' serve lines as the installed release parses and builds them."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def cpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MLA_FIXES_EXPECT_GPU_CC"}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **extra}


def assert_built(seen: dict) -> None:
    """The release built its engine config from the line."""
    assert "engine_config_error" not in seen, seen["engine_config_error"]


@functools.cache  # one run per worker: the fixes' folders and tests/ both read it
def read_serve_lines() -> dict:
    """``gpu/serve_lines.py``'s result: each GPU test's serve, bench and LLM
    line as the installed release's own parser reads it."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(GPU_TESTS / "serve_lines.py")],
        env=cpu_env(VLLM_PLUGINS=""),
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")), None)
    assert proc.returncode == 0 and line, proc.stderr[-6000:]
    return json.loads(line[len("RESULT=") :])
