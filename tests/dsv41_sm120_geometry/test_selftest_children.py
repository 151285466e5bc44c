"""Every child process dies with its parent (issue 33, issue 35 item 4).

``vllm_mla_fixes.children``: each child leads a process group of its own,
ended whole on a time limit, on SIGTERM, SIGINT or SIGHUP of the parent, and when the
parent dies.  Each test here starts children that start a grandchild (as a JIT
build starts ninja and nvcc) and hang, and asserts that no process of theirs
is left: through the mechanism itself, and through ``vllm-mla-fixes selftest
--jobs 2`` stopped by SIGTERM (nothing of its groups may remain after 5 s).
(``doctor`` starts no child process: its DeepSeek-V4.1 prediction runs in its
own process.)  A process counts as left if it is alive: a zombie waiting for
an init that does not reap is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 5.0  # what the issue allows a stopped command's processes to be gone in

# A module on the children's PYTHONPATH: each hanging process starts a
# grandchild that sleeps, notes both pids in $PIDS_DIR, then hangs itself.
HANGERS = """\
import os
import subprocess
import sys
import time


def note(name):
    grandchild = subprocess.Popen(["sleep", "600"])
    path = os.path.join(os.environ["PIDS_DIR"], name)
    with open(path + ".tmp", "w") as out:
        out.write(f"{os.getpid()} {grandchild.pid}")
    os.replace(path + ".tmp", path)


def hang(name):
    note(name)
    time.sleep(3600)


def watched_worker(parent, name):
    from vllm_mla_fixes import children

    children.lead_group_and_watch(parent)
    hang(name)
"""


def _state(pid: int) -> str | None:
    """The process's state letter, None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pids) -> list[int]:
    return [pid for pid in pids if _state(pid) not in (None, "Z", "X")]


