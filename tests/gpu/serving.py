"""Run ``vllm serve`` on a tiny dummy-weight model and talk to it (GPU tests only)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


RESULTS_ENV = "VLLM_MLA_FIXES_GPU_RESULTS"


def results_dir(tmp_path_factory) -> Path:
    """Where a GPU run keeps what it saw: ``$VLLM_MLA_FIXES_GPU_RESULTS`` (the
    CI job's artifact folder), else a pytest temporary folder."""
    out = Path(os.environ.get(RESULTS_ENV) or tmp_path_factory.mktemp("results"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def keep_log(tmp_path_factory, name: str, text: str) -> Path:
    """The whole log of a run, beside its JSON summary, as ``<name>.log``."""
    path = results_dir(tmp_path_factory) / f"{name}.log"
    path.write_text(text)
    return path


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
    gpu_memory_before: dict | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# vLLM's children (EngineCore, workers) inherit the session of the process we
# start; stopping only that process would leave them holding GPU memory, and
# every later start on the runner would fail.  So each child gets its own
# session and the whole group is stopped.
STOP_GRACE_S = 60


def stop_process_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL whatever is left
    after ``grace`` seconds (also members that outlived an exited leader)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_alive(proc.pid):
        time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_in_own_session(
    cmd: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, but
    the child leads its own process group, which is stopped when the child
    exits and on timeout (then ``TimeoutExpired`` is raised, as
    ``subprocess.run`` does).  Output goes through files, not pipes: a
    grandchild that inherited them cannot keep the call waiting."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, grace=10)
            out.seek(0)
            err.seek(0)
            raise subprocess.TimeoutExpired(
                cmd, timeout, output=out.read(), stderr=err.read()
            ) from None
        stop_process_group(proc, grace=10)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


GIB = 2**30


def gpu_memory() -> dict | None:
    """Free and total memory of GPU 0 and the processes holding memory on it,
    from ``nvidia-smi`` (None where there is no nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def query(*args: str) -> str:
        return subprocess.run(
            [smi, *args, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    return parse_gpu_memory(
        query("--query-gpu=memory.free,memory.total"),
        query("--query-compute-apps=pid,process_name,used_memory"),
    )


def parse_gpu_memory(gpus_csv: str, apps_csv: str) -> dict:
    """nvidia-smi's CSV (MiB, no header, no units) -> GiB free/total of GPU 0 and holders."""
    free, total = (float(x) for x in gpus_csv.splitlines()[0].split(","))
    return {
        "free_gib": round(free / 1024, 2),
        "total_gib": round(total / 1024, 2),
        "holders": [line.strip() for line in apps_csv.splitlines() if line.strip()],
    }


def memory_problem(memory: dict | None, utilization: float) -> str | None:
    """Why vLLM cannot start with ``--gpu-memory-utilization utilization``
    on this GPU now (it takes that share of the total), or None."""
    if memory is None:
        return None
    needed = utilization * memory["total_gib"]
    if memory["free_gib"] >= needed:
        return None
    return (
        f"only {memory['free_gib']:.1f} GiB of GPU memory free of {memory['total_gib']:.1f} "
        f"GiB, and --gpu-memory-utilization {utilization} needs {needed:.1f} GiB; held by "
        f"(pid, name, MiB): {memory['holders'] or 'no listed process'}. A process left by an "
        f"earlier run holds it: stop it (kill <pid>) and rerun"
    )


def check_gpu_memory(args: list[str] | dict, log) -> dict | None:
    """Before a start: report free GPU memory into ``log`` and fail the test
    when there is not enough for the run's ``--gpu-memory-utilization``."""
    if isinstance(args, dict):
        utilization = float(args.get("gpu_memory_utilization", 0.9))
    else:
        flag = "--gpu-memory-utilization"
        utilization = float(args[args.index(flag) + 1]) if flag in args else 0.9
    memory = gpu_memory()
    if memory is not None:
        log.write(
            f"[gpu test] before start: {memory['free_gib']:.1f} GiB free of "
            f"{memory['total_gib']:.1f} GiB, holders {memory['holders']}\n"
        )
        log.flush()
    problem = memory_problem(memory, utilization)
    if problem:
        pytest.fail(problem, pytrace=False)
    return memory


@contextlib.contextmanager
def running_server(
    model_dir: Path,
    args: list[str],
    env: dict[str, str],
    log_path: Path,
    startup_timeout: float = 900,
):
    """``vllm serve`` on a free loopback port with exactly the environment
    ``env``, in its own process group; waits for /health (or for the process
    to die) before yielding, and stops the whole group on exit."""
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
        memory = check_gpu_memory(args, log)
        server = Server(
            port,
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            ),
            gpu_memory_before=memory,
        )
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
            stop_process_group(server.proc)


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
