"""What the decision reads of an engine: :class:`EngineConfig`, a frozen,
hashable record of every engine setting and model figure the fix's choice
depends on, read from a ``VllmConfig`` (the engine's own, a drafter's copy of
it, or the one ``doctor`` builds from a serve line and a ``config.json``).

Two configs of one engine give equal records: the drafter's copy of the
engine config differs only in what no field here reads.  The record is the
key under which :mod:`.fix_state` keeps the engine's decision, so it names
everything the decision reads of the config -- the model's KV topology, the
drafter's, and the settings vLLM's planner reads when it plans the layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_mla_fixes import settings
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.settings import (
    DSV41_DRAFTER_SWA_ROWS,
    DSV41_GEOMETRY,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import Geometry

DSPARK = "dspark"
DEFAULT_DSPARK_LAYERS = 3
"""DSpark's drafter layer count where its config names none (vLLM's own default)."""


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """The model's DeepSeek-V4.1 KV topology, from its ``config.json``: which
    layers own compressed-KV and indexer caches, at which compress ratios,
    and the drafter layers vLLM numbers past the backbone."""

    backbone_layers: int
    compress_ratios: tuple[int, ...]  # one per layer, drafter layers included where listed
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    window: int
    head_dim: int
    index_head_dim: int
    drafter_layers: int = 0

    def ratio(self, layer: int) -> int:
        """A layer's compress ratio; layers past the list are sliding-window only."""
        return int(self.compress_ratios[layer]) if layer < len(self.compress_ratios) else 0

    @property
    def layers(self) -> range:
        return range(self.backbone_layers + self.drafter_layers)

    def owns_compressed(self, layer: int) -> bool:
        return layer < self.backbone_layers and layer in self.kv_sources and self.ratio(layer) > 0

    def owns_indexer(self, layer: int) -> bool:
        return self.owns_compressed(layer) and layer in self.index_sources

    def is_drafter(self, layer: int) -> bool:
        return layer >= self.backbone_layers

    @property
    def owned_ratios(self) -> tuple[int, ...]:
        """Compress ratios of the compressed-KV caches the model owns."""
        return tuple(sorted({self.ratio(n) for n in self.layers if self.owns_compressed(n)}))


class UnreadableModel(ValueError):
    """The model config does not describe a DeepSeek-V4.1 KV topology."""


_TOPOLOGY_FIELDS = (
    "num_hidden_layers",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "sliding_window",
    "head_dim",
    "index_head_dim",
)


def model_layout(text_config: Any, drafter_config: object = None) -> ModelLayout:
    """The layout from a model's (text) config; ``drafter_config``: a DSpark
    drafter's config (its layer count), None without DSpark.  Raises
    :class:`UnreadableModel` naming each missing or malformed field."""
    missing = [name for name in _TOPOLOGY_FIELDS if getattr(text_config, name, None) is None]
    if missing:
        raise UnreadableModel(f"the model config has no {', '.join(missing)}")
    try:
        layout = ModelLayout(
            backbone_layers=int(text_config.num_hidden_layers),
            compress_ratios=tuple(int(r) for r in text_config.compress_ratios),
            kv_sources=tuple(sorted(int(n) for n in text_config.kv_source_layer_ids)),
            index_sources=tuple(sorted(int(n) for n in text_config.index_source_layer_ids)),
            window=int(text_config.sliding_window),
            head_dim=int(text_config.head_dim),
            index_head_dim=int(text_config.index_head_dim),
            drafter_layers=0 if drafter_config is None else dspark_layers(drafter_config),
        )
    except (TypeError, ValueError) as exc:
        raise UnreadableModel(f"the model config's KV topology is malformed: {exc}") from exc
    return layout


