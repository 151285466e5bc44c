"""``selftest --geometry dspark-long-prefill``: the sparse-MLA top-k indices of
a long DSpark prefill, bounded on this device's kernels (vllm#56771).

vLLM's top-k gather (``compute_global_topk_indices_and_lens``) bounds a
top-k index below only.  On CPU vLLM's own metadata never reaches the
missing upper bound (``reproductions/dspark_gather.py``); only an index at
or past the token's visible compressed length ``(position + 1) // ratio``
would, and only the device's indexer kernels decide whether one comes out.

This check serves a 12,288-token prompt in ``--max-num-batched-tokens``
2048 chunks beside a DSpark verify step, then a padded verify step, through
vLLM's own scheduler, block tables and metadata
(:func:`..reproductions.dspark_gather.serve_long_prompt`).  For each
compressed layer's gather call of the kept steps it writes random fp8 index
keys into that layer's indexer pages, scores random fp8 queries against
them with the device's indexer logits kernel (DeepGEMM's paged MQA logits
on a GPU that has it, else the PyTorch stand-in), picks each token's top-k
within its visible length with vLLM's own top-k op where the device has it,
and then checks:

- every index of a real token is -1 or below its visible length;
- vLLM's gather, run on a block table whose cells hold their own
  coordinates, loads only cells of the token's own row below the blocks its
  request holds.

A control injects one index past the visible length into the same run's
indices: the check must catch it, or its PASS means nothing.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..reproductions import dspark_gather as dg
from . import bounds as bd
from . import kernels as kn
from .results import DSPARK_CASE, DSPARK_CONTROL, GeometryResult, new_result

GEOMETRY = "dspark-long-prefill"
PROMPT_TOKENS = 12_288  # vllm#56771's "12k reliably"
INDEX_BOUNDS = bd.Bound(
    0.0,
    "indices or loads out of bounds",
    "every index of a real token is -1 or below (position + 1) // ratio; every gather "
    "load is in the token's own block-table row, below its request's blocks",
)
CHECKED_KERNELS = (kn.INDEXER_LOGITS, *kn.INDEX_READERS)


@dataclass(frozen=True)
class Violation:
    """One index, or one load of vLLM's gather, out of bounds."""

    call: dg.GatherCall
    token: int  # the token's place in the call
    what: str

    def __str__(self) -> str:
        call = self.call
        row = int(call.token_to_req[self.token])
        position = int(call.positions[self.token])
        return (
            f"{call.step}, {call.layer} ({call.path}), token at position {position} of "
            f"request row {row}: {self.what}"
        )


def index_violations(call: dg.GatherCall, indices: torch.Tensor) -> list[Violation]:
    """Indices of real tokens outside [-1, visible length)."""
    found = []
    visible = call.visible.tolist()
    for token, lane in _outside(call, indices.cpu()):
        index = int(indices[token, lane])
        found.append(
            Violation(
                call, token, f"lane {lane} holds index {index}, visible length {visible[token]}"
            )
        )
    return found


def _outside(call: dg.GatherCall, indices: torch.Tensor) -> list[list[int]]:
    visible = call.visible[:, None]
    bad = ((indices < -1) | (indices >= visible)) & call.is_valid[:, None]
    return cast("list[list[int]]", bad.nonzero().tolist())


def load_violations(call: dg.GatherCall, reads: list[dg.Read]) -> list[Violation]:
    """Loads of vLLM's gather outside the token's own allocated blocks."""
    return [
        Violation(call, read.token, f"the gather read cell {read.cell}: {read.kind}")
        for read in dg.out_of_bounds(reads)
    ]


def violations(call: dg.GatherCall, indices: torch.Tensor) -> list[Violation]:
    return index_violations(call, indices) + load_violations(call, dg.gather_reads(call, indices))


def write_index_keys(view: torch.Tensor, gen: torch.Generator) -> None:
    """Random fp8 index keys and unit scales in every page of an indexer cache
    (``[pages, states, 132]`` bytes: each page's keys, then their scales)."""
    from . import reference as ref

    pages, states, _ = view.shape
    flat = view.view(pages, -1)
    keys = (torch.randn(pages, states * ref.INDEX_DIM, generator=gen) * 2).to(torch.float8_e4m3fn)
    flat[:, : states * ref.INDEX_DIM] = keys.view(torch.uint8).to(view.device)
    if ref.index_scales_are_ue8m0x4():
        unit = torch.full((pages, states * 4), 127, dtype=torch.uint8)  # 2 ** (127 - 127)
    else:
        unit = torch.ones(pages, states, dtype=torch.float32).view(torch.uint8)
    flat[:, states * ref.INDEX_DIM :] = unit.view(pages, -1).to(view.device)


