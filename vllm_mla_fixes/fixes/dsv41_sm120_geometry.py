"""dsv41-sm120-geometry: DeepSeek-V4.1 on SM120/SM121 cannot start, or reads the wrong pages.

Upstream:   vllm-project/vllm#59203 (report), #56702 (closed report), #56509 and
            #57292 (open candidate fixes; #56509 starts but every output is
            U+FFFD), flashinfer-ai/flashinfer#5323 (report), #5174 (extra page
            32) and #5244/#5121 (extra page 128) -- all open
Affected:   vLLM 0.32.0 (FlashInfer 0.7.0.post1), 0.33.0 (FlashInfer 0.7.2.post1) and
            0.34.0 (pins FlashInfer 0.7.3); 0.30.0/0.31.0 carry it but are not covered
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
    0.34.0 declares 64-token kernel blocks on SM12x: --block-size 64 then starts
    with 32-state ratio-2 pages and 32-token SWA pages, and 128 fails at
    start-up ("... needs 64-token kernel blocks, which packed 128-token KV cache
    blocks cannot be split into").

How we fix it
    On SM12x only, every page FlashInfer or the indexer reads holds 64 states,
    the sliding-window cache gets 64-token blocks, and both backends declare
    the kernel block size per spec (tokens_per_state 1 -> [64], 2 -> [128]; no
    spec -> upstream's answer).  Two geometries deliver that; which one is in
    force is decided per engine configuration (:func:`geometry_decision`),
    logged once, and reported by ``status``:

    interleaved-split (default)
        Every compressed-KV and indexer-K cache keeps 128-token manager blocks
        in the one packed group (ratio-2 pages: 64 states, not split).  The
        ratio-1 compressed/indexer pair (128 states per block) is split into
        64-state kernel pages that interleave: each unit is one compressed
        kernel page followed by one indexer kernel page (46,080 B for the V4
        584-B record; derived from the real pair of page sizes), the block
        stride is a multiple of the unit, and each ratio-1 cache is bound as a
        strided view with the unit as page stride.  The ratio-1 writers get
        kernel-block slots: when an attention group hands its builders the
        kernel block table, it also hands them ``ktable[req, pos // 64] * 64 +
        pos % 64``, computed elementwise from the manager slot into persistent
        per-builder buffers (no allocation or host sync per step; stable
        addresses for CUDA graphs).  Zeroing a newly allocated block clears
        the block's whole pair region (both caches' interleaved pages), and a
        prefix-cache block copy copies that region whole, also on vLLM's
        per-cache copy path.  vLLM's planner then holds 1.118x the
        tokens of upstream's --block-size 128 layout at 8k and 1.042x at 128k.
        A DSpark drafter's sliding-window caches (layers numbered past the
        backbone) get 128-token pages where FlashInfer's own envelope takes
        run-time page sizes (0.7.2.post1 on), so its three layers share one
        KV-cache group instead of opening another 64-token one: 1.051x /
        1.019x of upstream with the same drafter (0.993x / 0.997x on
        FlashInfer 0.7.0.post1, where they keep 64 rows: putting two 64-row
        kernel pages in a 128-token drafter block would need the drafter's own
        slot mappings translated, and DSpark computes those in its own kernel
        and replays them in FULL graphs, past any metadata-build hook).
    per-ratio (fallback)
        Each cache gets ``64 x compress_ratio``-token blocks (ratio-1 64,
        ratio-2 128), so the hybrid manager gives each ratio its own group and
        no block is split (0.88x / 0.65x of upstream's capacity).  Used where
        the split is not proven safe: a speculative method other than DSpark
        (whose drafter layers hold no ratio-1 cache), ngram or suffix; a KV
        connector other than vLLM's CPU offloading one (which moves whole
        packed blocks); DCP/PCP > 1, HiSparse, a KV record other than the V4
        fp8_ds_mla one with the fp8 indexer row, a model whose ratio-1 caches
        do not pair up, a split target whose source was not reviewed, or
        ``VLLM_MLA_FIXES_DSV41_GEOMETRY=per-ratio``.

    The compressed-slot-mapping warm-up also compiles the key of the 64-state
    pages, for the ratios of the caches the fix made.  Only the fix's own
    backends, caches and specs are touched, so other models on SM12x see no
    change.  Workers whose specs show different geometries stop the engine
    core with an error naming each (vLLM's own check is an ``assert``).  A start-up self-check, run when the KV-cache views are bound to the
    layers, raises a clear error naming layer, compress ratio and page size if
    any FlashInfer-bound cache or indexer cache does not have 64-row pages.
    ``--block-size`` no longer decides these caches' pages on SM12x; 64 and 128
    both start.  SM90/SM100 and every other platform see no change.

Remove when
    vLLM chooses 64-state pages on SM12x itself (the probe reports not-needed
    once the targets change), or FlashInfer and DeepGEMM accept every page the
    default geometry produces and vLLM's backends say so.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from vllm_mla_fixes import patching
from vllm_mla_fixes.patching import CannotProbe, FixInfo, Patch, TargetMismatch

INFO = FixInfo(
    name="dsv41-sm120-geometry",
    summary="DeepSeek-V4.1 on SM120/SM121 (FLASHINFER_MLA_SPARSE_DSV41): --block-size 64 fails "
    "'No common block size', 128 hands FlashInfer 32-token SWA pages and the indexer "
    "128-state ratio-1 pages; fixed so every page holds 64 states, by default with 128-token "
    "blocks and interleaved 64-state ratio-1 kernel pages (more KV capacity than upstream), "
    "else per-ratio blocks",
    upstream=(
        "vllm#59203",
        "vllm#56702",
        "vllm#56509",
        "vllm#57292",
        "flashinfer#5323",
        "flashinfer#5174",
        "flashinfer#5244",
    ),
    affected=">=0.32.0.dev0,<=0.34.0",
    affected_releases=("0.32.0", "0.33.0", "0.34.0"),
    fixed_in=None,
    newest_reviewed="0.34.0",
    hardware="SM120, SM121 (FLASHINFER_MLA_SPARSE_DSV41)",
    error="ValueError: No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128]).",
    workarounds=(
        "none upstream: --block-size 128 starts, but FlashInfer 0.7.0.post1 then rejects the "
        "32-token sliding-window page on the first request ('page_block_size=32')",
        "PR #56509 (kernel blocks of 64 inside 128-token blocks) starts but produces U+FFFD: "
        "do not serve with it",
    ),
    not_covered=(
        patching.NotCovered(
            ">=0.30.0.dev0,<0.32.0.dev0",
            ("0.30.0", "0.31.0"),
            "0.30/0.31 choose kernel block sizes through a different API, which this fix does not wrap",
        ),
    ),
)

PAGE_ROWS = 64
"""States per page that FlashInfer's SM120 sparse-MLA kernels (primary page) and
SM120's paged-MQA indexer kernels take."""

SPLIT_MANAGER_BLOCK = 2 * PAGE_ROWS
"""Tokens per manager block of every compressed/indexer cache under the split:
64 states at ratio 2, two 64-state kernel pages at ratio 1."""

