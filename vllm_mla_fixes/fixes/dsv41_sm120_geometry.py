"""dsv41-sm120-geometry: DeepSeek-V4.1 on SM120/SM121 cannot start, or reads the wrong pages.

Upstream:   vllm-project/vllm#59203 (report), #56702 (closed report), #56509 and
            #57292 (open candidate fixes; #56509 starts but every output is
            U+FFFD), flashinfer-ai/flashinfer#5323 (report), #5174 (extra page
            32) and #5244/#5121 (extra page 128) -- all open
Affected:   vLLM 0.32.0 (FlashInfer 0.7.0.post1) and 0.33.0 (FlashInfer 0.7.2.post1)
Fixed in:   open
Hardware:   SM120 (RTX PRO 6000 Blackwell) and SM121 (GB10), where
            FLASHINFER_MLA_SPARSE_DSV41 is the only DeepSeek-V4.1 backend

Why it breaks
    Every compressed-KV cache and every indexer-K cache takes the global
    ``--block-size`` B (``tokens_per_state`` = the layer's compress ratio, so a
    page holds B / ratio states) and the sliding-window cache is hard-wired to
    32-token blocks.  FlashInfer's SM120 sparse-MLA kernels (0.7.0.post1) are
    instantiated for 64-row primary pages only, and SM120's paged-MQA indexer
    kernels take 64 states per page.  Mixed ratios 1 and 2 leave no B that
    works: B=64 fails at start-up in ``select_common_block_size`` ("No common
    block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128]).", both backends
    declare [128]); B=128 starts, but the SWA page is 32 (FlashInfer 0.7.0.post1
    rejects it on the first request: "SM120 sparse-MLA has no decode kernel for
    this shape ... page_block_size=32") and ratio-1 pages hold 128 states.
    #56509 splits 128-token manager blocks into 64-token kernel blocks, but the
    ratio-1 writers keep addressing manager slots while readers use the kernel
    table, so writes land in other layers' pages: garbage, not a crash.

How we fix it
    On SM12x only, each cache gets the block size that makes its page hold 64
    states -- 64 x compress_ratio tokens (ratio-1 caches 64, ratio-2 caches 128)
    and a 64-token sliding-window cache -- declared through the specs, so the
    hybrid KV-cache manager gives each ratio its own block size and every
    writer and reader keeps using one block table per cache (no kernel-block
    splitting).  Both backends declare the matching kernel block size per spec
    (tokens_per_state 1 -> [64], 2 -> [128]; no spec -> upstream's answer).
    The compressed-slot-mapping warm-up also compiles the key of the 64-state
    pages.  A start-up self-check, run when the KV-cache views are bound to the
    layers, raises a clear error naming layer, compress ratio and page size if
    any FlashInfer-bound cache or indexer cache does not have 64-row pages.
    ``--block-size`` no longer decides these caches' pages on SM12x; 64 and 128
    both start.  SM90/SM100 and every other platform see no change.

Remove when
    vLLM chooses per-ratio block sizes on SM12x itself (the probe reports
    not-needed once the targets change), or FlashInfer and DeepGEMM accept
    every page the default geometry produces and vLLM's backends say so.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

from vllm_mla_fixes import patching
from vllm_mla_fixes.patching import CannotProbe, FixInfo, Patch, TargetMismatch

INFO = FixInfo(
    name="dsv41-sm120-geometry",
    summary="DeepSeek-V4.1 on SM120/SM121 (FLASHINFER_MLA_SPARSE_DSV41): --block-size 64 fails "
            "'No common block size', 128 hands FlashInfer 32-token SWA pages and the indexer "
            "128-state ratio-1 pages; fixed with per-ratio blocks so every page holds 64 states",
    upstream=("vllm#59203", "vllm#56702", "vllm#56509", "vllm#57292",
              "flashinfer#5323", "flashinfer#5174", "flashinfer#5244"),
    affected=">=0.32.0.dev0,<0.34.0",
    affected_releases=("0.32.0", "0.33.0"),
    fixed_in=None,
    hardware="SM120, SM121 (FLASHINFER_MLA_SPARSE_DSV41)",
    error="ValueError: No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128]).",
    workarounds=(
        "none upstream: --block-size 128 starts, but FlashInfer 0.7.0.post1 then rejects the "
        "32-token sliding-window page on the first request ('page_block_size=32')",
        "PR #56509 (kernel blocks of 64 inside 128-token blocks) starts but produces U+FFFD: "
        "do not serve with it",
    ),
)

PAGE_ROWS = 64
"""States per page that FlashInfer's SM120 sparse-MLA kernels (primary page) and
SM120's paged-MQA indexer kernels take."""