def indexer_indices(
    call: dg.GatherCall,
    view: torch.Tensor,
    heads: int,
    topk: int,
    kernels: kn.Kernels,
    gen: torch.Generator,
) -> torch.Tensor:
    """The call's top-k rows as the device's indexer makes them: each real
    token's query scored by the paged MQA logits kernel against its
    request's index keys up to its visible length, then its top-k within
    that length; padding tokens length 0."""
    device = kernels.device.torch_device
    tokens = len(call.positions)
    lengths = torch.where(call.is_valid, call.visible, 0).to(torch.int32)
    q = torch.randn(tokens, 1, heads, 128, generator=gen)
    q_fp8 = (q * 64).to(torch.float8_e4m3fn).to(device)
    weights = torch.rand(tokens, heads, generator=gen).to(device)
    table = call.block_table[call.token_to_req.long()].to(torch.int32).contiguous().to(device)
    context = lengths.view(tokens, 1).contiguous().to(device)
    width = int(table.shape[1]) * call.block_size
    logits = kernels.paged_logits(
        q_fp8,
        view.to(device).unsqueeze(-2),
        weights,
        context,
        table,
        _schedule(kernels, context, call.block_size),
        width,
    )
    return kernels.topk_within_lengths(logits, context, topk)


def _schedule(kernels: kn.Kernels, context: torch.Tensor, states: int) -> torch.Tensor:
    """DeepGEMM's paged MQA logits schedule for these rows (its stand-in needs none)."""
    if not kernels.is_real(kn.INDEXER_LOGITS):
        return torch.empty(0, dtype=torch.int32)
    from vllm.utils.deep_gemm import get_paged_mqa_logits_metadata

    sms = torch.cuda.get_device_properties(context.device).multi_processor_count
    return get_paged_mqa_logits_metadata(context, states, sms)


def control_call(calls: tuple[dg.GatherCall, ...]) -> tuple[int, int]:
    """(call, token) the control corrupts: the last real token of the prefill
    call that sees the most compressed positions."""
    prefills = [i for i, c in enumerate(calls) if c.path == "prefill"]
    chosen = max(prefills, key=lambda i: int(calls[i].visible.max()))
    valid = calls[chosen].is_valid.nonzero().flatten()
    return chosen, int(valid[-1])


def unbounded(call: dg.GatherCall, indices: torch.Tensor, token: int) -> torch.Tensor:
    """``indices`` with ``token``'s first lane set one block past its
    request's blocks: past its visible length, as vllm#56771's indices would be."""
    row = int(call.token_to_req[token])
    corrupted = indices.clone()
    corrupted[token, 0] = call.allocated[row] * call.block_size
    return corrupted


def indexer_rows(
    served: dg.Served,
    layout: Any,
    kernels: kn.Kernels,
    result: GeometryResult,
    seed: int = 0,
    entering: Callable[[str], None] | None = None,
) -> list[torch.Tensor | None]:
    """Each call's top-k rows from the device's indexer over fresh random keys
    in its layer's pages (None where the pages do not match the gather's
    blocks: a problem in ``result``)."""
    gen = torch.Generator().manual_seed(seed)
    tell = entering or (lambda kernel: None)
    written: set[str] = set()
    rows: list[torch.Tensor | None] = []
    for call in served.calls:
        view = layout.caches[f"{call.layer}.indexer.k_cache"].module.kv_cache
        if int(view.shape[1]) != call.block_size:
            result.case(DSPARK_CASE).fail(
                f"{call.layer}: indexer pages hold {int(view.shape[1])} states, "
                f"the gather's blocks {call.block_size}"
            )
            rows.append(None)
            continue
        if call.layer not in written:
            write_index_keys(view, gen)
            written.add(call.layer)
        tell(kn.INDEXER_LOGITS)
        indices = indexer_indices(call, view, layout.model.index_heads, served.topk, kernels, gen)
        rows.append(indices.cpu())
        tell("")
        result.kernel(kn.INDEXER_LOGITS).compared += int(call.is_valid.sum())
    return rows


