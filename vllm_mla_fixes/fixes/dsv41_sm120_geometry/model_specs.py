"""The KV-cache specs of the whole model, built from its config, for planning.

The decision compares layouts with vLLM's own planner.  It must get the same
answer in every process and pipeline rank, so it never plans on the layers a
rank happens to hold: this module describes every cache of the full model
(drafter layers included) from the :class:`~.engine.ModelLayout`, and asks
vLLM's own spec producers -- ``DeepseekV4Attention``, ``DeepseekV4SWACache``,
``DeepseekV4IndexerCache`` and ``CompressorStateCache``'s
``get_kv_cache_spec``, unwrapped -- for each cache's spec.

A description holds what the layer's ``__init__`` derives for its spec, by
vLLM's own helpers where vLLM has one (the KV dtype resolution, the indexer's
row width, the MXFP8 record rule) and the SM12x attention class's own class
attributes; ``REVIEWED`` pins the producers.  At start-up each live cache's
spec is compared with its description's (:func:`mismatches`, logged and shown
by ``status``), so a description that drifts from vLLM is named, not silent.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, cast

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig, ModelLayout
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    COMPRESSOR_MODULE,
    FLASHINFER_MODULE,
    SWA_MODULE,
    UPSTREAM_SWA_BLOCK,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind

SM12X_ATTENTION = "DeepseekV4FlashInferSM120Attention"
"""The attention class vLLM builds for DeepSeek-V4.1 on SM12x (FlashInfer DSV41)."""


@dataclasses.dataclass(frozen=True)
class CacheName:
    """One cache of the model: the name vLLM registers it under, and its kind."""

    layer: int
    kind: CacheKind
    name: str
    compress_ratio: int


def attention_prefix(layer: int) -> str:
    return f"model.layers.{layer}.attn"


def caches(model: ModelLayout) -> list[CacheName]:
    """Every KV cache the full model registers, in layer order."""
    found = []
    for layer in model.layers:
        prefix = attention_prefix(layer)
        ratio = model.ratio(layer)
        found.append(CacheName(layer, CacheKind.SLIDING_WINDOW, f"{prefix}.swa_cache", 0))
        if model.owns_compressed(layer):
            found.append(CacheName(layer, CacheKind.COMPRESSED, prefix, ratio))
            if ratio > 1:
                found.append(
                    CacheName(
                        layer,
                        CacheKind.COMPRESSOR_STATE,
                        f"{prefix}.compressor.state_cache",
                        ratio,
                    )
                )
        if model.owns_indexer(layer):
            found.append(CacheName(layer, CacheKind.INDEXER, f"{prefix}.indexer.k_cache", ratio))
    return found


def _import(module_name: str) -> Any:
    import importlib

    return importlib.import_module(module_name)


def _unwrapped(cls: type) -> Callable[..., object]:
    """``cls.get_kv_cache_spec`` as vLLM wrote it (the fix may wrap it)."""
    function = cast("Callable[..., object]", cls.__dict__["get_kv_cache_spec"])
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


@dataclasses.dataclass(frozen=True)
class Records:
    """The per-token records and alignments a DeepSeek-V4.1 layer's
    ``__init__`` derives, for the engine's cache dtype and platform."""

    kv_cache_dtype: str
    torch_dtype: object
    swa_bytes: int
    compressed_bytes: int
    page_alignment: int
    swa_block_stride_alignment: int | None


def records(engine: EngineConfig, cache_config: object) -> Records:
    attention = _import(ATTENTION_MODULE)
    cls = getattr(_import(FLASHINFER_MODULE), SM12X_ATTENTION)
    blank = object.__new__(cls)  # for the class's own properties; no __init__ runs
    kv_dtype, torch_dtype = attention._resolve_dsv4_kv_cache_dtype(
        cls.use_fp8_ds_mla_layout, engine.cache_dtype, cache_config, blank.packed_kv_cache_dtype
    )
    swa_bytes = 528 if engine.mxfp8_record else 584
    compressed = 288 if kv_dtype == "nvfp4_ds_mla" else swa_bytes
    return Records(
        kv_cache_dtype=str(kv_dtype),
        torch_dtype=torch_dtype,
        swa_bytes=swa_bytes,
        compressed_bytes=compressed,
        page_alignment=512 if engine.mxfp8_record else 576,
        swa_block_stride_alignment=math.lcm(swa_bytes, compressed) if engine.mxfp8_record else None,
    )


