"""Issue 42, step 1: does vLLM's own DSpark path make its top-k gather read
past a request's blocks?  (vllm#56771, the first defect vllm PR #57388 names.)

A long prompt is prefilled in chunks beside a DSpark verify step, on the
tiny DeepSeek-V4.1 layout, through vLLM's own ``KVCacheManager``,
``BlockTables`` and ``build_attn_metadata`` (the self-test's
:class:`~..selftest.timeline.BlockScheduler` and ``Worker``).  Only the
steps whose metadata is kept are built in full: the earlier chunks need
their blocks and block-table rows, not their metadata.

For each compressed layer, :func:`gather_reads` then runs vLLM's
``compute_global_topk_indices_and_lens`` as ``_forward_prefill`` and
``_forward_decode`` call it, on that metadata, with a block table whose
every cell holds its own coordinates (``row * width + column``) and a guard
row below the last: each slot the kernel returns names the cell it loaded.
A load is in bounds when the cell is in the token's own request row and
below the blocks that request holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

GUARD_ROWS = 1  # table rows below the batch's: a load there is outside the table
PREFILL_BUDGET = 2048  # --max-num-batched-tokens of the replayed server
DRAFTS = 5  # the report's num_speculative_tokens
VERIFY_TOKENS = 1 + DRAFTS


@dataclass(frozen=True)
class GatherCall:
    """One compressed layer's ``compute_global_topk_indices_and_lens`` call
    of one step, with the arguments vLLM's attention passes it."""

    step: str
    layer: str
    path: str  # "prefill" or "decode"
    compress_ratio: int
    block_size: int  # attn_metadata.block_size // compress_ratio
    block_table: torch.Tensor  # the rows the call passes
    token_to_req: torch.Tensor  # one per token of the call
    is_valid: torch.Tensor
    positions: torch.Tensor
    allocated: tuple[int, ...]  # per batch row: blocks of this table the request holds

    @property
    def visible(self) -> torch.Tensor:
        """Per token: the compressed positions its indexer may pick (the
        short-context path's ``(position + 1) // ratio``)."""
        return (self.positions + 1) // self.compress_ratio


@dataclass(frozen=True)
class Read:
    token: int
    row: int  # the request row the token belongs to
    cell: tuple[int, int]  # (row, column) the kernel loaded
    kind: str  # "in bounds", "past its blocks", "another request's row", "outside the table"


def legal_indices(call: GatherCall, topk: int) -> torch.Tensor:
    """Top-k rows as the indexer can fill them: for each valid token, 0 and
    then the largest compressed positions it can see, -1 after (the extremes
    of every legal row); padding tokens -1, as the indexer's reset leaves them."""
    rows = torch.full((len(call.positions), topk), -1, dtype=torch.int32)
    for token, (visible, valid) in enumerate(zip(call.visible.tolist(), call.is_valid.tolist())):
        if not valid or visible <= 0:
            continue
        picks = [0] + list(range(visible - 1, max(visible - topk, 0), -1))
        rows[token, : len(picks)] = torch.tensor(picks[:topk], dtype=torch.int32)
    return rows


def gather_reads(call: GatherCall, indices: torch.Tensor) -> list[Read]:
    """Run vLLM's gather on ``indices`` with a coordinate-coded block table,
    on the device ``indices`` are on; every load, classified."""
    from vllm.models.deepseek_v41.common.ops.cache_utils import (
        compute_global_topk_indices_and_lens,
    )

    device = indices.device
    rows, width = call.block_table.shape
    coded = torch.arange((rows + GUARD_ROWS) * width, dtype=torch.int32, device=device)
    coded = coded.view(-1, width)
    slots, _ = compute_global_topk_indices_and_lens(
        indices.contiguous(),
        call.token_to_req.to(device),
        coded[:rows],
        call.block_size,
        call.is_valid.to(device),
    )
    slots = slots.cpu()
    reads = []
    for token, lane in (slots >= 0).nonzero().tolist():
        code = int(slots[token, lane]) // call.block_size
        cell = divmod(code, width)
        own = int(call.token_to_req[token])
        if cell[0] >= rows:
            kind = "outside the table"
        elif cell[0] != own:
            kind = "another request's row"
        elif cell[1] >= call.allocated[own]:
            kind = "past its blocks"
        else:
            kind = "in bounds"
        reads.append(Read(token, own, cell, kind))
    return reads


