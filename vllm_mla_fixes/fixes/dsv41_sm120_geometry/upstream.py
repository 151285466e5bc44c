"""Upstream's own layout for an engine configuration on SM12x, and whether the
installed kernels take it.

vLLM builds every compressed-KV and indexer-K page from the kernel block the
backends declare for ``--block-size`` B (``B / compress_ratio`` states), and
the sliding-window pages from its hard-wired 32-token block.  Whether that
layout starts is vLLM's own kernel-block rule: each DeepSeek-V4.1 backend must
declare B itself (0.32/0.33 declare [128], 0.34.0 declares [64] on SM12x and
refuses to split a packed 128-token block).  Whether it then serves is the
kernels' own declaration (:mod:`.envelope`): every page a kernel reads must be
inside its envelope.  ``tests/dsv41_sm120_geometry/test_dsv41_truth_table.py`` checks this
prediction against vLLM's real start-up and planner for every covered cell.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    FLASHINFER_MODULE,
    INDEXER_MODULE,
    UPSTREAM_SWA_BLOCK,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind

SWA = CacheKind.SLIDING_WINDOW
COMPRESSED = CacheKind.COMPRESSED
INDEXER = CacheKind.INDEXER
ENVELOPE_CACHE = {SWA: envelope.SWA, COMPRESSED: envelope.COMPRESSED, INDEXER: envelope.INDEXER}
NOT_ON_SM12X = frozenset({envelope.DEEPGEMM_LOGITS_FP4})
"""Kernels no SM12x line reaches: SM120 refuses the MXFP4 indexer cache at start-up."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    cache: str  # e.g. "indexer K, compress ratio 2"
    rows: int
    kernel: str

    def as_dict(self) -> dict[str, object]:
        return {"cache": self.cache, "rows": self.rows, "kernel": self.kernel}


@dataclasses.dataclass(frozen=True)
class UpstreamLayout:
    """Upstream's layout for one ``--block-size`` and what the kernels say of it."""

    block_size: int
    starts: bool
    start_error: str | None
    pages: tuple[tuple[str, int], ...]  # (cache, rows) of every page kind a kernel reads
    rejected: tuple[Rejection, ...]
    unknown: tuple[str, ...]  # declarations that could not be read (never "accepts")

    @property
    def works(self) -> bool | None:
        """True: starts and every page is inside its kernels' envelopes; None: unknown."""
        if not self.starts or self.rejected:
            return False
        return None if self.unknown else True


def _cache_name(kind: CacheKind, ratio: int) -> str:
    return kind.value if kind is SWA else f"{kind.value}, compress ratio {ratio}"


def _backends() -> dict[str, Any]:
    """The DeepSeek-V4.1 backend classes, by vLLM's name for them."""
    backends = {}
    for module_name, cls_name in (
        (FLASHINFER_MODULE, "DeepseekV4FlashInferMLASparseBackend"),
        (INDEXER_MODULE, "DeepseekV41IndexerBackend"),
    ):
        backend = getattr(importlib.import_module(module_name), cls_name)
        backends[backend.get_name()] = backend
    return backends


def declared_kernel_blocks() -> dict[str, list[int]]:
    """Kernel block sizes each DeepSeek-V4.1 backend declares with no spec in
    view (vLLM's own answer, which the fix leaves unchanged for that call)."""
    return {
        name: [int(getattr(s, "base", s)) for s in backend.get_supported_kernel_block_sizes()]
        for name, backend in _backends().items()
    }


def vllm_start_error(block_size: int, name: str, sizes: list[int]) -> str:
    """vLLM's own exception text for backend ``name`` (declaring kernel blocks
    ``sizes``) at ``--block-size``, raised by vLLM's own checks: its common
    block size selection, or, where a declared size divides the block, the
    split of a packed block into kernel blocks (0.34.0 refuses that for the
    sliding-window cache, a token cache, whatever its page sizes).  Our own
    words only where neither check raises here."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker import utils

    backend = _backends()[name]
    try:
        utils.select_common_block_size(block_size, [backend])
    except ValueError as exc:
        return str(exc)
    divisors = [size for size in sizes if block_size % size == 0]
    if divisors and hasattr(utils.AttentionGroup, "map_kv_cache_to_kernel_blocks"):
        token_cache = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.uint8
        )
        group = utils.AttentionGroup(backend, [], token_cache, 0, kernel_block_size=max(divisors))
        try:
            group.map_kv_cache_to_kernel_blocks(torch.empty(1, 2, block_size, 1, dtype=torch.uint8))
        except ValueError as exc:
            return str(exc)
    return f"{name} declares kernel blocks {sizes}, not {block_size}"


def picked_block_size(declared: dict[str, list[int]]) -> int:
    """The block size vLLM picks when ``--block-size`` is not given: the
    smallest size every DeepSeek-V4.1 backend declares (the truth-table test
    checks this against the platform's own choice)."""
    return math.lcm(*(min(sizes) for sizes in declared.values()))


def upstream_layout(
    block_size: int, ratios: tuple[int, ...] = (1, 2), declared: dict[str, list[int]] | None = None
) -> UpstreamLayout:
    """Upstream's pages for ``block_size`` and the installed kernels' verdict."""
    declared = declared_kernel_blocks() if declared is None else declared
    refusing = [name for name, sizes in declared.items() if block_size not in sizes]
    if refusing:
        name = refusing[0]
        return UpstreamLayout(
            block_size,
            False,
            vllm_start_error(block_size, name, declared[name]),
            (),
            (),
            (),
        )
    pages = [(SWA, 0, UPSTREAM_SWA_BLOCK)]
    for ratio in ratios:
        pages += [(COMPRESSED, ratio, block_size // ratio), (INDEXER, ratio, block_size // ratio)]
    rejected, unknown = page_verdicts(pages)
    return UpstreamLayout(
        block_size,
        True,
        None,
        tuple((_cache_name(kind, ratio), rows) for kind, ratio, rows in pages),
        rejected,
        unknown,
    )


def kernels_on(kind: CacheKind) -> list[envelope.KernelEnvelope]:
    """The envelopes of the kernels an SM12x line runs on a cache of ``kind``."""
    return [
        e
        for e in envelope.envelopes_for_cache(ENVELOPE_CACHE[kind])
        if e.kernel not in NOT_ON_SM12X
    ]


def page_verdicts(
    pages: list[tuple[CacheKind, int, int]],
) -> tuple[tuple[Rejection, ...], tuple[str, ...]]:
    """(each (cache, rows) a kernel rejects, with the kernel; the envelopes that
    could not be read) for pages given as (kind, compress ratio, rows)."""
    rejected: dict[Rejection, None] = {}
    unknown: dict[str, None] = {}
    for kind, ratio, rows in pages:
        for kernel in kernels_on(kind):
            verdict = kernel.accepts_rows(rows)
            if verdict is None:
                unknown[f"{kernel.title}: {kernel.unknown}"] = None
            elif not verdict:
                rejected[Rejection(_cache_name(kind, ratio), rows, kernel.title)] = None
    return tuple(rejected), tuple(unknown)


def for_config(vllm_config: object) -> UpstreamLayout:
    """Upstream's layout for the engine configuration's ``--block-size`` (or
    the size vLLM picks when the line gives none)."""
    declared = declared_kernel_blocks()
    cache = getattr(vllm_config, "cache_config", None)
    given = getattr(cache, "user_specified_block_size", True)
    block_size = getattr(cache, "block_size", None)
    if not given or not isinstance(block_size, int):
        block_size = picked_block_size(declared)
    return upstream_layout(block_size, declared=declared)
