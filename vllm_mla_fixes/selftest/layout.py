"""A tiny DeepSeek-V4.1 KV layout, allocated and bound by vLLM's own code.

Layers (``TinyModel``): compress ratios ``0, 2, 1``: a sliding-window-only
layer, then one kv/index source of each ratio (compressed KV cache, indexer K
cache, and for ratio 2 the compressor's state ring).  Every layer has its own
sliding-window (SWA) cache.  (Consumer layers, which read a source's caches
through the same views and block tables, add no cache and are left out to keep
the interpreter time down.)  The page records are the SM120
ones: fp8_ds_mla V4 records (584 B, pages aligned to 576 B) and 132-B fp8
indexer rows.

The cache modules and specs are vLLM's (``DeepseekV4SWACache``,
``DeepseekV4IndexerCache``, ``CompressorStateCache``, and
``DeepseekV4Attention.get_kv_cache_spec`` called on an instance of the SM120
attention class, registered in the forward context, whose ``__init__`` (which
needs a GPU) is replaced by setting the attributes it reads), and so are the grouping
(``get_kv_cache_groups``), the allocation (``get_kv_cache_config_from_groups``,
``allocate_kv_cache``), the attention groups' kernel block sizes
(``prepare_kernel_block_sizes``, ``AttentionGroup.create_metadata_builders``),
the kernel views (``map_kv_caches_to_kernel_blocks``) and the bound views
(each module's ``bind_kv_cache``).  Only the first phase of vLLM's
``init_attn_backend`` (one ``AttentionGroup`` per backend and spec within a
cache group) is redone here, because it looks the layers up as fully built
attention modules.

Geometries (what differs is only the block sizes handed to the specs, the
kernel block sizes the backends declare, and -- through the fix module -- the
kernel views and the slots the ratio-1 writers get):

``per-ratio``
    The fix's fallback, built directly: SWA 64, ratio-1 caches 64 tokens/block,
    ratio-2 caches 128 (64 states); backends declare 64 for ratio-1 specs and
    128 for ratio-2.  Every FlashInfer page holds 64 rows, every indexer page
    64 states, no block is split.
``plugin``
    The project's fix module (``vllm_mla_fixes.fixes.dsv41_sm120_geometry``)
    applied to the installed vLLM, with ``--block-size 128`` and the stock
    SWA block size of 32 at the call site: its default geometry, the
    interleaved split (128-token blocks; the ratio-1 compressed/indexer pair
    split into 64-state kernel pages interleaved in units of one compressed
    and one indexer page; ratio-1 writers on kernel-block slots).
``plugin-fallback``
    The fix module with a KV connector configured: it must choose the
    per-ratio geometry by itself.
``split-untranslated``
    Control (the bug class of vLLM PR #56509): the fix's interleaved split
    with the ratio-1 slot translation taken out, so the ratio-1 writers keep
    their manager-block slots while the readers use the kernel block table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

SWA_RECORD = 584
PAGE_ALIGN = 576
INDEXER_ROW = 132  # 128 fp8 + one fp32 scale
STATE_DIM = 1024  # compressor ring row: kv state + score state


@dataclass(frozen=True)
class TinyModel:
    compress_ratios: tuple[int, ...] = (0, 2, 1)
    kv_sources: tuple[int, ...] = (1, 2)
    sliding_window: int = 128
    index_topk: int = 64
    q_heads: int = 8  # smallest head count FlashInfer's SM120 kernels take
    seq_lens: tuple[int, ...] = (150, 70)
    block_size: int = 128  # the issue's --block-size
    # A tight pool (the per-ratio geometry needs 25 blocks besides the null
    # block), as on a loaded server: blocks are nearly all in use, so a write
    # that misses its page is likely to hit another cache's page.
    num_blocks: int = 26
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 4
    max_model_len: int = 1024
    rms_norm_eps: float = 1e-6

    def source_of(self, layer: int) -> int | None:
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_sources if s <= layer)


@dataclass(frozen=True)
class Geometry:
    name: str
    swa_block: int
    block_for_ratio: dict[int, int] = field(hash=False)
    kernel_for_ratio: dict[int, int] = field(hash=False)
    via_plugin: bool = False
    kv_connector: bool = False  # configure a KV connector (the fix must fall back)
    untranslated: bool = False  # take the fix's ratio-1 slot translation out


GEOMETRIES: dict[str, Geometry] = {
    g.name: g
    for g in (
        Geometry("per-ratio", 64, {1: 64, 2: 128}, {1: 64, 2: 128}),
        Geometry("plugin", 32, {1: 128, 2: 128}, {}, via_plugin=True),
        Geometry("plugin-fallback", 32, {1: 128, 2: 128}, {}, via_plugin=True,
                 kv_connector=True),
        Geometry("split-untranslated", 32, {1: 128, 2: 128}, {}, via_plugin=True,
                 untranslated=True),
    )
}



# --------------------------------------------------------------------------
# Configuration: real vLLM sub-configs, assembled without VllmConfig (whose
# construction needs a device).
# --------------------------------------------------------------------------


def make_config(model: TinyModel, kv_connector: bool = False) -> SimpleNamespace:
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        CompilationConfig,
        KVTransferConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    # fp8_ds_mla is what --kv-cache-dtype fp8 resolves to for this backend
    # (_resolve_dsv4_kv_cache_dtype writes it back onto the cache config).
    cache = CacheConfig(block_size=model.block_size, cache_dtype="fp8_ds_mla")
    cache.kv_cache_layout = "BLHNC"  # the indexer admits only BLHNC / BLNHC
    cache.num_gpu_blocks_override = model.num_blocks
    hf = DeepseekV41Config(
        text_config=dict(
            num_hidden_layers=len(model.compress_ratios),
            compress_ratios=list(model.compress_ratios),
            kv_source_layer_ids=list(model.kv_sources),
            index_source_layer_ids=list(model.kv_sources),
            sliding_window=model.sliding_window,
            index_topk=model.index_topk,
            head_dim=512,
            qk_rope_head_dim=64,
            index_head_dim=128,
            rms_norm_eps=model.rms_norm_eps,
        )
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=model.max_num_batched_tokens,
        max_num_seqs=model.max_num_seqs,
        max_model_len=model.max_model_len,
        is_encoder_decoder=False,
    )
    attention = AttentionConfig()
    # What VllmConfig.__post_init__ resolves for max_model_len <= 256K.
    attention.sparse_mla_prefill_workspace_factor = 5
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf, hf_text_config=hf, max_model_len=model.max_model_len
        ),
        cache_config=cache,
        scheduler_config=scheduler,
        attention_config=attention,
        parallel_config=ParallelConfig(),
        compilation_config=CompilationConfig(),
        speculative_config=None,
        kv_transfer_config=(
            KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
            if kv_connector else None
        ),
        kernel_config=SimpleNamespace(enable_jit_warmup=False),
        use_v2_model_runner=True,
        num_speculative_tokens=0,
    )


def _config_with_block_size(cfg: SimpleNamespace, block_size: int) -> SimpleNamespace:
    out = copy.copy(cfg)
    out.cache_config = copy.copy(cfg.cache_config)
    out.cache_config.block_size = block_size
    return out


def _declaring(backend: type, sizes: dict[int, int]) -> type:
    """``backend`` declaring ``sizes[tokens_per_state]`` as its kernel block."""

    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        if kv_cache_spec is None:
            return [max(sizes.values())]
        return [sizes[int(kv_cache_spec.tokens_per_state)]]

    return type(
        f"{backend.__name__}Per{'_'.join(f'{k}x{v}' for k, v in sorted(sizes.items()))}",
        (backend,),
        {"get_supported_kernel_block_sizes": staticmethod(get_supported_kernel_block_sizes)},
    )


# --------------------------------------------------------------------------
# Layout.
# --------------------------------------------------------------------------


@dataclass
class CacheLayer:
    """One KV cache of the tiny model."""

    name: str
    kind: str  # "swa" | "compressed" | "indexer" | "ring"
    layer: int
    ratio: int
    module: Any  # the vLLM module (or stand-in self) whose bind_kv_cache binds it
    backend: type
    spec: Any = None  # the layer's spec as grouped (per layer, not per group)
    group_id: int = -1
    manager_view: torch.Tensor | None = None  # [blocks, H, N, C] from allocate_kv_cache
    bound: torch.Tensor | None = None  # what the layer holds after bind_kv_cache
    attn_group: Any = None


@dataclass
class Layout:
    geometry: Geometry
    model: TinyModel
    config: SimpleNamespace
    caches: dict[str, CacheLayer]
    kv_cache_config: Any
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]
    guard_error: str | None  # vLLM's refusal to map the split, if any
    storage: torch.Tensor  # the whole KV allocation, flat uint8

    def group_block_size(self, gid: int) -> int:
        return self.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size

    def by_kind(self, kind: str) -> list[CacheLayer]:
        return [c for c in self.caches.values() if c.kind == kind]

    def find(self, kind: str, layer: int) -> CacheLayer:
        return next(c for c in self.caches.values() if c.kind == kind and c.layer == layer)

    def own_bytes(self, cache: CacheLayer, block_ids) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of ``cache``'s pages in the given manager
        blocks: its kernel pages where its blocks are split into kernel
        blocks (kernel block j of block b is ``b * kernel_block_stride + j``),
        else its manager pages."""
        group = cache.attn_group
        kernel = getattr(group, "kernel_block_size", None)
        if kernel is None:
            view = cache.manager_view
            page = cache.spec.page_size_bytes
            return [
                (view.storage_offset() + b * view.stride(0),
                 view.storage_offset() + b * view.stride(0) + page)
                for b in block_ids
            ]
        view = cache.bound
        page = cache.spec.copy_with_new_block_size(kernel).page_size_bytes
        per_block = cache.spec.block_size // kernel
        stride = group.kernel_block_stride or per_block
        return [
            (view.storage_offset() + (b * stride + j) * view.stride(0),
             view.storage_offset() + (b * stride + j) * view.stride(0) + page)
            for b in block_ids
            for j in range(per_block)
        ]