def out_of_bounds(reads: list[Read]) -> list[Read]:
    return [r for r in reads if r.kind != "in bounds"]


def stale_lanes(call: GatherCall, indices: torch.Tensor) -> list[int]:
    """Tokens whose gathered row has a lane at or past its ``topk_length``
    that is not -1: what FlashInfer 0.7.0.post1's SM120 prefill reads anyway
    (flashinfer#5075, bounded per lane from 0.7.2.post1)."""
    from vllm.models.deepseek_v41.common.ops.cache_utils import (
        compute_global_topk_indices_and_lens,
    )

    slots, lengths = compute_global_topk_indices_and_lens(
        indices.contiguous(), call.token_to_req, call.block_table, call.block_size, call.is_valid
    )
    lanes = torch.arange(slots.shape[1]).expand_as(slots)
    past = (lanes >= lengths[:, None]) & (slots != -1)
    return cast("list[int]", past.any(dim=1).nonzero().flatten().tolist())


def short_context_rows(
    positions: torch.Tensor, rows: int, topk: int, ratio: int, sentinel: int
) -> torch.Tensor:
    """The top-k buffer after vLLM's short-context indexer fill (the path a
    step takes while ``max_seq_len // ratio <= index_topk``) over ``rows``
    tokens, on a buffer that held ``sentinel`` everywhere before."""
    import triton
    from vllm.models.deepseek_v41 import attention

    # 0.34.0 imports it from deepseek_v4 under a public name; 0.32.0 and 0.33.0 define it here.
    names = ("fill_short_context_topk_indices", "_fill_short_context_topk_indices")
    fill = next(getattr(attention, name) for name in names if hasattr(attention, name))
    buffer = torch.full((len(positions), topk), sentinel, dtype=torch.int32)
    fill[(rows,)](
        buffer,
        positions,
        TOP_K=topk,
        COMPRESS_RATIO=ratio,
        PADDED_TOP_K=triton.next_power_of_2(topk),
    )
    return buffer


def normalised_alike(tokens: int, topk: int) -> bool:
    """Whether the installed FlashInfer's SM120 sparse-MLA normalisation makes
    the same rows of 2-D ``[T, topk]`` prefill indices and 3-D ``[T, 1, topk]``
    decode indices: the SM120 entry point unsqueezes a ``[T, H, D]`` query to
    ``[T, 1, H, D]``, so T requests of one token each."""
    from flashinfer.mla import _core

    indices = torch.arange(tokens * topk, dtype=torch.int32).view(tokens, topk)
    lengths = torch.full((tokens,), topk, dtype=torch.int32)
    flat, flat_lens = _core._normalize_sparse_mla_indices_and_lens(
        indices=indices,
        lens=lengths,
        batch_size=tokens,
        q_len_per_request=1,
        device=indices.device,
        name="prefill",
    )
    nested, nested_lens = _core._normalize_sparse_mla_indices_and_lens(
        indices=indices.view(tokens, 1, topk),
        lens=lengths,
        batch_size=tokens,
        q_len_per_request=1,
        device=indices.device,
        name="decode",
    )
    assert flat_lens is not None and nested_lens is not None
    return bool(
        torch.equal(flat, nested) and torch.equal(flat_lens.flatten(), nested_lens.flatten())
    )