UPSTREAM_SWA_BLOCK = 32
FLASHINFER_BACKEND = "FLASHINFER_MLA_SPARSE_DSV41"

ATTENTION_MODULE = "vllm.models.deepseek_v41.attention"
FLASHINFER_MODULE = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
INDEXER_MODULE = "vllm.v1.attention.backends.mla.indexer"
SWA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
WARMUP_MODULE = "vllm.v1.attention.backends.mla.compressor_utils"
WORKER_UTILS_MODULE = "vllm.v1.worker.utils"

# Reviewed code, by (module, qualified name): fingerprint -> releases.  The
# fix wraps or relies on exactly these definitions; anything else is a
# TargetMismatch and vLLM stays untouched.
REVIEWED: dict[tuple[str, str], dict[str, str]] = {
    (ATTENTION_MODULE, "DeepseekV4Attention.get_kv_cache_spec"): {"80626492cbc4d6b0": "0.32.0, 0.33.0"},
    (ATTENTION_MODULE, "DeepseekV4IndexerCache.get_kv_cache_spec"): {"0ef5dfb296bbfb3b": "0.32.0", "f47d3ccf7860b805": "0.33.0"},
    (FLASHINFER_MODULE, "DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes"): {"d6dc7a2839ed5309": "0.32.0, 0.33.0"},
    (FLASHINFER_MODULE, "DeepseekV4FlashInferSM120Attention._forward_decode"): {"ead22506b9bf0f0a": "0.32.0, 0.33.0"},
    (FLASHINFER_MODULE, "DeepseekV4FlashInferSM120Attention._forward_prefill"): {"1b6cfe48f45705bf": "0.32.0, 0.33.0"},
    (INDEXER_MODULE, "DeepseekV41IndexerBackend.get_supported_kernel_block_sizes"): {"3ee73f2582cb00c7": "0.32.0, 0.33.0"},
    (SWA_MODULE, "DeepseekV4SWACache.__init__"): {"73b7aedf34908917": "0.32.0", "71449ccde4274966": "0.33.0"},
    (SWA_MODULE, "DeepseekV4SWACache.get_kv_cache_spec"): {"f513952670f9bf38": "0.32.0", "753bd30916d94e25": "0.33.0"},
    (WARMUP_MODULE, "CompressedSlotMappingKernel.get_warmup_keys"): {"216e302a557266f9": "0.32.0", "776a353d46e2e7b3": "0.33.0"},
    (WORKER_UTILS_MODULE, "bind_kv_cache_to_layers"): {"999feba03e12db36": "0.32.0, 0.33.0"},
}


class PageGeometryError(ValueError):
    """A DeepSeek-V4.1 cache reaches FlashInfer or the indexer with pages of
    the wrong size (raised by the start-up self-check)."""


# --------------------------------------------------------------------------- gate

def _check_swa_call_site() -> None:
    """``DeepseekV4Attention.__init__`` builds its SWA cache through the module
    name ``DeepseekV4SWACache`` with ``block_size=32`` -- the call the fix
    redirects -- exactly once."""
    _, tree = patching.vllm_source(ATTENTION_MODULE)
    init = patching.find_definition(tree, "DeepseekV4Attention.__init__")
    if init is None:
        raise TargetMismatch("DeepseekV4Attention.__init__ does not exist")
    calls = [node for node in ast.walk(init) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "DeepseekV4SWACache"]
    blocks = [kw.value.value for call in calls for kw in call.keywords
              if kw.arg == "block_size" and isinstance(kw.value, ast.Constant)]
    if len(calls) != 1 or blocks != [UPSTREAM_SWA_BLOCK]:
        raise TargetMismatch(
            "DeepseekV4Attention.__init__ no longer builds exactly one DeepseekV4SWACache "
            f"with block_size={UPSTREAM_SWA_BLOCK}")