def check_indices(
    served: dg.Served,
    rows: list[torch.Tensor | None],
    kernels: kn.Kernels,
    result: GeometryResult,
    entering: Callable[[str], None] | None = None,
    corrupt: tuple[int, int] | None = None,
) -> None:
    """Every index against its token's visible length, every gather load
    against its request's blocks, then the control.  ``corrupt`` = (call,
    token) sets one index out of bounds in the run itself (what a test uses
    to see a FAIL); the control does the same on a copy and must be caught."""
    tell = entering or (lambda kernel: None)
    device = kernels.device.torch_device
    for kernel in CHECKED_KERNELS:
        result.kernel(kernel).bound = INDEX_BOUNDS
    for place, (call, indices) in enumerate(zip(served.calls, rows, strict=True)):
        if indices is None:
            continue
        if corrupt is not None and corrupt[0] == place:
            indices = unbounded(call, indices, corrupt[1])
        real_tokens = int(call.is_valid.sum())
        result.kernel(kn.INDEXER_TOPK).compared += real_tokens
        for found in index_violations(call, indices):
            result.kernel(kn.INDEXER_TOPK).fail(str(found))
            result.case(DSPARK_CASE).fail(str(found))
        tell(kn.TOPK_GATHER)
        reads = dg.gather_reads(call, indices.to(device))
        tell("")
        result.kernel(kn.TOPK_GATHER).compared += len(reads)
        for found in load_violations(call, reads):
            result.kernel(kn.TOPK_GATHER).fail(str(found))
            result.case(DSPARK_CASE).fail(str(found))
        result.case(DSPARK_CASE).compared += real_tokens
    place, token = control_call(served.calls)
    call, indices = served.calls[place], rows[place]
    if indices is None:
        result.case(DSPARK_CONTROL).fail("MISSED: the control's call did not run")
        return
    tell(kn.TOPK_GATHER)
    caught = [
        v for v in violations(call, unbounded(call, indices, token).to(device)) if v.token == token
    ]
    tell("")
    if len({v.what.startswith("lane") for v in caught}) == 2:  # by both checks
        result.case(DSPARK_CONTROL).compared += 1
        result.layout.append(f"control caught: {caught[0]}; {caught[-1].what}")
    else:
        result.case(DSPARK_CONTROL).fail(
            f"MISSED: an index past the visible length at {call.step}, {call.layer}, "
            f"token {token} was not caught by both the index and the load check"
        )


def run_dspark_long_prefill(
    device: kn.Device,
    kernels: kn.Kernels | None = None,
    seed: int = 0,
    entering: Callable[[str], None] | None = None,
) -> GeometryResult:
    """The whole check on ``device``; never raises for what it finds."""
    kernels = kernels or kn.Kernels.for_device(device)
    result = new_result(GEOMETRY)
    start = time.monotonic()
    try:
        with dg.tiny_dspark_layout(PROMPT_TOKENS + 4096, device.torch_device) as layout:
            served = dg.serve_long_prompt(layout, PROMPT_TOKENS)
        result.block_size = layout.block_size
        steps = sorted({c.step for c in served.calls})
        result.layout.append(
            f"{PROMPT_TOKENS}-token prompt in chunks of {dg.PREFILL_BUDGET} tokens beside a "
            f"DSpark verify of {dg.VERIFY_TOKENS}; checked steps: {'; '.join(steps)}; "
            f"{len(served.calls)} gather calls, top-{served.topk}"
        )
        rows = indexer_rows(served, layout, kernels, result, seed, entering)
        check_indices(served, rows, kernels, result, entering)
    except Exception as exc:
        result.aborted = f"{type(exc).__name__}: {exc}"
        result.layout.append(traceback.format_exc(limit=6))
    result.seconds = time.monotonic() - start
    return result


def verdict_line(result: GeometryResult, kernels: kn.Kernels) -> str:
    """What the check's verdict rests on: which of its kernels were real."""
    real = [k for k in CHECKED_KERNELS if kernels.sources.get(k, "").startswith("real")]
    stand_ins = [k for k in CHECKED_KERNELS if k not in real]
    caught = result.cases[DSPARK_CONTROL].compared > 0
    line = (
        f"{GEOMETRY}: real kernels: {', '.join(real) or 'none'}; "
        f"stand-ins: {', '.join(stand_ins) or 'none'}; "
        f"control {'caught' if caught else 'MISSED'}"
    )
    if kn.INDEXER_LOGITS in stand_ins or kn.INDEXER_TOPK in stand_ins:
        line += (
            " - the indexer here is a stand-in, so this says nothing about the indices "
            "the real kernels emit: run it on the SM12x GPU"
        )
    return line
