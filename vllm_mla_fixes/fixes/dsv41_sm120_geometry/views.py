"""Interleaved kernel views: under the split, the ratio-1 compressed and
indexer caches are bound as strided views whose 64-state kernel pages
interleave inside each 128-token block; block zeroing and prefix-cache block
copies see each block's whole pair region."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import (
    STATE,
    InterleavedPlacement,
    PairRegion,
    interleaved_placement,
    is_split_ratio1,
    view_key,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    FLASHINFER_BACKEND,
    GEOMETRY_ENV,
    INFO,
    PAGE_ROWS,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import slot_buffers


@dataclasses.dataclass(frozen=True)
class InterleavedCache:
    layer: str
    kind: str  # "compressed" or "indexer"
    start: int  # byte offset of the cache's first kernel page in block 0
    kernel_page: int  # bytes of one 64-state page
    lead: int  # bytes from its pair's start to its first kernel page (0, or the compressed page)


def interleave_plan(
    kv_caches: dict[str, Any], groups: list[Any]
) -> tuple[int, int, list[InterleavedCache]]:
    """(unit, kernel pages per block stride, caches) for the ratio-1 caches of
    ``groups``, from their manager views; raises :class:`PageGeometryError`
    unless their manager pages fill one contiguous run of whole units."""
    caches = []
    for group in groups:
        kind = "compressed" if group.backend.get_name() == FLASHINFER_BACKEND else "indexer"
        spec = group.kv_cache_spec
        kernel_page = spec.copy_with_new_block_size(group.kernel_block_size).page_size_bytes
        if spec.page_size_bytes != 2 * kernel_page:
            raise PageGeometryError(
                f"{INFO.name}: {kind} page {spec.page_size_bytes} B is not two {kernel_page}-B "
                "kernel pages; the interleaved split cannot bind it"
            )
        for name in group.layer_names:
            view = kv_caches[name]
            caches.append(
                (
                    view.storage_offset() * view.element_size(),
                    kind,
                    name,
                    kernel_page,
                    spec.page_size_bytes,
                    view,
                )
            )
    caches.sort(key=lambda c: c[0])
    strides = {c[5].stride(0) * c[5].element_size() for c in caches}
    storages = {c[5].untyped_storage().data_ptr() for c in caches}
    kinds = [c[1] for c in caches]
    compressed_pages = {c[3] for c in caches if c[1] == "compressed"}
    indexer_pages = {c[3] for c in caches if c[1] == "indexer"}
    problem = None
    if len(strides) != 1 or len(storages) != 1:
        problem = "the ratio-1 caches do not share one packed allocation"
    elif (
        kinds.count("compressed") != kinds.count("indexer")
        or len(compressed_pages) != 1
        or len(indexer_pages) != 1
    ):
        problem = f"ratio-1 caches {kinds} do not pair up"
    elif any(a[0] + a[4] != b[0] for a, b in zip(caches, caches[1:])):
        problem = "the ratio-1 caches' pages are not adjacent in the packed block"
    if problem is None:
        unit = compressed_pages.pop() + indexer_pages.pop()
        block_stride = strides.pop()
        if block_stride % unit:
            problem = f"the block stride {block_stride} B is not a multiple of the {unit}-B unit"
    if problem is not None:
        raise PageGeometryError(
            f"vllm-mla-fixes ({INFO.name}): cannot interleave the ratio-1 compressed/indexer "
            f"pages: {problem}.  Set {GEOMETRY_ENV}=per-ratio and report this with "
            "`vllm-mla-fixes doctor`."
        )
    region = caches[0][0]
    plan, pair = [], {"compressed": 0, "indexer": 0}
    for _, kind, name, kernel_page, _, _ in caches:
        lead = 0 if kind == "compressed" else unit - kernel_page
        plan.append(
            InterleavedCache(name, kind, region + 2 * unit * pair[kind] + lead, kernel_page, lead)
        )
        pair[kind] += 1
    return unit, block_stride // unit, plan


def _interleaved_views(kv_caches: dict[str, Any], groups: list[Any]) -> dict[str, object]:
    import torch

    unit, stride_pages, plan = interleave_plan(kv_caches, groups)
    views = {}
    for cache in plan:
        manager = kv_caches[cache.layer]
        size = manager.element_size()
        rows = PAGE_ROWS
        num_pages = (manager.shape[0] - 1) * stride_pages + 2
        views[cache.layer] = torch.as_strided(
            manager,
            (num_pages, *manager.shape[1:-2], rows, manager.shape[-1]),
            (unit // size, *manager.stride()[1:]),
            cache.start // size,
        )
        pair_start = cache.start - cache.lead
        for view in (manager, views[cache.layer]):
            STATE.pair_regions[view_key(view)] = PairRegion(
                pair_start, 2 * unit, stride_pages * unit
            )
    leads = {cache.layer: cache.lead for cache in plan}
    for group in groups:
        group.kernel_block_stride = stride_pages
        lead = next(leads[name] for name in group.layer_names if name in leads)
        STATE.interleaved[(group.backend, group.kv_cache_spec)] = InterleavedPlacement(unit, lead)
        for builder in group.metadata_builders:
            slot_buffers(builder)
    return views


def with_interleaved_ratio1_views(original: Callable[..., Any]) -> Callable[..., object]:
    @functools.wraps(original)
    def map_kv_caches_to_kernel_blocks(kv_caches: dict[str, object], attn_groups: Any) -> object:
        attn_groups = list(attn_groups)
        split = [group for group in attn_groups if is_split_ratio1(group)]
        rest = [group for group in attn_groups if not any(group is s for s in split)]
        mapped = original(kv_caches, rest)
        present = [group for group in split if any(n in kv_caches for n in group.layer_names)]
        if present:
            mapped.update(_interleaved_views(kv_caches, present))
        return mapped

    return map_kv_caches_to_kernel_blocks


def with_pair_manager_view(original: Callable[..., object]) -> Callable[..., object]:
    """vLLM views a split group's bound cache as manager blocks to zero newly
    allocated blocks (``KVBlockZeroer``), assuming a block's kernel pages are
    contiguous.  For an interleaved cache the view is the whole pair region of
    the block instead (both caches' pages, 2 units), so zeroing a new block
    clears exactly the ratio-1 pages it holds."""

    @functools.wraps(original)
    def map_kv_cache_to_manager_blocks(self: Any, kv_cache: Any, num_blocks: int) -> object:
        placement = interleaved_placement(self)
        if placement is None:
            return original(self, kv_cache, num_blocks)
        import torch

        unit, lead = placement.unit, placement.lead
        size = kv_cache.element_size()
        pair = 2 * unit // size
        return torch.as_strided(
            kv_cache,
            (num_blocks, 1, 1, pair),
            (kv_cache.stride(0) * self.kernel_block_stride, pair, pair, 1),
            kv_cache.storage_offset() - lead // size,
        )

    return map_kv_cache_to_manager_blocks


def with_pair_region_copies(original: Callable[..., object]) -> Callable[..., object]:
    """vLLM copies a block for a partial prefix-cache hit through the whole
    allocation when the allocation is exactly ``num_blocks`` blocks, and
    otherwise through each cache's own view (an extensible or padded
    allocation).  An interleaved ratio-1 cache's manager view spans only part
    of its pair region (the other cache's pages and the page padding lie
    between its rows), and its kernel view is not a whole number of pages per
    block, so each is handed over as its block's whole pair region instead;
    the compressed and indexer caches of one pair then give the same view,
    which vLLM copies once."""

    @functools.wraps(original)
    def copy_kv_cache_blocks_inplace(
        kv_caches: Any, num_blocks: int, kv_cache_block_copies: object
    ) -> object:
        if STATE.pair_regions and kv_cache_block_copies:
            kv_caches = [_pair_region_view(cache, num_blocks) for cache in kv_caches]
        return original(kv_caches, num_blocks, kv_cache_block_copies)

    return copy_kv_cache_blocks_inplace


def _pair_region_view(cache: Any, num_blocks: int) -> object:
    placement = STATE.pair_regions.get(view_key(cache))
    if placement is None:
        return cache
    import torch

    start, pair, block_stride = placement.start, placement.size, placement.block_stride
    size = cache.element_size()
    return torch.as_strided(
        cache, (num_blocks, pair // size), (block_stride // size, 1), start // size
    )
