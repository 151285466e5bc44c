"""Sparse-MLA fp8 KV start-up on vLLM 0.25.x, driven through vLLM's own code.

The layer specs come from the real producers (``MLAAttention.get_kv_cache_spec``
and ``DeepseekV32IndexerCache.get_kv_cache_spec``) called for each layer of a
tiny GLM-DSA ``config.json``; the KV-cache configs from the real planners
(profiling: ``get_kv_cache_groups`` + ``get_kv_cache_config_from_groups`` with
the CUDA-graph minimum; engine core: ``get_kv_cache_configs``); the views from
the real model runners (V1 ``GPUModelRunner`` and Model Runner V2).  Only the
objects that hold configuration (``self`` of a layer, ``vllm_config``) are
plain namespaces, because building real ones needs a GPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any, cast

import torch

TINY_GLM_DSA = (
    Path(__file__).resolve().parent.parent / "models" / "tiny_glm_moe_dsa" / "config.json"
)
BLOCK_SIZE = 64
MAX_NUM_SEQS = 16
CPU = torch.device("cpu")


def load_config(path: Path = TINY_GLM_DSA) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return cast("dict[str, Any]", json.load(f))


def cudagraph_min_blocks(max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """vLLM's default largest CUDA-graph capture size, which the profiling
    KV cache uses as its block count."""
    return min(2 * max_num_seqs, 512)


def make_vllm_config(
    model: dict[str, Any],
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 4096,
    num_gpu_blocks_override: int | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=block_size,
            cache_dtype="fp8_ds_mla",
            num_gpu_blocks_override=num_gpu_blocks_override,
            num_gpu_blocks=None,
        ),
        model_config=SimpleNamespace(
            max_model_len=max_model_len,
            original_max_model_len=max_model_len,
            dtype=torch.bfloat16,
            hf_config=SimpleNamespace(**model),
        ),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            pipeline_parallel_size=1,
            tensor_parallel_size=1,
        ),
        speculative_config=None,
        kv_transfer_config=None,
    )


def layer_specs(model: dict[str, Any], vllm_config: SimpleNamespace) -> dict[str, Any]:
    """The KV-cache spec of every MLA and indexer layer, from vLLM's own producers.

    ``MLAAttention.__init__`` has already turned ``--kv-cache-dtype fp8`` into
    ``fp8_ds_mla`` for sparse MLA; the stand-in layers carry that state."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    mla_head = model["kv_lora_rank"] + model["qk_rope_head_dim"]
    # fp8 keys plus one fp32 scale per 128-dim key
    index_head = model["index_head_dim"] + model["index_head_dim"] // 128 * 4
    specs = {}
    for i in range(model["num_hidden_layers"]):
        attn = SimpleNamespace(kv_cache_dtype="fp8_ds_mla", head_size=mla_head)
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttention.get_kv_cache_spec(
            attn, vllm_config
        )
        indexer = SimpleNamespace(
            cache_config=vllm_config.cache_config,
            head_dim=index_head,
            dtype=kv_cache_dtype_str_to_dtype("fp8_ds_mla", None),
        )
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = (
            DeepseekV32IndexerCache.get_kv_cache_spec(indexer, vllm_config)
        )
    return specs


def profiling_kv_cache_config(
    model: dict[str, Any], max_num_seqs: int = MAX_NUM_SEQS
) -> tuple[Any, dict[str, Any]]:  # vLLM's KVCacheConfig, the layer specs
    """What ``GPUModelRunner._init_minimal_kv_cache_for_profiling`` builds."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    vllm_config = make_vllm_config(model)
    specs = layer_specs(model, vllm_config)
    groups = get_kv_cache_groups(vllm_config, specs)
    vllm_config.cache_config.num_gpu_blocks_override = cudagraph_min_blocks(max_num_seqs)
    return get_kv_cache_config_from_groups(vllm_config, groups, available_memory=0), specs


def engine_kv_cache_config(
    model: dict[str, Any], num_blocks: int
) -> tuple[Any, dict[str, Any]]:  # vLLM's KVCacheConfig, the layer specs
    """What the engine core plans from the workers' specs, given memory for ``num_blocks``."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    vllm_config = make_vllm_config(model)
    specs = layer_specs(model, vllm_config)
    bytes_per_block = sum(spec.page_size_bytes for spec in specs.values())
    (config,) = get_kv_cache_configs(vllm_config, [specs], [num_blocks * bytes_per_block])
    return config, specs


def _attention_groups(kv_cache_config: Any) -> list[list[Any]]:  # vLLM's AttentionGroups
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import AttentionGroup

    groups = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        per_layer = (
            group.kv_cache_spec.kv_cache_specs
            if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
            else dict.fromkeys(group.layer_names, group.kv_cache_spec)
        )
        by_backend: dict[Any, list[str]] = {}  # vLLM's backend class -> its layers
        for name in group.layer_names:
            backend = (
                DeepseekV32IndexerBackend
                if name.endswith("indexer.k_cache")
                else FlashMLASparseBackend
            )
            by_backend.setdefault(backend, []).append(name)
        groups.append(
            [
                AttentionGroup(backend, names, per_layer[names[0]], group_id)
                for backend, names in by_backend.items()
            ]
        )
    return groups


