"""A DSpark drafter's sliding-window page rows under the split, chosen by
planning both candidates with vLLM's own planner on the engine's real layers.

Where FlashInfer takes run-time page sizes, a drafter's sliding-window caches
are built with 128-row pages (:data:`DRAFTER_SWA_ROWS`): they then share one
KV-cache group instead of joining the backbone's 64-row sliding-window type.
Whether that holds more KV tokens than 64-row pages depends on how many
drafter layers there are (measured on DeepSeek-V4.1-Flash: with three, 128 rows
hold 1.058x of 64; with one, 0.940x).  So when vLLM first asks a drafter cache
for its spec -- every layer exists by then -- both candidates are planned with
vLLM's own spec collection, grouping, KV-cache config and capacity functions,
and the one holding more tokens at the engine's max-model-len is kept (a tie
keeps 64, the page rows every other cache has).  The drafter caches read their
``block_size`` at run time (their spec, the attention metadata, DSpark's
context insert), so setting it before the spec is produced is all it takes.
The planning runs once per engine, at start-up, never per step: two passes
of 2-3 ms each on the 40-layer DeepSeek-V4.1-Flash layout (CPU, 0.34.0; the
first pass of a process 39 ms with its imports).  Each pass is
:func:`.planning.planned_tokens`.  Where upstream's layout works, the 2% rule
(:mod:`.gain`) plans the drafter's rows itself, with the rest of the fix's
layout, and keeps them here (:func:`keep_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_mla_fixes import settings
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import _backbone_layers, drafter_swa_rows
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import DRAFTER_SWA_ROWS, INFO, PAGE_ROWS
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.planning import planned_tokens
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import _logger, _state

CHOSEN = "vllm_mla_fixes_drafter_rows"  # set on each drafter cache: (rows, why)


def _layer_number(prefix: Any) -> int | None:
    """``N`` of a ``...layers.N.<module>`` prefix, by vLLM's own parser (the
    one DSpark's and every model's layers are numbered for), or None."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(str(prefix))
    except (AssertionError, IndexError, ValueError):
        return None


def past_backbone(prefix: Any, vllm_config: Any) -> bool:
    """Whether the cache built under ``prefix`` is a drafter's: numbered past
    the backbone's layers."""
    number = _layer_number(prefix)
    backbone = _backbone_layers(vllm_config)
    return number is not None and backbone is not None and number >= backbone


def _drafter_caches(vllm_config: Any) -> list[Any]:
    context = vllm_config.compilation_config.static_forward_context
    return [context[name] for name in sorted(_state["drafter_swa_caches"]) if name in context]


def row_candidates() -> tuple[int, ...]:
    """The drafter page rows to plan: both where the installed FlashInfer
    takes run-time page sizes and the setting forces neither, else the one."""
    rows, _ = drafter_swa_rows()
    if rows == DRAFTER_SWA_ROWS and settings.value(settings.DSV41_DRAFTER_SWA_ROWS) is None:
        return (DRAFTER_SWA_ROWS, PAGE_ROWS)
    return (rows,)


def planned_choice(layers: int, tokens: dict[int, int]) -> tuple[int, str]:
    """(rows, why) from the planned KV tokens per GiB of both candidates'
    rows: the one holding more (a tie keeps 64, the rows of every other cache)."""
    rows = max(tokens, key=lambda r: (tokens[r], r == PAGE_ROWS))
    return rows, (
        f"planned both with the engine's {layers} drafter layer{'s' if layers > 1 else ''}: "
        f"{DRAFTER_SWA_ROWS}-row pages hold {tokens[DRAFTER_SWA_ROWS]:,} KV tokens per GiB, "
        f"{PAGE_ROWS}-row {tokens[PAGE_ROWS]:,}"
    )


def keep_rows(caches: list[Any], rows: int, why: str) -> None:
    """Give the drafter ``caches`` their page rows for good, and say why."""
    for cache in caches:
        cache.block_size = rows
        setattr(cache, CHOSEN, (rows, why))
        if rows != DRAFTER_SWA_ROWS:
            _state["drafter_swa_narrowed"].add(cache.prefix)
    _state["drafter_rows"] = (rows, why)


def choose_rows(vllm_config: Any) -> tuple[int, str]:
    """The drafter caches' page rows for this engine, and why: planned once,
    when vLLM first asks one of them for its spec, and kept on each cache."""
    caches = _drafter_caches(vllm_config)
    if not caches:
        return drafter_swa_rows()
    chosen = getattr(caches[0], CHOSEN, None)
    if chosen is not None:
        return chosen
    rows, why = drafter_swa_rows()
    candidates = row_candidates()
    if len(candidates) > 1:
        try:
            tokens = {
                count: planned_tokens(vllm_config, {cache: count for cache in caches})
                for count in candidates
            }
        except Exception as exc:  # noqa: BLE001 - keep the kernel page rows, say why
            rows = PAGE_ROWS
            why = (
                f"planning the drafter's pages both ways failed ({type(exc).__name__}: {exc}); "
                f"kept at {PAGE_ROWS}, the rows of every other cache"
            )
            _logger().warning("vllm-mla-fixes (%s): %s", INFO.name, why)
        else:
            rows, why = planned_choice(len(caches), tokens)
    keep_rows(caches, rows, why)
    return rows, why


def with_planned_rows(cache: Any) -> None:
    """Make ``cache`` (a drafter's sliding-window cache built with 128 rows)
    settle its page rows by :func:`choose_rows` before its first spec."""
    produce: Callable[[Any], Any] = cache.get_kv_cache_spec

    @functools.wraps(produce)
    def get_kv_cache_spec(vllm_config: Any) -> Any:
        if not _state["planning"]:
            choose_rows(vllm_config)
        return produce(vllm_config)

    cache.get_kv_cache_spec = get_kv_cache_spec


def planned_drafter_rows() -> tuple[int, str] | None:
    """The drafter page rows the last planning in this process chose, and why
    (None before a drafter cache gave its spec)."""
    return _state["drafter_rows"]
