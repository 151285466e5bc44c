"""A tiny DeepSeek-V4.1 KV layout, planned, allocated and bound by vLLM's own code.

Layers (:class:`TinyModel`), compress ratios ``2, 1, 0``: one kv/index source
of each ratio (compressed KV cache, indexer K cache, and for ratio 2 the
compressor's state ring), then a sliding-window (SWA) only layer after the last
source, which makes vLLM's decoder replay run the last source and it on each
long prefill's last window.  Every layer has its own SWA cache, built with
bounded replay on (vLLM's default), so a prefix hit replays its last window.
The KV caches (sliding-window and compressed) hold the fp8_ds_mla record the
release's layer writes on the GPU's arch (:func:`kv_records`): on SM100 the
V4.1 MXFP8 record (528 B, pages aligned to 512 B, SWA blocks of whole rows of
both records), elsewhere (SM12x, SM90) the V4 record (584 B, pages aligned to
576 B); the indexer caches hold 132-B fp8 rows.

Everything below the layers is vLLM's: the cache modules and spec producers
(``DeepseekV4SWACache``, ``DeepseekV4IndexerCache``, ``CompressorStateCache``,
``DeepseekV4Attention.get_kv_cache_spec`` on an instance of the SM120 attention
class), ``customize_attention_spec``, the planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``), ``prepare_kernel_block_sizes``, the
metadata builders (``AttentionGroup.create_metadata_builders``), the allocation
(``allocate_kv_cache``), the kernel views (``map_kv_caches_to_kernel_blocks``),
the bindings (each module's ``bind_kv_cache``) and the new-block zeroer
(``KVBlockZeroer``).  Only the first phase of vLLM's ``init_attn_backend``
(one ``AttentionGroup`` per backend and spec within a cache group) is redone
here, because it looks the layers up as fully built attention modules, whose
``__init__`` needs a GPU and weights.

Geometries (:data:`GEOMETRIES`) differ only in whether and how the fix is
applied: its default (the interleaved split), its per-ratio fallback (chosen
by the fix itself because a NixlConnector is configured), upstream's own
layout with the block size upstream starts with on SM12x, and the control
(the split with the ratio-1 slot translation taken out: the bug class of vLLM
PR #56509).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import torch

PAGE_ALIGN = 576  # the layer's kv_page_alignment for V4 records (their TMA stride)
MXFP8_PAGE_ALIGN = 512  # and for V4.1 records
INDEXER_ROW = 132  # 128 fp8 + one fp32 scale
STATE_DIM = 1024  # compressor ring row: kv state + score state
STOCK_SWA_BLOCK = 32  # what DeepseekV4Attention.__init__ passes


@dataclass(frozen=True)
class TinyModel:
    # Per layer; the last ``drafter_layers`` are a DSpark drafter's
    # sliding-window-only layers, numbered past the backbone as vLLM numbers
    # them, so the fix gives them its drafter page size.
    compress_ratios: tuple[int, ...] = (2, 1, 0, 0)
    drafter_layers: int = 1
    kv_sources: tuple[int, ...] = (0, 1)
    sliding_window: int = 128
    index_topk: int = 64
    q_heads: int = 8  # smallest head count FlashInfer's SM120 kernels take
    index_heads: int = 32  # what DeepGEMM's paged MQA logits kernels take
    block_size: int = 128  # the issue's --block-size
    # A tight pool, as on a loaded server: a request admitted after another
    # finished gets that request's freed blocks, stale contents and all, and a
    # write that misses its page is likely to land in another cache's page.
    num_blocks: int = 40
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 4
    max_model_len: int = 1024
    rms_norm_eps: float = 1e-6
    # DSpark's num_speculative_tokens: the builders then take a verify step's
    # 1 + drafts tokens per request as decodes, as vLLM's do.
    speculative_tokens: int = 0

    def source_of(self, layer: int) -> int | None:
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_sources if s <= layer)

    def without_drafter(self) -> TinyModel:
        """The backbone alone: upstream's own layout (no fix) has nothing that
        tells a drafter's pages apart, and at its 32-token sliding-window
        pages one group more would outgrow the tight pool."""
        if not self.drafter_layers:
            return self
        return dataclasses.replace(
            self,
            compress_ratios=self.compress_ratios[: self.backbone_layers],
            drafter_layers=0,
        )

    @property
    def backbone_layers(self) -> int:
        return len(self.compress_ratios) - self.drafter_layers

    @property
    def cut(self) -> int:
        """The last kv source: decoder replay runs the layers from here on."""
        return max(self.kv_sources)


@dataclass(frozen=True)
class KvRecords:
    """The records a DeepSeek-V4.1 layer's KV caches hold on this arch under
    fp8_ds_mla (``--kv-cache-dtype fp8``), and their alignments."""

    swa_bytes_per_token: int
    compressed_bytes_per_token: int
    page_alignment: int  # the layer's kv_page_alignment: both caches' pages
    block_stride_alignment: int | None  # the SWA cache's packed_block_stride_alignment
    mxfp8: bool  # the V4.1 MXFP8 record (else the V4 one)


def kv_records() -> KvRecords:
    """What ``DeepseekV4Attention.__init__`` derives for its caches: its
    ``kv_mxfp8`` (the release's ``_use_v41_mxfp8_kv_record``: SM100) picks the
    record, named by the width its writers dispatch on (``cache_utils``'s
    constants); under fp8_ds_mla the compressed cache holds the same record
    (288-B NVFP4 is nvfp4_ds_mla's); the page alignment is 512 for V4.1
    records and 576 for V4's; with V4.1 records the SWA cache's blocks hold
    whole rows of both (the lcm of the two widths) where the release's
    ``DeepseekV4SWACache`` takes that (0.33.0 on).
    tests/dsv41_sm120_geometry/test_selftest_kernel_calls.py evaluates the layer's own statements
    on each arch and compares."""
    import inspect
    import math

    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.common.ops import cache_utils

    mxfp8 = v41._use_v41_mxfp8_kv_record()
    swa = cache_utils.V41_BYTES_PER_TOKEN if mxfp8 else cache_utils.V4_BYTES_PER_TOKEN
    compressed = swa
    takes_stride = (
        "packed_block_stride_alignment" in inspect.signature(v41.DeepseekV4SWACache).parameters
    )
    return KvRecords(
        swa_bytes_per_token=swa,
        compressed_bytes_per_token=compressed,
        page_alignment=MXFP8_PAGE_ALIGN if mxfp8 else PAGE_ALIGN,
        block_stride_alignment=math.lcm(swa, compressed) if mxfp8 and takes_stride else None,
        mxfp8=mxfp8,
    )


@dataclass(frozen=True)
class Geometry:
    name: str
    title: str
    # "fix" (must pass), "control" (must be caught), "upstream" (informative),
    # "dspark" (top-k bounds of a long DSpark prefill: must pass, its own control caught)
    role: str
    via_plugin: bool = True
    kv_connector: bool = False  # configure a KV connector: the fix must fall back
    untranslated: bool = False  # take the fix's ratio-1 slot translation out


GEOMETRIES: dict[str, Geometry] = {
    g.name: g
    for g in (
        Geometry("split", "fix, default: interleaved split", "fix"),
        Geometry(
            "fallback",
            "fix, fallback: per-ratio (chosen: NixlConnector configured)",
            "fix",
            kv_connector=True,
        ),
        Geometry("upstream", "upstream, no fix", "upstream", via_plugin=False),
        Geometry(
            "control",
            "control: split, ratio-1 writers untranslated (#56509)",
            "control",
            untranslated=True,
        ),
        Geometry(
            "dspark-long-prefill",
            "DSpark: 12,288-token prefill in 2,048-token chunks, indexer top-k bounds (#56771)",
            "dspark",
        ),
    )
}


# --------------------------------------------------------------------------
# Configuration: real vLLM sub-configs, assembled without VllmConfig (whose
# construction needs a device).
# --------------------------------------------------------------------------


class DSparkConfig(SimpleNamespace):
    """The fields of a DSpark ``SpeculativeConfig`` that the planner and the
    attention builders read; its predicates (``use_eagle()``,
    ``use_dspark()``, ...) are the release's own methods, run on these fields
    (building the real one needs the drafter's model config)."""

    def __getattr__(self, name: str) -> object:
        from vllm.config import SpeculativeConfig

        method = getattr(SpeculativeConfig, name)
        if not callable(method):
            raise AttributeError(name)
        return method.__get__(self)


def make_config(model: TinyModel, block_size: int, kv_connector: bool = False) -> SimpleNamespace:
    """The configuration a ``vllm serve --block-size block_size`` of the tiny
    model has; the pool holds as many tokens at any block size."""
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
    cache = CacheConfig(block_size=block_size, cache_dtype="fp8_ds_mla")
    cache.kv_cache_layout = "BLHNC"  # the indexer admits only BLHNC / BLNHC
    cache.num_gpu_blocks_override = model.num_blocks * model.block_size // block_size
    cache.enable_prefix_caching = True
    hf = DeepseekV41Config(
        text_config=dict(
            num_hidden_layers=model.backbone_layers,
            compress_ratios=list(model.compress_ratios[: model.backbone_layers]),
            kv_source_layer_ids=list(model.kv_sources),
            index_source_layer_ids=list(model.kv_sources),
            sliding_window=model.sliding_window,
            index_topk=model.index_topk,
            index_n_heads=model.index_heads,
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
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf, hf_text_config=hf, max_model_len=model.max_model_len
        ),
        cache_config=cache,
        scheduler_config=scheduler,
        attention_config=attention,
        parallel_config=ParallelConfig(),
        compilation_config=CompilationConfig(),
        speculative_config=(
            DSparkConfig(
                method="dspark",
                num_speculative_tokens=model.speculative_tokens,
                max_num_new_slots_for_drafting=0,
                parallel_drafting=False,
                disable_eagle_block_drop=False,
                enable_adaptive_verification=False,
                draft_model_config=None,
                num_speculative_tokens_per_batch_size=None,
            )
            if model.speculative_tokens
            else None
        ),
        kv_transfer_config=(
            # A connector the split is not reviewed with (it moves per-layer pages).
            KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
            if kv_connector
            else None
        ),
        kernel_config=SimpleNamespace(enable_jit_warmup=False),
        use_v2_model_runner=True,
        num_speculative_tokens=model.speculative_tokens,
    )
    _derived_properties(config)
    return config


def _derived_properties(config: SimpleNamespace) -> None:
    """What ``VllmConfig`` derives from these sub-configs and vLLM's planner
    reads (the tokens in flight that sliding-window specs reserve for, from
    0.32.0 on; the fix plans its layouts with that planner), computed by
    ``VllmConfig``'s own properties."""
    from vllm.config import VllmConfig

    for name in ("max_concurrent_batches", "max_in_flight_tokens"):
        derived = getattr(VllmConfig, name, None)
        if isinstance(derived, property) and derived.fget is not None:
            setattr(config, name, derived.fget(config))


def upstream_block_size() -> int:
    """The ``--block-size`` upstream starts with on SM12x: the kernel block its
    FlashInfer and indexer backends declare there (128 up to 0.33.0; 64 from
    0.34.0, where 128 fails at start-up)."""
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLASparseBackend,
    )
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend

    sizes = [
        int(size)
        for backend in (DeepseekV4FlashInferMLASparseBackend, DeepseekV41IndexerBackend)
        for size in backend.get_supported_kernel_block_sizes()
        if isinstance(size, int)
    ]
    return min(sizes) if sizes else 128


# --------------------------------------------------------------------------
# Layout.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheModule:
    """One KV cache of the tiny model as its layer builds it, before vLLM plans it."""

    name: str
    kind: str  # "swa" | "compressed" | "indexer" | "ring"
    layer: int
    ratio: int
    module: Any  # the vLLM module (or attention stand-in self) whose bind_kv_cache binds it
    backend: type[Any]  # the vLLM attention backend class of its layer


@dataclass(frozen=True)
class CacheGrouping:
    """Where vLLM's planner put one cache: its spec, group and attention group."""

    spec: Any  # the layer's spec as grouped (per layer, not per group)
    group_id: int
    attn_group: Any


@dataclass(frozen=True)
class CacheLayer(CacheGrouping, CacheModule):
    """One KV cache of the tiny model, planned, allocated and bound."""

    manager_view: torch.Tensor  # [blocks, H, N, C] from allocate_kv_cache
    bound: torch.Tensor  # what the layer holds after bind_kv_cache

    @classmethod
    def of(
        cls,
        cache: CacheModule,
        grouping: CacheGrouping,
        manager_view: torch.Tensor,
        bound: torch.Tensor,
    ) -> CacheLayer:
        return cls(
            **{f.name: getattr(cache, f.name) for f in dataclasses.fields(CacheModule)},
            **{f.name: getattr(grouping, f.name) for f in dataclasses.fields(CacheGrouping)},
            manager_view=manager_view,
            bound=bound,
        )


@dataclass
class Layout:
    geometry: Geometry
    model: TinyModel
    config: SimpleNamespace
    device: torch.device
    block_size: int  # the --block-size the specs were given
    caches: dict[str, CacheLayer]
    readers: dict[int, Any]  # layer -> SM120 attention object whose methods read its caches
    kv_cache_config: Any
    attn_groups: list[list[object]]
    kernel_block_sizes: list[int]
    guard_error: str | None  # vLLM's refusal to map a split, if any
    storage: torch.Tensor  # the whole KV allocation, flat uint8
    kv_records: KvRecords  # what the sliding-window and compressed caches hold
    zeroer: Any = None  # vLLM's KVBlockZeroer over the bound views

    def group_block_size(self, gid: int) -> int:
        return cast(int, self.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size)

    def by_kind(self, kind: str) -> list[CacheLayer]:
        return [c for c in self.caches.values() if c.kind == kind]

    def find(self, kind: str, layer: int) -> CacheLayer:
        return next(c for c in self.caches.values() if c.kind == kind and c.layer == layer)

    def own_bytes(
        self, cache: CacheLayer, block_ids: list[int], padded: bool = True
    ) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of ``cache``'s pages in the given manager
        blocks: its kernel pages where its blocks are split into kernel
        blocks (kernel block j of block b is ``b * kernel_block_stride + j``),
        else its manager pages.  ``padded``: with the alignment padding that
        ends a page, else only the bytes of its rows (what a kernel reads and
        vLLM's zeroer clears).  Block 0, vLLM's null block, owns nothing."""
        ids = [b for b in block_ids if b > 0]
        group = cache.attn_group
        kernel = getattr(group, "kernel_block_size", None)
        split = kernel is not None
        view = cache.bound if split else cache.manager_view
        size = view.element_size()
        if padded:
            spec = cache.spec.copy_with_new_block_size(kernel) if split else cache.spec
            page = spec.page_size_bytes
        else:
            page = size * int(torch.tensor(view.shape[1:]).prod())
        per_block = cache.spec.block_size // kernel if split else 1
        stride = (group.kernel_block_stride or per_block) if split else 1
        return [
            (
                size * (view.storage_offset() + (b * stride + j) * view.stride(0)),
                size * (view.storage_offset() + (b * stride + j) * view.stride(0)) + page,
            )
            for b in ids
            for j in range(per_block)
        ]

    def mask_of(self, cache_blocks: dict[str, list[int]], padded: bool = True) -> torch.Tensor:
        """Bytes of the allocation that are the given caches' own pages in the
        given blocks."""
        mask = torch.zeros(self.storage.numel(), dtype=torch.bool, device=self.storage.device)
        for name, ids in cache_blocks.items():
            for start, end in self.own_bytes(self.caches[name], ids, padded):
                mask[start:end] = True
        return mask


def _new_sm120_attention(
    prefix: str, layer: int, ratio: int, model: TinyModel, device: torch.device, records: KvRecords
) -> Any:  # vLLM's DeepseekV4FlashInferSM120Attention
    """The SM120 FlashInfer attention class, without its ``__init__`` (which
    needs a GPU, tensor-parallel groups and weights): the attributes its spec
    producer and its ``_forward_decode`` / ``_forward_prefill`` read."""
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as SM120Attention,
    )

    attn = SM120Attention.__new__(SM120Attention)
    torch.nn.Module.__init__(attn)
    attn.prefix = prefix
    attn.layer_index = layer
    attn.is_kv_source = layer in model.kv_sources
    attn.kv_cache_dtype = "fp8_ds_mla"
    attn.kv_cache_torch_dtype = torch.uint8
    attn.head_dim = 512
    attn.compress_ratio = ratio
    # What the layer's __init__ sets on this arch (its spec producer reads
    # the alignment and the compressed record).
    attn.kv_mxfp8 = records.mxfp8
    attn.kv_page_alignment = records.page_alignment
    attn.compressed_bytes_per_token = records.compressed_bytes_per_token
    attn.kv_cache = torch.tensor([])
    attn.scale = attn.head_dim**-0.5
    attn.topk_indices_buffer = torch.full(
        (model.max_num_batched_tokens, model.index_topk), -1, dtype=torch.int32, device=device
    )
    attn.attn_sink = torch.zeros(model.q_heads, dtype=torch.float32, device=device)
    # What DeepseekV4Attention.__init__ sets for _fused_qnorm_rope_kv_insert,
    # the main forward's SWA writer (one GPU, no context parallelism); the
    # self-test points ``rotary_emb`` at its own cos/sin table per run.
    attn.n_local_heads = model.q_heads
    attn.padded_heads = attn.get_padded_num_q_heads(model.q_heads)
    attn.eps = model.rms_norm_eps
    attn.use_pcp = False
    attn.max_num_batched_tokens = model.max_num_batched_tokens
    attn._pads_q_by_copy = False  # only 32 of 64 padded heads pad by copy
    return attn


def _make_caches(
    model: TinyModel, cfg: SimpleNamespace, device: torch.device, records: KvRecords
) -> tuple[dict[str, CacheModule], dict[int, object]]:
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41 import attention
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekSparseSWAFlashInferBackend,
        DeepseekV4FlashInferMLASparseBackend,
    )

    caches: dict[str, CacheModule] = {}
    readers: dict[int, object] = {}
    packing: dict[str, object] = {
        "packed_bytes_per_token": records.swa_bytes_per_token,
        "packed_page_alignment": records.page_alignment,
    }
    if records.block_stride_alignment is not None:  # 0.33.0 on, V4.1 records
        # FlashMLA reads the interleaved V4.1 records as rows of the whole
        # cache: the layer asks for blocks of whole rows of both records.
        packing["packed_block_stride_alignment"] = records.block_stride_alignment
    with set_current_vllm_config(cfg):
        for layer, ratio in enumerate(model.compress_ratios):
            prefix = f"model.layers.{layer}.self_attn"
            reader = _new_sm120_attention(prefix, layer, ratio, model, device, records)
            readers[layer] = reader
            # Built through the name DeepseekV4Attention.__init__ uses, with the
            # arguments it passes, so a fix that redirects that call takes part.
            swa = attention.DeepseekV4SWACache(
                head_dim=512,
                window_size=model.sliding_window,
                dtype=torch.uint8,
                prefix=f"{prefix}.swa_cache",
                cache_config=cfg.cache_config,
                backend_cls=DeepseekSparseSWAFlashInferBackend,
                block_size=STOCK_SWA_BLOCK,
                bounded_replay=True,
                **packing,
            )
            reader.swa_cache_layer = swa
            caches[swa.prefix] = CacheModule(
                swa.prefix, "swa", layer, ratio, swa, swa.get_attn_backend()
            )
            if layer not in model.kv_sources:
                continue
            # Registered in the forward context as DeepseekV4Attention.__init__ does.
            cfg.compilation_config.static_forward_context[prefix] = reader
            caches[prefix] = CacheModule(
                prefix, "compressed", layer, ratio, reader, DeepseekV4FlashInferMLASparseBackend
            )
            index = attention.DeepseekV4IndexerCache(
                head_dim=INDEXER_ROW,
                dtype=torch.uint8,
                prefix=f"{prefix}.indexer.k_cache",
                cache_config=cfg.cache_config,
                compress_ratio=ratio,
            )
            caches[index.prefix] = CacheModule(
                index.prefix, "indexer", layer, ratio, index, index.get_attn_backend()
            )
            if ratio > 1:
                ring = CompressorStateCache(
                    state_dim=STATE_DIM,
                    dtype=torch.float32,
                    prefix=f"{prefix}.compressor.state_cache",
                )
                caches[ring.prefix] = CacheModule(
                    ring.prefix, "ring", layer, ratio, ring, ring.get_attn_backend()
                )
    return caches, readers


def _spec_of(cache: CacheModule, cfg: SimpleNamespace) -> object:  # vLLM's KV-cache spec
    if cache.kind == "compressed":
        from vllm.models.deepseek_v41.attention import DeepseekV4Attention

        return DeepseekV4Attention.get_kv_cache_spec(cache.module, cfg)
    return cache.module.get_kv_cache_spec(cfg)


def _bind(cache: CacheModule, view: torch.Tensor) -> torch.Tensor:
    if cache.kind == "compressed":
        from vllm.models.deepseek_v41.attention import DeepseekV4Attention

        DeepseekV4Attention.bind_kv_cache(cache.module, view)
    else:
        cache.module.bind_kv_cache(view)
    return cache.module.kv_cache


def _kv_cache_planner() -> ModuleType:
    """vLLM's module with get_kv_cache_groups / get_kv_cache_config_from_groups
    (``kv_cache_utils`` in 0.32, ``kv_cache_planning`` from 0.33)."""
    try:
        from vllm.v1.core import kv_cache_planning as planner
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planner
    return cast(ModuleType, planner)


def _upstream_refusal(
    kv_caches: dict[str, torch.Tensor],
    groups: list[Any],  # vLLM's AttentionGroups
) -> str | None:
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


def _specs(modules: dict[str, CacheModule], cfg: SimpleNamespace) -> dict[str, object]:
    """Each cache's spec as ``attn_utils.get_kv_cache_spec`` builds it."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    specs = {}
    for name, module in modules.items():
        spec = _spec_of(module, cfg)
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(module.backend, spec)
        specs[name] = spec
    return specs


def _attention_groups(
    kv_cache_config: Any, modules: dict[str, CacheModule]
) -> tuple[list[list[Any]], dict[str, CacheGrouping]]:
    """Phase 1 of ``init_attn_backend``: one ``AttentionGroup`` per (backend,
    spec) in each KV-cache group; and where each cache went."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import AttentionGroup

    attn_groups: list[list[object]] = []
    grouping: dict[str, CacheGrouping] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        keyed: dict[tuple[str, object], Any] = {}  # (backend, spec) -> AttentionGroup
        for name in group.layer_names:
            backend = modules[name].backend
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            key = (backend.full_cls_name(), spec)
            if key not in keyed:
                keyed[key] = AttentionGroup(backend, [name], spec, gid)
            else:
                keyed[key].layer_names.append(name)
            grouping[name] = CacheGrouping(spec, gid, keyed[key])
        attn_groups.append(list(keyed.values()))
    return attn_groups, grouping


def build_layout(
    geometry: Geometry, model: TinyModel, sentinel: int, device: torch.device | str = "cpu"
) -> Layout:
    """Specs, groups, allocation, attention groups and builders, kernel views,
    bindings and the zeroer, on ``device``; the allocation filled with ``sentinel``."""
    from vllm.v1.worker.utils import (
        KVBlockZeroer,
        allocate_kv_cache,
        map_kv_caches_to_kernel_blocks,
        prepare_kernel_block_sizes,
    )

    from .reference import storage_bytes

    device = torch.device(device)
    block_size = model.block_size if geometry.via_plugin else upstream_block_size()
    cfg = make_config(model, block_size, kv_connector=geometry.kv_connector)
    records = kv_records()
    modules, readers = _make_caches(model, cfg, device, records)

    planner = _kv_cache_planner()
    groups = planner.get_kv_cache_groups(cfg, _specs(modules, cfg))
    kv_cache_config = planner.get_kv_cache_config_from_groups(cfg, groups, 1 << 40)
    attn_groups, grouping = _attention_groups(kv_cache_config, modules)

    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    for gid, groups_of_gid in enumerate(attn_groups):
        for group in groups_of_gid:
            group.create_metadata_builders(cfg, device, kernel_block_size=kernel_block_sizes[gid])

    kv_caches = allocate_kv_cache(
        kv_cache_config,
        device,
        cfg.cache_config.get_resolved_kv_cache_layout(),
        kernel_block_sizes,
    )
    all_groups = [g for gs in attn_groups for g in gs]
    guard_error = _upstream_refusal(kv_caches, all_groups)
    bindable = map_kv_caches_to_kernel_blocks(kv_caches, all_groups)
    caches = {
        name: CacheLayer.of(module, grouping[name], kv_caches[name], _bind(module, bindable[name]))
        for name, module in modules.items()
    }

    storage = storage_bytes(next(iter(kv_caches.values())))
    storage.fill_(sentinel)
    zeroer = KVBlockZeroer(
        device,
        iter(all_groups),
        kernel_block_sizes,
        cfg.compilation_config.static_forward_context,
        kv_cache_config.num_blocks,
    )
    return Layout(
        geometry=geometry,
        model=model,
        config=cfg,
        device=device,
        block_size=block_size,
        caches=caches,
        readers=readers,
        kv_cache_config=kv_cache_config,
        attn_groups=attn_groups,
        kernel_block_sizes=kernel_block_sizes,
        guard_error=guard_error,
        storage=storage,
        kv_records=records,
        zeroer=zeroer,
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
            + (
                f", kernel block {kernel} (stride {cache.attn_group.kernel_block_stride})"
                if kernel
                else ""
            )
            + f"; bound view {tuple(view.shape)} rows/page {view.shape[1]}"
            f" page stride {view.stride(0)}"
        )
    return lines