def split_k_scratch(tokens: int, heads: int, topk: int, extra_topk: int) -> list[tuple[int, int]]:
    """The byte ranges of vLLM's 128 MiB workspace that FlashInfer
    0.7.0.post1's host code hands its SM120 sparse-MLA kernel for one call
    (``_sparse_mla_decode_workspace``: split-K partials, then their LSE);
    none for a prefill-sized call.  That FlashInfer's only: later ones plan
    the carve-up in their compiled module, which needs a GPU."""
    from flashinfer.mla import _core

    workspace = torch.empty(128 << 20, dtype=torch.uint8)
    views = _core._sparse_mla_decode_workspace(
        workspace, num_tokens=tokens, num_heads=heads, d_v=512, topk=topk, extra_topk=extra_topk
    )
    base = workspace.data_ptr()
    return [
        (v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size())
        for v in views
        if v is not None
    ]


# ------------------------------------------------------------------ serving


@dataclass(frozen=True)
class Served:
    """The gather calls of the kept steps, and the indexer's own view of them."""

    calls: tuple[GatherCall, ...]
    # step -> (tokens the attention reads top-k rows for, tokens the indexer
    # metadata counts, tokens of the forward)
    rows: dict[str, tuple[int, int, int]]
    positions: dict[str, torch.Tensor]  # step -> the forward's positions, padding included
    topk: int


@contextlib.contextmanager
def tiny_dspark_layout(max_model_len: int, device: torch.device | str = "cpu") -> Iterator[Any]:
    """The geometry fix's split layout of the tiny model with one drafter
    layer, DSpark's speculative config, on ``device`` (a CPU: vLLM's
    simulated SM120 host)."""
    from ..selftest.applied import applied_fix
    from ..selftest.env import drafter_pages_at_128, one_torch_thread, simulated_sm120_host
    from ..selftest.layout import GEOMETRIES, TinyModel, build_layout

    model = TinyModel(
        max_model_len=max_model_len,
        num_blocks=max_model_len // 64 + 8,
        max_num_batched_tokens=PREFILL_BUDGET,
        speculative_tokens=DRAFTS,
    )
    on_cpu = torch.device(device).type == "cpu"
    host = simulated_sm120_host() if on_cpu else contextlib.nullcontext()
    with one_torch_thread(), host, drafter_pages_at_128(), applied_fix():
        yield build_layout(GEOMETRIES["split"], model, 0, device)


def serve_long_prompt(layout: Any, prompt_tokens: int) -> Served:
    """A 100-token request ``V`` verifying 1 + 5 tokens beside each chunk of a
    ``prompt_tokens`` prompt ``L`` (chunks as the token budget makes them),
    then both verifying in a batch padded for a FULL CUDA graph.  Keeps the
    last chunk's step and the padded verify step."""
    from ..selftest import timeline as tl

    prompts = {
        "V": list(range(20_000, 20_100)),
        "L": list(range(30_000, 30_000 + prompt_tokens)),
    }
    scheduler = tl.BlockScheduler(layout, prompts.__getitem__)
    worker = tl.Worker(layout)
    plans = [tl.StepPlan("V prefill", (("V", None),), ())]
    left = prompt_tokens
    while left:
        chunk = min(PREFILL_BUDGET - VERIFY_TOKENS, left)
        left -= chunk
        plans.append(
            tl.StepPlan(
                f"V verify + L prefill {prompt_tokens - left - chunk}-{prompt_tokens - left}",
                (("V", VERIFY_TOKENS), ("L", chunk)),
                (),
                accept=(("V", DRAFTS),),
            )
        )
    plans.append(
        tl.StepPlan(
            "V, L verify padded to 4",
            (("V", VERIFY_TOKENS), ("L", VERIFY_TOKENS)),
            (),
            pad_to=4,
            pad_tokens=4 * VERIFY_TOKENS,
            accept=(("V", DRAFTS), ("L", DRAFTS)),
        )
    )
    kept = {plans[-2].name, plans[-1].name}
    calls: list[GatherCall] = []
    rows: dict[str, tuple[int, int, int]] = {}
    positions: dict[str, torch.Tensor] = {}
    for plan in plans:
        scheduled = []
        for name, tokens in plan.work:
            start, count, replay = scheduler.schedule(name, tokens)
            scheduled.append((name, start, count, replay, start < len(prompts[name])))
        block_ids = {name: scheduler.block_ids(name) for name, *_ in scheduled}
        batch = worker.prepare(plan, scheduled, block_ids, scheduler.new_block_ids())
        if plan.name in kept:
            worker.build_metadata(batch)
            calls += _gather_calls(layout, batch, block_ids)
            rows[plan.name] = _row_counts(layout, batch)
            positions[plan.name] = batch.positions[: rows[plan.name][2]].cpu().clone()
        accepted = dict(plan.accept)
        for name, _, count, _, prefilling in scheduled:
            scheduler.advance(name, count, None if prefilling else accepted.get(name))
    return Served(tuple(calls), rows, positions, layout.model.index_topk)


