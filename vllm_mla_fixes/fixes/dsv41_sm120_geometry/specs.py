"""Spec producers: the KV-cache specs the DeepSeek-V4.1 layers hand vLLM's
planner under the chosen geometry, the backends' per-spec kernel block sizes,
the sliding-window cache's page rows, and the warm-up keys of 64-state pages."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    _decide,
    _decision_for_specs,
    drafter_swa_rows,
    stepped_aside,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.drafter_pages import (
    past_backbone,
    with_planned_rows,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gain import settle, with_settling
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    DRAFTER_SWA_ROWS,
    INFO,
    PAGE_ROWS,
    SPLIT,
    SPLIT_MANAGER_BLOCK,
    UPSTREAM,
    UPSTREAM_SWA_BLOCK,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import (
    _ORIGINAL_PRODUCERS,
    _state,
)


def per_ratio_spec(spec: Any) -> Any:
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


def split_spec(spec: Any, unit: int) -> Any:
    """``spec`` with 128-token manager blocks; a ratio-1 spec also asks the
    planner for a block stride that is a whole number of interleave units
    (set before ``customize_attention_spec``, which fills it only when empty)."""
    changes: dict[str, Any] = {"block_size": SPLIT_MANAGER_BLOCK, "page_size_padded": None}
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


def _wrap_spec_producer(cls: type) -> Callable:
    original = cls.__dict__["get_kv_cache_spec"]
    _ORIGINAL_PRODUCERS[cls] = original

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if spec is None:
            return None
        settle(vllm_config)
        decision = _decision_for_specs(vllm_config)
        if decision.geometry == UPSTREAM:
            return spec
        states = spec.tokens_per_state
        if not _state["planning"] and isinstance(states, int) and states > 1:
            _state["owned_ratios"].add(states)
        if decision.geometry == SPLIT:
            return split_spec(spec, decision.unit)
        return per_ratio_spec(spec)

    get_kv_cache_spec.__wrapped_by__ = INFO.name  # type: ignore[attr-defined]
    return get_kv_cache_spec


def _per_spec_kernel_block_sizes(original: Callable) -> staticmethod:
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        if kv_cache_spec is None or stepped_aside():
            # Platform-level block-size choice (no cache in view), or upstream's
            # own layout in force: upstream's answer.
            return original(kv_cache_spec)
        states = getattr(kv_cache_spec, "tokens_per_state", None)
        if isinstance(states, int) and states >= 1:
            return [PAGE_ROWS * states]
        return original(kv_cache_spec)

    get_supported_kernel_block_sizes.__wrapped__ = original  # type: ignore[attr-defined]
    return staticmethod(get_supported_kernel_block_sizes)


def swa_page_rows(prefix: Any) -> int:
    """Sliding-window page rows for the cache built under ``prefix``:
    upstream's where its layout is in force; else 128 for a drafter layer's
    (numbered past the backbone) where FlashInfer takes run-time page sizes,
    and 64."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    if _decide(config).geometry == UPSTREAM:
        return UPSTREAM_SWA_BLOCK
    if past_backbone(prefix, config):
        return drafter_swa_rows()[0]
    return PAGE_ROWS


def _swa_cache_with_kernel_pages(cache_class: type) -> Callable:
    """Stands in for the class name inside ``deepseek_v41.attention`` only, so
    DeepSeek-V4.0 (which shares the class) is not touched."""

    def build_swa_cache(*args, **kwargs):
        if kwargs.get("block_size") != UPSTREAM_SWA_BLOCK:
            return cache_class(*args, **kwargs)
        prefix = kwargs.get("prefix")
        kwargs["block_size"] = swa_page_rows(prefix)
        cache = cache_class(*args, **kwargs)
        if kwargs["block_size"] == DRAFTER_SWA_ROWS:
            _state["drafter_swa_caches"].add(prefix)
            with_planned_rows(cache)
        elif kwargs["block_size"] == UPSTREAM_SWA_BLOCK:
            _state["upstream_swa_caches"].add(prefix)
            with_settling(cache)
        return cache

    build_swa_cache.__wrapped__ = cache_class  # type: ignore[attr-defined]
    return build_swa_cache


def _warmup_keys_with_64_state_pages(original: Callable) -> Callable:
    """Also warm the compressed-slot-mapping kernel for the block size it
    really sees (the states per page, 64), not ``--block-size // ratio`` --
    for the compress ratios of the DeepSeek-V4.1 caches the fix made in this
    process (a worker builds its specs before it warms up) and no other, so
    another model's compressed cache (GLM's kpool of ratio 32) keeps
    upstream's keys."""

    @functools.wraps(original)
    def get_warmup_keys(self, vllm_config):
        keys = list(original(self, vllm_config))
        owned = _state["owned_ratios"]
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
