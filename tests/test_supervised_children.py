"""Every process the package starts is supervised (issue 43).

``status --json --truth-table`` derives the truth table in a child
interpreter; stopped by SIGTERM, it used to leave that child running under
PID 1.  Every start now goes through :mod:`vllm_mla_fixes.children`
(:func:`children.run` for a command, ``multiprocessing`` workers that call
``lead_group_and_watch``): a process group of its own, ended whole when the
parent is stopped, at a time limit, and once the child has exited.  A scan
of the package's source fails on any other way of starting a process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from bad_input_runs import operator_env
from fix_releases import newest_covered

import vllm_mla_fixes
from vllm_mla_fixes import children

pytestmark = pytest.mark.vllm_release(newest_covered())  # no vLLM in them but status's: one session

PACKAGE = Path(vllm_mla_fixes.__file__).resolve().parent
STARTS = re.compile(
    r"\bsubprocess\.(run|Popen|call|check_call|check_output|getoutput|getstatusoutput)\b"
    r"|\bos\.(system|popen|fork|forkpty|spawn\w*|exec\w*|posix_spawn\w*)\("
    r"|\.Process\(|\bPool\("
)
# Each start the scan finds, and why it is supervised.
SUPERVISED = {
    "children.py": "children.run itself: its own group, ended on a signal, a timeout, at exit",
    "fixes/dsv41_sm120_geometry/selftest/isolation.py": (
        "multiprocessing workers: lead_group_and_watch, registered, ended by supervised()"
    ),
    "reproductions/fa4_on_cpu.py": (
        "os.fork inside the reproduction's interpreter, which children.run started as a group "
        "leader: the fork is in that group and ended with it"
    ),
}
GONE_WITHIN_S = 5.0


def test_every_process_start_in_the_package_is_supervised():
    found = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if STARTS.search(path.read_text(encoding="utf-8"))
    }
    assert found == set(SUPERVISED), "a process started outside vllm_mla_fixes.children"


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(group: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while _group_alive(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().endswith("\n")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} not written in {seconds} s"
        time.sleep(0.05)
    return path.read_text()


# A child that starts a grandchild (as a JIT build starts a compiler), says
# its group, and hangs.
HANGING_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpgrp()}\\n")
    time.sleep(600)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT])  # SIGTERM: status, below
def test_a_stopped_parent_ends_the_childs_whole_group(signum, tmp_path):
    said = tmp_path / "group"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys\n"
            "from vllm_mla_fixes import children\n"
            # as a terminal starts it: nohup (a background CI job) leaves both ignored
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
            "children.run([sys.executable, '-c', sys.argv[1], sys.argv[2]], timeout=600)\n",
            HANGING_CHILD,
            str(said),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    group = int(_wait_for(said, parent, 60))
    assert group != os.getpgrp()  # the child leads a group of its own
    parent.send_signal(signum)
    parent.communicate(timeout=30)
    assert parent.returncode != 0
    assert _gone(group), f"process group {group} outlived its parent"


def test_a_child_past_its_time_limit_is_ended_whole(tmp_path):
    said = tmp_path / "group"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        children.run([sys.executable, "-c", HANGING_CHILD, str(said)], timeout=1)
    assert time.monotonic() - started < 30
    assert _gone(int(said.read_text()))


def test_what_a_child_prints_comes_back():
    done = children.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); exit(3)"],
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_status_truth_table_stopped_by_sigterm_leaves_no_derivation_running(tmp_path):
    """The case of issue 43: an empty cache folder, so status starts the
    derivation; SIGTERM to status once the derivation runs."""
    status = subprocess.Popen(
        [sys.executable, "-m", "vllm_mla_fixes", "status", "--json", "--truth-table"],
        env=operator_env({"VLLM_MLA_FIXES_CACHE_DIR": str(tmp_path / "cache")}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deriving = None
    deadline = time.monotonic() + 300
    while deriving is None:
        assert status.poll() is None, status.communicate()
        assert time.monotonic() < deadline, "status started no derivation"
        for task in Path(f"/proc/{status.pid}/task").iterdir():
            for pid in Path(task, "children").read_text().split() if task.exists() else []:
                if "truth_table" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                    deriving = int(pid)
        time.sleep(0.1)
    group = os.getpgid(deriving)
    assert group == deriving  # it leads its own group
    status.send_signal(signal.SIGTERM)
    _, stderr = status.communicate(timeout=60)
    assert status.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert _gone(group), "the truth-table derivation outlived status"