def device_capability() -> tuple[int, int]:
    """The CUDA device capability vLLM's platform reports (NVML; no CUDA init).

    Raises :class:`CannotProbe` where there is no CUDA platform with a device."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # pragma: no cover - vLLM broken
        raise CannotProbe(f"vllm.platforms failed to import: {type(exc).__name__}: {exc}") from exc
    if not current_platform.is_cuda():
        raise _NotCuda(type(current_platform).__name__)
    capability = current_platform.get_device_capability()
    if capability is None:
        raise CannotProbe("the CUDA platform reports no device capability")
    return int(capability.major), int(capability.minor)


class _NotCuda(Exception):
    pass


def probe(capability: tuple[int, int] | None = None) -> str | None:
    """None when the installed vLLM carries the bug on this device.

    ``capability`` (major, minor) replaces the device query.  Tests on CPU pass
    it: vLLM's platform machinery has no honest way to stand for an SM120
    device without one (``CudaPlatform`` asks NVML), and the patched code paths
    themselves never consult the capability, so driving them on CPU after
    ``probe((12, 0))`` exercises exactly what runs on SM120.
    """
    if capability is None:
        try:
            capability = device_capability()
        except _NotCuda as exc:
            return f"not a CUDA platform ({exc}); the geometry is SM12x-only"
    major, minor = capability
    if major != 12:
        return (f"SM{major}{minor}: the page geometry is wrong only on SM12x; "
                "this device keeps vLLM's block sizes")
    for (module, qualname), known in REVIEWED.items():
        patching.require_fingerprint(module, qualname, known)
    _check_swa_call_site()
    return None


# ------------------------------------------------------------------ replacements

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


def _wrap_spec_producer(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        return None if spec is None else per_ratio_spec(spec)

    get_kv_cache_spec.__wrapped_by__ = INFO.name  # type: ignore[attr-defined]
    return get_kv_cache_spec


def _per_spec_kernel_block_sizes(original: Callable) -> staticmethod:
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        if kv_cache_spec is None:
            # Platform-level block-size choice: no cache in view, keep upstream's answer.
            return original(kv_cache_spec)
        states = getattr(kv_cache_spec, "tokens_per_state", None)
        if isinstance(states, int) and states >= 1:
            return [PAGE_ROWS * states]
        return original(kv_cache_spec)

    get_supported_kernel_block_sizes.__wrapped__ = original  # type: ignore[attr-defined]
    return staticmethod(get_supported_kernel_block_sizes)


def _swa_cache_with_64_token_blocks(cache_class: type) -> Callable:
    """Stands in for the class name inside ``deepseek_v41.attention`` only, so
    DeepSeek-V4.0 (which shares the class) is not touched."""
    def build_swa_cache(*args, **kwargs):
        if kwargs.get("block_size") == UPSTREAM_SWA_BLOCK:
            kwargs["block_size"] = PAGE_ROWS
        return cache_class(*args, **kwargs)

    build_swa_cache.__wrapped__ = cache_class  # type: ignore[attr-defined]
    return build_swa_cache


def _warmup_keys_with_64_state_pages(original: Callable) -> Callable:
    """Also warm the compressed-slot-mapping kernel for the block size it
    really sees (the states per page, 64), not ``--block-size // ratio``."""
    @functools.wraps(original)
    def get_warmup_keys(self, vllm_config):
        keys = list(original(self, vllm_config))
        extra = [self.dispatch(compress_ratio=key.compress_ratio, block_size=PAGE_ROWS,
                               dcp_world_size=key.dcp_world_size,
                               cp_interleave=key.cp_interleave)
                 for key in keys]
        return list(dict.fromkeys([*keys, *extra]))

    return get_warmup_keys


