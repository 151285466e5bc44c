"""Median time of GPU kernel calls after warm-up; needs PyTorch only (no vLLM).

``time_calls`` times a set of callables in interleaved rounds (each round
calls every one once, so clock drift and a busy neighbour hit them alike),
drops the warm-up rounds (JIT compilation, autotuning, cold caches) and
returns each one's median in microseconds.  On CUDA one call is timed with a
pair of ``torch.cuda.Event``s on the current stream (the GPU's own clock,
not the host's launch latency); elsewhere with ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

WARMUP = 5
REPEATS = 30
NOT_TIMED_CPU = "not timed (no GPU)"

Timer = Callable[[Callable[[], object]], float]


def cuda_event_us(call: Callable[[], object]) -> float:
    """One call, timed by CUDA events around it on the current stream."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # ms -> us


def host_clock_us(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def timer_for(device: torch.device) -> Timer:
    return cuda_event_us if device.type == "cuda" else host_clock_us


def time_calls(
    calls: Mapping[str, Callable[[], object]],
    device: torch.device,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    timer: Timer | None = None,
) -> dict[str, float]:
    """Median microseconds per call of each of ``calls`` over ``repeats``
    rounds, after ``warmup`` rounds that are run but not counted."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    timer = timer or timer_for(device)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(warmup + repeats):
        for name, call in calls.items():
            elapsed = timer(call)
            if round_ >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator where both were timed."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator
