"""Ratio-1 writer slots: under the split, the ratio-1 writers get kernel-block
slots, translated from manager-block slots into persistent per-builder
buffers each time an attention group hands its builders the kernel table."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import interleaved_placement
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    INFO,
    PageGeometryError,
)

SLOT_BUFFERS: weakref.WeakKeyDictionary[object, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def slot_buffers(builder: Any) -> tuple[Any, Any]:
    """Persistent (slots, block index) buffers of one metadata builder, sized
    for the scheduler's token budget: allocated once (when the views are
    bound, or on a builder's first build), reused every step."""
    buffers = SLOT_BUFFERS.get(builder)
    if buffers is None:
        import torch

        tokens = builder.vllm_config.scheduler_config.max_num_batched_tokens
        device = builder.device
        buffers = (
            torch.empty(tokens, dtype=torch.int64, device=device),
            torch.empty(tokens, dtype=torch.int64, device=device),
        )
        SLOT_BUFFERS[builder] = buffers
    return buffers


def kernel_slots(group: Any, slot_mapping: Any, ubatch_idx: int = 0) -> Any:
    """Manager-block slots -> kernel-block slots of an interleaved group:
    ``ktable[req, pos // k] * k + pos % k`` = ``s + (s // B) * (S * k - B)``
    for manager block B, kernel block k and kernel-block stride S.  A pad
    (negative slot) has ``s // B < 0``, clamped to 0, so it is kept as is.
    Three elementwise ops into the builder's persistent buffers per step."""
    import torch

    slots, blocks = slot_buffers(group.get_metadata_builder(ubatch_idx))
    n = slot_mapping.shape[0]
    if slot_mapping.dim() != 1 or n > slots.shape[0]:
        raise PageGeometryError(
            f"{INFO.name}: slot mapping of shape {tuple(slot_mapping.shape)} exceeds the "
            f"{slots.shape[0]}-token buffer of the interleaved split"
        )
    manager_block = group.kv_cache_spec.block_size
    block = torch.div(slot_mapping, manager_block, rounding_mode="floor", out=blocks[:n]).clamp_(
        min=0
    )
    shift = group.kernel_block_stride * group.kernel_block_size - manager_block
    return torch.add(slot_mapping, block, alpha=shift, out=slots[:n])


def with_kernel_slots(original: Callable[..., Any]) -> Callable[..., object]:
    @functools.wraps(original)
    def _with_kernel_block_table(
        self: object, common_attn_metadata: object, ubatch_idx: int = 0
    ) -> object:
        metadata = original(self, common_attn_metadata, ubatch_idx)
        if interleaved_placement(self) is None:
            return metadata
        return dataclasses.replace(
            metadata, slot_mapping=kernel_slots(self, metadata.slot_mapping, ubatch_idx)
        )

    return _with_kernel_block_table
