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
import signal
import time
from typing import TYPE_CHECKING, Any

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


def run_isolated(
    names: tuple[str, ...],
    device: Device,
    jobs: int,
    limit_seconds: float = DEFAULT_LIMIT_SECONDS,
    timed: bool = True,
) -> list[GeometryResult]:
    """Run geometries ``names``, at most ``jobs`` processes at a time; results in
    the order of ``names``.  A process still running after ``limit_seconds``
    is stopped and its geometry reported as hung in the kernel it was in."""
    context = multiprocessing.get_context("spawn")
    waiting = list(names)
    # receiving end: name, process, the kernel it entered, when it started
    running: dict[Any, tuple[str, Any, Any, float]] = {}
    results: dict[str, GeometryResult] = {}
    while waiting or running:
        while waiting and len(running) < jobs:
            name = waiting.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            entered = context.RawArray(ctypes.c_char, _KERNEL_NAME_BYTES + 1)
            process = context.Process(
                target=_geometry_process,
                args=(name, device, sender, entered, timed),
                name=f"selftest-{name}",
            )
            process.start()
            sender.close()  # the child's end: the parent then sees EOF when the child dies
            running[receiver] = (name, process, entered, time.monotonic())
        deadline = min(started for _, _, _, started in running.values()) + limit_seconds
        ready: list[Any] = multiprocessing.connection.wait(
            list(running), timeout=max(0.0, deadline - time.monotonic())
        )
        for receiver in [r for r in running if r not in ready]:
            name, process, entered, started = running[receiver]
            if time.monotonic() - started >= limit_seconds:
                del running[receiver]
                process.kill()
                process.join()
                receiver.close()
                kernel = entered.value.decode(errors="replace")
                results[name] = _hung(name, limit_seconds, kernel)
                results[name].seconds = time.monotonic() - started
        for receiver in ready:
            name, process, entered, started = running.pop(receiver)
            try:
                result = receiver.recv()
            except EOFError:
                result = None
            receiver.close()
            process.join()
            if result is None:
                result = _died(name, process.exitcode, entered.value.decode(errors="replace"))
                result.seconds = time.monotonic() - started
            results[name] = result
    return [results[name] for name in names]


def _geometry_process(name: str, device: Device, sender, entered, timed: bool) -> None:
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