def _make_caches(geometry: Geometry, model: TinyModel, cfg: SimpleNamespace):
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41 import attention
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekSparseSWAFlashInferBackend,
        DeepseekV4FlashInferMLASparseBackend,
    )
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as SM120Attention,
    )

    caches: dict[str, CacheLayer] = {}
    fi_backend = DeepseekV4FlashInferMLASparseBackend
    with set_current_vllm_config(cfg):
        for layer, ratio in enumerate(model.compress_ratios):
            prefix = f"model.layers.{layer}.self_attn"
            # Built through the name DeepseekV4Attention.__init__ uses, so a
            # fix that redirects that call site takes part.
            swa = attention.DeepseekV4SWACache(
                head_dim=512,
                window_size=model.sliding_window,
                dtype=torch.uint8,
                prefix=f"{prefix}.swa_cache",
                cache_config=cfg.cache_config,
                backend_cls=DeepseekSparseSWAFlashInferBackend,
                block_size=geometry.swa_block,
                packed_bytes_per_token=SWA_RECORD,
                packed_page_alignment=PAGE_ALIGN,
            )
            caches[swa.prefix] = CacheLayer(
                swa.prefix, "swa", layer, ratio, swa, swa.get_attn_backend()
            )
            if layer not in model.kv_sources:
                continue
            block = geometry.block_for_ratio[ratio]
            ratio_cfg = cfg if geometry.via_plugin else _config_with_block_size(cfg, block)
            # The SM120 FlashInfer attention class, registered in the forward
            # context as its __init__ does (which needs a GPU and is not run),
            # with what __init__ sets on a kv-source layer for get_kv_cache_spec.
            attn_self = SM120Attention.__new__(SM120Attention)
            torch.nn.Module.__init__(attn_self)
            attn_self.is_kv_source = True
            attn_self.kv_cache_dtype = "fp8_ds_mla"
            attn_self.kv_cache_torch_dtype = torch.uint8
            attn_self.head_dim = 512
            attn_self.compress_ratio = ratio
            attn_self.kv_page_alignment = PAGE_ALIGN
            attn_self.compressed_bytes_per_token = SWA_RECORD
            attn_self.kv_cache = torch.tensor([])
            attn_self.prefix = prefix
            cfg.compilation_config.static_forward_context[prefix] = attn_self
            attn_self.spec_source = (attention.DeepseekV4Attention, ratio_cfg)
            caches[prefix] = CacheLayer(prefix, "compressed", layer, ratio, attn_self, fi_backend)
            index = attention.DeepseekV4IndexerCache(
                head_dim=INDEXER_ROW,
                dtype=torch.uint8,
                prefix=f"{prefix}.indexer.k_cache",
                cache_config=ratio_cfg.cache_config,
                compress_ratio=ratio,
            )
            caches[index.prefix] = CacheLayer(
                index.prefix, "indexer", layer, ratio, index, index.get_attn_backend()
            )
            if ratio > 1:
                ring = CompressorStateCache(
                    state_dim=STATE_DIM,
                    dtype=torch.float32,
                    prefix=f"{prefix}.compressor.state_cache",
                )
                caches[ring.prefix] = CacheLayer(
                    ring.prefix, "ring", layer, ratio, ring, ring.get_attn_backend()
                )
    return caches


