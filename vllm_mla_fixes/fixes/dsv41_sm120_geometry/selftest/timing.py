"""Per-step cost of the interleaved split on the local device.

Each forward step, the two ratio-1 attention groups (compressed KV, indexer K)
turn the step's manager slots into kernel-block slots (``kernel_slots``: three
elementwise ops into persistent buffers).  Upstream's layout does no such
work; for scale, vLLM's own per-step ``map_to_kernel_block_table`` (what vLLM
runs every step for any group whose kernel block is smaller than its manager
block) is timed on the same group, for the same batch: a decode step of 64
requests and one 8,192-token prefill chunk.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .env import simulated_sm120_host
from .kernels import Device
from .layout import GEOMETRIES, TinyModel, build_layout

DECODE_REQUESTS = 64
PREFILL_CHUNK = 8192


@dataclass(frozen=True)
class StepCost:
    tokens: int
    kernel_slots_us: float  # one ratio-1 group
    map_to_kernel_block_table_us: float  # vLLM's own, one group

    @property
    def per_step_us(self) -> float:
        """Both ratio-1 groups."""
        return 2 * self.kernel_slots_us


def _best_us(
    call: Callable[..., object],  # called with no argument (its lambdas bind theirs as defaults)
    device: torch.device,
    calls: int = 200,
    rounds: int = 7,
) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()
    sync()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def slot_translation_cost(device: Device) -> list[StepCost]:
    """Time ``kernel_slots`` beside ``map_to_kernel_block_table`` on the
    split's ratio-1 group, built by vLLM's planner with the fix applied."""
    host = simulated_sm120_host() if device.kind == "cpu" else contextlib.nullcontext()
    with host:
        return _slot_translation_cost(device.torch_device)


def _slot_translation_cost(device: torch.device) -> list[StepCost]:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import kernel_slots

    from .applied import applied_fix

    model = TinyModel(
        max_num_seqs=DECODE_REQUESTS,
        max_num_batched_tokens=PREFILL_CHUNK,
        max_model_len=2 * PREFILL_CHUNK,
        num_blocks=2 * PREFILL_CHUNK // 128 + 8,
    )
    out = []
    with applied_fix():
        layout = build_layout(GEOMETRIES["split"], model, 0, device)
        group = next(
            c.attn_group for c in layout.caches.values() if c.kind == "compressed" and c.ratio == 1
        )
        gen = torch.Generator().manual_seed(0)
        blocks = layout.kv_cache_config.num_blocks
        width = model.max_model_len // layout.group_block_size(group.kv_cache_group_id)
        for tokens, requests in ((DECODE_REQUESTS, DECODE_REQUESTS), (PREFILL_CHUNK, 1)):
            table = torch.randint(
                1, blocks, (requests, width), generator=gen, dtype=torch.int32
            ).to(device)
            slots = torch.randint(0, blocks * 128, (tokens,), generator=gen).to(device)
            slots[-3:] = -1  # graph padding
            out.append(
                StepCost(
                    tokens,
                    _best_us(lambda s=slots: kernel_slots(group, s), device),
                    _best_us(lambda t=table: group.map_to_kernel_block_table(t), device),
                )
            )
    return out
