"""DeepSeek-V4.1 SM120 page geometry on vLLM 0.32/0.33, driven through vLLM's own code on CPU.

The layers are real: ``DeepseekV4SWACache``, ``DeepseekV4IndexerCache`` and
``CompressorStateCache`` are constructed by their own ``__init__`` under a real
``VllmConfig`` -- the SWA cache through the name ``deepseek_v41.attention``
calls it by, with the arguments ``DeepseekV4Attention.__init__`` passes.  The
attention layer itself is an instance of ``DeepseekV4FlashInferSM120Attention``
(the class vLLM selects on SM120) whose cache attributes are set with the same
helpers its ``__init__`` uses; its ``__init__`` needs a GPU (CUDA events,
tensor-parallel groups, FlashInfer's SM120 module), so it is not run.

From the layers on, everything is vLLM's: the worker's spec collection
(``get_kv_cache_spec``, with ``customize_attention_spec``), the engine core's
layout resolution and planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``), the worker's ``AttentionGroup``s,
``prepare_kernel_block_sizes``, ``select_common_block_size`` (as
``AttentionGroup.create_metadata_builders`` calls it), ``allocate_kv_cache``,
``map_kv_caches_to_kernel_blocks`` and ``bind_kv_cache_to_layers``; then the
page sizes FlashInfer derives from the bound views and FlashInfer's own SM120
planner (0.7.0.post1) or static decode envelope (0.7.2.post1).

The ``VllmConfig`` and the platform answering as an SM120 device are
:mod:`~vllm_mla_fixes.fixes.dsv41_sm120_geometry.simulated`'s, the same that
``doctor``'s prediction builds.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.simulated import (
    DSV41_FLASH,
    STAND_IN_MAX_MODEL_LEN,
    EngineSettings,
    attach_model,
    make_vllm_config,
    sm120_platform,
)

if TYPE_CHECKING:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.upstream import Rejection

TINY_DSV41 = Path(__file__).resolve().parents[3] / "models" / "tiny_deepseek_v41" / "config.json"

# The report's failing call: TP8 (8 of 64 heads), 8 decode tokens, the
# 128-token window as SWA top-k.
REPORT_CALL = {"num_tokens": 8, "num_heads": 8, "topk": 128}
BLOCK_SIZE_ERROR = "No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128])."
INDEXER_BLOCK_SIZE_ERROR = "No common block size for 64 (DEEPSEEK_V41_INDEXER: [128])."
# 0.34.0: both backends take [64] on SM12x, so a packed 128-token block must be split.
SPLIT_ERROR = (
    "FLASHINFER_MLA_SPARSE_DSV41 needs 64-token kernel blocks, which packed 128-token "
    "KV cache blocks cannot be split into. Reduce --block-size to 64 or set "
    "VLLM_KV_CACHE_LAYOUT to a layer-compact layout (e.g. LBNHC)."
)
START_ERRORS = (BLOCK_SIZE_ERROR, SPLIT_ERROR)
CPU = torch.device("cpu")


def tiny_model() -> dict[str, Any]:
    with open(TINY_DSV41, encoding="utf-8") as f:
        return cast("dict[str, Any]", json.load(f)["text_config"])


def attention_prefix(layer: int) -> str:
    return f"model.layers.{layer}.attn"


# ------------------------------------------------------------------ the layers


def build_layers(
    vllm_config: Any,  # a vllm.config.VllmConfig
    model: dict[str, Any],
    drafter_ratios: tuple[int, ...] = (),
    only: Iterable[int] | None = None,
) -> dict[str, Any]:
    """Register the model's KV-cache layers in ``vllm_config``'s static forward
    context, as ``DeepseekV41ForCausalLM`` does on SM120; returns the attention layers.

    ``drafter_ratios``: one DSpark drafter layer per entry, numbered past the
    backbone with that compress ratio (DSpark's own are 0: the ratio list ends
    with the backbone), built as ``DSparkDeepseekV4Model`` builds its decoder
    layers and marked ``is_draft_layer`` as vLLM's speculator marks them."""
    from vllm.config import set_current_vllm_config

    cache_config = vllm_config.cache_config
    context = vllm_config.compilation_config.static_forward_context
    ratios = model["compress_ratios"]
    kv_sources = set(model["kv_source_layer_ids"])
    index_sources = set(model["index_source_layer_ids"])
    layers = {}
    backbone = model["num_hidden_layers"]
    attach_model(vllm_config, model, drafter_ratios)
    with set_current_vllm_config(vllm_config):
        for layer_id in range(backbone + len(drafter_ratios)) if only is None else only:
            drafter = layer_id >= backbone
            attn = _sm120_attention(
                layer_id,
                model,
                compress_ratio=int(
                    drafter_ratios[layer_id - backbone] if drafter else ratios[layer_id]
                ),
                # DeepseekV4Attention.__init__: only backbone layers own caches.
                is_kv_source=not drafter and layer_id in kv_sources,
                cache_config=cache_config,
            )
            prefix = attn.prefix
            context[prefix] = attn
            _register_caches(attn, model, cache_config, is_index_source=layer_id in index_sources)
            if drafter:
                for name in (prefix, attn.swa_cache_layer.prefix):
                    context[name].is_draft_layer = True
            layers[prefix] = attn
    return layers


