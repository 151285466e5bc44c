"""Apply: installs the fix's wrappers on the vLLM modules as they are imported."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import (
    SPEC_MERGE_SITES,
    merges_worker_specs,
    with_geometry_check,
    with_workers_agreeing,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import split_unreviewed
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    FLASHINFER_MODULE,
    INDEXER_MODULE,
    WARMUP_MODULE,
    WORKER_UTILS_MODULE,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import with_kernel_slots
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.specs import (
    per_spec_kernel_block_sizes,
    swa_cache_with_decided_rows,
    warmup_keys_with_64_state_pages,
    wrap_spec_producer,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.views import (
    with_interleaved_ratio1_views,
    with_pair_manager_view,
    with_pair_region_copies,
)
from vllm_mla_fixes.patching import Patch


def apply(patch: Patch) -> None:
    # Screened here, where vLLM's sources are known to be readable; the split's
    # targets are patched only when they are the reviewed code.
    split_reviewed = not split_unreviewed()
    STATE.clear()

    def on_attention(module: ModuleType) -> None:
        for cls in (module.DeepseekV4Attention, module.DeepseekV4IndexerCache):
            patch.replace(cls, "get_kv_cache_spec", wrap_spec_producer(cls))
        patch.replace(
            module, "DeepseekV4SWACache", swa_cache_with_decided_rows(module.DeepseekV4SWACache)
        )

    def declare_kernel_blocks_per_spec(backend: Any) -> None:
        STATE.backends += (backend,)
        patch.replace(
            backend,
            "get_supported_kernel_block_sizes",
            per_spec_kernel_block_sizes(backend.get_supported_kernel_block_sizes),
        )

    def on_warmup(module: ModuleType) -> None:
        kernel = module.CompressedSlotMappingKernel
        patch.replace(
            kernel,
            "get_warmup_keys",
            warmup_keys_with_64_state_pages(kernel.__dict__["get_warmup_keys"]),
        )

    def on_worker_utils(module: ModuleType) -> None:
        patch.replace_function(
            module, "bind_kv_cache_to_layers", with_geometry_check(module.bind_kv_cache_to_layers)
        )
        if split_reviewed:
            _patch_interleaved_split(patch, module)

    def on_spec_merge(function: str) -> Callable[[ModuleType], None]:
        def wrap(module: ModuleType) -> None:
            # 0.32 merges in kv_cache_utils, 0.33+ in kv_cache_planning; the
            # other candidate lacks the function and is left alone.
            if merges_worker_specs(module.__name__, function):
                patch.replace_function(
                    module, function, with_workers_agreeing(getattr(module, function))
                )

        return wrap

    for module_name, function in SPEC_MERGE_SITES:
        patch.when_imported(module_name, on_spec_merge(function))
    patch.when_imported(ATTENTION_MODULE, on_attention)
    patch.when_imported(
        FLASHINFER_MODULE,
        lambda module: declare_kernel_blocks_per_spec(module.DeepseekV4FlashInferMLASparseBackend),
    )
    patch.when_imported(
        INDEXER_MODULE,
        lambda module: declare_kernel_blocks_per_spec(module.DeepseekV41IndexerBackend),
    )
    patch.when_imported(WARMUP_MODULE, on_warmup)
    patch.when_imported(WORKER_UTILS_MODULE, on_worker_utils)


def _patch_interleaved_split(patch: Patch, module: ModuleType) -> None:
    """The worker utilities the interleaved split changes: its kernel-block
    views, slots and pair copies (apply calls this only where the screen found
    these targets to be the reviewed code)."""
    patch.replace_function(
        module,
        "map_kv_caches_to_kernel_blocks",
        with_interleaved_ratio1_views(module.map_kv_caches_to_kernel_blocks),
    )
    group = module.AttentionGroup
    patch.replace(
        group,
        "_with_kernel_block_table",
        with_kernel_slots(group.__dict__["_with_kernel_block_table"]),
    )
    patch.replace(
        group,
        "map_kv_cache_to_manager_blocks",
        with_pair_manager_view(group.__dict__["map_kv_cache_to_manager_blocks"]),
    )
    patch.replace_function(
        module,
        "copy_kv_cache_blocks_inplace",
        with_pair_region_copies(module.copy_kv_cache_blocks_inplace),
    )
