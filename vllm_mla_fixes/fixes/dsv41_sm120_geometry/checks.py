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
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import Decision
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    DRAFTER_SWA_ROWS,
    FLASHINFER_BACKEND,
    GEOMETRY_ENV,
    INFO,
    PAGE_ROWS,
    SPLIT_MANAGER_BLOCK,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind, Geometry
from vllm_mla_fixes.patching import CannotProbe, TargetMismatch


@dataclasses.dataclass(frozen=True)
class CachePage:
    layer: str
    kind: CacheKind
    compress_ratio: int
    rows: int  # tokens (states) per page as the kernel sees it
    owner: object = dataclasses.field(default=None, compare=False, repr=False)  # the bound layer


def bound_pages(forward_context: dict[str, object]) -> list[CachePage]:
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
                    CachePage(
                        swa.prefix, CacheKind.SLIDING_WINDOW, 0, int(swa.kv_cache.shape[-2]), swa
                    )
                )
            if layer.is_kv_source and layer.kv_cache.numel():
                pages.append(
                    CachePage(
                        name,
                        CacheKind.COMPRESSED,
                        layer.compress_ratio,
                        int(layer.kv_cache.shape[-2]),
                        layer,
                    )
                )
        elif isinstance(layer, attention.DeepseekV4IndexerCache) and layer.kv_cache.numel():
            pages.append(
                CachePage(
                    name,
                    CacheKind.INDEXER,
                    layer.compress_ratio,
                    int(layer.kv_cache.shape[-2]),
                    layer,
                )
            )
    return pages


def expected_rows(page: CachePage) -> int | None:
    """Rows the fix gave this page's layer (64; 128 for a drafter's
    sliding-window pages where its engine's decision says so), or None for a
    layer the fix laid out nothing for (upstream's own layout)."""
    return None if page.owner is None else STATE.page_rows.get(page.owner)


