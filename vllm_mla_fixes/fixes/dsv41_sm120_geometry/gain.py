"""The 2% rule (issue 25, item 4): where upstream's layout for the line works,
the fix still applies when its own layout holds at least
:data:`GAIN_TO_APPLY` times upstream's KV tokens per GiB, at the engine's
max-model-len, with the layers the engine really builds (a DSpark drafter's
included).

The geometry is first decided while the layers are built: each
sliding-window cache takes its page rows then, upstream's 32 where upstream's
layout works.  A drafter's layers are built after the backbone's, so the rule
cannot be judged there.  The first spec vLLM asks of a DeepSeek-V4.1 cache
settles it instead (every layer exists by then, and no spec has been handed
out): both layouts are planned with vLLM's own planner on the engine's real
layers (:mod:`.planning`), upstream's as built and the fix's candidate with
its page rows (a drafter's both ways where those are planned).  The outcome
is kept on the caches (:data:`GAIN_MEMO`), where
:func:`decision.upstream_gain` reads it, and its figures are in the
decision's reason.  Where the fix's layout holds enough more, the caches take
its page rows for good before their first spec (they read ``block_size`` at
run time) and the decision becomes the fix's; else nothing changes.

vLLM registered the Triton kernels that index sliding-window pages for JIT
warm-up with the rows each cache was built with, so where the rows move,
:func:`register_moved_rows_warmup` registers them for the new rows while the
KV caches are bound (vLLM's warm-up registry is collecting then).

Cost, where upstream's layout works: three planning passes at start-up
(upstream's and the fix's two drafter candidates; two without a drafter),
never per step: 3.3 ms per engine without speculation, 5.1 ms with DSpark's three
drafter layers (CPU, 0.34.0; the first engine of a process 48 ms with its
imports; ``benchmarks/dsv41_gain_planning.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    Decision,
    UpstreamGain,
    _decide,
    drafter_swa_rows,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.drafter_pages import (
    keep_rows,
    past_backbone,
    planned_choice,
    row_candidates,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    GAIN_TO_APPLY,
    INFO,
    PAGE_ROWS,
    SPLIT,
    UPSTREAM,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.planning import planned_tokens
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import GAIN_MEMO, _logger, _state


def _upstream_row_caches(vllm_config: Any) -> list[Any]:
    context = vllm_config.compilation_config.static_forward_context
    return [context[name] for name in sorted(_state["upstream_swa_caches"]) if name in context]


def _max_model_len(vllm_config: Any) -> int | None:
    value = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    return value if isinstance(value, int) else None


def _planned_gain(vllm_config: Any, caches: list[Any]) -> tuple[UpstreamGain, dict[Any, int]]:
    """The rule's outcome for this engine, and the fix's page rows per cache
    (empty unless the fix applies)."""
    candidate = _decide(vllm_config, consider_upstream=False)
    if candidate.geometry == SPLIT and not candidate.unit:
        return UpstreamGain(None, "the fix's interleave unit is unknown, so not planned"), {}
    length = _max_model_len(vllm_config)
    if length is None:
        return UpstreamGain(None, "no max-model-len to plan the layouts at"), {}
    drafters = [cache for cache in caches if past_backbone(cache.prefix, vllm_config)]
    backbone = {cache: PAGE_ROWS for cache in caches if cache not in drafters}
    drafter_options = row_candidates() if drafters else (PAGE_ROWS,)
    try:
        upstream_tokens = planned_tokens(
            vllm_config, {cache: cache.block_size for cache in caches}, Decision(UPSTREAM, "")
        )
        options = {
            rows: planned_tokens(
                vllm_config, {**backbone, **{cache: rows for cache in drafters}}, candidate
            )
            for rows in drafter_options
        }
    except Exception as exc:  # noqa: BLE001 - keep upstream's working layout, say why
        note = (
            f"planning the fix's layout against upstream's failed ({type(exc).__name__}: "
            f"{exc}), so upstream's is kept"
        )
        _logger().warning("vllm-mla-fixes (%s): %s", INFO.name, note)
        return UpstreamGain(None, note), {}
    rows, why = (
        planned_choice(len(drafters), options)
        if len(options) > 1
        else (drafter_options[0], drafter_swa_rows()[1])
    )
    ratio = options[rows] / upstream_tokens
    gain = UpstreamGain(
        round(ratio, 4),
        f"planned on the engine's layers at max_model_len {length}: the fix's "
        f"{candidate.geometry} layout holds {options[rows]:,} KV tokens per GiB, upstream's "
        f"{upstream_tokens:,} ({ratio:.3f}x, "
        f"{'at least' if ratio >= GAIN_TO_APPLY else 'under'} the {GAIN_TO_APPLY:.2f}x that "
        "a layout nobody has run on hardware must gain)",
    )
    if not gain.applies:
        return gain, {}
    if drafters:
        _state["drafter_swa_caches"].update(cache.prefix for cache in drafters)
        keep_rows(drafters, rows, why)
    return gain, {**backbone, **{cache: rows for cache in drafters}}


MOVED_ROWS_WARMUP = "vllm_mla_fixes_moved_rows_warmup"
"""Set on a sliding-window cache whose rows the rule moved, where vLLM warms
its JIT kernels up: DSpark's speculative tokens per step, 0 without DSpark."""


