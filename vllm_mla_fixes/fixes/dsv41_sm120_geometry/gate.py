"""Gate: which vLLM definitions the fix was reviewed against (``REVIEWED``),
which of them only the interleaved split needs (``SPLIT_TARGETS``), and the
probe that decides, per device, whether the installed vLLM needs the fix."""

from __future__ import annotations

import ast

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    COMPRESSOR_MODULE,
    FLASHINFER_MODULE,
    INDEXER_MODULE,
    SPARSE_MLA_MODULE,
    SWA_MODULE,
    UPSTREAM_SWA_BLOCK,
    WARMUP_MODULE,
    WORKER_UTILS_MODULE,
)
from vllm_mla_fixes.patching import CannotProbe, TargetMismatch

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
    # vLLM's own rules the decision reads (engine.py, model_specs.py): the KV
    # record a cache dtype resolves to, MXFP8 or not, the indexer's row size.
    (ATTENTION_MODULE, "_resolve_dsv4_kv_cache_dtype"): {
        "8dd32655a8010973": "0.32.0",
        "d45d98418437f37a": "0.33.0, 0.34.0",
    },
    (ATTENTION_MODULE, "_use_v41_mxfp8_kv_record"): {"0c71e8d12e7d9f11": "0.32.0, 0.33.0, 0.34.0"},
    (ATTENTION_MODULE, "_indexer_k_cache_head_dim"): {"1faf065e1542d687": "0.32.0, 0.33.0, 0.34.0"},
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
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import FIX  # the record, above this module
    from vllm_mla_fixes.screen_cache import cached_screen  # parsing vLLM costs each process ~0.1 s

    return cached_screen(FIX, source_screen)


def source_screen() -> None:
    """The probe's source checks (no import): every reviewed definition of
    the per-ratio geometry and the SWA call site are the reviewed code, else
    :class:`TargetMismatch`.  The split's own targets are screened separately
    (:func:`split_unreviewed`): a mismatch there only selects the fallback."""
    for (module, qualname), known in REVIEWED.items():
        if (module, qualname) not in SPLIT_TARGETS:
            patching.require_fingerprint(module, qualname, known)
    _check_swa_call_site()


_split_screens: dict[str, str | None] = {}
"""split_unreviewed's verdicts in this process, keyed by the content key of
every file and table it reads (``screen_cache.screen_key``)."""


def split_unreviewed() -> str | None:
    """Why the interleaved split cannot be used with the installed vLLM (one
    of its targets is not the reviewed code), or None.  Parsing the sources
    takes about 0.6 s; the verdict is kept under the content key of what it
    read, so a changed file or table is screened again."""
    from vllm_mla_fixes.screen_cache import screen_key

    if patching.sources_root() is not None:  # screening another tree (review)
        return _screen_split_targets()
    try:
        key = screen_key(REVIEWED, source_screen)
    except OSError:
        return _screen_split_targets()
    if key not in _split_screens:
        _split_screens[key] = _screen_split_targets()
    return _split_screens[key]


def _screen_split_targets() -> str | None:
    for key in sorted(SPLIT_TARGETS):
        try:
            patching.require_fingerprint(*key, REVIEWED[key])
        except (TargetMismatch, CannotProbe) as exc:
            return f"the interleaved split is not reviewed for this vLLM ({exc})"
    return None
