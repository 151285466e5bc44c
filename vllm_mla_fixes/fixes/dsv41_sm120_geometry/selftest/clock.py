"""Time of GPU kernel launches after warm-up; needs PyTorch only (no vLLM).

``time_rounds`` times a set of callables in interleaved rounds (each round
calls every one once, the order reversed every other round, so clock drift
and a busy neighbour hit them alike), drops the warm-up rounds (JIT
compilation, autotuning, cold caches) and returns every counted round's
microseconds; ``paired_ratio`` gives the median of two calls' per-round
ratios with its quartiles.  On CUDA one call is timed with a pair of
``torch.cuda.Event``s on the current stream around its launches (the GPU's
own clock, not the host's launch latency); elsewhere with ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import cast

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
    return cast(float, start.elapsed_time(end)) * 1e3  # ms -> us


def host_clock_us(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def timer_for(device: torch.device) -> Timer:
    return cuda_event_us if device.type == "cuda" else host_clock_us


def time_rounds(
    calls: Mapping[str, Callable[[], object]],
    device: torch.device,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    timer: Timer | None = None,
) -> dict[str, list[float]]:
    """Microseconds of each of ``calls`` in each of ``repeats`` rounds, after
    ``warmup`` rounds that are run but not counted.  Each round calls every
    one once, the order reversed every other round (A B, B A, ...), so that
    neither always runs on the caches the other left."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    timer = timer or timer_for(device)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_ in range(warmup + repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            elapsed = timer(calls[name])
            if round_ >= warmup:
                samples[name].append(elapsed)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def paired_ratio(numerators: list[float], denominators: list[float]) -> tuple[float, float, float]:
    """The median of the per-round ratios of two calls timed in the same
    rounds, and their lower and upper quartiles (the spread)."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True) if d > 0]
    if not ratios:
        raise ValueError("no round with a non-zero denominator")
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    low, middle, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return middle, low, high
