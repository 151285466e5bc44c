"""Run ``vllm serve`` on a tiny dummy-weight model and talk to it (GPU tests only)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def require_gpu(*majors: int, why: str) -> tuple[int, int]:
    """Skip unless a CUDA GPU of one of these compute-capability majors is present."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU with compute capability {'/'.join(f'{m}.x' for m in majors)}: {why}")
    capability = torch.cuda.get_device_capability()
    if capability[0] not in majors:
        pytest.skip(f"this GPU is SM{capability[0]}{capability[1]}; needs "
                    f"{'/'.join(f'SM{m}x' for m in majors)}: {why}")
    return capability


def require_vllm(specifier: str) -> str:
    from importlib.metadata import version

    from vllm_mla_fixes.patching import release_admitted

    installed = version("vllm")
    if not release_admitted(installed, specifier):
        pytest.skip(f"needs vLLM {specifier}, found {installed}")
    return installed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeResult:
    healthy: bool
    log: str
    returncode: int | None
    completions: list[dict] = field(default_factory=list)

    def has(self, text: str) -> bool:
        return text in self.log


def serve(model_dir: Path, args: list[str], env: dict[str, str], log_path: Path,
          startup_timeout: float = 900, prompts: list[list[int]] | None = None,
          max_tokens: int = 8) -> ServeResult:
    """Start the server, wait for /health or for it to die, send the prompts, stop it."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *args]
    full_env = {**os.environ, **env}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        healthy, completions = False, []
        try:
            deadline = time.monotonic() + startup_timeout
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        healthy = r.status == 200
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                if healthy:
                    break
                time.sleep(2)
            for prompt in (prompts or []) if healthy else []:
                body = json.dumps({"model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens,
                                   "temperature": 0, "ignore_eos": True}).encode()
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as r:
                    completions.append(json.loads(r.read()))
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return ServeResult(healthy, log_path.read_text(errors="replace"), proc.returncode, completions)