def _spec_of(cache: CacheLayer, cfg: SimpleNamespace):
    if cache.kind == "compressed":
        attn_cls, ratio_cfg = cache.module.spec_source
        return attn_cls.get_kv_cache_spec(cache.module, ratio_cfg)
    return cache.module.get_kv_cache_spec(cfg)


def _bind(cache: CacheLayer, view: torch.Tensor) -> torch.Tensor:
    if cache.kind == "compressed":
        from vllm.models.deepseek_v41.attention import DeepseekV4Attention

        DeepseekV4Attention.bind_kv_cache(cache.module, view)
    else:
        cache.module.bind_kv_cache(view)
    return cache.module.kv_cache


def _kv_cache_planner():
    """vLLM's module with get_kv_cache_groups / get_kv_cache_config_from_groups
    (``kv_cache_utils`` in 0.32, ``kv_cache_planning`` from 0.33)."""
    try:
        from vllm.v1.core import kv_cache_planning as planner
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planner
    return planner


def _upstream_refusal(kv_caches, groups) -> str | None:
    """What vLLM's own ``map_kv_caches_to_kernel_blocks`` says about the
    kernel blocks these groups ask for (the fix replaces it to bind the
    interleaved ratio-1 pages): its error, or None if it maps them."""
    from vllm.v1.worker import utils

    upstream = getattr(utils.map_kv_caches_to_kernel_blocks, "__wrapped__", None)
    if upstream is None:
        return None
    split = [g for g in groups if g.kernel_block_size is not None]
    strides = [(g, g.kernel_block_stride) for g in split]
    try:
        upstream(kv_caches, split)
    except ValueError as exc:
        return str(exc)
    finally:
        for group, stride in strides:
            group.kernel_block_stride = stride
    return None


