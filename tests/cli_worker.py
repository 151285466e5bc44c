"""Runs ``vllm-mla-fixes`` command lines as fresh processes, fast: the
property suite's (``test_properties.py``) way to run hundreds of them.

    python cli_worker.py     # then one JSON request per line on stdin

The worker imports vLLM and this package once (tens of seconds), then forks
one child per request.  The child is a process of its own, as a command run
from a shell is: its own environment, working folder, file descriptors 1 and
2 (files the answer is read from), and exit status; nothing it does (the
plugin's patches, a setting, a signal) reaches the next one.  The plugin
state the import left (vLLM's "plugins loaded" flag, this package's fix
results) is reset in the child first, so that the command loads the plugins
as a new process does.

A request: ``{"argv": [...], "env": {...}, "cwd": PATH, "timeout": SECONDS}``
runs ``vllm-mla-fixes ARGV``; ``{"engine_config": [serve args], ...}`` asks
the installed vLLM alone whether ``vllm serve ARGS`` builds its engine config
(the oracle doctor is held to).  The answer: ``{"status", "stdout",
"stderr", "seconds"}`` (status ``"hung"`` when the timeout passed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_GLM = ROOT / "vllm_mla_fixes" / "models" / "tiny_glm_moe_dsa"


def _warm() -> None:
    """Import what every command imports, derive what a process derives once
    and keeps (vLLM's inspection of the tiny model's architecture, the
    kernels' declarations status compares), with no plugin loaded."""
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # as the CLI sets it
    os.environ["VLLM_PLUGINS"] = ""
    import vllm_mla_fixes.cli  # noqa: F401
    from vllm_mla_fixes import doctor, serve_line

    doctor.read_environment(load_plugins=False)  # torchaudio, NVML, torch
    vllm_mla_fixes.cli._kernel_disagreements()  # seconds on 0.32-0.34, kept per process
    with serve_line.cuda_device_type_while_parsing():
        try:
            serve_line.check_engine_config(serve_line.parse([str(TINY_GLM)]))
        except serve_line.Rejected:
            pass  # a release that refuses the tiny model says so in each child
    del os.environ["VLLM_PLUGINS"]


def _as_a_new_process() -> None:
    import vllm.plugins

    import vllm_mla_fixes

    vllm_mla_fixes.revert_all()
    vllm.plugins.plugins_loaded = False


def _engine_config(serve_args: list[str]) -> int:
    """0 where the installed vLLM builds the line's engine config, else 2
    with what it raised on stderr."""
    from vllm_mla_fixes import serve_line

    with serve_line.cuda_device_type_while_parsing():
        try:
            serve_line.check_engine_config(serve_line.parse(serve_args))
        except serve_line.Rejected as exc:
            print(exc, file=sys.stderr)
            return 2
    return 0


def _child(request: dict, out: str, err: str) -> None:
    """In the forked child: never returns."""
    status = 70
    try:
        os.chdir(request.get("cwd") or tempfile.gettempdir())
        for name in request.get("unset", ()):
            os.environ.pop(name, None)
        os.environ.update(request.get("env", {}))
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _as_a_new_process()
        if "engine_config" in request:
            status = _engine_config(request["engine_config"])
        else:
            from vllm_mla_fixes.cli import main

            try:
                status = main(request["argv"])
            except SystemExit as exc:  # --help, --version: argparse exits
                status = exc.code if isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # what the interpreter would print: the test fails on it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        status = 70
    os._exit(status)


def _run(request: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="cli-worker-") as folder:
        out, err = f"{folder}/stdout", f"{folder}/stderr"
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(request, out, err)
        deadline = started + float(request.get("timeout", 120))
        status: int | str = "hung"
        while time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        read = lambda path: Path(path).read_text(encoding="utf-8", errors="backslashreplace")  # noqa: E731
        return {
            "status": status,
            "stdout": read(out),
            "stderr": read(err),
            "seconds": time.monotonic() - started,
        }


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")  # answers go here alone
    os.dup2(2, 1)  # whatever the imports print goes to stderr
    _warm()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        answer = _run(request)
        print(f"{answer['seconds']:.2f} s {answer['status']} {request}"[:300], file=sys.stderr)
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