def _members(groups: set[int]) -> list[int]:
    """Live processes whose process group or session is one of ``groups``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if state not in ("Z", "X") and (pgrp in groups or session in groups):
            found.append(int(entry.name))
    return found


def _wait_for_pids(folder: Path, names: list[str], timeout: float, proc=None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = {name: folder / name for name in names}
        if all(path.exists() for path in files.values()):
            return {name: tuple(map(int, path.read_text().split())) for name, path in files.items()}
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before its children hung:\n{err[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no pid files {names} in {timeout} s (found {os.listdir(folder)})")


def _gone_within(pids, groups: set[int], seconds: float) -> list[int]:
    """What is still alive of ``pids`` and ``groups`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = sorted(set(_alive(pids)) | set(_members(groups)))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _describe(pids) -> str:
    lines = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "?"
        lines.append(f"{pid} ({_state(pid)}): {cmd[:200]}")
    return "\n".join(lines)


@pytest.fixture
def site(tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "hangers.py").write_text(HANGERS)
    pids = tmp_path / "pids"
    pids.mkdir()
    yield folder, pids
    # A failing test leaves its processes behind: end them, by the pids noted (the
    # children's own, and each script's, noted by _script).
    for noted in pids.iterdir():
        if noted.suffix == ".tmp":  # being written: not a whole pid yet
            continue
        for pid in _alive(map(int, noted.read_text().split())):
            os.kill(pid, signal.SIGKILL)


def _env(site_dir: Path, pids: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MLA_FIXES")}
    env.pop("VLLM_PLUGINS", None)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=f"{site_dir}{os.pathsep}{ROOT}",
        PIDS_DIR=str(pids),
        **extra,
    )
    return env


def _script(site_dir: Path, pids: Path, code: str) -> subprocess.Popen:
    script = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(site_dir, pids),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # noted like its children's, so that the site fixture ends it if the test fails
    (pids / f"script-{script.pid}").write_text(str(script.pid))
    return script


# ------------------------------------------------------------------ the mechanism


def test_a_worker_that_forks_and_hangs_is_ended_whole_at_its_time_limit(site):
    site_dir, pids = site
    parent = _script(
        site_dir,
        pids,
        """
        import multiprocessing, os, time
        import hangers
        from vllm_mla_fixes import children
        if __name__ == "__main__":
            context = multiprocessing.get_context("spawn")
            worker = context.Process(target=hangers.watched_worker, args=(os.getpid(), "worker"))
            with children.supervised():
                worker.start()
                children.register(worker.pid)
                while not os.path.exists(os.path.join(os.environ["PIDS_DIR"], "worker")):
                    time.sleep(0.1)
                assert not children.exited(worker.pid, 1.0)  # it hangs: the time limit
                children.end_group(worker.pid)
                worker.join(children.REAP_TIMEOUT_S)
                print(worker.exitcode)
        """,
    )
    out, err = parent.communicate(timeout=180)
    assert out.strip() == str(-signal.SIGKILL), err[-3000:]
    ((worker, grandchild),) = _wait_for_pids(pids, ["worker"], 1.0).values()
    left = _gone_within([worker, grandchild], {worker}, GRACE_S)
    assert not left, _describe(left)


def test_a_worker_that_forks_and_hangs_is_ended_whole_when_its_parent_is_killed(site):
    """SIGKILL gives the parent no chance to end anything: the worker's
    watchdog ends the worker's group, grandchild included."""
    site_dir, pids = site
    parent = _script(
        site_dir,
        pids,
        """
        import multiprocessing, os, time
        import hangers
        if __name__ == "__main__":
            context = multiprocessing.get_context("spawn")
            context.Process(target=hangers.watched_worker, args=(os.getpid(), "worker")).start()
            time.sleep(3600)
        """,
    )
    ((worker, grandchild),) = _wait_for_pids(pids, ["worker"], 120, parent).values()
    parent.kill()
    parent.wait(timeout=10)
    left = _gone_within([worker, grandchild], {worker}, GRACE_S)
    assert not left, _describe(left)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopping_signal_ends_every_child_group_then_acts_as_before(site, signum):
    site_dir, pids = site
    parent = _script(
        site_dir,
        pids,
        """
        import multiprocessing, os, signal, sys, time
        import hangers
        from vllm_mla_fixes import children
        if __name__ == "__main__":
            # as a terminal starts Python; a background job (CI under nohup) starts
            # it with SIGINT (and SIGHUP) ignored, which supervised() leaves ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            context = multiprocessing.get_context("spawn")
            try:
                with children.supervised():
                    for name in ("one", "two"):
                        worker = context.Process(
                            target=hangers.watched_worker, args=(os.getpid(), name)
                        )
                        worker.start()
                        children.register(worker.pid)
                    time.sleep(3600)
            except KeyboardInterrupt:
                print("KeyboardInterrupt")
                sys.exit(130)
        """,
    )
    found = _wait_for_pids(pids, ["one", "two"], 120, parent)
    parent.send_signal(signum)
    out, _ = parent.communicate(timeout=30)
    if signum != signal.SIGINT:  # the default action, as without children
        assert parent.returncode == -signum
    else:  # Python's own SIGINT handler
        assert (parent.returncode, out.strip()) == (130, "KeyboardInterrupt")
    every = [pid for pair in found.values() for pid in pair]
    left = _gone_within(every, {child for child, _ in found.values()} | {parent.pid}, GRACE_S)
    assert not left, _describe(left)


# ------------------------------------------------------------------ the commands

SELFTEST_HANG = """\
# Every geometry starts a grandchild and hangs (tests/dsv41_sm120_geometry/test_selftest_children.py).
import hangers
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness


def run_geometry(name, device, kernels=None, entering=None, **kwargs):
    hangers.hang(name)


harness.run_geometry = run_geometry
"""


def _stopped_by_sigterm(command: list[str], env: dict, pids: Path, names: list[str]):
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its group: the test's to inspect
    )
    try:
        found = _wait_for_pids(pids, names, 600, proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        every = [pid for pair in found.values() for pid in pair]
        groups = {proc.pid} | {child for child, _ in found.values()}
        left = _gone_within(every, groups, GRACE_S)
        assert not left, _describe(left)
        assert proc.returncode == 128 + signal.SIGTERM  # unwound: cli's one line
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)


@pytest.mark.vllm_release("0.34.0")
def test_sigterm_to_selftest_with_two_jobs_leaves_no_process(site):
    site_dir, pids = site
    (site_dir / "sitecustomize.py").write_text(SELFTEST_HANG)
    command = Path(sys.executable).with_name("vllm-mla-fixes")
    geometries = ["--geometry", "split", "--geometry", "control"]
    _stopped_by_sigterm(
        [str(command), "selftest", "--json", "--no-timing", "--jobs", "2", *geometries],
        _env(site_dir, pids),
        pids,
        ["split", "control"],
    )