def _warmup_tokens(vllm_config: Any) -> int | None:
    """What the warm-up registration needs of the engine config: None where
    vLLM warms nothing up, else DSpark's speculative tokens (0 without it)."""
    kernel_config = getattr(vllm_config, "kernel_config", None)
    if not getattr(kernel_config, "enable_jit_warmup", False):
        return None
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None or not speculative.use_dspark():
        return 0
    return int(speculative.num_speculative_tokens)


def settle(vllm_config: Any) -> None:
    """Judge the 2% rule once for this engine, before its first spec: a no-op
    unless its sliding-window caches were built with upstream's rows."""
    if _state["planning"]:
        return
    caches = _upstream_row_caches(vllm_config)
    if not caches or hasattr(caches[0], GAIN_MEMO):
        return
    gain, rows = _planned_gain(vllm_config, caches)
    warmup = _warmup_tokens(vllm_config) if rows else None
    for cache in caches:
        setattr(cache, GAIN_MEMO, gain)
        cache.block_size = rows.get(cache, cache.block_size)
        if warmup is not None:
            setattr(cache, MOVED_ROWS_WARMUP, warmup)


def with_settling(cache: Any) -> None:
    """Make ``cache`` (a sliding-window cache built with upstream's rows)
    settle the 2% rule before its first spec."""
    produce: Callable[[Any], Any] = cache.get_kv_cache_spec

    @functools.wraps(produce)
    def get_kv_cache_spec(vllm_config: Any) -> Any:
        settle(vllm_config)
        return produce(vllm_config)

    cache.get_kv_cache_spec = get_kv_cache_spec


def register_moved_rows_warmup(forward_context: dict[str, Any]) -> None:
    """Register the sliding-window index kernels for JIT warm-up with the
    rows the 2% rule gave the caches, as each layer registered them at
    construction for the rows it was built with.  A failure costs only a
    compile on first use, so it is logged, never raised."""
    moved = [cache for cache in forward_context.values() if hasattr(cache, MOVED_ROWS_WARMUP)]
    if not moved:
        return
    try:
        from vllm.v1.attention.backends.mla import sparse_swa

        for cache in moved:
            sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL.register_warmup(
                window_size=cache.window_size, block_size=cache.block_size
            )
            tokens = getattr(cache, MOVED_ROWS_WARMUP)
            if tokens:
                sparse_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL.register_warmup(
                    window_size=cache.window_size,
                    num_speculative_tokens=tokens,
                    block_size=cache.block_size,
                )
    except Exception as exc:  # noqa: BLE001 - warm-up only saves a first-use compile
        _logger().warning(
            "vllm-mla-fixes (%s): could not register the sliding-window index kernels' "
            "warm-up for the fix's page rows (%s: %s); they compile on first use",
            INFO.name,
            type(exc).__name__,
            exc,
        )