DRAFTER_SWA_ROWS = 2 * PAGE_ROWS
"""Tokens per sliding-window page of a drafter layer (DSpark's three are
sliding-window only), where the installed FlashInfer takes the primary page
size at run time (0.7.2.post1, 0.33.0's pin, and later).  vLLM charges every
sliding-window group (window - 1 + in-flight tokens) / block size blocks per
request whatever its layer count, and the backbone's 40 sliding-window layers
fill seven 64-token groups of six; three drafter layers more would open an
eighth.  At 128 tokens they share one group of half the cost, and the split
holds more tokens than upstream with DSpark too."""

DRAFTER_SWA_ENV = "VLLM_MLA_FIXES_DSV41_DRAFTER_SWA_ROWS"
"""Set to 64 to keep drafter sliding-window pages at 64 rows (should a
FlashInfer build refuse 128-row pages that its envelope lists)."""

UPSTREAM_SWA_BLOCK = 32
FLASHINFER_BACKEND = "FLASHINFER_MLA_SPARSE_DSV41"
INDEXER_BACKEND = "DEEPSEEK_V41_INDEXER"
V4_RECORD_BYTES = 584  # the fp8_ds_mla V4 record SM120 uses (the split was proven on it)
FP8_INDEXER_ROW = 132  # 128 fp8 + one fp32 scale

SPLIT = "interleaved-split"
PER_RATIO = "per-ratio"
GEOMETRY_ENV = "VLLM_MLA_FIXES_DSV41_GEOMETRY"

ATTENTION_MODULE = "vllm.models.deepseek_v41.attention"
FLASHINFER_MODULE = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
INDEXER_MODULE = "vllm.v1.attention.backends.mla.indexer"
SWA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
WARMUP_MODULE = "vllm.v1.attention.backends.mla.compressor_utils"
WORKER_UTILS_MODULE = "vllm.v1.worker.utils"
SPARSE_MLA_MODULE = "vllm.models.deepseek_v41.sparse_mla"
COMPRESSOR_MODULE = "vllm.models.deepseek_v41.compressor"

# Reviewed code, by (module, qualified name): fingerprint -> releases.  The
# fix wraps or relies on exactly these definitions; anything else is a
# TargetMismatch and vLLM stays untouched.
REVIEWED: dict[tuple[str, str], dict[str, str]] = {
    (ATTENTION_MODULE, "DeepseekV4Attention.get_kv_cache_spec"): {
        "80626492cbc4d6b0": "0.32.0, 0.33.0, 0.34.0"
    },
    (ATTENTION_MODULE, "DeepseekV4IndexerCache.get_kv_cache_spec"): {
        "0ef5dfb296bbfb3b": "0.32.0",
        "f47d3ccf7860b805": "0.33.0, 0.34.0",
    },
    (FLASHINFER_MODULE, "DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes"): {
        "d6dc7a2839ed5309": "0.32.0, 0.33.0",
        "544fde42b12dfc4a": "0.34.0",
    },
    (FLASHINFER_MODULE, "DeepseekV4FlashInferSM120Attention._forward_decode"): {
        "ead22506b9bf0f0a": "0.32.0, 0.33.0, 0.34.0"
    },
    (FLASHINFER_MODULE, "DeepseekV4FlashInferSM120Attention._forward_prefill"): {
        "1b6cfe48f45705bf": "0.32.0, 0.33.0, 0.34.0"
    },
    (INDEXER_MODULE, "DeepseekV41IndexerBackend.get_supported_kernel_block_sizes"): {
        "3ee73f2582cb00c7": "0.32.0, 0.33.0",
        "b0712154722b009f": "0.34.0",
    },
    (SWA_MODULE, "DeepseekV4SWACache.__init__"): {
        "73b7aedf34908917": "0.32.0",
        "71449ccde4274966": "0.33.0, 0.34.0",
    },
    (SWA_MODULE, "DeepseekV4SWACache.get_kv_cache_spec"): {
        "f513952670f9bf38": "0.32.0",
        "753bd30916d94e25": "0.33.0, 0.34.0",
    },
    (WARMUP_MODULE, "CompressedSlotMappingKernel.get_warmup_keys"): {
        "216e302a557266f9": "0.32.0",
        "776a353d46e2e7b3": "0.33.0, 0.34.0",
    },
    (WORKER_UTILS_MODULE, "bind_kv_cache_to_layers"): {
        "999feba03e12db36": "0.32.0, 0.33.0",
        "70806dab17e278c2": "0.34.0",
    },
    # The interleaved split replaces or relies on these as well (SPLIT_TARGETS).
    (WORKER_UTILS_MODULE, "map_kv_caches_to_kernel_blocks"): {
        "afea4079dd113fc9": "0.32.0, 0.33.0, 0.34.0"
    },
    (WORKER_UTILS_MODULE, "AttentionGroup._with_kernel_block_table"): {
        "840b1d99ab0f763f": "0.32.0, 0.33.0, 0.34.0"
    },
    (WORKER_UTILS_MODULE, "AttentionGroup.map_kv_cache_to_manager_blocks"): {
        "adaa4142305eed54": "0.32.0, 0.33.0, 0.34.0"
    },
    (WORKER_UTILS_MODULE, "AttentionGroup.map_to_kernel_block_table"): {
        "cc9a2dd5a6626db7": "0.32.0, 0.33.0, 0.34.0"
    },
    (WORKER_UTILS_MODULE, "AttentionGroup.create_metadata_builders"): {
        "b295cd3635ff4ac7": "0.32.0, 0.33.0, 0.34.0"
    },
    (SPARSE_MLA_MODULE, "DeepseekV4SparseMLAMetadataBuilder.build"): {
        "eb3a874718c6b296": "0.32.0",
        "2cda0476ce889793": "0.33.0, 0.34.0",
    },
    (INDEXER_MODULE, "DeepseekV32IndexerMetadataBuilder.build"): {
        "b0d2cbc0ce1ba697": "0.32.0",
        "618f410d0514a898": "0.33.0",
        "3c64753715ca1bdd": "0.34.0",
    },
    (COMPRESSOR_MODULE, "DeepseekCompressor.insert_cache"): {
        "15beaa9c9e75793c": "0.32.0, 0.33.0, 0.34.0"
    },
    (WORKER_UTILS_MODULE, "copy_kv_cache_blocks_inplace"): {
        "26096f415bb6708b": "0.32.0, 0.33.0",
        "b7aad7fe8a2aaf0c": "0.34.0",
    },
}

SPLIT_TARGETS = frozenset(
    {
        # replaced: the ratio-1 kernel views, and the kernel slots handed to builders
        (WORKER_UTILS_MODULE, "map_kv_caches_to_kernel_blocks"),
        (WORKER_UTILS_MODULE, "AttentionGroup._with_kernel_block_table"),
        (WORKER_UTILS_MODULE, "AttentionGroup.map_kv_cache_to_manager_blocks"),
        # wrapped: prefix-cache block copies see each ratio-1 pair region whole
        (WORKER_UTILS_MODULE, "copy_kv_cache_blocks_inplace"),
        # relied on: kernel block j of block b is b * kernel_block_stride + j; the
        # builders' kernel block size; ratio-1 writers take the builder's
        # ``cm.slot_mapping`` (sparse-MLA and indexer builders, compressor insert)
        (WORKER_UTILS_MODULE, "AttentionGroup.map_to_kernel_block_table"),
        (WORKER_UTILS_MODULE, "AttentionGroup.create_metadata_builders"),
        (SPARSE_MLA_MODULE, "DeepseekV4SparseMLAMetadataBuilder.build"),
        (INDEXER_MODULE, "DeepseekV32IndexerMetadataBuilder.build"),
        (COMPRESSOR_MODULE, "DeepseekCompressor.insert_cache"),
    }
)
"""The definitions only the interleaved split needs: where one of them is not
the reviewed code, the fix still applies, with the per-ratio geometry."""