# -------------------------------------------------------------- start-up check

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
                pages.append(CachePage(swa.prefix, "sliding-window KV", 0, int(swa.kv_cache.shape[-2])))
            if layer.is_kv_source and layer.kv_cache.numel():
                pages.append(CachePage(name, "compressed KV", layer.compress_ratio,
                                       int(layer.kv_cache.shape[-2])))
        elif isinstance(layer, attention.DeepseekV4IndexerCache) and layer.kv_cache.numel():
            pages.append(CachePage(name, "indexer K", layer.compress_ratio, int(layer.kv_cache.shape[-2])))
    return pages


def check_page_geometry(pages: Iterable[CachePage]) -> None:
    """Raise :class:`PageGeometryError` unless every page holds 64 states."""
    wrong = [page for page in pages if page.rows != PAGE_ROWS]
    if not wrong:
        return
    lines = "\n".join(
        f"  {page.layer}: {page.kind} cache, compress ratio {page.compress_ratio}, "
        f"{page.rows}-{'state' if page.kind == 'indexer K' else 'token'} pages"
        for page in wrong)
    raise PageGeometryError(
        f"vllm-mla-fixes ({INFO.name}): on SM12x, FlashInfer's sparse-MLA kernels and the "
        f"paged-MQA indexer read {PAGE_ROWS}-row pages, but {len(wrong)} DeepSeek-V4.1 "
        f"cache(s) were bound with other page sizes:\n{lines}\n"
        "Serving would fail on the first request or read other layers' rows. The KV-cache "
        "geometry was changed after this fix was applied (another plugin, a different vLLM "
        "build, or a kernel-block split); report this message with `vllm-mla-fixes doctor`.")


def _with_geometry_check(original: Callable) -> Callable:
    @functools.wraps(original)
    def bind_kv_cache_to_layers(kv_caches, forward_context, *args, **kwargs):
        result = original(kv_caches, forward_context, *args, **kwargs)
        check_page_geometry(bound_pages(forward_context))
        return result

    return bind_kv_cache_to_layers


# ------------------------------------------------------------------------ apply

def apply(patch: Patch) -> None:
    def on_attention(module) -> None:
        for cls in (module.DeepseekV4Attention, module.DeepseekV4IndexerCache):
            patch.replace(cls, "get_kv_cache_spec", _wrap_spec_producer(cls.__dict__["get_kv_cache_spec"]))
        patch.replace(module, "DeepseekV4SWACache", _swa_cache_with_64_token_blocks(module.DeepseekV4SWACache))

    def on_flashinfer(module) -> None:
        backend = module.DeepseekV4FlashInferMLASparseBackend
        patch.replace(backend, "get_supported_kernel_block_sizes",
                      _per_spec_kernel_block_sizes(backend.get_supported_kernel_block_sizes))

    def on_indexer(module) -> None:
        backend = module.DeepseekV41IndexerBackend
        patch.replace(backend, "get_supported_kernel_block_sizes",
                      _per_spec_kernel_block_sizes(backend.get_supported_kernel_block_sizes))

    def on_warmup(module) -> None:
        kernel = module.CompressedSlotMappingKernel
        patch.replace(kernel, "get_warmup_keys", _warmup_keys_with_64_state_pages(kernel.__dict__["get_warmup_keys"]))

    def on_worker_utils(module) -> None:
        patch.replace_function(module, "bind_kv_cache_to_layers",
                               _with_geometry_check(module.bind_kv_cache_to_layers))

    patch.when_imported(ATTENTION_MODULE, on_attention)
    patch.when_imported(FLASHINFER_MODULE, on_flashinfer)
    patch.when_imported(INDEXER_MODULE, on_indexer)
    patch.when_imported(WARMUP_MODULE, on_warmup)
    patch.when_imported(WORKER_UTILS_MODULE, on_worker_utils)


def for_capability(capability: tuple[int, int]):
    """This fix as a module-like object whose probe sees ``capability`` -- for
    :func:`vllm_mla_fixes.patching.run_fix` in tests and ``verify`` on CPU."""
    import types

    return types.SimpleNamespace(INFO=INFO, probe=functools.partial(probe, capability), apply=apply)
