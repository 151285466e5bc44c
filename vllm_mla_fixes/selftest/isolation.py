"""Each geometry in a process of its own, so that one geometry's fault cannot reach another's rows.

A CUDA error such as an illegal address is sticky: once a kernel raises it,
every later call in that process fails too.  Run in one process, a fault in
one layout would fail every layout after it and the verdict would blame the
wrong one.  Here each geometry runs in a spawned process; the parent keeps
the results of those that report and, for one that dies without reporting
(a segfault, the OOM killer), names the kernel it was in (each process
writes the kernel it is in into a buffer it shares with the parent).  One
still running after its time limit (a kernel that never returns) is stopped
and reported hung in the kernel it was in, so the others' verdicts still come.

On a GPU the processes keep the GPU: the CPU environment
(:func:`.env.prepare_process_env`) is set only where the device is the CPU.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_mla_fixes import children

if TYPE_CHECKING:
    from .harness import GeometryResult
    from .kernels import Device

_KERNEL_NAME_BYTES = 255


DEFAULT_LIMIT_SECONDS = 1800.0
"""How long one geometry's process may run before it is taken for hung and
stopped.  On a GPU a geometry takes seconds, but its first run may JIT-build
FlashInfer's SM120 kernels (13 sources: minutes on a serving node's cores,
41 minutes on 2 CPU cores, ``benchmarks/results/flashinfer_sm120_jit_0.33.0.txt``);
on CPU, under Triton's interpreter, a few minutes (``tests/README.md``)."""

TEARDOWN_SECONDS = 30.0
"""How long a process that has sent its result may take to exit before its
group is ended (a process can hang in teardown after a sticky CUDA fault)."""


def run_isolated(
    names: tuple[str, ...],
    device: Device,
    jobs: int,
    limit_seconds: float = DEFAULT_LIMIT_SECONDS,
    timed: bool = True,
) -> list[GeometryResult]:
    """Run geometries ``names``, at most ``jobs`` processes at a time; results in
    the order of ``names``.  A process still running after ``limit_seconds``
    is stopped and its geometry reported as hung in the kernel it was in.
    Each process leads a process group of its own, ended whole when its
    geometry is done, when it hangs, and when this process is stopped or dies
    (:mod:`vllm_mla_fixes.children`)."""
    context = multiprocessing.get_context("spawn")
    waiting = list(names)
    running: dict[Any, _Worker] = {}  # by the receiving end of its pipe
    results: dict[str, GeometryResult] = {}
    with children.supervised():
        while waiting or running:
            while waiting and len(running) < jobs:
                worker = _start(context, waiting.pop(0), device, timed)
                running[worker.receiver] = worker
            deadline = min(w.started for w in running.values()) + limit_seconds
            ready: list[Any] = multiprocessing.connection.wait(
                list(running), timeout=max(0.0, deadline - time.monotonic())
            )
            for receiver in ready:
                worker = running.pop(receiver)
                results[worker.name] = _collect(worker)
            for worker in [w for w in running.values() if w.elapsed() >= limit_seconds]:
                del running[worker.receiver]
                _end(worker, teardown_seconds=0.0)
                results[worker.name] = _hung(worker.name, limit_seconds, worker.kernel())
                results[worker.name].seconds = worker.elapsed()
    return [results[name] for name in names]


@dataclass
class _Worker:
    """One geometry's process, as the parent tracks it."""

    name: str
    process: Any
    receiver: Any  # the parent's end of the pipe the result comes through
    entered: Any  # the kernel the process is in (shared buffer)
    started: float

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def kernel(self) -> str:
        return self.entered.value.decode(errors="replace")


def _start(context, name: str, device: Device, timed: bool) -> _Worker:
    receiver, sender = context.Pipe(duplex=False)
    entered = context.RawArray(ctypes.c_char, _KERNEL_NAME_BYTES + 1)
    process = context.Process(
        target=_geometry_process,
        args=(name, device, sender, entered, timed, os.getpid()),
        name=f"selftest-{name}",
    )
    process.start()
    children.register(process.pid)
    sender.close()  # the child's end: the parent then sees EOF when the child dies
    return _Worker(name, process, receiver, entered, time.monotonic())


def _collect(worker: _Worker) -> GeometryResult:
    """The result a process sent, or, where it died without one, its death."""
    try:
        result = worker.receiver.recv()
    except EOFError:
        result = None
    # One that died is exiting (its pipe closed): the wait lets its own exit
    # status, not the group's SIGKILL, say how it died.
    _end(worker, teardown_seconds=TEARDOWN_SECONDS)
    if result is None:
        result = _died(worker.name, worker.process.exitcode, worker.kernel())
        result.seconds = worker.elapsed()
    return result


def _end(worker: _Worker, teardown_seconds: float) -> None:
    """Give the process ``teardown_seconds`` to exit, then end its whole group
    (what it started goes with it) and reap it, each wait bounded."""
    worker.receiver.close()
    children.exited(worker.process.pid, teardown_seconds)
    children.end_group(worker.process.pid)
    worker.process.join(children.REAP_TIMEOUT_S)


def _geometry_process(name: str, device: Device, sender, entered, timed: bool, parent: int) -> None:
    children.lead_group_and_watch(parent)
    if device.kind == "cpu":
        from .env import prepare_process_env

        prepare_process_env()
    from . import harness

    def entering(kernel: str) -> None:
        entered.value = kernel.encode()[:_KERNEL_NAME_BYTES]

    sender.send(harness.run_geometry(name, device, entering=entering, timed=timed))
    sender.close()


def _died(name: str, exitcode: int | None, kernel: str) -> GeometryResult:
    from .harness import new_result

    result = new_result(name)
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    where = f" in {kernel}" if kernel else " outside the kernel calls"
    result.aborted = f"its process {how}{where} without reporting"
    result.crashed_in = kernel or None
    return result


def _hung(name: str, limit_seconds: float, kernel: str) -> GeometryResult:
    from .harness import new_result

    result = new_result(name)
    where = f" in {kernel}" if kernel else " outside the kernel calls"
    result.aborted = (
        f"its process was still running after {limit_seconds:g} s{where} and was stopped "
        "(raise the limit with --geometry-timeout if a first-run JIT build needs longer)"
    )
    result.crashed_in = kernel or None
    return result