class PageGeometryError(ValueError):
    """A DeepSeek-V4.1 cache reaches FlashInfer or the indexer with pages of
    the wrong size, or the packed block cannot hold the interleaved pages
    (raised at start-up, before any request)."""


# --------------------------------------------------------------------------- gate


def _check_swa_call_site() -> None:
    """``DeepseekV4Attention.__init__`` builds its SWA cache through the module
    name ``DeepseekV4SWACache`` with ``block_size=32`` -- the call the fix
    redirects -- exactly once."""
    _, tree = patching.vllm_source(ATTENTION_MODULE)
    init = patching.find_definition(tree, "DeepseekV4Attention.__init__")
    if init is None:
        raise TargetMismatch("DeepseekV4Attention.__init__ does not exist")
    calls = [
        node
        for node in ast.walk(init)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "DeepseekV4SWACache"
    ]
    blocks = [
        kw.value.value
        for call in calls
        for kw in call.keywords
        if kw.arg == "block_size" and isinstance(kw.value, ast.Constant)
    ]
    if len(calls) != 1 or blocks != [UPSTREAM_SWA_BLOCK]:
        raise TargetMismatch(
            "DeepseekV4Attention.__init__ no longer builds exactly one DeepseekV4SWACache "
            f"with block_size={UPSTREAM_SWA_BLOCK}"
        )


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
        return (
            f"SM{major}{minor}: the page geometry is wrong only on SM12x; "
            "this device keeps vLLM's block sizes"
        )
    from vllm_mla_fixes.screen_cache import cached_screen  # parsing vLLM costs each process ~0.1 s

    return cached_screen(sys.modules[__name__], source_screen)


def source_screen() -> None:
    """The probe's source checks (no import): every reviewed definition of
    the per-ratio geometry and the SWA call site are the reviewed code, else
    :class:`TargetMismatch`.  The split's own targets are screened separately
    (:func:`split_unreviewed`): a mismatch there only selects the fallback."""
    for (module, qualname), known in REVIEWED.items():
        if (module, qualname) not in SPLIT_TARGETS:
            patching.require_fingerprint(module, qualname, known)
    _check_swa_call_site()


def split_unreviewed() -> str | None:
    """Why the interleaved split cannot be used with the installed vLLM (one
    of its targets is not the reviewed code), or None."""
    for key in sorted(SPLIT_TARGETS):
        try:
            patching.require_fingerprint(*key, REVIEWED[key])
        except (TargetMismatch, CannotProbe) as exc:
            return f"the interleaved split is not reviewed for this vLLM ({exc})"
    return None


# ------------------------------------------------------------ geometry decision


@dataclasses.dataclass(frozen=True)
class Decision:
    geometry: str  # SPLIT or PER_RATIO
    reason: str
    unit: int = 0  # bytes of one interleave unit (compressed + indexer kernel page), SPLIT only


_SPLIT_DEFAULT = (
    "default on SM12x: 128-token blocks, ratio-1 compressed/indexer pages "
    "interleaved as 64-state kernel pages"
)
_state: dict[str, Any] = {
    "split_unreviewed": None,
    "decisions": {},
    # The DeepSeek-V4.1 backend classes whose kernel block sizes the fix
    # declares: only their ratio-1 groups are split.
    "backends": (),
    # Compress ratios of the caches the fix's spec producers made (> 1 only):
    # the warm-up adds its 64-state key for these and no other.
    "owned_ratios": set(),
    # Prefixes of the drafter sliding-window caches built with 128-row pages.
    "drafter_swa_caches": set(),
}


DSPARK = "dspark"
# Speculative methods that draft from token ids alone: no drafter layer, no
# drafter KV; the target's verify pass (1 + N tokens, metadata rebuilt and its
# ratio-1 slots translated every step) is the only writer, as without drafting.
TOKEN_ONLY_METHODS = ("ngram", "ngram_gpu", "suffix")
# Drafters with attention layers of their own that write KV in the target's
# cache groups and update draft-decode metadata in place: the indexer's
# ``update_draft_decode_metadata`` recomputes slots only for ratio > 1.
EAGLE_STYLE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "draft_model")


def speculative_method(vllm_config: Any) -> str | None:
    config = getattr(vllm_config, "speculative_config", None)
    if config is None:
        return None
    return str(getattr(config, "method", None) or "unknown").lower()


def _speculative_trigger(method: str | None) -> str | None:
    """Why the split is not used with this speculative method, or None (the
    per-method reasons are what ``status``, ``doctor`` and the README say)."""
    if method is None or method == DSPARK or method in TOKEN_ONLY_METHODS:
        return None
    if method in EAGLE_STYLE_METHODS:
        return (
            f"speculative method {method} (its drafter layers write KV through their own "
            "metadata and update draft-decode metadata in place, where the indexer's "
            "update_draft_decode_metadata recomputes slots only for ratio > 1: not "
            "reviewed with the split)"
        )
    return f"speculative method {method} is not reviewed with the split"


def _speculative_note(method: str | None) -> str:
    """What the in-force split adds to its reason under speculative decoding."""
    if method == DSPARK:
        rows, why = drafter_swa_rows()
        return (
            "; with DSpark: no drafter layer owns or reads a ratio-1 compressed or indexer "
            "cache (checked on the model's layers), so only the target's verify pass "
            f"writes ratio-1 pages, through kernel-table slots; drafter sliding-window pages "
            f"hold {rows} tokens ({why})"
        )
    if method in TOKEN_ONLY_METHODS:
        return (
            f"; with {method}: drafts come from token ids, no drafter KV; only the target's "
            "verify pass writes ratio-1 pages, through kernel-table slots"
        )
    return ""


def drafter_ratio1_layer(
    forward_context: dict[str, Any], num_backbone_layers: int | None
) -> str | None:
    """The first drafter layer that owns or reads a ratio-1 compressed or
    indexer cache, described, or None.  A drafter layer is one vLLM's
    speculator marked ``is_draft_layer``, or an attention layer numbered past
    the backbone."""
    attention = sys.modules.get(ATTENTION_MODULE)
    if attention is None:
        return None
    for name, layer in forward_context.items():
        past_backbone = (
            num_backbone_layers is not None
            and isinstance(getattr(layer, "layer_id", None), int)
            and layer.layer_id >= num_backbone_layers
        )
        if not (getattr(layer, "is_draft_layer", False) or past_backbone):
            continue
        if isinstance(layer, attention.DeepseekV4IndexerCache) and layer.compress_ratio == 1:
            return f"{name} (drafter indexer cache, compress ratio 1)"
        if isinstance(layer, attention.DeepseekV4Attention) and layer.compress_ratio == 1:
            role = "owns" if layer.is_kv_source else "reads"
            return f"{name} (drafter layer that {role} a ratio-1 compressed cache)"
    return None


def _drafter_layers(forward_context: dict[str, Any]) -> list[str]:
    return [
        name for name, layer in forward_context.items() if getattr(layer, "is_draft_layer", False)
    ]