def _sm120_attention(
    layer_id: int, model: dict[str, Any], compress_ratio: int, is_kv_source: bool, cache_config: Any
) -> Any:
    """An SM120 attention layer with only the cache attributes set (no weights)."""
    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferSM120Attention as SM120Attention,
    )

    attn = SM120Attention.__new__(SM120Attention)
    torch.nn.Module.__init__(attn)
    # What DeepseekV4Attention.__init__ sets for the caches, with its helpers.
    attn.prefix = attention_prefix(layer_id)
    attn.layer_id = layer_id
    attn.head_dim = model["head_dim"]
    attn.window_size = model["sliding_window"]
    attn.compress_ratio = compress_ratio
    attn.is_kv_source = is_kv_source
    attn.kv_cache_dtype, attn.kv_cache_torch_dtype = v41._resolve_dsv4_kv_cache_dtype(
        attn._uses_fp8_ds_mla_layout(),
        cache_config.cache_dtype,
        cache_config,
        attn.packed_kv_cache_dtype,
    )
    attn.kv_mxfp8 = v41._use_v41_mxfp8_kv_record()
    attn.swa_bytes_per_token = 528 if attn.kv_mxfp8 else 584
    attn.compressed_bytes_per_token = attn.swa_bytes_per_token
    attn.kv_page_alignment = 512 if attn.kv_mxfp8 else 576
    attn.kv_cache = torch.tensor([])
    return attn


def _register_caches(
    attn: Any, model: dict[str, Any], cache_config: Any, is_index_source: bool
) -> None:
    """The layer's sliding-window, compressor-state and indexer caches, built
    as DeepseekV4Attention.__init__ builds them (each registers itself in the
    current config's forward context)."""
    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.compressor import CompressorStateCache

    prefix = attn.prefix
    # The sliding-window cache, through the module name __init__ uses.
    attn.swa_cache_layer = v41.DeepseekV4SWACache(
        head_dim=attn.head_dim,
        window_size=attn.window_size,
        dtype=attn.kv_cache_torch_dtype,
        prefix=f"{prefix}.swa_cache",
        cache_config=cache_config,
        backend_cls=attn.swa_backend_cls,
        block_size=32,
        packed_bytes_per_token=attn.swa_bytes_per_token,
        packed_page_alignment=attn.kv_page_alignment,
        bounded_replay=False,
    )
    if attn.is_kv_source and attn.compress_ratio > 1:
        CompressorStateCache(
            state_dim=2 * attn.head_dim,
            dtype=torch.float32,
            prefix=f"{prefix}.compressor.state_cache",
        )
    if attn.is_kv_source and is_index_source:
        v41.DeepseekV4IndexerCache(
            head_dim=v41._indexer_k_cache_head_dim(model["index_head_dim"], False),
            dtype=torch.uint8,
            prefix=f"{prefix}.indexer.k_cache",
            cache_config=cache_config,
            compress_ratio=attn.compress_ratio,
        )