def _compressed_layers(layout: Any) -> list[tuple[str, int, int]]:
    """(prefix, compress ratio, KV-cache group) of each compressed cache."""
    out = []
    for gid, group in enumerate(layout.kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            cache = layout.caches[name]
            if cache.kind == "compressed":
                layer = int(name.split(".")[2])
                out.append((name, layout.model.compress_ratios[layer], gid))
    return out


def _swa_prefix(compressed: str) -> str:
    return f"{compressed}.swa_cache"


def _gather_calls(
    layout: Any, batch: Any, block_ids: dict[str, tuple[list[int], ...]]
) -> list[GatherCall]:
    """The step's calls, their tensors copied to the CPU: the builders'
    persistent buffers that the metadata views are rewritten by the next step."""
    calls = []
    for prefix, ratio, gid in _compressed_layers(layout):
        compressed = batch.metadata[prefix]
        swa = batch.metadata[_swa_prefix(prefix)]
        kernel_per_block = layout.group_block_size(gid) // compressed.block_size
        allocated = [len(block_ids[name][gid]) * kernel_per_block for name in batch.names]
        allocated += [0] * (batch.num_reqs - len(allocated))
        decodes, decode_tokens = swa.num_decodes, swa.num_decode_tokens
        paths = []
        if decodes:  # _forward_decode passes the decode requests' rows only
            paths.append(("decode", compressed.block_table[:decodes], slice(0, decode_tokens)))
        if swa.num_prefills:
            end = decode_tokens + swa.num_prefill_tokens
            paths.append(("prefill", compressed.block_table, slice(decode_tokens, end)))
        for path, table, tokens in paths:
            calls.append(
                GatherCall(
                    step=batch.plan.name,
                    layer=prefix,
                    path=path,
                    compress_ratio=ratio,
                    block_size=compressed.block_size // ratio,
                    block_table=table.cpu().clone(),
                    token_to_req=swa.token_to_req_indices[tokens].cpu().clone(),
                    is_valid=swa.is_valid_token[tokens].cpu().clone(),
                    positions=batch.positions[tokens].cpu().clone(),
                    allocated=tuple(allocated),
                )
            )
    return calls


def _row_counts(layout: Any, batch: Any) -> tuple[int, int, int]:
    """Top-k rows the attention reads (its SWA metadata's decode + prefill
    tokens), rows the indexer's metadata counts (what its short-context fill
    writes), and the forward's tokens (what the full indexer path resets)."""
    prefix, _, _ = _compressed_layers(layout)[0]
    swa = batch.metadata[_swa_prefix(prefix)]
    indexer = batch.metadata[f"{prefix}.indexer.k_cache"]
    forward_tokens = batch.num_tokens_padded if batch.plan.pad_to else batch.num_tokens
    return (
        swa.num_decode_tokens + swa.num_prefill_tokens,
        indexer.num_decode_tokens + indexer.num_prefill_tokens,
        forward_tokens,
    )
