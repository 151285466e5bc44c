"""``scripts/selftest-h200.sh`` stops before installing anything, with one line,
where it cannot work: no package index reachable, or no Python 3.11 (issue 27)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "selftest-h200.sh"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once it is closed


def _bin_with(tmp_path: Path, **tools: str) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, target in tools.items():
        (folder / name.replace("_", ".")).symlink_to(target)
    return folder


def _run(tmp_path: Path, path: str, **env: str) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    home.mkdir(parents=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    return subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(SCRIPT)],
        env={**base, "HOME": str(home), "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_offline_it_stops_at_once_with_one_line(tmp_path):
    index = f"http://127.0.0.1:{_closed_port()}/simple"
    python = _bin_with(tmp_path, python3_11=sys.executable)
    for variable in ("UV_INDEX_URL", "PIP_INDEX_URL"):
        path = f"{python}{os.pathsep}{os.environ['PATH']}"
        done = _run(tmp_path / variable, path, **{variable: index})
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert line.startswith(
            f"selftest-h200.sh: the package index {index}/uv/ cannot be reached ("
        ), line
        assert line.endswith(
            "this script installs the pinned environment and needs the network; "
            "run it where the index is reachable"
        ), line
        assert not (tmp_path / variable / "home" / ".cache").exists()  # nothing installed


def test_without_python_3_11_it_says_so_in_one_line(tmp_path):
    tools = _bin_with(tmp_path, dirname=shutil.which("dirname") or "/usr/bin/dirname")
    done = _run(tmp_path / "case", str(tools))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "selftest-h200.sh: python3.11 is not on PATH: the environments in envs/ are locked "
        "for Python 3.11; install it and rerun"
    ]