# -------------------------------------------------------------- vLLM's pipeline


def _planner() -> ModuleType:
    """Module with ``get_kv_cache_groups``/``get_kv_cache_config_from_groups``
    (moved to ``kv_cache_planning`` in 0.33)."""
    try:
        from vllm.v1.core import kv_cache_planning as planner
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planner
    return cast(ModuleType, planner)


@dataclasses.dataclass
class Geometry:
    vllm_config: Any
    layers: dict[str, Any]
    specs: dict[str, Any]
    kv_cache_config: Any
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]

    @property
    def forward_context(self) -> dict[str, Any]:
        return cast("dict[str, Any]", self.vllm_config.compilation_config.static_forward_context)


def plan_geometry(
    block_size: int,
    model: dict[str, Any] | None = None,
    num_gpu_blocks_override: int | None = 8,
    available_memory: int = 1 << 30,
    settings: EngineSettings | None = None,
    speculative_config: Any = None,
    drafter_ratios: tuple[int, ...] = (),
    max_model_len: int = STAND_IN_MAX_MODEL_LEN,
    after_build: Callable[[dict[str, Any]], None] | None = None,
) -> Geometry:
    """Layers -> specs -> layout -> groups -> KV-cache config -> attention groups
    -> kernel block sizes, each step vLLM's own (``settings``: the serve
    line's engine settings, see :class:`EngineSettings`; ``speculative_config``
    and ``drafter_ratios`` (see :func:`build_layers`) add a drafter)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    vllm_config = make_vllm_config(block_size, num_gpu_blocks_override, settings)
    if speculative_config is not None:
        object.__setattr__(vllm_config, "speculative_config", speculative_config)
    drafter_ratios = drafter_ratios or (settings.drafter_ratios if settings else ())
    model_layout: dict[str, Any] = DSV41_FLASH if model is None else model
    attach_model(vllm_config, model_layout, drafter_ratios, max_model_len)
    layers = build_layers(vllm_config, model_layout, drafter_ratios)
    if after_build is not None:  # something that changes the layers before their specs
        after_build(layers)
    specs = get_kv_cache_spec(vllm_config)
    backends = {
        layer.get_attn_backend()
        for layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).values()
    }
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(sorted(backends, key=str))]
    layout = resolve_kv_cache_layout(vllm_config, [layouts], specs.values())
    vllm_config.cache_config.kv_cache_layout = layout.name
    planner = _planner()
    groups = planner.get_kv_cache_groups(vllm_config, specs)
    kv_cache_config = planner.get_kv_cache_config_from_groups(vllm_config, groups, available_memory)

    # The worker's attention groups: one per (backend, layer spec) in each KV-cache group.
    attn_layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    attn_groups: list[list[Any]] = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        by_key: dict[tuple[str, Any], Any] = {}  # (backend, spec) -> AttentionGroup
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            backend = attn_layers[name].get_attn_backend()
            key = (backend.full_cls_name(), spec)
            if key in by_key:
                by_key[key].layer_names.append(name)
            else:
                by_key[key] = AttentionGroup(backend, [name], spec, group_id)
        attn_groups.append(list(by_key.values()))
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    return Geometry(vllm_config, layers, specs, kv_cache_config, attn_groups, kernel_block_sizes)


def select_kernel_block_sizes(geometry: Geometry) -> dict[str, int]:
    """``select_common_block_size`` for every attention group, as
    ``AttentionGroup.create_metadata_builders`` calls it (raises vLLM's error),
    and the group's kernel block size recorded as it records it (without
    building the metadata builders)."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import select_common_block_size

    chosen = {}
    for group_id, groups in enumerate(geometry.attn_groups):
        for group in groups:
            if isinstance(group.kv_cache_spec, AttentionSpec):
                size = select_common_block_size(
                    geometry.kernel_block_sizes[group_id], [group.backend], [group.kv_cache_spec]
                )
                chosen[f"{group.backend.get_name()}:{group.layer_names[0]}"] = size
                if size != group.kv_cache_spec.block_size:
                    group.kernel_block_size = size
    return chosen


