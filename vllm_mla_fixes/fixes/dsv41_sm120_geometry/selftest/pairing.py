"""The decode step's reading kernels timed alone: the fix's layout against a baseline, in one process.

What is timed is the kernels and nothing around them: the launches of
FlashInfer's SM120 sparse-MLA decode and of DeepGEMM's paged MQA logits that
vLLM's ``_forward_decode`` and the indexer make in the timed step (a
CUDA-graph padded decode of two requests), recorded at the kernel boundary
(:class:`.kernels.Launch`) and made again alone, CUDA events around each
layout's launches of one kernel.  Only the backbone layers' launches count:
upstream's layout has no drafter layer, so both sides time the same layers,
batch and rows (:func:`.timed_step.timed_work`; unequal work is refused).

Both layouts are built and run up to the timed step in this one process; then
the rounds interleave them (fix, baseline, baseline, fix, ...), and each
kernel gets the median microseconds of each side and the median of the
per-round ratios with its quartiles.  The baseline is upstream's own layout
where it runs and reads back exactly (an SM12x GPU); elsewhere (SM90, SM100,
or an SM12x release whose upstream layout fails) it is a dense layout of the
same tokens: the pages each launch reads, copied one after another in the
order the requests read them, page shape and stride kept, and the launch's
page ids renumbered to match (:func:`dense_launch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import clock
from . import kernels as kn
from .harness import timed_step_launches
from .timed_step import TIMED_KERNELS, TIMED_STEP, TimedLaunch, timed_work
from .timeline import TIMELINE, StepPlan

FIX_GEOMETRY = "split"  # the fix's default layout
UPSTREAM, DENSE = "upstream", "dense"
BASELINES = {
    UPSTREAM: "upstream's own layout, run in the same process",
    DENSE: "a dense layout of the same tokens: the pages each launch reads, copied one "
    "after another in reading order (page shape and stride kept), the same kernels",
}
WHAT_IS_TIMED = (
    "the reading kernels alone (FlashInfer's sparse-MLA decode, DeepGEMM's paged MQA "
    "logits), CUDA events around each layout's launches of the timed step; the "
    "backbone layers only (upstream's layout has no drafter layer), the same batch and rows"
)


@dataclass
class KernelTiming:
    fix_us: float  # median over the rounds
    baseline_us: float
    ratio: float  # median of the per-round fix / baseline
    ratio_quartiles: tuple[float, float]


@dataclass
class DecodeTiming:
    """The timed step's reading kernels, the fix's layout over the baseline."""

    baseline: str | None  # UPSTREAM or DENSE; None where nothing was timed
    note: str | None = None  # why not timed, or what stands instead
    work: dict[str, dict[str, object]] = field(default_factory=dict)  # per kernel, both sides
    kernels: dict[str, KernelTiming] = field(default_factory=dict)

    @classmethod
    def not_timed(cls, why: str) -> DecodeTiming:
        return cls(None, why)


def time_decode_step(
    device: kn.Device,
    kernels: kn.Kernels,
    baseline: str,
    timed: tuple[str, ...] | None = None,
    plans: tuple[StepPlan, ...] = TIMELINE,
    timed_step: str = TIMED_STEP,
    warmup: int = clock.WARMUP,
    repeats: int = clock.REPEATS,
    timer: clock.Timer | None = None,
    entering: Callable[[str], None] | None = None,
) -> DecodeTiming:
    """Time the kernels ``timed`` (default: the real ones among the timed
    kernels) of ``timed_step``, the fix's default layout against ``baseline``.
    Raises what stops a layout's run."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline {baseline!r}: one of {', '.join(BASELINES)}")
    timed = timed if timed is not None else tuple(k for k in TIMED_KERNELS if kernels.is_real(k))
    if not timed:
        return DecodeTiming.not_timed("not timed: the reading kernels are stand-ins here")
    fix_result, fix = timed_step_launches(
        FIX_GEOMETRY, device, kernels, plans, timed_step, entering=entering
    )
    if not fix_result.clean:
        return DecodeTiming.not_timed("not timed: the fix's layout did not read back exactly")
    note, base = None, fix
    if baseline == UPSTREAM:
        upstream_result, base = timed_step_launches(
            UPSTREAM, device, kernels, plans, timed_step, entering=entering
        )
        if not upstream_result.clean:
            baseline, note = DENSE, "upstream's layout did not read back exactly here"
    if baseline == DENSE:
        base = {
            kernel: [t._replace(launch=dense_launch(kernel, t.launch)) for t in launches]
            for kernel, launches in fix.items()
        }
    work = {k: timed_work(fix)[k] for k in timed}
    if work != {k: timed_work(base)[k] for k in timed}:
        raise RuntimeError(
            f"unequal work: the fix's layout launches {timed_work(fix)}, "
            f"the baseline {timed_work(base)}"
        )
    timing = DecodeTiming(baseline, note, work)
    for kernel in timed:
        rounds = clock.time_rounds(
            {"fix": _each(fix[kernel]), "baseline": _each(base[kernel])},
            device.torch_device,
            warmup,
            repeats,
            timer,
        )
        ratio, low, high = clock.paired_ratio(rounds["fix"], rounds["baseline"])
        timing.kernels[kernel] = KernelTiming(
            clock.median(rounds["fix"]), clock.median(rounds["baseline"]), ratio, (low, high)
        )
    return timing


