"""Spec producers: the KV-cache specs the DeepSeek-V4.1 layers hand vLLM's
planner under their engine's decision, the backends' per-spec kernel block
sizes, the sliding-window cache's page rows, and the warm-up keys of
64-state pages.  Each asks :data:`~.fix_state.STATE` for the decision of the
engine whose config it is given (or, while layers are built, the current one)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import model_specs
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import engine_config
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    PAGE_ROWS,
    SPLIT_MANAGER_BLOCK,
    UPSTREAM_SWA_BLOCK,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind, Geometry


def per_ratio_spec(spec: Any) -> object:
    """``spec`` with ``64 x tokens_per_state`` tokens per block, so that a page
    holds 64 states.  ``page_size_padded`` is recomputed from the new page
    (``replace`` would keep the old block size's padding)."""
    states = spec.tokens_per_state
    if not isinstance(states, int) or states < 1:
        return spec
    block_size = PAGE_ROWS * states
    if spec.block_size == block_size:
        return spec
    return dataclasses.replace(spec, block_size=block_size, page_size_padded=None)


def split_spec(spec: Any, unit: int) -> object:
    """``spec`` with 128-token manager blocks; a ratio-1 spec also asks the
    planner for a block stride that is a whole number of interleave units
    (set before ``customize_attention_spec``, which fills it only when empty)."""
    changes: dict[str, object] = {"block_size": SPLIT_MANAGER_BLOCK, "page_size_padded": None}
    if spec.tokens_per_state == 1:
        current = spec.block_stride_alignment
        if current is not None and not isinstance(current, int):
            raise PageGeometryError(
                f"unexpected block_stride_alignment {current!r} on a ratio-1 spec"
            )
        changes["block_stride_alignment"] = math.lcm(unit, current or 1)
    if spec.block_size == SPLIT_MANAGER_BLOCK and spec.tokens_per_state != 1:
        return dataclasses.replace(spec, page_size_padded=None)
    return dataclasses.replace(spec, **changes)


def fixed_spec(spec: object, geometry: Geometry, unit: int) -> object:
    """A compressed-KV or indexer-K spec as the fix lays it out under ``geometry``."""
    if geometry is Geometry.SPLIT:
        return split_spec(spec, unit)
    if geometry is Geometry.PER_RATIO:
        return per_ratio_spec(spec)
    return spec


def wrap_spec_producer(cls: type) -> Callable[..., object]:
    """``cls.get_kv_cache_spec`` laying out its engine's decision."""
    original = cls.__dict__["get_kv_cache_spec"]

    @functools.wraps(original)
    def get_kv_cache_spec(self: object, vllm_config: object) -> object:
        spec = original(self, vllm_config)
        if spec is None:
            return None
        decision = STATE.decision_for(vllm_config)
        _compare_with_description(self, spec, vllm_config)
        if decision.geometry is Geometry.UPSTREAM:
            return spec
        fixed = fixed_spec(spec, decision.geometry, decision.unit)
        STATE.page_rows[self] = PAGE_ROWS
        if decision.geometry is Geometry.SPLIT and spec.tokens_per_state == 1:
            STATE.split_layers.add(self)
        return fixed

    return get_kv_cache_spec


def _compare_with_description(layer: object, spec: object, vllm_config: object) -> None:
    """Name a live spec that differs from the one the decision planned with."""
    number = _layer_number(getattr(layer, "prefix", None))
    if number is None:
        return
    kind = CacheKind.COMPRESSED if hasattr(layer, "is_kv_source") else CacheKind.INDEXER
    engine = engine_config(vllm_config)
    try:
        found = model_specs.mismatch(vllm_config, engine, number, kind, spec)
    except Exception as exc:  # noqa: BLE001 - the comparison itself failed: say so, change nothing
        found = f"layer {number} {kind.value}: could not be described ({type(exc).__name__}: {exc})"
    if found:
        STATE.note_mismatch(engine, found)


def per_spec_kernel_block_sizes(original: Callable[..., object]) -> staticmethod[..., object]:
    """The backend's kernel block sizes for a spec, a function of the spec
    alone (vLLM asks with no engine config in view): 64-state pages wherever
    the spec's block holds whole 64-state pages -- every layout the fix lays
    out, and upstream's own where it works on SM12x (0.34.0's --block-size
    64, which gets upstream's very answer; the truth-table and multi-engine
    tests hold every working upstream layout to it) -- else upstream's own
    answer, as with no spec in view."""

    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> object:
        states = getattr(kv_cache_spec, "tokens_per_state", None)
        if not isinstance(states, int) or states < 1:
            return original(kv_cache_spec)
        if kv_cache_spec.block_size % (PAGE_ROWS * states):
            return original(kv_cache_spec)
        return [PAGE_ROWS * states]

    get_supported_kernel_block_sizes.__wrapped__ = original  # type: ignore[attr-defined]
    return staticmethod(get_supported_kernel_block_sizes)


def _layer_number(prefix: object) -> int | None:
    """``N`` of a ``...layers.N.<module>`` prefix, by vLLM's own parser, or None."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return int(extract_layer_index(str(prefix)))
    except (AssertionError, IndexError, ValueError):
        return None


def swa_cache_with_decided_rows(cache_class: type) -> Callable[..., object]:
    """Stands in for the class name inside ``deepseek_v41.attention`` only, so
    DeepSeek-V4.0 (which shares the class) is not touched: each cache gets
    its engine's sliding-window rows (upstream's 32 where the fix steps aside)."""

    def build_swa_cache(*args: object, **kwargs: object) -> object:
        if kwargs.get("block_size") != UPSTREAM_SWA_BLOCK:
            return cache_class(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        decision = STATE.decision_for(config)
        layer = _layer_number(kwargs.get("prefix"))
        rows = decision.backbone_swa_rows
        if layer is not None:
            rows = decision.swa_rows(layer, engine_config(config).model)
        kwargs["block_size"] = rows
        cache = cache_class(*args, **kwargs)
        if decision.applies:
            STATE.page_rows[cache] = rows
        return cache

    build_swa_cache.__wrapped__ = cache_class  # type: ignore[attr-defined]
    return build_swa_cache


def warmup_keys_with_64_state_pages(original: Callable[..., Any]) -> Callable[..., object]:
    """Also warm the compressed-slot-mapping kernel for the block size it
    really sees (the states per page, 64), not ``--block-size // ratio`` --
    for the compress ratios of the DeepSeek-V4.1 caches the engine's decision
    lays out and no other, so another model's compressed cache (GLM's kpool
    of ratio 32) keeps upstream's keys."""

    @functools.wraps(original)
    def get_warmup_keys(self: Any, vllm_config: object) -> list[object]:
        keys = list(original(self, vllm_config))
        owned = _owned_ratios(vllm_config)
        extra = [
            self.dispatch(
                compress_ratio=key.compress_ratio,
                block_size=PAGE_ROWS,
                dcp_world_size=key.dcp_world_size,
                cp_interleave=key.cp_interleave,
            )
            for key in keys
            if key.compress_ratio in owned
        ]
        return list(dict.fromkeys([*keys, *extra]))

    return get_warmup_keys


def _owned_ratios(vllm_config: object) -> tuple[int, ...]:
    """Compress ratios > 1 of the caches the engine's decision lays out."""
    engine = engine_config(vllm_config)
    if engine.model is None or not STATE.decision_for(vllm_config).applies:
        return ()
    return tuple(r for r in engine.model.owned_ratios if r > 1)