def _descriptions(
    engine: EngineConfig, model: ModelLayout, cache_config: object, swa_rows: Mapping[int, int]
) -> dict[str, tuple[Any, SimpleNamespace]]:
    """name -> (the cache's class, its description) for every cache."""
    attention = _import(ATTENTION_MODULE)
    compressor = _import(COMPRESSOR_MODULE)
    swa = _import(SWA_MODULE)
    cache_config = copy.copy(cache_config)  # vLLM's resolution writes the record back
    found = records(engine, cache_config)
    cls = getattr(_import(FLASHINFER_MODULE), SM12X_ATTENTION)
    indexer_row = attention._indexer_k_cache_head_dim(model.index_head_dim, engine.indexer_fp4)
    ring_rows = max(8, 1 << (engine.speculative_tokens + 1).bit_length())
    described: dict[str, tuple[object, SimpleNamespace]] = {}
    for cache in caches(model):
        if cache.kind is CacheKind.SLIDING_WINDOW:
            described[cache.name] = (
                swa.DeepseekV4SWACache,
                SimpleNamespace(
                    backend_cls=cls.swa_backend_cls or swa.DeepseekSparseSWABackend,
                    # vLLM resolves it per release and runner; it decides prefix
                    # caching only, not the planned layout (equal capacity both ways)
                    bounded_replay=False,
                    block_size=swa_rows.get(cache.layer, UPSTREAM_SWA_BLOCK),
                    head_dim=model.head_dim,
                    window_size=model.window,
                    dtype=found.torch_dtype,
                    cache_config=cache_config,
                    packed_bytes_per_token=found.swa_bytes,
                    packed_page_alignment=found.page_alignment,
                    packed_block_stride_alignment=found.swa_block_stride_alignment,
                ),
            )
        elif cache.kind is CacheKind.COMPRESSED:
            described[cache.name] = (
                attention.DeepseekV4Attention,
                SimpleNamespace(
                    backend_cls=cls.backend_cls,
                    is_kv_source=True,
                    kv_cache_dtype=found.kv_cache_dtype,
                    kv_cache_torch_dtype=found.torch_dtype,
                    head_dim=model.head_dim,
                    compress_ratio=cache.compress_ratio,
                    kv_page_alignment=found.page_alignment,
                    compressed_bytes_per_token=found.compressed_bytes,
                ),
            )
        elif cache.kind is CacheKind.COMPRESSOR_STATE:
            described[cache.name] = (
                compressor.CompressorStateCache,
                SimpleNamespace(
                    block_size=ring_rows, state_dim=2 * model.head_dim, dtype=_float32()
                ),
            )
        else:
            described[cache.name] = (
                attention.DeepseekV4IndexerCache,
                SimpleNamespace(
                    head_dim=indexer_row,
                    dtype=_uint8(),
                    cache_config=cache_config,
                    compress_ratio=cache.compress_ratio,
                    sparse_logits=engine.indexer_sparse_logits,
                    rocm_mxfp4=False,  # SM12x is not ROCm
                ),
            )
    return described


def _float32() -> object:
    import torch

    return torch.float32


def _uint8() -> object:
    import torch

    return torch.uint8


def with_block_size(vllm_config: Any, block_size: int) -> Any:
    """A shallow copy of ``vllm_config`` whose cache config (itself a copy)
    has ``block_size``: what the engine's config is for that block size."""
    config = copy.copy(vllm_config)
    cache_config = copy.copy(vllm_config.cache_config)
    cache_config.block_size = block_size
    object.__setattr__(config, "cache_config", cache_config)
    return config


def model_specs(
    vllm_config: object, engine: EngineConfig, block_size: int, swa_rows: Mapping[int, int]
) -> dict[str, object]:
    """Upstream's spec of every cache of the full model at ``block_size``,
    with the sliding-window caches of ``swa_rows`` (layer -> rows; others 32),
    from vLLM's own spec producers; also the backends, for layout resolution."""
    assert engine.model is not None, "callers check the layout first"
    config = with_block_size(vllm_config, block_size)
    # vLLM's resolution writes the KV record back onto the cache config as the
    # first attention layer is built; the specs are what they are after that
    records(engine, config.cache_config)
    described = _descriptions(engine, engine.model, config.cache_config, swa_rows)
    return {name: _unwrapped(cls)(desc, config) for name, (cls, desc) in described.items()}


def backends(vllm_config: Any, engine: EngineConfig) -> list[type]:
    """The attention backends of every cache of the full model."""
    assert engine.model is not None, "callers check the layout first"
    described = _descriptions(engine, engine.model, vllm_config.cache_config, {})
    return sorted({cls.get_attn_backend(desc) for cls, desc in described.values()}, key=str)


def mismatch(
    vllm_config: Any, engine: EngineConfig, layer: int, kind: CacheKind, spec: object
) -> str | None:
    """How the live ``spec`` of ``layer``'s ``kind`` cache (as vLLM's own
    producer gave it) differs from its description, or None where they agree."""
    if engine.model is None:
        return None
    block_size = vllm_config.cache_config.block_size
    described = model_specs(vllm_config, engine, block_size, {})
    name = next((c.name for c in caches(engine.model) if c.layer == layer and c.kind is kind), None)
    expected = None if name is None else described[name]
    if expected == spec:
        return None
    return f"layer {layer} {kind.value}: vLLM's {spec!r}, described {expected!r}"