def dspark_layers(drafter_config: object) -> int:
    """DSpark's drafter layer count, read as vLLM's DSpark model reads it."""
    for name in ("n_mtp_layers", "num_nextn_predict_layers"):
        value = getattr(drafter_config, name, None)
        if value:
            return int(value)
    return DEFAULT_DSPARK_LAYERS


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the decision reads of one engine's configuration."""

    model: ModelLayout | None  # None: the config gives no readable topology
    model_problem: str  # why ``model`` is None ("" otherwise)
    block_size: int | None  # None: the line gives none and vLLM picks it
    cache_dtype: str
    max_model_len: int | None
    speculative_method: str | None
    speculative_tokens: int
    kv_connector: str | None
    decode_context_parallel: int
    prefill_context_parallel: int
    # The planner's sliding-window reserve reads vLLM's ``max_in_flight_tokens``
    # (pipeline stages, +1 with async scheduling, times --max-num-batched-tokens):
    # the capacity figures, so the gain rule and the drafter rows, depend on it.
    # Tensor and data parallel sizes are read by no figure (the spec producers
    # take no head count, the planner reads TP only after capacity), and a
    # DSpark drafter's copy of the config has its own TP: they stay out.
    pipeline_parallel: int
    in_flight_tokens: int | None
    hisparse: bool
    indexer_sparse_logits: bool
    indexer_fp4: bool
    hybrid_manager_disabled: bool
    capability: tuple[int, int] | None
    mxfp8_record: bool
    forced_geometry: Geometry | None
    forced_drafter_rows: int | None

    def as_dict(self) -> dict[str, object]:
        return {
            "block_size": self.block_size,
            "cache_dtype": self.cache_dtype,
            "max_model_len": self.max_model_len,
            "speculative_method": self.speculative_method,
            "kv_connector": self.kv_connector,
            "decode_context_parallel_size": self.decode_context_parallel,
            "prefill_context_parallel_size": self.prefill_context_parallel,
            "drafter_layers": None if self.model is None else self.model.drafter_layers,
            "layers": None if self.model is None else self.model.backbone_layers,
            "capability": None if self.capability is None else list(self.capability),
        }


OFFLOADING_CONNECTOR = "OffloadingConnector"
SIMPLE_OFFLOAD_ENV = "VLLM_USE_SIMPLE_KV_OFFLOAD"


def kv_connector_name(vllm_config: object) -> str | None:
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
    if (settings.environment_variable(SIMPLE_OFFLOAD_ENV) or "").strip().lower() in ("1", "true"):
        return "SimpleCPUOffloadConnector"
    return OFFLOADING_CONNECTOR


def speculative_method(vllm_config: object) -> str | None:
    config = getattr(vllm_config, "speculative_config", None)
    if config is None:
        return None
    return str(getattr(config, "method", None) or "unknown").lower()


def _text_config(model_config: object) -> object:
    return getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)


def _drafter_config(vllm_config: Any, text_config: object) -> object:
    """DSpark's config (its draft model's, else the target's: DSpark ships
    inside the target checkpoint), or None without DSpark."""
    if speculative_method(vllm_config) != DSPARK:
        return None
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    return _text_config(draft) or text_config


def _layout_of(vllm_config: object) -> tuple[ModelLayout | None, str]:
    text_config = _text_config(getattr(vllm_config, "model_config", None))
    if text_config is None:
        return None, "the engine config has no model config"
    try:
        return model_layout(text_config, _drafter_config(vllm_config, text_config)), ""
    except UnreadableModel as exc:
        return None, str(exc)


def _platform() -> tuple[tuple[int, int] | None, bool]:
    """(device capability, whether DeepSeek-V4.1 uses its MXFP8 KV record
    there), by vLLM's own platform and its own record rule; (None, False)
    where vLLM cannot say."""
    try:
        from vllm.models.deepseek_v41 import attention
        from vllm.platforms import current_platform

        found = current_platform.get_device_capability()
        mxfp8 = bool(attention._use_v41_mxfp8_kv_record())
    except Exception:  # noqa: BLE001 - no platform to ask: unknown device, V4 record
        return None, False
    return (None if found is None else (int(found.major), int(found.minor))), mxfp8


def _kv_record(cache_dtype: str) -> str:
    """The KV record ``--kv-cache-dtype`` resolves to for DeepSeek-V4.1 on
    SM12x, by vLLM's own resolution (which an engine's first attention layer
    writes back onto its cache config: ``fp8`` becomes ``fp8_ds_mla``), so a
    config before and after that write is one engine."""
    try:
        import importlib

        attention = importlib.import_module("vllm.models.deepseek_v41.attention")
        sm12x = importlib.import_module("vllm.models.deepseek_v41.nvidia.flashinfer_sparse")
        cls = sm12x.DeepseekV4FlashInferSM120Attention
        blank = object.__new__(cls)  # for the class's own properties; no __init__ runs
        resolved, _ = attention._resolve_dsv4_kv_cache_dtype(
            cls.use_fp8_ds_mla_layout, cache_dtype, None, blank.packed_kv_cache_dtype
        )
    except Exception:  # noqa: BLE001 - a dtype vLLM refuses stays as written
        return cache_dtype
    return str(resolved)