def _each(launches: list[TimedLaunch]) -> Callable[[], None]:
    def launch_all() -> None:
        for timed in launches:
            timed.launch()

    return launch_all


# ------------------------------------------------------------------ dense baseline


def dense_launch(kernel: str, launch: kn.Launch) -> kn.Launch:
    """``launch`` on a dense copy of the pages it reads (see the module)."""
    if kernel == kn.ATTENTION_DECODE:
        return _dense_attention(launch)
    if kernel == kn.INDEXER_LOGITS:
        return _dense_logits(launch)
    raise ValueError(f"no dense layout for {kernel}")


def _reading_order(page_ids: torch.Tensor) -> torch.Tensor:
    """The distinct ids of ``page_ids`` in the order they are first read."""
    unique, inverse = torch.unique(page_ids, return_inverse=True)
    first = torch.full((unique.numel(),), page_ids.numel(), dtype=torch.int64)
    first = first.scatter_reduce(0, inverse.cpu(), torch.arange(page_ids.numel()), "amin")
    return unique[first.argsort().to(unique.device)]


def _packed(cache: torch.Tensor, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages ``page_ids`` of ``cache`` copied one after another into a new
    allocation (page shape and strides kept), and each old page id's new one."""
    used = _reading_order(page_ids.to(torch.int64).flatten())
    pages = max(int(used.numel()), 1)
    storage = torch.zeros(pages * cache.stride(0), dtype=cache.dtype, device=cache.device)
    dense = storage.as_strided((pages, *cache.shape[1:]), cache.stride())
    dense[: used.numel()] = cache[used]
    renumbered = torch.zeros(cache.shape[0], dtype=torch.int64, device=cache.device)
    renumbered[used] = torch.arange(used.numel(), device=cache.device)
    return dense, renumbered


def _dense_slots(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache read through flat slots (page * rows + row; -1 reads nothing)."""
    rows = cache.shape[1]
    wide = slots.to(torch.int64)
    valid = (wide >= 0) & (wide < cache.shape[0] * rows)
    dense, renumbered = _packed(cache, wide[valid] // rows)
    moved = torch.where(valid, renumbered[wide.clamp_min(0) // rows] * rows + wide % rows, wide)
    return dense, moved.to(slots.dtype)


def _dense_attention(launch: kn.Launch) -> kn.Launch:
    kwargs = dict(launch.kwargs)
    kwargs["swa_kv_cache"], kwargs["sparse_indices"] = _dense_slots(
        kwargs["swa_kv_cache"], kwargs["sparse_indices"]
    )
    if kwargs.get("compressed_kv_cache") is not None:
        kwargs["compressed_kv_cache"], kwargs["extra_sparse_indices"] = _dense_slots(
            kwargs["compressed_kv_cache"], kwargs["extra_sparse_indices"]
        )
    return kn.Launch(launch.kernel, launch.args, kwargs)


def _dense_logits(launch: kn.Launch) -> kn.Launch:
    """DeepGEMM's paged MQA logits (q, kv, weights, context_lens, block_table,
    ...): the pages each row's context covers, renumbered in its block table."""
    q, cache, weights, context_lens, block_table, *rest = launch.args
    rows = cache.shape[1]
    pages_read = (context_lens.to(torch.int64).amax(dim=-1) + rows - 1) // rows
    reading = torch.arange(block_table.shape[1], device=block_table.device) < pages_read[:, None]
    dense, renumbered = _packed(cache, block_table[reading])
    table = torch.zeros_like(block_table)
    table[reading] = renumbered[block_table[reading].to(torch.int64)].to(block_table.dtype)
    return kn.Launch(launch.kernel, (q, dense, weights, context_lens, table, *rest), launch.kwargs)