def _backbone_layers(vllm_config: Any) -> int | None:
    text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    value = getattr(text, "num_hidden_layers", None)
    return value if isinstance(value, int) else None


def _dspark_misfit(vllm_config: Any) -> str | None:
    """Under DSpark, once the model's layers are registered: why its drafter
    does not fit the split, or None."""
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    if not context:
        return None
    if not _drafter_layers(context):
        return (
            "speculative method dspark, but no drafter layer is registered with the model's "
            "layers, so they cannot be checked for ratio-1 caches"
        )
    layer = drafter_ratio1_layer(context, _backbone_layers(vllm_config))
    if layer is not None:
        return f"speculative method dspark with {layer}: its ratio-1 slots are not translated"
    return None


OFFLOADING_CONNECTOR = "OffloadingConnector"
SIMPLE_OFFLOAD_ENV = "VLLM_USE_SIMPLE_KV_OFFLOAD"


def kv_connector_name(vllm_config: Any) -> str | None:
    """The KV connector the engine runs: the configured one, else the one
    ``--kv-offloading-size`` selects (``VllmConfig`` does this itself; a
    serve line read by ``doctor`` has not been through it), else None."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:
        return str(getattr(transfer, "kv_connector", None) or "unknown")
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "kv_offloading_size", None) is None:
        return None
    if (getattr(cache, "kv_offloading_backend", None) or "native") != "native":
        return "LMCacheMPConnector"
    if os.environ.get(SIMPLE_OFFLOAD_ENV, "").strip().lower() in ("1", "true"):
        return "SimpleCPUOffloadConnector"
    return OFFLOADING_CONNECTOR


def _kv_transfer_trigger(vllm_config: Any) -> str | None:
    connector = kv_connector_name(vllm_config)
    if connector is None or connector == OFFLOADING_CONNECTOR:
        # vLLM's CPU offloading moves a packed layout's whole blocks (every
        # layer's pages of a block id); the self-test's offload-reload case
        # clobbers and reloads them through its own transfer regions.
        return None
    return (
        f"KV connector {connector} is configured (not reviewed with the split: it may move "
        "manager-block pages per layer, where the split's ratio-1 pages interleave)"
    )


def _config_triggers(vllm_config: Any) -> str | None:
    """The first engine setting under which the split is not proven safe."""
    speculative = _speculative_trigger(speculative_method(vllm_config))
    if speculative:
        return speculative
    transfer = _kv_transfer_trigger(vllm_config)
    if transfer:
        return transfer
    parallel = getattr(vllm_config, "parallel_config", None)
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, field, 1) or 1
        if size > 1:
            return (
                f"{field} is {size} (context-parallel slot sharding is not reviewed with the split)"
            )
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "hisparse_config", None) is not None:
        return "HiSparse is configured (not reviewed with the split)"
    attention_module = sys.modules.get(ATTENTION_MODULE)
    if attention_module is not None and attention_module._use_v41_mxfp8_kv_record():
        return "the KV record is MXFP8 (the split is proven on the V4 fp8_ds_mla record)"
    return None


def _ratio1_pair_unit(vllm_config: Any) -> tuple[int, str | None]:
    """(interleave unit in bytes, None) from the model's real ratio-1 caches,
    or (0, why the split does not fit this model).  Reads the layers vLLM
    registered in the static forward context; (0, None) before they exist."""
    attention = sys.modules.get(ATTENTION_MODULE)
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    if attention is None or not context:
        return 0, None
    sources = [
        layer
        for layer in context.values()
        if isinstance(layer, attention.DeepseekV4Attention) and layer.is_kv_source
    ]
    indexers = [
        layer for layer in context.values() if isinstance(layer, attention.DeepseekV4IndexerCache)
    ]
    ratios = {int(layer.compress_ratio) for layer in [*sources, *indexers]}
    if not ratios <= {1, 2}:
        return 0, f"compress ratios {sorted(ratios)} (the split is reviewed for ratios 1 and 2)"
    ratio1 = [layer for layer in sources if layer.compress_ratio == 1]
    ratio1_index = [layer for layer in indexers if layer.compress_ratio == 1]
    if not ratio1:
        return 0, "no ratio-1 cache to split (the per-ratio geometry is the same)"
    if len(ratio1) != len(ratio1_index):
        return 0, (
            f"{len(ratio1)} ratio-1 compressed caches but {len(ratio1_index)} ratio-1 "
            "indexer caches (they interleave in pairs)"
        )
    pages = []
    for layer, cls in (
        (ratio1[0], attention.DeepseekV4Attention),
        (ratio1_index[0], attention.DeepseekV4IndexerCache),
    ):
        spec = _ORIGINAL_PRODUCERS[cls](layer, vllm_config)
        state_bytes = getattr(spec, "state_content_bytes", None) or spec.head_size
        expected = V4_RECORD_BYTES if cls is attention.DeepseekV4Attention else FP8_INDEXER_ROW
        if state_bytes != expected:
            return 0, (
                f"{cls.__name__} record of {state_bytes} B (the split is proven on the "
                f"{V4_RECORD_BYTES}-B V4 record and the {FP8_INDEXER_ROW}-B fp8 indexer row)"
            )
        kernel_page = spec.copy_with_new_block_size(PAGE_ROWS).page_size_bytes
        manager_page = spec.copy_with_new_block_size(SPLIT_MANAGER_BLOCK).page_size_bytes
        if manager_page != 2 * kernel_page:
            return 0, (
                f"{cls.__name__}: a {SPLIT_MANAGER_BLOCK}-token page ({manager_page} B) is "
                f"not two {PAGE_ROWS}-state pages ({kernel_page} B)"
            )
        pages.append(kernel_page)
    return sum(pages), None


def _decide(vllm_config: Any) -> Decision:
    forced = os.environ.get(GEOMETRY_ENV, "").strip().lower()
    if forced == PER_RATIO:
        return Decision(PER_RATIO, f"{GEOMETRY_ENV}=per-ratio")
    if forced not in ("", SPLIT):
        return Decision(PER_RATIO, f"{GEOMETRY_ENV}={forced!r} is not '{PER_RATIO}' or '{SPLIT}'")
    if _state["split_unreviewed"]:
        return Decision(PER_RATIO, _state["split_unreviewed"])
    trigger = _config_triggers(vllm_config)
    if trigger:
        return Decision(PER_RATIO, trigger)
    method = speculative_method(vllm_config)
    if method == DSPARK:
        misfit = _dspark_misfit(vllm_config)
        if misfit:
            return Decision(PER_RATIO, misfit)
    unit, misfit = _ratio1_pair_unit(vllm_config)
    if misfit:
        return Decision(PER_RATIO, misfit)
    return Decision(SPLIT, _SPLIT_DEFAULT + _speculative_note(method), unit)


def geometry_decision(vllm_config: Any) -> tuple[str, str]:
    """(geometry, reason) this fix uses for ``vllm_config`` on SM12x.

    ``vllm_config`` is a ``VllmConfig`` or any object with the same attribute
    names (``speculative_config``, ``kv_transfer_config``, ``cache_config``,
    ``parallel_config``, ``attention_config``; missing ones count as unset), so
    ``doctor`` can ask before a server starts.  Once the model's layers are
    registered, the ratio-1 caches' real page sizes are checked too."""
    if _state["split_unreviewed"] is None:
        try:
            _state["split_unreviewed"] = split_unreviewed() or ""
        except Exception as exc:  # vLLM not importable here: say so, choose the fallback
            _state["split_unreviewed"] = f"cannot read vLLM's sources here: {exc}"
    decision = _decide(vllm_config)
    return decision.geometry, decision.reason