def create_metadata_builders(geometry: Geometry, max_model_len: int = 8192) -> None:
    """Every attention group's own ``create_metadata_builders``, as the worker
    runs it at start-up.  It picks the group's kernel block size and, where
    that is smaller than the group's block (0.34.0 on SM12x), records the split
    that ``map_kv_caches_to_kernel_blocks`` then applies when binding.  The
    model config is a namespace with what the builders read of it; the
    prefill-workspace factor is what ``VllmConfig`` resolves for contexts up to 256K."""

    from vllm.models.deepseek_v41.compressor import CompressorBackend
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    model = dict(DSV41_FLASH, qk_rope_head_dim=64, index_topk=512)
    hf_config = DeepseekV41Config(text_config=model)
    config = geometry.vllm_config
    # The builders read the real config class; the text config the fix read stays.
    text = getattr(config.model_config, "hf_text_config", None) or hf_config
    config.model_config = SimpleNamespace(
        hf_config=hf_config, hf_text_config=text, max_model_len=max_model_len, use_mla=True
    )
    config.attention_config.sparse_mla_prefill_workspace_factor = 5
    for group_id, groups in enumerate(geometry.attn_groups):
        for group in groups:
            if group.backend is not CompressorBackend:  # its ring is never split or read here
                group.create_metadata_builders(
                    config, CPU, kernel_block_size=geometry.kernel_block_sizes[group_id]
                )


def start_upstream(block_size: int) -> tuple[Geometry | None, str | None]:
    """vLLM's start-up for ``--block-size``: kernel block sizes, metadata
    builders, allocation and binding.  Returns the bound geometry, or vLLM's
    start-up error text."""
    geometry = plan_geometry(block_size)
    try:
        select_kernel_block_sizes(geometry)
        create_metadata_builders(geometry)
        allocate_and_bind(geometry)
    except ValueError as exc:
        return None, str(exc)
    return geometry, None


def allocate_and_bind(geometry: Geometry) -> dict[str, torch.Tensor]:
    """vLLM's allocation and binding of the KV cache views (the fix's self-check runs here)."""
    from vllm.v1.worker import utils as worker_utils

    layout = geometry.vllm_config.cache_config.get_resolved_kv_cache_layout()
    kv_caches = worker_utils.allocate_kv_cache(
        geometry.kv_cache_config, CPU, layout, geometry.kernel_block_sizes
    )
    flat_groups = [group for groups in geometry.attn_groups for group in groups]
    views = worker_utils.map_kv_caches_to_kernel_blocks(kv_caches, flat_groups)
    worker_utils.bind_kv_cache_to_layers(views, geometry.forward_context)
    return cast("dict[str, torch.Tensor]", kv_caches)


@dataclasses.dataclass(frozen=True)
class Page:
    layer: str
    kind: str
    compress_ratio: int
    rows: int


def flashinfer_pages(geometry: Geometry) -> list[Page]:
    """Page size of every cache as FlashInfer's SM120 entry (kv_layout="NHD")
    and the indexer read it: the bound view through the layer's own
    ``_as_sparse_cache``, then ``shape[1]`` (FlashInfer's NHD page axis)."""
    from vllm.models.deepseek_v41 import attention as v41

    pages = []
    for name, layer in geometry.forward_context.items():
        if isinstance(layer, v41.DeepseekV4Attention):
            swa = layer._as_sparse_cache(layer.swa_cache_layer.kv_cache)
            pages.append(Page(layer.swa_cache_layer.prefix, "swa", 0, int(swa.shape[1])))
            if layer.is_kv_source:
                compressed = layer._as_sparse_cache(layer.kv_cache)
                pages.append(
                    Page(name, "compressed", layer.compress_ratio, int(compressed.shape[1]))
                )
        elif isinstance(layer, v41.DeepseekV4IndexerCache):
            pages.append(Page(name, "indexer", layer.compress_ratio, int(layer.kv_cache.shape[1])))
    return pages