def check_page_geometry(pages: Iterable[CachePage], everything: bool = False) -> None:
    """Raise :class:`PageGeometryError` unless every page the fix laid out
    holds the states it gave it; ``everything``: hold every page to the
    fix's 64 rows (128 for the sliding-window pages the fix gave 128)."""
    wrong = []
    for page in pages:
        expected = expected_rows(page)
        if expected is None and everything:
            expected = PAGE_ROWS
        if expected is not None and page.rows != expected:
            wrong.append(page)
    if not wrong:
        return
    lines = "\n".join(
        f"  {page.layer}: {page.kind} cache, compress ratio {page.compress_ratio}, "
        f"{page.rows}-{'state' if page.kind is CacheKind.INDEXER else 'token'} pages"
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


def drafter_ratio1_layer(forward_context: dict[str, object]) -> str | None:
    """The first drafter layer (marked ``is_draft_layer`` by vLLM's
    speculator) that owns or reads a ratio-1 compressed or indexer cache,
    described, or None."""
    attention = sys.modules.get(ATTENTION_MODULE)
    if attention is None:
        return None
    for name, layer in forward_context.items():
        if not getattr(layer, "is_draft_layer", False):
            continue
        if isinstance(layer, attention.DeepseekV4IndexerCache) and layer.compress_ratio == 1:
            return f"{name} (drafter indexer cache, compress ratio 1)"
        if isinstance(layer, attention.DeepseekV4Attention) and layer.compress_ratio == 1:
            role = "owns" if layer.is_kv_source else "reads"
            return f"{name} (drafter layer that {role} a ratio-1 compressed cache)"
    return None


def check_no_split_drafter(forward_context: dict[str, object]) -> None:
    """With the split bound, raise :class:`PageGeometryError` if a drafter
    layer owns or reads a ratio-1 cache (its writes would take manager-block
    slots); the geometry decision rules this out, this catches anything that
    bypassed it."""
    layer = drafter_ratio1_layer(forward_context)
    if layer is None:
        return
    raise PageGeometryError(
        f"vllm-mla-fixes ({INFO.name}): the interleaved split is bound, but {layer}; "
        "drafter writes to split ratio-1 pages are not translated. "
        f"Set {GEOMETRY_ENV}=per-ratio and report this with `vllm-mla-fixes doctor`."
    )


def with_geometry_check(original: Callable[..., object]) -> Callable[..., object]:
    @functools.wraps(original)
    def bind_kv_cache_to_layers(
        kv_caches: object, forward_context: dict[str, object], *args: object, **kwargs: object
    ) -> object:
        result = original(kv_caches, forward_context, *args, **kwargs)
        check_page_geometry(bound_pages(forward_context))
        if any(layer in STATE.split_layers for layer in forward_context.values()):
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
    blocks: dict[object, set[int]] = {}
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
        return Geometry.SPLIT.value
    if all(isinstance(r, int) and b == {PAGE_ROWS * r} for r, b in blocks.items()):
        return Geometry.PER_RATIO.value
    sizes = ", ".join(f"ratio {r}: {sorted(b)}" for r, b in sorted(blocks.items(), key=str))
    return f"vLLM's own (block sizes {sizes}: the fix is not applied there)"


def expected_block(decision: Decision, tokens_per_state: int) -> int | None:
    """The block size a compressed-KV or indexer-K spec has under ``decision``
    (None where upstream's layout could not be read)."""
    if decision.geometry is Geometry.SPLIT:
        return SPLIT_MANAGER_BLOCK
    if decision.geometry is Geometry.PER_RATIO:
        return PAGE_ROWS * tokens_per_state
    return None if decision.upstream is None else decision.upstream.block_size


def _laid_out_otherwise(decision: Decision, specs: dict[str, Any]) -> list[str]:
    """The compressed-KV and indexer-K specs of one worker that ``decision``
    does not lay out so, each named with what it has and should have."""
    wrong = []
    for name, spec in specs.items():
        if getattr(spec, "model_version", None) != "deepseek_v4":
            continue
        if getattr(spec, "sliding_window", None) is not None:
            continue  # the sliding-window cache's rows are the layer's own
        states = getattr(spec, "tokens_per_state", None)
        if not isinstance(states, int):
            continue
        block = expected_block(decision, states)
        if block is not None and spec.block_size != block:
            wrong.append(f"{name}: {spec.block_size}-token blocks, not {block}")
        elif (
            decision.geometry is Geometry.SPLIT
            and states == 1
            and not (
                isinstance(spec.block_stride_alignment, int)
                and spec.block_stride_alignment % decision.unit == 0
            )
        ):
            wrong.append(f"{name}: no block stride of whole {decision.unit}-B interleave units")
    return wrong


def check_workers_agree(vllm_config: object, kv_cache_specs: list[dict[str, object]]) -> None:
    """Raise :class:`PageGeometryError` unless every worker's specs lay out
    the engine's decision -- the same pure function of the same engine
    config as each worker's -- naming each worker that does not and what its
    specs show.  Pipeline ranks hold different layers; each is held to the
    one decision, never to another rank."""
    decision = STATE.decision_for(vllm_config)
    found = []
    for worker, specs in enumerate(kv_cache_specs):
        wrong = _laid_out_otherwise(decision, specs)
        if wrong:
            shown = specs_geometry(specs)
            found.append(f"worker {worker} shows {shown} ({'; '.join(wrong[:3])})")
    if not found:
        return
    raise PageGeometryError(
        f"vllm-mla-fixes ({INFO.name}): the engine's DeepSeek-V4.1 KV geometry is "
        f"{decision.geometry.value}, but {'; '.join(found)}, so no one layout fits them all.  "
        "The decision is the same function of the engine config and the installed kernels "
        "in every process, so those workers read something else: set VLLM_MLA_FIXES and "
        f"{GEOMETRY_ENV} alike on every node, and install the same vllm-mla-fixes, vLLM, "
        "FlashInfer and DeepGEMM builds in every node's environment (with Ray, see the "
        "README: 'Ray workers'); each worker logs the geometry it chose and why "
        "('DeepSeek-V4.1 KV geometry ...')."
    )


def merges_worker_specs(module_name: str, function: str) -> bool:
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


def with_workers_agreeing(original: Callable[..., object]) -> Callable[..., object]:
    @functools.wraps(original)
    def merge_worker_specs(
        vllm_config: object,
        kv_cache_specs: list[dict[str, object]],
        *args: object,
        **kwargs: object,
    ) -> object:
        check_workers_agree(vllm_config, kv_cache_specs)
        return original(vllm_config, kv_cache_specs, *args, **kwargs)

    return merge_worker_specs