def _decision_for_specs(vllm_config: Any) -> Decision:
    decision = _decide(vllm_config)
    if decision.geometry == SPLIT and not decision.unit:
        decision = Decision(
            PER_RATIO,
            "the model's ratio-1 caches are not registered in the "
            "forward context, so the interleave unit is unknown",
        )
    key = (decision.geometry, decision.reason)
    if key not in _state["decisions"]:
        _state["decisions"][key] = decision
        _logger().info(
            "vllm-mla-fixes (%s): DeepSeek-V4.1 KV geometry %s (%s)",
            INFO.name,
            decision.geometry,
            decision.reason,
        )
    return decision


def status_detail() -> str:
    """What ``status`` adds to the applied reason: the geometry in force in
    this process, or the rule when no model was loaded here."""
    decided = list(_state["decisions"].values())
    if decided:
        return "; ".join(f"geometry {d.geometry} ({d.reason})" for d in decided)
    if _state["split_unreviewed"]:
        return f"geometry {PER_RATIO} ({_state['split_unreviewed']})"
    return (
        f"geometry chosen when the model loads: {SPLIT} by default (also with DSpark "
        "drafters that own or read no ratio-1 cache, ngram and suffix), "
        f"{PER_RATIO} with EAGLE-style or other speculative methods, a KV connector other "
        "than CPU offloading, DCP/PCP > 1, HiSparse, another KV record, ratio-1 caches that do not "
        f"pair up, or {GEOMETRY_ENV}=per-ratio"
    )


def _logger():
    try:
        from vllm.logger import init_logger
    except Exception:  # pragma: no cover - vLLM broken
        import logging

        return logging.getLogger("vllm.mla_fixes")
    return init_logger("vllm.mla_fixes")


# ------------------------------------------------------------------ spec producers


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


_ORIGINAL_PRODUCERS: dict[type, Callable] = {}


def _wrap_spec_producer(cls: type) -> Callable:
    original = cls.__dict__["get_kv_cache_spec"]
    _ORIGINAL_PRODUCERS[cls] = original

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if spec is None:
            return None
        decision = _decision_for_specs(vllm_config)
        if isinstance(spec.tokens_per_state, int) and spec.tokens_per_state > 1:
            _state["owned_ratios"].add(spec.tokens_per_state)
        if decision.geometry == SPLIT:
            return split_spec(spec, decision.unit)
        return per_ratio_spec(spec)

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


@functools.cache
def flashinfer_takes_runtime_swa_pages() -> bool:
    """Whether the installed FlashInfer's SM120 DeepSeek-V4 decode kernels take
    the primary (sliding-window) page size at run time, as its own envelope
    says (0.7.2.post1 and later); 0.7.0.post1 instantiates 64 rows only."""
    try:
        from flashinfer.mla import supported_sparse_mla_sm120_configs

        family = supported_sparse_mla_sm120_configs().get("dsv4")
        return bool(
            family is not None
            and getattr(family, "page_block_size_is_runtime", False)
            and family.supports_decode(8, 128, page_block_size=DRAFTER_SWA_ROWS)
        )
    except Exception:  # noqa: BLE001 - an unknown FlashInfer keeps 64-row pages
        return False


def _layer_number(prefix: Any) -> int | None:
    """``N`` of a ``...layers.N.<module>`` prefix, by vLLM's own parser (the
    one DSpark's and every model's layers are numbered for), or None."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(str(prefix))
    except (AssertionError, IndexError, ValueError):
        return None


def swa_page_rows(prefix: Any) -> int:
    """Sliding-window page rows for the cache built under ``prefix``: 128 for
    a drafter layer's (numbered past the backbone) where FlashInfer takes
    run-time page sizes, else 64."""
    from vllm.config import get_current_vllm_config

    number = _layer_number(prefix)
    backbone = _backbone_layers(get_current_vllm_config())
    if number is None or backbone is None or number < backbone:
        return PAGE_ROWS
    return drafter_swa_rows()[0]


def drafter_swa_rows() -> tuple[int, str]:
    """Rows of a drafter's sliding-window pages, and why."""
    if os.environ.get(DRAFTER_SWA_ENV, "").strip() == str(PAGE_ROWS):
        return PAGE_ROWS, f"{DRAFTER_SWA_ENV}={PAGE_ROWS}"
    if flashinfer_takes_runtime_swa_pages():
        return DRAFTER_SWA_ROWS, (
            "the installed FlashInfer takes run-time page sizes; all drafter layers share "
            "one KV-cache group"
        )
    return PAGE_ROWS, "the installed FlashInfer decodes 64-row primary pages only"


def _swa_cache_with_kernel_pages(cache_class: type) -> Callable:
    """Stands in for the class name inside ``deepseek_v41.attention`` only, so
    DeepSeek-V4.0 (which shares the class) is not touched."""

    def build_swa_cache(*args, **kwargs):
        if kwargs.get("block_size") == UPSTREAM_SWA_BLOCK:
            kwargs["block_size"] = swa_page_rows(kwargs.get("prefix"))
            if kwargs["block_size"] != PAGE_ROWS:
                _state["drafter_swa_caches"].add(kwargs.get("prefix"))
        return cache_class(*args, **kwargs)

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


# ----------------------------------------------------- interleaved kernel views


def _is_split_ratio1(group: Any) -> bool:
    """A ratio-1 attention group of one of the fix's backends with a kernel
    block size.  Decided from the group's class and spec alone, so groups of
    any other backend (other models, test stand-ins) are never asked anything."""
    backend = group.backend
    return (
        group.kernel_block_size is not None
        and getattr(group.kv_cache_spec, "tokens_per_state", None) == 1
        and isinstance(backend, type)
        and issubclass(backend, _state["backends"])
    )


_INTERLEAVED: dict[tuple[type, Any], tuple[int, int]] = {}
"""(backend class, spec) of the attention groups bound to interleaved pages ->
(unit bytes, bytes from the pair's start to the cache's first kernel page);
copies of those groups (DBO micro-batches, decoder replay) match too."""


def _interleaved_placement(group: Any) -> tuple[int, int] | None:
    """The group's entry in :data:`_INTERLEAVED`, or None.  Groups the fix does
    not own return None before their spec is hashed or their backend touched."""
    if not _INTERLEAVED or not _is_split_ratio1(group):
        return None
    return _INTERLEAVED.get((group.backend, group.kv_cache_spec))


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


def _interleaved_views(kv_caches: dict[str, Any], groups: list[Any]) -> dict[str, Any]:
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
            _PAIR_REGIONS[_view_key(view)] = (pair_start, 2 * unit, stride_pages * unit)
    leads = {cache.layer: cache.lead for cache in plan}
    for group in groups:
        group.kernel_block_stride = stride_pages
        lead = next(leads[name] for name in group.layer_names if name in leads)
        _INTERLEAVED[(group.backend, group.kv_cache_spec)] = (unit, lead)
        for builder in group.metadata_builders:
            _slot_buffers(builder)
    return views


