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

The same machinery (:func:`run_jobs`) runs the kernel timing on a GPU in a
process of its own, after the geometries (:func:`run_timing`).  Each process
leads a process group of its own (:mod:`vllm_mla_fixes.children`): it is
ended whole, with anything it started (a JIT build's compilers), once it has
reported, when it hangs, and when the self-test is stopped or dies; every wait
for it has a time limit.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from vllm_mla_fixes import children

if TYPE_CHECKING:
    from .kernels import Device
    from .pairing import DecodeTiming
    from .results import GeometryResult

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
) -> list[GeometryResult]:
    """Run geometries ``names``, at most ``jobs`` processes at a time; results in
    the order of ``names``.  A process still running after ``limit_seconds``
    is stopped and its geometry reported as hung in the kernel it was in."""
    outcomes = run_jobs(
        [Job(name, _run_geometry, (name, device)) for name in names], device, jobs, limit_seconds
    )
    return [_geometry_result(name, outcomes[name], limit_seconds) for name in names]


def run_timing(device: Device, baseline: str, limit_seconds: float) -> DecodeTiming:
    """The decode step's kernels timed (:mod:`.pairing`) in a process of its
    own, after the geometries: a fault there cannot reach their verdicts."""
    from .pairing import DecodeTiming

    outcome = run_jobs(
        [Job("timing", _time_decode_step, (device, baseline))], device, 1, limit_seconds
    )["timing"]
    if isinstance(outcome, Lost):
        return DecodeTiming.not_timed(f"not timed: the timing process {outcome.how}")
    return outcome  # type: ignore[return-value]


@dataclass(frozen=True)
class Job:
    """What one process runs: ``target(*args, entering=...)``, a module-level
    function (the process is spawned), whose return value is sent back."""

    name: str
    target: Callable[..., object]
    args: tuple[object, ...]


@dataclass(frozen=True)
class Lost:
    """A job whose process did not report: it died, or was stopped hung."""

    hung: bool
    how: str  # "was killed by SIGSEGV in <kernel>", "was still running after 60 s ..."
    kernel: str  # the kernel it was in, "" outside them
    seconds: float


def run_jobs(
    jobs: list[Job], device: Device, parallel: int, limit_seconds: float
) -> dict[str, object]:
    """Each job's returned value (or :class:`Lost`), by name; at most
    ``parallel`` processes at a time.  Each process leads a process group of
    its own, ended whole when its job is done, when it runs past
    ``limit_seconds``, and when this process is stopped or dies
    (:mod:`vllm_mla_fixes.children`)."""
    context = multiprocessing.get_context("spawn")
    waiting = list(jobs)
    # by the receiving end of its pipe
    running: dict[multiprocessing.connection.Connection[object, object], _Worker] = {}
    outcomes: dict[str, object] = {}
    with children.supervised():
        while waiting or running:
            while waiting and len(running) < parallel:
                worker = _start(context, waiting.pop(0), device)
                running[worker.receiver] = worker
            deadline = min(w.started for w in running.values()) + limit_seconds
            ready = multiprocessing.connection.wait(
                list(running), timeout=max(0.0, deadline - time.monotonic())
            )
            for receiver in [r for r in running if r in ready]:
                worker = running.pop(receiver)
                outcomes[worker.name] = _collect(worker)
            for worker in [w for w in running.values() if w.elapsed() >= limit_seconds]:
                del running[worker.receiver]
                _end(worker, teardown_seconds=0.0)
                where = _where(worker.kernel())
                how = f"was still running after {limit_seconds:g} s{where} and was stopped"
                outcomes[worker.name] = Lost(True, how, worker.kernel(), worker.elapsed())
    return outcomes


@dataclass
class _Worker:
    """One job's process, as the parent tracks it."""

    name: str
    process: multiprocessing.context.SpawnProcess
    pid: int  # the process's, known once it started
    # the parent's end of the pipe the result comes through
    receiver: multiprocessing.connection.Connection[object, object]
    entered: ctypes.Array[ctypes.c_char]  # the kernel the process is in (shared buffer)
    started: float

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def kernel(self) -> str:
        return self.entered.value.decode(errors="replace")


def _start(context: multiprocessing.context.SpawnContext, job: Job, device: Device) -> _Worker:
    receiver, sender = context.Pipe(duplex=False)
    entered = context.RawArray(ctypes.c_char, _KERNEL_NAME_BYTES + 1)
    process = context.Process(
        target=_worker_process,
        args=(job, device, sender, entered, os.getpid()),
        name=f"selftest-{job.name}",
    )
    process.start()
    pid = cast(int, process.pid)  # started: it has its pid
    children.register(pid)
    sender.close()  # the child's end: the parent then sees EOF when the child dies
    return _Worker(job.name, process, pid, receiver, entered, time.monotonic())


def _collect(worker: _Worker) -> object:
    """What a process sent, or, where it died without sending, its death."""
    try:
        outcome = worker.receiver.recv()
    except EOFError:
        outcome = None
    # One that died is exiting (its pipe closed): the wait lets its own exit
    # status, not the group's SIGKILL, say how it died.
    _end(worker, teardown_seconds=TEARDOWN_SECONDS)
    if outcome is None:
        how = f"{_death(worker.process.exitcode)}{_where(worker.kernel())} without reporting"
        outcome = Lost(False, how, worker.kernel(), worker.elapsed())
    return outcome


def _end(worker: _Worker, teardown_seconds: float) -> None:
    """Give the process ``teardown_seconds`` to exit, then end its whole group
    (what it started goes with it) and reap it, each wait bounded."""
    worker.receiver.close()
    children.exited(worker.pid, teardown_seconds)
    children.end_group(worker.pid)
    worker.process.join(children.REAP_TIMEOUT_S)


def _worker_process(
    job: Job,
    device: Device,
    sender: multiprocessing.connection.Connection[object, object],
    entered: ctypes.Array[ctypes.c_char],
    parent: int,
) -> None:
    children.lead_group_and_watch(parent)
    if device.kind == "cpu":
        from .env import prepare_process_env

        prepare_process_env()

    def entering(kernel: str) -> None:
        entered.value = kernel.encode()[:_KERNEL_NAME_BYTES]

    sender.send(job.target(*job.args, entering=entering))
    sender.close()


def _run_geometry(name: str, device: Device, entering: Callable[[str], None]) -> GeometryResult:
    from . import harness

    return harness.run_geometry(name, device, entering=entering)


def _time_decode_step(
    device: Device, baseline: str, entering: Callable[[str], None]
) -> DecodeTiming:
    from . import kernels as kn
    from .pairing import DecodeTiming, time_decode_step

    try:
        return time_decode_step(device, kn.Kernels.for_device(device), baseline, entering=entering)
    except Exception as exc:  # the time is a figure, not a verdict
        return DecodeTiming.not_timed(f"not timed: {type(exc).__name__}: {exc}")


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _where(kernel: str) -> str:
    return f" in {kernel}" if kernel else " outside the kernel calls"


def _geometry_result(name: str, outcome: object, limit_seconds: float) -> GeometryResult:
    from .results import GeometryResult, new_result

    if isinstance(outcome, GeometryResult):
        return outcome
    assert isinstance(outcome, Lost)
    result = new_result(name)
    result.aborted = f"its process {outcome.how}"
    if outcome.hung:
        result.aborted += (
            " (raise the limit with --geometry-timeout if a first-run JIT build needs longer)"
        )
    result.crashed_in = outcome.kernel or None
    result.seconds = outcome.seconds
    return result
