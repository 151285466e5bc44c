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
first pass of a process 39 ms with its imports).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from vllm_mla_fixes import settings
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import drafter_swa_rows
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import DRAFTER_SWA_ROWS, INFO, PAGE_ROWS
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import _logger, _state

PLANNED_MEMORY = 1 << 30  # the capacity is compared per GiB, as the benchmark reports it


def _planner() -> Any:
    """The module holding ``get_kv_cache_groups`` and
    ``get_kv_cache_config_from_groups`` (``kv_cache_planning`` from 0.33 on)."""
    try:
        from vllm.v1.core import kv_cache_planning as planner
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planner
    return planner


@contextlib.contextmanager
def _rows_meanwhile(caches: list[Any], rows: int) -> Iterator[None]:
    saved = [cache.block_size for cache in caches]
    for cache in caches:
        cache.block_size = rows
    try:
        yield
    finally:
        for cache, size in zip(caches, saved):
            cache.block_size = size


@contextlib.contextmanager
def _layout_resolved(vllm_config: Any, specs: dict[str, Any]) -> Iterator[None]:
    """The KV-cache layout the engine core will resolve, set meanwhile where
    it is not yet (a worker produces its specs before the engine core
    resolves it; the planner asks for it), by vLLM's own resolution."""
    cache_config = vllm_config.cache_config
    saved = cache_config.kv_cache_layout
    if saved is None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase).values()
        backends = sorted({layer.get_attn_backend() for layer in layers}, key=str)
        supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        resolved = resolve_kv_cache_layout(vllm_config, [supported], specs.values())
        cache_config.kv_cache_layout = resolved.name
    try:
        yield
    finally:
        cache_config.kv_cache_layout = saved


def planned_tokens(vllm_config: Any, caches: list[Any], rows: int) -> int:
    """KV tokens per GiB at the engine's max-model-len with the drafter
    ``caches`` at ``rows``-row pages, by vLLM's own planning of every layer."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    planner = _planner()
    with _rows_meanwhile(caches, rows):
        _state["planning_drafter_rows"] = True
        try:
            specs = get_kv_cache_spec(vllm_config)
        finally:
            _state["planning_drafter_rows"] = False
    with _layout_resolved(vllm_config, specs):
        groups = planner.get_kv_cache_groups(vllm_config, specs)
        config = planner.get_kv_cache_config_from_groups(vllm_config, groups, PLANNED_MEMORY)
        return int(get_kv_cache_capacity(vllm_config, config)[0])


CHOSEN = "vllm_mla_fixes_drafter_rows"  # set on each drafter cache: (rows, why)


def _drafter_caches(vllm_config: Any) -> list[Any]:
    context = vllm_config.compilation_config.static_forward_context
    return [context[name] for name in sorted(_state["drafter_swa_caches"]) if name in context]


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
    if rows == DRAFTER_SWA_ROWS and settings.value(settings.DSV41_DRAFTER_SWA_ROWS) is None:
        try:
            wide = planned_tokens(vllm_config, caches, DRAFTER_SWA_ROWS)
            narrow = planned_tokens(vllm_config, caches, PAGE_ROWS)
        except Exception as exc:  # noqa: BLE001 - keep the kernel page rows, say why
            rows = PAGE_ROWS
            why = (
                f"planning the drafter's pages both ways failed ({type(exc).__name__}: {exc}); "
                f"kept at {PAGE_ROWS}, the rows of every other cache"
            )
            _logger().warning("vllm-mla-fixes (%s): %s", INFO.name, why)
        else:
            rows = DRAFTER_SWA_ROWS if wide > narrow else PAGE_ROWS
            why = (
                f"planned both with the engine's {len(caches)} drafter layer"
                f"{'s' if len(caches) > 1 else ''}: {DRAFTER_SWA_ROWS}-row pages hold "
                f"{wide:,} KV tokens per GiB, {PAGE_ROWS}-row {narrow:,}"
            )
    for cache in caches:
        cache.block_size = rows
        setattr(cache, CHOSEN, (rows, why))
        if rows != DRAFTER_SWA_ROWS:
            _state["drafter_swa_narrowed"].add(cache.prefix)
    _state["drafter_rows"] = (rows, why)
    return rows, why


def with_planned_rows(cache: Any) -> None:
    """Make ``cache`` (a drafter's sliding-window cache built with 128 rows)
    settle its page rows by :func:`choose_rows` before its first spec."""
    produce: Callable[[Any], Any] = cache.get_kv_cache_spec

    @functools.wraps(produce)
    def get_kv_cache_spec(vllm_config: Any) -> Any:
        if not _state["planning_drafter_rows"]:
            choose_rows(vllm_config)
        return produce(vllm_config)

    cache.get_kv_cache_spec = get_kv_cache_spec


def planned_drafter_rows() -> tuple[int, str] | None:
    """The drafter page rows the last planning in this process chose, and why
    (None before a drafter cache gave its spec)."""
    return _state["drafter_rows"]
