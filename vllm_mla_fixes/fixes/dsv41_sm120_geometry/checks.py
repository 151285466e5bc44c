"""Start-up and agreement checks: every FlashInfer- or indexer-bound cache has
the page rows the fix gave it (checked when the KV-cache views are bound),
no drafter layer writes split ratio-1 pages, and all workers chose one
geometry (checked where the engine core merges their specs)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    drafter_ratio1_layer,
    stepped_aside,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gain import register_moved_rows_warmup
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    DRAFTER_SWA_ROWS,
    FLASHINFER_BACKEND,
    GEOMETRY_ENV,
    INFO,
    PAGE_ROWS,
    PER_RATIO,
    SPLIT,
    SPLIT_MANAGER_BLOCK,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import (
    _INTERLEAVED,
    _state,
)
from vllm_mla_fixes.patching import CannotProbe, TargetMismatch


@dataclasses.dataclass(frozen=True)
class CachePage:
    layer: str
    kind: str  # "sliding-window KV", "compressed KV", "indexer K"
    compress_ratio: int
    rows: int  # tokens (states) per page as the kernel sees it


def bound_pages(forward_context: dict[str, Any]) -> list[CachePage]:
    """Page size of every DeepSeek-V4.1 cache that FlashInfer's SM120 backend or
    the indexer reads, from the views bound to the layers."""
    attention = sys.modules.get(ATTENTION_MODULE)
    if attention is None:
        return []
    pages: list[CachePage] = []
    for name, layer in forward_context.items():
        if isinstance(layer, attention.DeepseekV4Attention):
            backend = layer.get_attn_backend()
            if backend.get_name() != FLASHINFER_BACKEND:
                continue
            swa = getattr(layer, "swa_cache_layer", None)
            if swa is not None and swa.kv_cache.numel():
                pages.append(
                    CachePage(swa.prefix, "sliding-window KV", 0, int(swa.kv_cache.shape[-2]))
                )
            if layer.is_kv_source and layer.kv_cache.numel():
                pages.append(
                    CachePage(
                        name, "compressed KV", layer.compress_ratio, int(layer.kv_cache.shape[-2])
                    )
                )
        elif isinstance(layer, attention.DeepseekV4IndexerCache) and layer.kv_cache.numel():
            pages.append(
                CachePage(name, "indexer K", layer.compress_ratio, int(layer.kv_cache.shape[-2]))
            )
    return pages


def expected_rows(page: CachePage) -> int:
    """Rows the fix gave this page: 64, or 128 for a drafter's sliding-window
    cache it built so and planning kept so (see :mod:`.drafter_pages`)."""
    if (
        page.kind == "sliding-window KV"
        and page.layer in _state["drafter_swa_caches"]
        and page.layer not in _state["drafter_swa_narrowed"]
    ):
        return DRAFTER_SWA_ROWS
    return PAGE_ROWS


def check_page_geometry(pages: Iterable[CachePage]) -> None:
    """Raise :class:`PageGeometryError` unless every page holds the states the
    fix gave it (64; 128 for a drafter's sliding-window pages)."""
    wrong = [page for page in pages if page.rows != expected_rows(page)]
    if not wrong:
        return
    lines = "\n".join(
        f"  {page.layer}: {page.kind} cache, compress ratio {page.compress_ratio}, "
        f"{page.rows}-{'state' if page.kind == 'indexer K' else 'token'} pages"
        for page in wrong
    )
    raise PageGeometryError(
        f"vllm-mla-fixes ({INFO.name}): on SM12x, FlashInfer's sparse-MLA kernels and the "
        f"paged-MQA indexer read {PAGE_ROWS}-row pages ({DRAFTER_SWA_ROWS} for a drafter's "
        f"sliding-window cache), but {len(wrong)} DeepSeek-V4.1 "
        f"cache(s) were bound with other page sizes:\n{lines}\n"
        "Serving would fail on the first request or read other layers' rows. The KV-cache "
        "geometry was changed after this fix was applied (another plugin, a different vLLM "
        "build, or a kernel-block split); report this message with `vllm-mla-fixes doctor`."
    )


def check_no_split_drafter(forward_context: dict[str, Any]) -> None:
    """With the split bound, raise :class:`PageGeometryError` if a drafter
    layer owns or reads a ratio-1 cache (its writes would take manager-block
    slots); the geometry decision rules this out, this catches anything that
    bypassed it."""
    layer = drafter_ratio1_layer(forward_context, None)
    if layer is None:
        return
    raise PageGeometryError(
        f"vllm-mla-fixes ({INFO.name}): the interleaved split is bound, but {layer}; "
        "drafter writes to split ratio-1 pages are not translated. "
        f"Set {GEOMETRY_ENV}=per-ratio and report this with `vllm-mla-fixes doctor`."
    )


def _with_geometry_check(original: Callable) -> Callable:
    @functools.wraps(original)
    def bind_kv_cache_to_layers(kv_caches, forward_context, *args, **kwargs):
        result = original(kv_caches, forward_context, *args, **kwargs)
        register_moved_rows_warmup(forward_context)
        if stepped_aside():
            return result  # upstream's own pages, inside the kernels' envelopes
        check_page_geometry(bound_pages(forward_context))
        if _INTERLEAVED:
            check_no_split_drafter(forward_context)
        return result

    return bind_kv_cache_to_layers


SPEC_MERGE_SITES = (
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_configs"),  # 0.32
    ("vllm.v1.core.kv_cache_planning", "get_global_kv_cache_groups"),  # 0.33, 0.34
)
"""Where the engine core merges the workers' KV-cache specs.  vLLM checks
there that every worker built the same spec for a layer with a bare
``assert``, which ``python -O`` removes: the first worker's spec then wins
silently and the others bind caches the planner did not lay out."""


_MERGE_ASSERT_TEXT = "The KV cache specs for the same layer are different"


def specs_geometry(specs: dict[str, Any]) -> str | None:
    """The DeepSeek-V4.1 geometry one worker's KV-cache specs show (from its
    compressed-KV caches' block sizes), or None where it has none."""
    blocks: dict[Any, set[int]] = {}
    split_aligned = True
    for spec in specs.values():
        if getattr(spec, "model_version", None) != "deepseek_v4":
            continue
        if getattr(spec, "sliding_window", None) is not None:
            continue  # the sliding-window cache: 64-token blocks in both geometries
        ratio = getattr(spec, "tokens_per_state", None)
        blocks.setdefault(ratio, set()).add(spec.block_size)
        if ratio == 1 and not isinstance(spec.block_stride_alignment, int):
            split_aligned = False
    if not blocks:
        return None
    if 1 in blocks and split_aligned and all(b == {SPLIT_MANAGER_BLOCK} for b in blocks.values()):
        return SPLIT
    if all(isinstance(r, int) and b == {PAGE_ROWS * r} for r, b in blocks.items()):
        return PER_RATIO
    sizes = ", ".join(f"ratio {r}: {sorted(b)}" for r, b in sorted(blocks.items(), key=str))
    return f"vLLM's own (block sizes {sizes}: the fix is not applied there)"


def check_workers_agree(kv_cache_specs: list[dict[str, Any]]) -> None:
    """Raise :class:`PageGeometryError` when the workers' specs show different
    DeepSeek-V4.1 geometries, naming each with its workers."""
    by_geometry: dict[str, list[int]] = {}
    for worker, specs in enumerate(kv_cache_specs):
        geometry = specs_geometry(specs)
        if geometry is not None:
            by_geometry.setdefault(geometry, []).append(worker)
    if len(by_geometry) < 2:
        return
    found = "; ".join(
        f"worker{'s' if len(workers) > 1 else ''} {', '.join(map(str, workers))}: {geometry}"
        for geometry, workers in by_geometry.items()
    )
    raise PageGeometryError(
        f"vllm-mla-fixes ({INFO.name}): the workers chose different DeepSeek-V4.1 KV-cache "
        f"geometries ({found}), so no one layout fits them all.  Each worker decides "
        f"from its own environment: set {GEOMETRY_ENV} and VLLM_MLA_FIXES alike on every "
        "node, and install vllm-mla-fixes in every node's environment (with Ray, see the "
        "README: 'Ray workers'); each worker logs the geometry it chose and why "
        "('DeepSeek-V4.1 KV geometry ...')."
    )


def _merges_worker_specs(module_name: str, function: str) -> bool:
    """Whether ``module_name.function`` is the reviewed kind of merge site:
    ``(vllm_config, kv_cache_specs, ...)`` with vLLM's per-layer assert."""
    try:
        text, tree = patching.vllm_source(module_name)
    except (TargetMismatch, CannotProbe):
        return False
    node = patching.find_definition(tree, function)
    if not isinstance(node, ast.FunctionDef):
        return False
    params = [arg.arg for arg in node.args.args[:2]]
    source = ast.get_source_segment(text, node) or ""
    return params == ["vllm_config", "kv_cache_specs"] and _MERGE_ASSERT_TEXT in source


def _with_workers_agreeing(original: Callable) -> Callable:
    @functools.wraps(original)
    def merge_worker_specs(vllm_config, kv_cache_specs, *args, **kwargs):
        check_workers_agree(kv_cache_specs)
        return original(vllm_config, kv_cache_specs, *args, **kwargs)

    return merge_worker_specs
