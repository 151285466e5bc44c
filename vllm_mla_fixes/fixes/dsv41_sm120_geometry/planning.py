"""Candidate layouts planned with vLLM's own planner on the engine's real layers.

Two choices are taken once the model's layers exist, at the first spec vLLM
asks of a DeepSeek-V4.1 cache: whether the fix's layout holds enough more KV
than upstream's working one to apply (:mod:`.gain`), and how many rows a
DSpark drafter's sliding-window pages hold (:mod:`.drafter_pages`).  Both
plan each candidate the way the engine will: vLLM's spec collection over
every layer, its grouping, its KV-cache config and its capacity function, at
the engine's max-model-len.  The sliding-window caches read ``block_size`` at
run time, so a candidate's page rows are set on them for the pass only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import _state

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
def _rows_meanwhile(rows: dict[Any, int]) -> Iterator[None]:
    saved = {cache: cache.block_size for cache in rows}
    for cache, count in rows.items():
        cache.block_size = count
    try:
        yield
    finally:
        for cache, size in saved.items():
            cache.block_size = size


@contextlib.contextmanager
def _planning(decision: Any) -> Iterator[None]:
    """A planning pass: the spec producers lay out ``decision`` (None: the
    engine's own) and record, log and plan nothing themselves."""
    _state["planning"] = True
    _state["planning_decision"] = decision
    try:
        yield
    finally:
        _state["planning"] = False
        _state["planning_decision"] = None


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


def planned_tokens(vllm_config: Any, rows: dict[Any, int], decision: Any = None) -> int:
    """KV tokens per GiB at the engine's max-model-len with each cache of
    ``rows`` at its page rows and the spec producers laying out ``decision``
    (None: the engine's own), by vLLM's own planning of every layer."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    planner = _planner()
    with _rows_meanwhile(rows), _planning(decision):
        specs = get_kv_cache_spec(vllm_config)
    with _layout_resolved(vllm_config, specs), _memory_decides_blocks(vllm_config):
        groups = planner.get_kv_cache_groups(vllm_config, specs)
        config = planner.get_kv_cache_config_from_groups(vllm_config, groups, PLANNED_MEMORY)
        return int(get_kv_cache_capacity(vllm_config, config)[0])


@contextlib.contextmanager
def _memory_decides_blocks(vllm_config: Any) -> Iterator[None]:
    """``--num-gpu-blocks-override`` unset meanwhile: with it the planner
    gives every candidate the same block count, whatever a GiB holds."""
    cache_config = vllm_config.cache_config
    saved = cache_config.num_gpu_blocks_override
    cache_config.num_gpu_blocks_override = None
    try:
        yield
    finally:
        cache_config.num_gpu_blocks_override = saved
