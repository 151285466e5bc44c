"""Run ``vllm serve`` on a tiny dummy-weight model and talk to it (GPU tests only)."""

from __future__ import annotations

import contextlib
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
        pytest.skip(
            f"needs a CUDA GPU with compute capability {'/'.join(f'{m}.x' for m in majors)}: {why}"
        )
    capability = torch.cuda.get_device_capability()
    if capability[0] not in majors:
        pytest.skip(
            f"this GPU is SM{capability[0]}{capability[1]}; needs "
            f"{'/'.join(f'SM{m}x' for m in majors)}: {why}"
        )
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


@dataclass
class Server:
    port: int
    proc: subprocess.Popen
    healthy: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def running_server(
    model_dir: Path,
    args: list[str],
    env: dict[str, str],
    log_path: Path,
    startup_timeout: float = 900,
):
    """``vllm serve`` on a free loopback port with exactly the environment
    ``env``; waits for /health (or for the process to die) before yielding, and
    stops the server on exit."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log_path, "w") as log:
        server = Server(port, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            deadline = time.monotonic() + startup_timeout
            while time.monotonic() < deadline and server.proc.poll() is None and not server.healthy:
                try:
                    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                        server.healthy = r.status == 200
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(2)
            yield server
        finally:
            if server.proc.poll() is None:
                server.proc.terminate()
                try:
                    server.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.proc.kill()
                    server.proc.wait()


def complete(server: Server, model_dir: Path, prompt: list[int], max_tokens: int, **extra) -> dict:
    """One greedy /v1/completions request with a token-ID prompt."""
    body = json.dumps(
        {
            "model": str(model_dir),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
    ).encode()
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def serve(
    model_dir: Path,
    args: list[str],
    env: dict[str, str],
    log_path: Path,
    startup_timeout: float = 900,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 8,
) -> ServeResult:
    """Start the server, wait for /health or for it to die, send the prompts, stop it."""
    with running_server(
        model_dir, args, {**os.environ, **env}, log_path, startup_timeout
    ) as server:
        completions = [
            complete(server, model_dir, p, max_tokens) for p in (prompts or []) if server.healthy
        ]
    return ServeResult(
        server.healthy, log_path.read_text(errors="replace"), server.proc.returncode, completions
    )