def _with_interleaved_ratio1_views(original: Callable) -> Callable:
    @functools.wraps(original)
    def map_kv_caches_to_kernel_blocks(kv_caches, attn_groups):
        attn_groups = list(attn_groups)
        split = [group for group in attn_groups if _is_split_ratio1(group)]
        rest = [group for group in attn_groups if not any(group is s for s in split)]
        mapped = original(kv_caches, rest)
        present = [group for group in split if any(n in kv_caches for n in group.layer_names)]
        if present:
            mapped.update(_interleaved_views(kv_caches, present))
        return mapped

    return map_kv_caches_to_kernel_blocks


def _with_pair_manager_view(original: Callable) -> Callable:
    """vLLM views a split group's bound cache as manager blocks to zero newly
    allocated blocks (``KVBlockZeroer``), assuming a block's kernel pages are
    contiguous.  For an interleaved cache the view is the whole pair region of
    the block instead (both caches' pages, 2 units), so zeroing a new block
    clears exactly the ratio-1 pages it holds."""

    @functools.wraps(original)
    def map_kv_cache_to_manager_blocks(self, kv_cache, num_blocks):
        placement = _interleaved_placement(self)
        if placement is None:
            return original(self, kv_cache, num_blocks)
        import torch

        unit, lead = placement
        size = kv_cache.element_size()
        pair = 2 * unit // size
        return torch.as_strided(
            kv_cache,
            (num_blocks, 1, 1, pair),
            (kv_cache.stride(0) * self.kernel_block_stride, pair, pair, 1),
            kv_cache.storage_offset() - lead // size,
        )

    return map_kv_cache_to_manager_blocks


_PAIR_REGIONS: dict[tuple, tuple[int, int, int]] = {}
"""(device, data pointer, shape, strides) of every view of an interleaved
ratio-1 cache, manager and kernel -> (byte offset of its pair region in block
0, pair bytes, block stride bytes).  Keys only: no tensor is kept alive."""


def _view_key(view: Any) -> tuple:
    return (view.device, view.data_ptr(), tuple(view.shape), tuple(view.stride()))


def _with_pair_region_copies(original: Callable) -> Callable:
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
    def copy_kv_cache_blocks_inplace(kv_caches, num_blocks, kv_cache_block_copies):
        if _PAIR_REGIONS and kv_cache_block_copies:
            kv_caches = [_pair_region_view(cache, num_blocks) for cache in kv_caches]
        return original(kv_caches, num_blocks, kv_cache_block_copies)

    return copy_kv_cache_blocks_inplace


