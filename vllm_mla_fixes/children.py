"""Child processes that cannot outlive the command that started them.

A command that starts a child (the self-test's geometry and timing workers)
must not leave it running when the command is stopped (``timeout``, systemd
and Kubernetes send SIGTERM; a terminal SIGINT, a closed one SIGHUP), when it gives up on the child
(a time limit), or when it dies.  Each child here leads a process group (and
session) of its own, so that everything it starts in turn (ninja and nvcc of a
JIT build) is ended with it:

* :func:`supervised` (in the parent): a SIGTERM, SIGINT or SIGHUP first ends
  every child group still running, then does what it did before (SIGTERM's and
  SIGHUP's default end the command; SIGINT raises ``KeyboardInterrupt``);
  leaving the block ends the groups still running;
* :func:`end_group` ends a child's whole group (SIGKILL): on a time limit, and
  after the child has reported, for anything it left behind;
* when the parent dies without a chance to do so (SIGKILL, the OOM killer): the
  child calls :func:`lead_group_and_watch` first, whose watchdog thread ends
  the child's whole group as soon as its parent is gone.  (The kernel's
  parent-death signal, ``PR_SET_PDEATHSIG``, would kill the child alone and
  leave what it started running.)

Every wait has a time limit.  Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from subprocess import CompletedProcess
from types import FrameType

from vllm_mla_fixes.atomic import STOPPING_SIGNALS

WATCH_INTERVAL_S = 0.2  # how often a worker's watchdog looks for its parent
REAP_TIMEOUT_S = 10.0  # a SIGKILLed process is gone in far less, unless stuck in the kernel

# Leaders (pids) of the child groups started and not yet ended.
_live: set[int] = set()
_live_lock = threading.Lock()


def register(leader: int) -> None:
    """``leader``'s group is ended by :func:`end_all` (and a stopping signal)."""
    with _live_lock:
        _live.add(leader)


def end_group(leader: int) -> None:
    """SIGKILL every process of the group ``leader`` leads, and ``leader``
    itself (it may not have made its group yet).  Call it before reaping
    ``leader``: until then its pid, and so its group's id, cannot be reused."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(leader, signal.SIGKILL)
    with _live_lock:
        _live.discard(leader)


def end_all() -> None:
    """End every child group started and not yet ended: those registered, and
    any child ``multiprocessing`` started here that is not registered yet (a
    signal between its ``start()`` and :func:`register`; left alive, it would
    wait for its parent to die while ``multiprocessing``'s exit handler waits
    for it)."""
    with _live_lock:
        leaders = list(_live)
    for leader in leaders:
        end_group(leader)
    # Only now: active_children() reaps the children that have exited, and a
    # registered leader must not be reaped before its group is ended.
    started = sys.modules.get("multiprocessing")  # never imported here: nothing it started
    if started is not None:
        for child in started.active_children():
            if child.pid is not None:
                end_group(child.pid)


def exited(pid: int, timeout: float) -> bool:
    """Whether child ``pid`` has exited within ``timeout`` seconds; it is left
    unreaped, so that its group can still be ended safely."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # already reaped
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def supervised() -> Iterator[None]:
    """Inside this block a SIGTERM, SIGINT or SIGHUP first ends every child group,
    then acts as it did before (one the process ignores stays ignored);
    leaving the block ends the groups still running.  Signal handlers belong to the main thread: elsewhere only the
    ending on leaving applies."""
    if threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            end_all()
        return
    previous = {int(signum): signal.getsignal(signum) for signum in STOPPING_SIGNALS}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        end_all()
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before != signal.SIG_IGN:  # the default action: die of the signal, as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in STOPPING_SIGNALS:
        if previous[signum] != signal.SIG_IGN:  # nohup, or a background job's SIGINT: stays ignored
            signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        end_all()


def run(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> CompletedProcess[str]:
    """Run the command ``argv`` to its end as a supervised child: it leads a
    session (and process group) of its own, which is ended whole when this
    process is stopped (:func:`supervised`), when it runs past ``timeout``
    seconds (``subprocess.TimeoutExpired``), and once it has exited (anything
    it left behind).  What it prints is returned as text.  A child that is
    this package's module takes ``--watch-parent PID`` and calls
    :func:`watch_parent`, so that it ends when this process dies unwarned."""
    import subprocess
    import tempfile

    with (
        tempfile.TemporaryFile("w+") as out,  # files, not pipes: nothing blocks on a full pipe
        tempfile.TemporaryFile("w+") as err,
        supervised(),
    ):
        child = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
        # A stopping signal before this line misses it: its watchdog
        # (--watch-parent) ends it once this process has gone.
        register(child.pid)
        try:
            finished = exited(child.pid, timeout)  # unreaped: its group can still be ended
        finally:
            end_group(child.pid)
            child.wait(REAP_TIMEOUT_S)
        if not finished:
            raise subprocess.TimeoutExpired(argv, timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, child.returncode, out.read(), err.read())


def lead_group_and_watch(parent: int) -> None:
    """In a child (a ``multiprocessing`` worker), first: lead a session (and
    process group) of its own, so that the parent ends it whole, with what it
    starts; and end that group if ``parent`` dies (a watchdog thread)."""
    os.setsid()
    watch_parent(parent)


def watch_parent(parent: int) -> None:
    """In a child that leads its own group (started by :func:`run`): end that
    group as soon as ``parent`` is gone (a watchdog thread)."""
    watchdog = threading.Thread(
        target=_end_group_when_orphaned, args=(parent,), name="parent-watchdog", daemon=True
    )
    watchdog.start()


def _end_group_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os.killpg(os.getpgrp(), signal.SIGKILL)