def build_layout(geometry: Geometry, model: TinyModel, sentinel: int) -> Layout:
    """Specs, groups, allocation, attention groups, kernel views, bindings."""
    from vllm.models.deepseek_v41.compressor import CompressorBackend
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import (
        AttentionGroup,
        allocate_kv_cache,
        customize_attention_spec,
        map_kv_caches_to_kernel_blocks,
        prepare_kernel_block_sizes,
    )

    from .reference import storage_bytes

    cfg = make_config(model, kv_connector=geometry.kv_connector)
    caches = _make_caches(geometry, model, cfg)
    if not geometry.via_plugin:
        for cache in caches.values():
            if cache.kind in ("compressed", "indexer"):
                cache.backend = _declaring(cache.backend, geometry.kernel_for_ratio)

    # Specs as attn_utils.get_kv_cache_spec builds them.
    specs = {}
    for name, cache in caches.items():
        spec = _spec_of(cache, cfg)
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(cache.backend, spec)
        specs[name] = spec

    planner = _kv_cache_planner()
    groups = planner.get_kv_cache_groups(cfg, specs)
    kv_cache_config = planner.get_kv_cache_config_from_groups(cfg, groups, 1 << 40)

    # Phase 1 of init_attn_backend: one AttentionGroup per (backend, spec).
    attn_groups: list[list[Any]] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        keyed: dict[tuple, Any] = {}
        for name in group.layer_names:
            cache = caches[name]
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            cache.spec = spec
            cache.group_id = gid
            key = (cache.backend.full_cls_name(), spec)
            if key not in keyed:
                keyed[key] = AttentionGroup(cache.backend, [name], spec, gid)
            else:
                keyed[key].layer_names.append(name)
            cache.attn_group = keyed[key]
        attn_groups.append(list(keyed.values()))

    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    device = torch.device("cpu")
    for gid, groups_of_gid in enumerate(attn_groups):
        for group in groups_of_gid:
            if group.backend is CompressorBackend:
                continue  # the ring is allocated but neither written nor read here
            group.create_metadata_builders(
                cfg, device, kernel_block_size=kernel_block_sizes[gid]
            )

    kv_caches = allocate_kv_cache(
        kv_cache_config, device, cfg.cache_config.get_resolved_kv_cache_layout(),
        kernel_block_sizes,
    )
    all_groups = [g for gs in attn_groups for g in gs]
    guard_error = _upstream_refusal(kv_caches, all_groups)
    bindable = map_kv_caches_to_kernel_blocks(kv_caches, all_groups)

    for name, cache in caches.items():
        cache.manager_view = kv_caches[name]
        cache.bound = _bind(cache, bindable[name])

    storage = storage_bytes(next(iter(kv_caches.values())))
    storage.fill_(sentinel)
    return Layout(
        geometry=geometry,
        model=model,
        config=cfg,
        caches=caches,
        kv_cache_config=kv_cache_config,
        attn_groups=attn_groups,
        kernel_block_sizes=kernel_block_sizes,
        guard_error=guard_error,
        storage=storage,
    )


def describe(layout: Layout) -> list[str]:
    """Human-readable lines: per cache, block size, page rows, page stride."""
    lines = []
    for cache in layout.caches.values():
        if cache.kind == "ring":
            continue
        view = cache.bound
        kernel = cache.attn_group.kernel_block_size
        lines.append(
            f"{cache.name}: group {cache.group_id} manager block "
            f"{layout.group_block_size(cache.group_id)}"
            + (f", kernel block {kernel} (stride {cache.attn_group.kernel_block_stride})"
               if kernel else "")
            + f"; bound view {tuple(view.shape)} rows/page {view.shape[1]}"
            f" page stride {view.stride(0)}"
        )
    return lines


__all__ = [
    "GEOMETRIES",
    "Geometry",
    "Layout",
    "TinyModel",
    "build_layout",
    "describe",
]
