"""KV tokens per GiB of a layout, by vLLM's own planner, on the full model.

The decision compares candidate layouts (upstream's against the fix's, a
drafter's 64- against 128-row pages) as the engine core will plan them:
vLLM's grouping (``get_kv_cache_groups``), its KV-cache config
(``get_kv_cache_config_from_groups``) and its capacity
(``get_kv_cache_capacity``), at the engine's max-model-len, on every cache of
the full model (:mod:`.model_specs`) -- never on the layers one pipeline rank
holds.  It plans on a shallow copy of the engine config, so the engine's own
is never changed: the copy's cache config has no block-count override (with
one, every candidate gets the same block count) and the KV-cache layout vLLM
resolves for the full model's backends where the engine has none yet.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import model_specs
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig, with_pipeline_size

PLANNED_MEMORY = 1 << 30  # compared per GiB, as the capacity benchmark reports it


def _planner() -> Any:
    """The module holding ``get_kv_cache_groups`` and
    ``get_kv_cache_config_from_groups`` (``kv_cache_planning`` from 0.33 on)."""
    try:
        from vllm.v1.core import kv_cache_planning as planner
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planner
    return planner


def _planning_config(
    vllm_config: Any, engine: EngineConfig, specs: Mapping[str, object], max_model_len: int
) -> object:
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    # the engine's pipeline stages, also on a DSpark drafter's one-stage copy
    config = copy.copy(with_pipeline_size(vllm_config, engine.pipeline_parallel))
    cache_config = copy.copy(vllm_config.cache_config)
    cache_config.num_gpu_blocks_override = None
    object.__setattr__(config, "cache_config", cache_config)
    model_config = copy.copy(vllm_config.model_config)  # the planner changes max_model_len
    model_config.max_model_len = max_model_len
    object.__setattr__(config, "model_config", model_config)
    if cache_config.kv_cache_layout is None:
        backends = model_specs.backends(vllm_config, engine)
        supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        cache_config.kv_cache_layout = resolve_kv_cache_layout(
            config, [supported], specs.values()
        ).name
    return config


def planned_tokens(
    vllm_config: object, engine: EngineConfig, specs: Mapping[str, object], max_model_len: int
) -> int:
    """KV tokens per GiB of the layout ``specs`` (every cache of the model)
    at ``max_model_len``, as vLLM's planner reports its capacity."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    planner = _planner()
    config = _planning_config(vllm_config, engine, specs, max_model_len)
    groups = planner.get_kv_cache_groups(config, dict(specs))
    kv_config = planner.get_kv_cache_config_from_groups(config, groups, PLANNED_MEMORY)
    return int(get_kv_cache_capacity(config, kv_config)[0])