def views_v1_runner(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """Allocate and view the caches with the real V1 ``GPUModelRunner`` methods."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(
        kv_cache_config=kv_cache_config,
        attn_groups=_attention_groups(kv_cache_config),
        runner_only_attn_layers=set(),
        device=CPU,
        cache_config=SimpleNamespace(cache_dtype="fp8_ds_mla"),
    )
    for name in (
        "_allocate_kv_cache_tensors",
        "_reshape_kv_cache_tensors",
        "_kv_cache_spec_attn_group_iterator",
        "_attn_group_iterator",
        "_has_mixed_attention_kv_layout",
    ):
        if hasattr(GPUModelRunner, name):
            setattr(runner, name, MethodType(getattr(GPUModelRunner, name), runner))
    raw = runner._allocate_kv_cache_tensors(kv_cache_config)
    kernel_block_sizes = [BLOCK_SIZE] * len(kv_cache_config.kv_cache_groups)
    return cast(
        "dict[str, torch.Tensor]", runner._reshape_kv_cache_tensors(raw, kernel_block_sizes)
    )


def views_model_runner_v2(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """Allocate and view the caches with Model Runner V2's real functions."""
    from vllm.v1.worker.gpu import attn_utils

    raw = attn_utils._allocate_kv_cache(kv_cache_config, {}, CPU)
    groups = [g for per_group in _attention_groups(kv_cache_config) for g in per_group]
    kernel_block_sizes = [BLOCK_SIZE] * len(kv_cache_config.kv_cache_groups)
    return cast(
        "dict[str, torch.Tensor]",
        attn_utils._reshape_kv_cache(
            groups, raw, "fp8_ds_mla", kernel_block_sizes, {}, kv_cache_config
        ),
    )


@dataclass
class Outcome:
    path: str
    num_blocks: int
    error: str | None
    shapes: dict[str, tuple[int, ...]]

    @property
    def ok(self) -> bool:
        return self.error is None


def run(
    path: str, model: dict[str, Any] | None = None, num_blocks: int = 96, runner: str = "v1"
) -> Outcome:
    """Start-up KV-cache initialisation along ``path`` ("profiling" or "engine")."""
    model = model or load_config()
    if path == "profiling":
        config, _ = profiling_kv_cache_config(model)
    else:
        config, _ = engine_kv_cache_config(model, num_blocks)
    view = views_v1_runner if runner == "v1" else views_model_runner_v2
    try:
        caches = view(config)
    except (RuntimeError, ValueError) as exc:
        return Outcome(path, config.num_blocks, f"{type(exc).__name__}: {exc}", {})
    return Outcome(path, config.num_blocks, None, {k: tuple(v.shape) for k, v in caches.items()})


def bytes_per_token(shape: tuple[int, ...]) -> int:
    """Bytes per token of a blocks-first (blocks, block_size, bytes) uint8 view."""
    return math.prod(shape[2:])


UPSTREAM_ERRORS = {
    "profiling": "shape '[32, 64, 576]' is invalid for input of size 1343488",
    "engine": "shape '[96, 64, 576]' is invalid for input of size 4030464",
}


def verify(report: Callable[[str], None]) -> bool:
    """Reproduce both start-up paths on the installed vLLM, then apply the fix and redo them."""
    from vllm_mla_fixes import installed_vllm_version
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape
    from vllm_mla_fixes.patching import State, run_fix

    model = load_config()
    report(
        f"model: {TINY_GLM_DSA.parent.name} ({model['architectures'][0]}, "
        f"{model['num_hidden_layers']} layers), --kv-cache-dtype fp8 -> fp8_ds_mla, "
        f"--block-size {BLOCK_SIZE}, --max-num-seqs {MAX_NUM_SEQS}"
    )
    reproduced = True
    for path in ("profiling", "engine"):
        outcome = run(path, model)
        what = (
            "CUDA-graph profiling"
            if path == "profiling"
            else "KV-cache init (also with --enforce-eager)"
        )
        report(f"upstream  {what}, {outcome.num_blocks} blocks: {outcome.error or 'no error'}")
        reproduced &= outcome.error is not None and UPSTREAM_ERRORS[path] in outcome.error
    result = run_fix(fp8_ds_mla_reshape.FIX, installed_vllm_version() or "0")
    if result.status.state is not State.APPLIED:
        report(f"fix not applied: {result.status.label()}")
        return False
    assert result.patch is not None  # an applied fix holds the patch that undoes it
    fixed = True
    try:
        for path in ("profiling", "engine"):
            outcome = run(path, model)
            if outcome.error:
                report(f"fixed     {path}: still fails: {outcome.error}")
                fixed = False
                continue
            summary = ", ".join(
                sorted({f"{name.split('.')[-1]} {shape}" for name, shape in outcome.shapes.items()})
            )
            report(f"fixed     {path}, {outcome.num_blocks} blocks: {summary}")
            fixed &= all(
                bytes_per_token(shape) == 656
                for name, shape in outcome.shapes.items()
                if name.endswith(".attn")
            )
    finally:
        result.patch.revert()
    if not reproduced:
        report("the upstream error did not reproduce as expected on this build")
    return reproduced and fixed