def _indexer_fp4(vllm_config: object) -> bool:
    """Whether the indexer cache holds MXFP4 rows, by vLLM's own rule (False
    where the config cannot say)."""
    try:
        from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4

        return bool(dsa_indexer_uses_fp4(vllm_config))
    except Exception:  # noqa: BLE001 - a config vLLM cannot read: the fp8 indexer row
        return False


def _speculative_tokens(vllm_config: object) -> int:
    """Tokens drafted per step, as ``VllmConfig`` reports them (the compressor
    state ring is sized from it)."""
    try:
        return int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
    except (AttributeError, TypeError, ValueError):
        return 0


def engine_parallel_config(vllm_config: object) -> object:
    """The parallel config of the engine ``vllm_config`` belongs to.  DSpark's
    drafter is built under a copy of the engine config whose parallel config
    vLLM sets to one stage and the drafter's TP (``_get_dspark_parallel_config``
    in ``v1/worker/gpu/spec_decode/dspark/utils.py``, 0.32.0 to 0.34.0); the
    speculative config both share holds the engine's own, set from its
    arguments (``SpeculativeConfig.target_parallel_config``), so the drafter's
    layers are decided as the engine's are, from configuration alone."""
    speculative = getattr(vllm_config, "speculative_config", None)
    target = getattr(speculative, "target_parallel_config", None)
    return target if target is not None else getattr(vllm_config, "parallel_config", None)


def with_pipeline_size(vllm_config: object, stages: int) -> Any:
    """A shallow copy of ``vllm_config`` whose parallel config (itself a
    copy) has ``stages`` pipeline stages; ``vllm_config`` where it has them."""
    import copy

    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None or getattr(parallel, "pipeline_parallel_size", 1) == stages:
        return vllm_config
    parallel = copy.copy(parallel)
    object.__setattr__(parallel, "pipeline_parallel_size", stages)
    config = copy.copy(vllm_config)
    object.__setattr__(config, "parallel_config", parallel)
    return config


def _in_flight_tokens(vllm_config: object, stages: int) -> int | None:
    """vLLM's own ``max_in_flight_tokens`` for the engine's pipeline stages
    (None where the config cannot say)."""
    try:
        return int(with_pipeline_size(vllm_config, stages).max_in_flight_tokens)
    except Exception:  # noqa: BLE001 - a config vLLM cannot read: unset
        return None


def engine_config(vllm_config: object) -> EngineConfig:
    """The record of ``vllm_config``; any part vLLM cannot give counts as unset."""
    cache = getattr(vllm_config, "cache_config", None)
    parallel = engine_parallel_config(vllm_config)
    attention = getattr(vllm_config, "attention_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    model, problem = _layout_of(vllm_config)
    capability, mxfp8 = _platform()
    block_size = getattr(cache, "block_size", None)
    given = getattr(cache, "user_specified_block_size", True)
    max_model_len = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    forced = settings.value(DSV41_GEOMETRY)
    stages = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    return EngineConfig(
        model=model,
        model_problem=problem,
        block_size=block_size if given and isinstance(block_size, int) else None,
        cache_dtype=_kv_record(str(getattr(cache, "cache_dtype", "auto"))),
        max_model_len=max_model_len if isinstance(max_model_len, int) else None,
        speculative_method=speculative_method(vllm_config),
        speculative_tokens=_speculative_tokens(vllm_config),
        kv_connector=kv_connector_name(vllm_config),
        decode_context_parallel=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
        prefill_context_parallel=int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        pipeline_parallel=stages,
        in_flight_tokens=_in_flight_tokens(vllm_config, stages),
        hisparse=getattr(attention, "hisparse_config", None) is not None,
        indexer_sparse_logits=bool(getattr(attention, "indexer_sparse_logits", False)),
        indexer_fp4=_indexer_fp4(vllm_config),
        hybrid_manager_disabled=bool(getattr(scheduler, "disable_hybrid_kv_cache_manager", False)),
        capability=capability,
        mxfp8_record=mxfp8,
        forced_geometry=None if forced is None else Geometry(forced),
        forced_drafter_rows=settings.value(DSV41_DRAFTER_SWA_ROWS),
    )