# ----------------------------------------------------------------- FlashInfer


def flashinfer_version() -> str:
    import flashinfer

    return str(flashinfer.__version__)


def sm120_decode_verdict(
    page_block_size: int,
    has_extra: bool,
    *,
    num_tokens: int = 8,
    num_heads: int = 8,
    topk: int = 128,
) -> str | None:
    """None if FlashInfer routes the DSV4 call to a kernel, else its error text.

    FlashInfer 0.7.0.post1: its SM120 planner's decision (``plan`` ->
    ``_decide``: the decode and prefill envelopes, then the crossover policy,
    here without a device calibration record, which only chooses between
    variants that both serve the call and so cannot turn a miss into a kernel)
    and, on a miss, the op's own error message.
    FlashInfer >= 0.7.2: routing lives in the compiled module; its static
    decode envelope (``supported_sparse_mla_sm120_configs``) answers on CPU."""
    try:
        from flashinfer.mla import _sparse_mla_sm120_plan as planner
        from flashinfer.mla._sparse_mla_sm120 import _decode_dispatch_error_message
    except ImportError:
        from flashinfer.mla import supported_sparse_mla_sm120_configs

        config = supported_sparse_mla_sm120_configs()["dsv4"]
        ok = config.supports_decode(
            num_heads, topk, num_tokens=num_tokens, page_block_size=page_block_size
        )
        return None if ok else f"outside the static dsv4 decode envelope (page {page_block_size})"
    model_type = planner._MODEL_TYPE_DSV4
    planned = planner._select_calibrated_variant(
        decode_eligible=planner.decode_splitk_eligible(
            model_type, num_heads, topk, page_block_size, has_extra, num_tokens
        ),
        decode_variant=planner.KernelVariant.DECODE_SPLITK,
        prefill_variant=planner.prefill_variant(
            model_type,
            num_heads,
            topk,
            page_block_size,
            has_extra,
            planner._normalize_prefill_impl(None),
        ),
        decode_preferred=None,
    )
    if planned is not None:
        return None
    return cast(
        "str | None",
        _decode_dispatch_error_message(
            num_tokens=num_tokens,
            num_heads=num_heads,
            topk=topk,
            d_qk=512,
            page_block_size=page_block_size,
            model_type=planner._MODEL_TYPE_DSV4,
            extra_topk=0,
        ),
    )


def flashinfer_primary_page(kv_cache: torch.Tensor) -> int:
    """The primary page size FlashInfer derives from a cache: FlashInfer
    0.7.0.post1's own helper; later releases read bytes/token from the compiled
    module, so there the NHD page axis (``shape[1]``) is read directly."""
    try:
        from flashinfer.mla import _sparse_mla_sm120_plan  # noqa: F401  (0.7.0-style package)
        from flashinfer.mla._sparse_mla_sm120 import _MODEL_TYPE_DSV4, _packed_kv_page_block_size
    except ImportError:
        return int(kv_cache.shape[1])  # NHD [pages, page_block_size, 1, bytes]
    return int(
        _packed_kv_page_block_size(kv_cache, model_type=_MODEL_TYPE_DSV4, name="swa_kv_cache")
    )


def sm120_paged_mqa_page_sizes() -> tuple[int, ...]:
    """The SM120 branch of vLLM's ``get_paged_mqa_page_sizes`` (the page sizes
    DeepGEMM's paged-MQA logits kernels take), read from its source because the
    branch is chosen by the device."""
    source = patching.definition_source("vllm.utils.deep_gemm", "get_paged_mqa_page_sizes")
    body = ast.parse(source).body[0]
    returns = [node.value for node in ast.walk(body) if isinstance(node, ast.Return)]
    if len(returns) != 1 or not isinstance(returns[0], ast.IfExp):
        raise ValueError("get_paged_mqa_page_sizes is not the reviewed conditional")
    test = ast.unparse(returns[0].test)
    if "is_device_capability_family(120)" not in test:
        raise ValueError(f"get_paged_mqa_page_sizes branches on {test}, not SM120")
    return tuple(ast.literal_eval(returns[0].body))