def _pair_region_view(cache: Any, num_blocks: int) -> Any:
    placement = _PAIR_REGIONS.get(_view_key(cache))
    if placement is None:
        return cache
    import torch

    start, pair, block_stride = placement
    size = cache.element_size()
    return torch.as_strided(
        cache, (num_blocks, pair // size), (block_stride // size, 1), start // size
    )


# ------------------------------------------------------------ ratio-1 writer slots

_SLOT_BUFFERS: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def _slot_buffers(builder: Any) -> tuple:
    """Persistent (slots, block index) buffers of one metadata builder, sized
    for the scheduler's token budget: allocated once (when the views are
    bound, or on a builder's first build), reused every step."""
    buffers = _SLOT_BUFFERS.get(builder)
    if buffers is None:
        import torch

        tokens = builder.vllm_config.scheduler_config.max_num_batched_tokens
        device = builder.device
        buffers = (
            torch.empty(tokens, dtype=torch.int64, device=device),
            torch.empty(tokens, dtype=torch.int64, device=device),
        )
        _SLOT_BUFFERS[builder] = buffers
    return buffers


def kernel_slots(group: Any, slot_mapping: Any, ubatch_idx: int = 0) -> Any:
    """Manager-block slots -> kernel-block slots of an interleaved group:
    ``ktable[req, pos // k] * k + pos % k`` = ``s + (s // B) * (S * k - B)``
    for manager block B, kernel block k and kernel-block stride S.  A pad
    (negative slot) has ``s // B < 0``, clamped to 0, so it is kept as is.
    Three elementwise ops into the builder's persistent buffers per step."""
    import torch

    slots, blocks = _slot_buffers(group.get_metadata_builder(ubatch_idx))
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


def _with_kernel_slots(original: Callable) -> Callable:
    @functools.wraps(original)
    def _with_kernel_block_table(self, common_attn_metadata, ubatch_idx=0):
        metadata = original(self, common_attn_metadata, ubatch_idx)
        if _interleaved_placement(self) is None:
            return metadata
        return dataclasses.replace(
            metadata, slot_mapping=kernel_slots(self, metadata.slot_mapping, ubatch_idx)
        )

    return _with_kernel_block_table


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
    cache it built so (see :data:`DRAFTER_SWA_ROWS`)."""
    if page.kind == "sliding-window KV" and page.layer in _state["drafter_swa_caches"]:
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
        check_page_geometry(bound_pages(forward_context))
        if _INTERLEAVED:
            check_no_split_drafter(forward_context)
        return result

    return bind_kv_cache_to_layers


# ------------------------------------------------------- workers must agree

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


# ------------------------------------------------------------------------ apply


def apply(patch: Patch) -> None:
    # Screened here, where vLLM's sources are known to be readable; the split's
    # targets are patched only when they are the reviewed code.
    _state["split_unreviewed"] = split_unreviewed() or ""
    _state["decisions"] = {}
    _state["backends"] = ()
    _state["owned_ratios"] = set()
    _state["drafter_swa_caches"] = set()
    _INTERLEAVED.clear()
    _PAIR_REGIONS.clear()
    split_reviewed = not _state["split_unreviewed"]

    def on_attention(module) -> None:
        for cls in (module.DeepseekV4Attention, module.DeepseekV4IndexerCache):
            patch.replace(cls, "get_kv_cache_spec", _wrap_spec_producer(cls))
        patch.replace(
            module, "DeepseekV4SWACache", _swa_cache_with_kernel_pages(module.DeepseekV4SWACache)
        )

    def on_flashinfer(module) -> None:
        backend = module.DeepseekV4FlashInferMLASparseBackend
        _state["backends"] += (backend,)
        patch.replace(
            backend,
            "get_supported_kernel_block_sizes",
            _per_spec_kernel_block_sizes(backend.get_supported_kernel_block_sizes),
        )

    def on_indexer(module) -> None:
        backend = module.DeepseekV41IndexerBackend
        _state["backends"] += (backend,)
        patch.replace(
            backend,
            "get_supported_kernel_block_sizes",
            _per_spec_kernel_block_sizes(backend.get_supported_kernel_block_sizes),
        )

    def on_warmup(module) -> None:
        kernel = module.CompressedSlotMappingKernel
        patch.replace(
            kernel,
            "get_warmup_keys",
            _warmup_keys_with_64_state_pages(kernel.__dict__["get_warmup_keys"]),
        )

    def on_worker_utils(module) -> None:
        patch.replace_function(
            module, "bind_kv_cache_to_layers", _with_geometry_check(module.bind_kv_cache_to_layers)
        )
        if split_reviewed:
            patch.replace_function(
                module,
                "map_kv_caches_to_kernel_blocks",
                _with_interleaved_ratio1_views(module.map_kv_caches_to_kernel_blocks),
            )
            group = module.AttentionGroup
            patch.replace(
                group,
                "_with_kernel_block_table",
                _with_kernel_slots(group.__dict__["_with_kernel_block_table"]),
            )
            patch.replace(
                group,
                "map_kv_cache_to_manager_blocks",
                _with_pair_manager_view(group.__dict__["map_kv_cache_to_manager_blocks"]),
            )
            patch.replace_function(
                module,
                "copy_kv_cache_blocks_inplace",
                _with_pair_region_copies(module.copy_kv_cache_blocks_inplace),
            )

    def on_spec_merge(function: str) -> Callable:
        def wrap(module) -> None:
            # 0.32 merges in kv_cache_utils, 0.33+ in kv_cache_planning; the
            # other candidate lacks the function and is left alone.
            if _merges_worker_specs(module.__name__, function):
                patch.replace_function(
                    module, function, _with_workers_agreeing(getattr(module, function))
                )

        return wrap

    for module_name, function in SPEC_MERGE_SITES:
        patch.when_imported(module_name, on_spec_merge(function))
    patch.when_imported(ATTENTION_MODULE, on_attention)
    patch.when_imported(FLASHINFER_MODULE, on_flashinfer)
    patch.when_imported(INDEXER_MODULE, on_indexer)
    patch.when_imported(WARMUP_MODULE, on_warmup)
    patch.when_imported(WORKER_UTILS_MODULE, on_worker_utils)


def for_capability(capability: tuple[int, int]):
    """This fix as a module-like object whose probe sees ``capability`` -- for
    :func:`vllm_mla_fixes.patching.run_fix` in tests and ``verify`` on CPU."""
    import types

    return types.SimpleNamespace(
        INFO=INFO,
        probe=functools.partial(probe, capability),
        apply=apply,
        status_detail=status_detail,
    )


# ------------------------------------------------------------------------ doctor


def diagnose(env, serve) -> list:
    """``vllm-mla-fixes doctor``'s findings for this fix on a release its probe
    decides (``env``: a :class:`~vllm_mla_fixes.report.Environment`, ``serve``:
    a :class:`~vllm_mla_fixes.report.ServeLine` or None)."""
    from vllm_mla_fixes.report import Finding, fix_verdict, major_minor

    name = INFO.name
    vllm_version = env.packages.get("vllm")
    if (
        serve is not None
        and serve.model_config
        and "DeepseekV41ForCausalLM" not in serve.architectures
    ):
        return [Finding("ok", name, "not a DeepSeek-V4.1 model")]
    sm = env.capability
    if sm is not None and sm[0] != 12:
        return [
            Finding(
                "ok",
                name,
                f"SM{sm[0]}{sm[1]}: the page-geometry failure is specific to "
                "SM120/SM121 (FlashInfer's SM120 sparse-MLA and indexer kernels); nothing changes here",
            )
        ]
    findings = [
        Finding(
            "info",
            name,
            f"GPU {f'SM{sm[0]}{sm[1]}' if sm else 'not visible'}: SM120 (RTX PRO 6000) "
            "and SM121 (GB10) are both compute capability 12.x; the fix applies to both "
            "(neither has been run on hardware by this project)",
        ),
        Finding(
            "info",
            name,
            "prove the fixed KV layout on this GPU before serving: the "
            "self-test runs FlashInfer's SM120 sparse-MLA, DeepGEMM's paged MQA logits "
            "and the indexer-K gather over it against a dense reference (exit 0 pass, "
            "1 mismatch, 2 cannot run); once the server is up, check its replies for "
            "U+FFFD; attach both outputs to a bug report",
            f"{SELFTEST_COMMAND}; then {SMOKE_COMMAND}",
        ),
    ]
    fi, cubin, jit = (
        env.packages.get(p)
        for p in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
    )
    if fi and cubin and fi != cubin:
        findings.append(
            Finding(
                "error",
                name,
                f"flashinfer-cubin {cubin} != flashinfer-python {fi}",
                f"install flashinfer-cubin {fi}, the version of flashinfer-python "
                "(PyPI has no flashinfer-cubin 0.7.x: take it from where "
                "flashinfer-python came from)",
            )
        )
    if jit is None:
        findings.append(
            Finding(
                "warn",
                name,
                "flashinfer-jit-cache is not installed: SM120 kernels come "
                "from the sm120f jit-cache; the report installs its 4 KB shim with --no-deps",
                f"install the flashinfer-jit-cache {fi} shim with --no-deps (it is not on PyPI)",
            )
        )
    elif fi and jit.split("+")[0] != fi:
        findings.append(
            Finding(
                "error",
                name,
                f"flashinfer-jit-cache {jit} does not match flashinfer-python "
                f"{fi}; FlashInfer refuses to start (unless FLASHINFER_DISABLE_VERSION_CHECK=1)",
                f"install flashinfer-jit-cache {fi} (a +cuXXX suffix is fine)",
            )
        )
    torch_v, audio_v = env.packages.get("torch"), env.packages.get("torchaudio")
    if audio_v and major_minor(audio_v) != major_minor(torch_v):
        findings.append(
            Finding(
                "warn",
                name,
                f"torchaudio {audio_v} was built for another torch than "
                f"{torch_v} (vLLM {vllm_version}'s own pins); it can fail to load "
                "(a language-model-only serve does not need it)",
                "pip uninstall -y torchaudio",
            )
        )
    if serve is None:
        findings.append(fix_verdict(env, name))
        return findings
    attention = serve.attention_config
    if str(attention.get("indexer_kv_dtype", "fp8")).lower() == "mxfp4":
        findings.append(
            Finding(
                "error",
                name,
                "indexer_kv_dtype='mxfp4' requires SM10x (B200/GB200); "
                "SM120 rejects it at start-up",
                f"use {INDEXER_FP8_FLAG}",
            )
        )
    if attention.get("indexer_sparse_logits"):
        findings.append(
            Finding(
                "error",
                name,
                "indexer_sparse_logits needs the MXFP4 indexer cache, which SM120 does not support",
                "remove indexer_sparse_logits",
            )
        )
    block = serve.block_size
    fixed = env.fix_state(name) == "applied"
    if (major_minor(vllm_version) or (0,)) >= (0, 34):
        # 0.34.0 declares 64-token kernel blocks on SM12x, which moves the failure.
        if block == 128 and not fixed:
            findings.append(
                Finding("warn", name, f"--block-size 128 fails at start-up: {SPLIT_ERROR_0_34}")
            )
        elif block == 64 and not fixed:
            findings.append(
                Finding(
                    "warn",
                    name,
                    "--block-size 64 starts on vLLM 0.34, but hands the indexer 32-state ratio-2 "
                    "pages (SM120's paged-MQA logits take 64) and FlashInfer 32-token "
                    "sliding-window pages",
                )
            )
    elif block == 64 and not fixed:
        findings.append(Finding("warn", name, f"--block-size 64 fails at start-up: {INFO.error}"))
    elif block in (None, 128) and not fixed:
        findings.append(
            Finding(
                "warn",
                name,
                "--block-size 128 starts, but page 32 reaches FlashInfer: "
                "that is the 32-token sliding-window cache of a SWA-only layer (not a "
                "ratio-2 page, as the report says); FlashInfer 0.7.0.post1 rejects it on the "
                "first request (page_block_size=32), and SM120's indexer takes only 64-state "
                "pages while ratio-1 layers get 128",
            )
        )
    findings += predicted_geometry(serve)
    findings.append(
        Finding(
            "info",
            name,
            "PR #56509 (64-token kernel blocks inside 128-token blocks) "
            "starts but writes ratio-1 latents through untranslated slots into other "
            "layers' pages: U+FFFD output; do not serve with it",
        )
    )
    if (serve.moe_backend or "auto") in ("triton", "b12x"):
        findings.append(
            Finding(
                "error",
                name,
                f"--moe-backend {serve.moe_backend} is not supported on SM120",
                f"leave it on auto (DEEPGEMM_MXFP4) or use {MOE_MARLIN_FLAG}",
            )
        )
    findings.append(fix_verdict(env, name))
    return findings


SPLIT_ERROR_0_34 = (
    "ValueError: FLASHINFER_MLA_SPARSE_DSV41 needs 64-token kernel blocks, which packed "
    "128-token KV cache blocks cannot be split into."
)
# Commands doctor suggests; tests run both (tests/test_selftest.py, tests/test_smoke.py).
SELFTEST_COMMAND = "vllm-mla-fixes selftest"
SMOKE_COMMAND = "vllm-mla-fixes smoke http://<host>:<port>"
# Serve flags doctor suggests; tests check them with each affected release's own config classes.
INDEXER_FP8_FLAG = '--attention-config \'{"indexer_kv_dtype": "fp8"}\''
MOE_MARLIN_FLAG = "--moe-backend marlin"


PREDICTION_MODULE = "vllm_mla_fixes.reproductions.dsv41_prediction"
PREDICTION_TIMEOUT_S = 900


def predicted_geometry(serve) -> list:
    """doctor's findings on what ``serve`` gets on SM12x, from a fresh
    interpreter that runs the fix's own decision on the engine config vLLM's
    parser builds from the line (works where no GPU is visible)."""
    import json
    import subprocess

    from vllm_mla_fixes.report import Finding

    name = INFO.name
    command = [sys.executable, "-m", PREDICTION_MODULE]
    if serve.model_config:
        command += ["--model-config", json.dumps(serve.model_config)]
    # Planning only: the GPU is not needed, and is not touched.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run(
            [*command, "--", *serve.raw],
            capture_output=True,
            text=True,
            timeout=PREDICTION_TIMEOUT_S,
            env=env,
        )
        lines = done.stdout.strip().splitlines()
        prediction = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        done, prediction = None, None
        failure = f"{type(exc).__name__}: {exc}"
    if prediction is not None and "error" in prediction:
        return [
            Finding(
                "error",
                name,
                f"vLLM rejects this serve line: {prediction['error']}",
                "correct the line; `vllm serve` would stop with the same error",
            )
        ]
    if prediction is None:
        if done is not None:
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
            failure = tail[-1] if tail else f"exit status {done.returncode}"
        return [
            Finding(
                "warn",
                name,
                f"could not predict this line's KV geometry on SM12x ({failure})",
                f"run `python -m {PREDICTION_MODULE} -- <serve args>` to see the full error",
            )
        ]
    return _prediction_findings(prediction)


def _prediction_findings(prediction: dict) -> list:
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    settings = prediction["settings"]
    findings = [
        Finding(
            "info",
            name,
            f"on SM12x this line gets the {prediction['geometry']} geometry: "
            f"{prediction['reason']} (the fix's own geometry_decision, on the engine config "
            f"vLLM {prediction['vllm']}'s `vllm serve` parser builds from this line; "
            f"{prediction['platform']}); --block-size does not decide these pages on SM12x",
        )
    ]
    figures = "; ".join(
        f"max_model_len {c['max_model_len']}: {c['tokens_per_gib']:,} tokens = "
        f"{c['tokens_per_gib'] / c['upstream_128']:.3f}x upstream --block-size 128 "
        f"({c['upstream_128']:,}) and {c['tokens_per_gib'] / c['upstream_64']:.3f}x "
        f"--block-size 64 ({c['upstream_64']:,})"
        for c in prediction["capacity"]
    )
    findings.append(
        Finding(
            "info",
            name,
            f"KV capacity of that geometry per GiB per rank (vLLM's planner, DeepSeek-V4.1-Flash "
            f"layout): {figures}",
        )
    )
    if settings["kv_offloading_backend"] and settings["kv_offloading_size"] is None:
        findings.append(
            Finding(
                "info",
                name,
                f"--kv-offloading-backend {settings['kv_offloading_backend']} without "
                f"--kv-offloading-size enables nothing in vLLM {prediction['vllm']} "
                "(offloading starts only with a size), so it is not offloading here",
            )
        )
    findings += _shape_findings(prediction)
    return findings


def _shape_findings(prediction: dict) -> list:
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    tp = prediction["settings"]["tensor_parallel_size"]
    shapes = prediction["shapes"]
    broken = [shape.get("error") for shape in shapes if "error" in shape]
    if broken:
        return [Finding("warn", name, f"per-rank FlashInfer shape not checked: {broken[0]}")]

    def described(shape: dict) -> str:
        extra = f", extra page {shape['extra_page']}" if shape["extra_page"] else ""
        return (
            f"{shape['heads']} heads (TP {tp}), top-k {shape['topk']}, page {shape['page']}"
            f"{extra} ({shape['role']})"
        )

    version = shapes[0]["flashinfer"]
    findings = []
    missing = [shape for shape in shapes if not shape["decode_kernel"]]
    for shape in missing:
        reported = f"; reported in {shape['reported']}" if shape["reported"] else ""
        findings.append(
            Finding(
                "error",
                name,
                f"FlashInfer {version} has no SM120 sparse-MLA decode kernel for this rank's "
                f"shape: {described(shape)} (flashinfer.mla.supported_sparse_mla_sm120_configs())"
                f"{reported}",
                f"use FlashInfer {RUNTIME_ENVELOPE_FLASHINFER} or newer (its DSV4 decode envelope "
                "takes any head count up to 128 and any top-k), or another --tensor-parallel-size",
            )
        )
    accepted = [shape for shape in shapes if shape["decode_kernel"]]
    if accepted:
        reports = [f"{described(s)}: {s['reported']}" for s in accepted if s["reported"]]
        findings.append(
            Finding(
                "ok",
                name,
                f"FlashInfer {version}'s SM120 decode envelope takes this rank's shapes: "
                + "; ".join(described(shape) for shape in accepted)
                + (
                    f" (a shape users hit on older FlashInfer: {'; '.join(reports)})"
                    if reports
                    else ""
                )
                + "; supported_sparse_mla_sm120_configs() describes decode kernels only, so "
                "prefill is not checked here",
            )
        )
    return findings


RUNTIME_ENVELOPE_FLASHINFER = "0.7.0.post1"
"""Oldest FlashInfer in this project's locks (vLLM 0.32.0's): its DSV4 decode
envelope takes any head count up to 128 and any top-k.  FlashInfer 0.6.18
(main as of 2026-08-22) instantiated fixed (heads, top-k) pairs with top-k in
{128, 192, 256, 512, 1024}: 64 heads with top-k 1152 (vllm#56837) had neither
a decode nor a prefill kernel there."""
