"""Output paths never replace what is not a regular file of ours (issue 43).

Every file a command writes goes through :mod:`vllm_mla_fixes.atomic`
(``selftest --report``, the wheel ``build-wheel`` writes and the one it
downloads, the screen and truth-table caches ``status`` keeps, the FA4
reproduction's ``--json``); the commands' own checks before any work
(:mod:`vllm_mla_fixes.arguments`) say the same thing first.  A folder, a
device, a FIFO, a socket, or a symbolic link to one, is refused and left as
it is; a link to a regular file is written through (its file replaced, the
link kept); a trailing slash names a folder; a write that fails names the
path and leaves no file, whole or partial.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from bad_input_runs import assert_one_error, cli
from fix_releases import newest_covered, newest_of_earliest_fix

from vllm_mla_fixes import arguments, atomic

pytestmark = pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))  # the node stays after the socket is closed


def _folder(path: Path) -> None:
    path.mkdir()


def _link_to_null(path: Path) -> None:
    path.symlink_to("/dev/null")


def _link_to_a_pipe(path: Path) -> None:
    """What ``/proc/self/fd/1`` is for a command in a pipeline (here under
    pytest, stdout itself is a file)."""
    read_end, _ = os.pipe()  # left open until the test process ends
    path.symlink_to(f"/proc/self/fd/{read_end}")


NOT_REGULAR: dict[str, tuple[Callable[[Path], None], str]] = {
    "FIFO": (_fifo, "it is a FIFO (named pipe), not a regular file"),
    "socket": (_socket, "it is a socket, not a regular file"),
    "folder": (_folder, "it is a folder; give a file name"),
    "link to /dev/null": (_link_to_null, "it is a link to a character device (/dev/null)"),
    "link to /proc/self/fd/N, a pipe": (_link_to_a_pipe, "it is a link to a FIFO (named pipe)"),
}


def _kind(path: Path) -> int:
    return stat.S_IFMT(path.lstat().st_mode)


@pytest.mark.parametrize("name", NOT_REGULAR)
def test_what_is_not_a_regular_file_is_refused_and_left_as_it_is(name, tmp_path):
    make, says = NOT_REGULAR[name]
    target = tmp_path / "report.json"
    make(target)
    before = _kind(target)
    assert says in (arguments.output_file_problem(str(target)) or "")
    with pytest.raises(atomic.CannotWrite, match=re.escape(f"cannot write '{target}': {says}")):
        atomic.write_atomic(target, "{}\n")
    assert _kind(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary file


def test_a_device_itself_is_refused():
    assert "it is a character device, not a regular file" in (
        arguments.output_file_problem("/dev/null") or ""
    )
    with pytest.raises(atomic.CannotWrite, match="it is a character device"):
        atomic.write_atomic(Path("/dev/null"), "{}")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_link_to_a_regular_file_is_written_through(tmp_path):
    real = tmp_path / "kept" / "report.json"
    real.parent.mkdir()
    real.write_text("earlier\n")
    link = tmp_path / "report.json"
    link.symlink_to(real)
    assert arguments.output_file_problem(str(link)) is None
    atomic.write_atomic(link, "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"
    assert [p.name for p in real.parent.iterdir()] == ["report.json"]


def test_a_link_loop_is_named(tmp_path):
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    assert "Too many levels of symbolic links" in (arguments.output_file_problem(str(loop)) or "")
    with pytest.raises(atomic.CannotWrite, match="Too many levels"):
        atomic.write_atomic(loop, "{}")


def test_a_trailing_slash_names_a_folder(tmp_path):
    assert arguments.output_file_problem(f"{tmp_path}/x.json/") == (
        "it ends in '/', which names a folder; give a file name"
    )


def test_a_full_file_system_names_the_path_and_leaves_no_file(tmp_path):
    """A real write that fails part-way (the file size limit: EFBIG, the same
    path through the code as ENOSPC), in a child so the limit stays there."""
    target = tmp_path / "report.json"
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from vllm_mla_fixes import atomic\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    atomic.write_atomic(Path(sys.argv[1]), 'x' * 100_000)\n"
        "except atomic.CannotWrite as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == f"cannot write '{target}': File too large\n", done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("report", "says"),
    [
        ("/dev/null", "--report '/dev/null': it is a character device, not a regular file"),
        ("{tmp}/x.json/", "which names a folder; give a file name"),
    ],
)
def test_selftest_refuses_a_report_path_before_any_work(report, says, tmp_path):
    report = report.format(tmp=tmp_path)
    proc = cli("selftest", "--report", report, cwd=tmp_path)
    assert_one_error(proc, 2, says.format(tmp=tmp_path))
    assert not list(tmp_path.iterdir())


def test_a_relative_xdg_cache_home_is_ignored_and_a_relative_home_is_named(monkeypatch, tmp_path):
    """The XDG spec ignores a relative XDG_CACHE_HOME; a relative HOME leaves
    no cache folder, and the message says which setting gives one."""
    from vllm_mla_fixes import screen_cache

    monkeypatch.delenv("VLLM_MLA_FIXES_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert screen_cache.cache_dir() == tmp_path / ".cache" / "vllm-mla-fixes" / "screens"
    monkeypatch.chdir(tmp_path)  # what a relative HOME resolves against
    monkeypatch.setenv("HOME", "relative-home")
    with pytest.raises(OSError, match="HOME is not absolute.*set VLLM_MLA_FIXES_CACHE_DIR"):
        screen_cache.cache_dir()