# ------------------------------------------------------------------- the fix


class applied:
    """Context manager: the fix applied as on an SM``capability`` device, reverted after."""

    def __init__(self, capability: tuple[int, int] = (12, 0)):
        self.capability = capability
        self.result: patching.AppliedFix | None = None

    def __enter__(self) -> patching.AppliedFix:
        from vllm_mla_fixes.patching import run_fix

        self.result = run_fix(fix.for_capability(self.capability), _installed_vllm())
        return self.result

    def __exit__(self, *exc: object) -> Literal[False]:
        if self.result is not None and self.result.patch is not None:
            self.result.patch.revert()
        return False


def _installed_vllm() -> str:
    import vllm

    return str(vllm.__version__)


# ------------------------------------------------------------------ capacity


def capacity(
    block_size: int,
    max_model_len: int,
    memory: int = 1 << 30,
    settings: EngineSettings | None = None,
) -> dict[str, float]:
    """KV capacity of the geometry for ``--block-size``, as vLLM reports it at
    start-up ("GPU KV cache size: N tokens"): ``get_kv_cache_capacity`` on the
    KV-cache config the planner builds for ``memory`` bytes.

    ``model_config`` is a namespace carrying ``max_model_len`` only (all that
    the capacity functions read of it): a real ``ModelConfig`` inspects the
    model class in a subprocess."""

    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    geometry = plan_geometry(
        block_size, num_gpu_blocks_override=None, available_memory=memory, settings=settings
    )
    config = geometry.vllm_config
    config.model_config = SimpleNamespace(max_model_len=max_model_len)
    tokens, concurrency = get_kv_cache_capacity(config, geometry.kv_cache_config)
    kv_config = geometry.kv_cache_config
    return {
        "groups": len(kv_config.kv_cache_groups),
        "num_blocks": kv_config.num_blocks,
        "bytes_per_block": kv_config.kv_cache_tensors[0].block_stride,
        "tokens": tokens,
        "concurrency": concurrency,
    }


# -------------------------------------------------------------------- verify


def verify(report: Callable[[str], None]) -> bool:
    """Reproduce the upstream failures, then show the fixed geometry, on an
    SM120 platform stand-in (see :func:`sm120_platform`)."""
    with sm120_platform():
        return _verify(report)


def kernel_verdicts(pages: list[Page]) -> tuple[tuple[Rejection, ...], tuple[str, ...]]:
    """(pages a kernel's own declaration rejects, envelopes that could not be
    read) of a bound layout (see ``dsv41_sm120_geometry.envelope``)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream

    kinds = {"swa": upstream.SWA, "compressed": upstream.COMPRESSED, "indexer": upstream.INDEXER}
    return upstream.page_verdicts(
        sorted({(kinds[p.kind], p.compress_ratio, p.rows) for p in pages})
    )


def _verdict_summary(rejected: tuple[Rejection, ...], unknown: tuple[str, ...]) -> str:
    if rejected:
        return "; ".join(f"{r.kernel} rejects {r.cache} pages of {r.rows} rows" for r in rejected)
    if unknown:
        return "unknown: " + "; ".join(unknown)
    return "every page inside the installed kernels' own envelopes"


@dataclasses.dataclass(frozen=True)
class UpstreamStart:
    """What upstream's own start-up of the tiny model did at one --block-size."""

    block_size: int
    error: str | None  # vLLM's start-up error, or None where it started
    pages: str = ""  # the page rows of each cache, where it started
    rejected: tuple[Rejection, ...] = ()  # pages a kernel's own declaration rejects
    unknown: tuple[str, ...] = ()  # envelopes that could not be read

    @property
    def works(self) -> bool:
        return self.error is None and not self.rejected and not self.unknown

    def outcome(self) -> str:
        """How this start went, in a few words, for the verifier's first line."""
        if self.error is not None:
            return f"--block-size {self.block_size} fails at start-up"
        if self.rejected:
            return f"--block-size {self.block_size} starts, but a kernel rejects its pages"
        if self.unknown:
            return f"--block-size {self.block_size} starts; an envelope could not be read"
        return f"--block-size {self.block_size} works"

    def lines(self) -> list[str]:
        if self.error is not None:
            return [f"--block-size {self.block_size}, upstream: ValueError: {self.error}"]
        return [
            f"--block-size {self.block_size}, upstream: starts; pages: {self.pages}",
            f"  kernels: {_verdict_summary(self.rejected, self.unknown)}",
        ]


