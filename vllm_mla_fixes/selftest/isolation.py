"""Each geometry in a process of its own, so that one geometry's fault cannot reach another's rows.

A CUDA error such as an illegal address is sticky: once a kernel raises it,
every later call in that process fails too.  Run in one process, a fault in
one layout would fail every layout after it and the verdict would blame the
wrong one.  Here each geometry runs in a spawned process; the parent keeps
the results of those that report and, for one that dies without reporting
(a segfault, the OOM killer), names the kernel it was in (each process
writes the kernel it is in into a buffer it shares with the parent).

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


def run_isolated(names: tuple[str, ...], device: Device, jobs: int) -> list[GeometryResult]:
    """Run geometries ``names``, at most ``jobs`` processes at a time; results in
    the order of ``names``."""
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
                args=(name, device, sender, entered),
                name=f"selftest-{name}",
            )
            process.start()
            sender.close()  # the child's end: the parent then sees EOF when the child dies
            running[receiver] = (name, process, entered, time.monotonic())
        ready: list[Any] = multiprocessing.connection.wait(list(running))
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


def _geometry_process(name: str, device: Device, sender, entered) -> None:
    if device.kind == "cpu":
        from .env import prepare_process_env

        prepare_process_env()
    from . import harness

    def entering(kernel: str) -> None:
        entered.value = kernel.encode()[:_KERNEL_NAME_BYTES]

    sender.send(harness.run_geometry(name, device, entering=entering))
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
