"""Apply: installs the fix's wrappers on the vLLM modules as they are imported,
and :func:`for_capability`, the fix as seen from a given device."""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import (
    SPEC_MERGE_SITES,
    _merges_worker_specs,
    _with_geometry_check,
    _with_workers_agreeing,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    status_detail,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import (
    probe,
    split_unreviewed,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    FLASHINFER_MODULE,
    INDEXER_MODULE,
    INFO,
    WARMUP_MODULE,
    WORKER_UTILS_MODULE,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import (
    _with_kernel_slots,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.specs import (
    _per_spec_kernel_block_sizes,
    _swa_cache_with_kernel_pages,
    _warmup_keys_with_64_state_pages,
    _wrap_spec_producer,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import (
    _INTERLEAVED,
    _PAIR_REGIONS,
    _state,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.views import (
    _with_interleaved_ratio1_views,
    _with_pair_manager_view,
    _with_pair_region_copies,
)
from vllm_mla_fixes.patching import Patch


def apply(patch: Patch) -> None:
    # Screened here, where vLLM's sources are known to be readable; the split's
    # targets are patched only when they are the reviewed code.
    _state["split_unreviewed"] = split_unreviewed() or ""
    _state["decisions"] = {}
    _state["backends"] = ()
    _state["owned_ratios"] = set()
    _state["drafter_swa_caches"] = set()
    _state["drafter_swa_narrowed"] = set()
    _state["upstream_swa_caches"] = set()
    _state["planning"] = False
    _state["planning_decision"] = None
    _state["drafter_rows"] = None
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