def upstream_start(block_size: int) -> UpstreamStart:
    geometry, error = start_upstream(block_size)
    if geometry is None:
        return UpstreamStart(block_size, error)
    pages = flashinfer_pages(geometry)
    rejected, unknown = kernel_verdicts(pages)
    return UpstreamStart(block_size, None, _page_summary(pages), rejected, unknown)


def upstream_story(version: str, starts: list[UpstreamStart]) -> str:
    """The verifier's first line: what upstream does on this release, from its
    recorded starts (a release's story differs from the next one's)."""
    return f"upstream on vLLM {version}: " + "; ".join(start.outcome() for start in starts)


def _verify(report: Callable[[str], None]) -> bool:
    report(f"FlashInfer {flashinfer_version()}")
    starts = [upstream_start(block_size) for block_size in (64, 128)]
    report(upstream_story(_installed_vllm(), starts))
    for start in starts:
        for line in start.lines():
            report(line)
    if any(start.error is not None and start.error not in START_ERRORS for start in starts):
        return False
    if not any(start.error is not None or start.rejected for start in starts):
        report("upstream's layout works for both block sizes: nothing to reproduce")
        return False

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import decision_detail

    ok = True
    with applied((12, 0)) as result:
        report(f"fix: {result.status.label()} ({result.status.reason})")
        ok &= result.status.state.value == "applied"
        for block_size in (64, 128):
            geometry = plan_geometry(block_size)
            sizes = select_kernel_block_sizes(geometry)
            create_metadata_builders(geometry)
            allocate_and_bind(geometry)  # runs the start-up self-check
            pages = flashinfer_pages(geometry)
            rejected, unknown = kernel_verdicts(pages)
            decision = STATE.decision_for(geometry.vllm_config)
            decided = decision.geometry
            report(
                f"--block-size {block_size}, fixed ({decided}): kernel block sizes "
                f"{sorted(set(sizes.values()))}; pages: {_page_summary(pages)}; "
                f"kernels: {_verdict_summary(rejected, unknown)}"
            )
            ok &= not rejected and not unknown
            if decided == fix.UPSTREAM:
                report(f"  {decision_detail(decision)}")
                continue  # upstream's own layout, which the kernels take
            ok &= all(page.rows == fix.PAGE_ROWS for page in pages)
            ratio1 = [
                geometry.forward_context[name].kv_cache
                for name in ("model.layers.20.attn", "model.layers.20.attn.indexer.k_cache")
            ]
            interleaved = (
                decided == fix.SPLIT
                and {view.stride(0) for view in ratio1} == {46080}
                and ratio1[1].storage_offset() - ratio1[0].storage_offset() == 37440
            )
            report(
                f"  {decision_detail(decision)}; ratio-1 compressed/indexer kernel pages "
                f"{'interleaved every 46,080 B' if interleaved else 'NOT interleaved'} in "
                f"{geometry.kv_cache_config.kv_cache_tensors[0].block_stride}-B blocks"
            )
            ok &= interleaved
    return bool(ok)


def _page_summary(pages: list[Page]) -> str:
    seen: dict[tuple[str, int], int] = {}
    for page in pages:
        seen.setdefault((page.kind, page.compress_ratio), page.rows)
    return ", ".join(f"{kind} r{ratio}: {rows}" for (kind, ratio), rows in sorted(seen.items()))
