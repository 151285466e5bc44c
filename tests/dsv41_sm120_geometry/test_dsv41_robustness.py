"""dsv41-sm120-geometry at its edges (issue 18, items 5 and 6), on real vLLM 0.32-0.34.

* Workers that chose different geometries reach the engine core's spec merge
  (vLLM's own function, from the module the engine core imports it from): a clear error naming
  each geometry and its workers, also under ``python -O``, where vLLM's own
  check is a bare ``assert`` and vanishes.
* A prefix-cache block copy through vLLM's per-cache path (taken when the
  allocation is larger than its blocks, as the extensible KV cache makes it)
  copies each interleaved ratio-1 pair region whole; upstream's copy of the
  same views leaves bytes of the pair behind.
* Another model's compressed cache (GLM's kpool, ratio 32) gets exactly
  upstream's warm-up keys with the fix applied.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from fix_releases import covered

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import check_workers_agree, specs_geometry
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

pytestmark = pytest.mark.vllm_release(*covered(DSV41))


def _engine_core_merge():
    """The function vLLM's engine core merges the workers' specs with (it
    imports it by name from the planner module, which the fix patches), and
    its extra arguments after ``(vllm_config, kv_cache_specs)``.  Taken from
    the planner module: importing the engine core costs half a minute here."""
    planner = repro._planner()
    if hasattr(planner, "get_global_kv_cache_groups"):  # 0.33, 0.34
        return planner.get_global_kv_cache_groups, ()
    return planner.get_kv_cache_configs, ([1 << 30, 1 << 30],)  # 0.32


def worker_specs() -> dict:
    """The per-layer specs a worker sends to the engine core: the model's
    layers, then vLLM's own spec collection (``--block-size 128``)."""
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    config = repro.make_vllm_config(128)
    repro.build_layers(config, repro.DSV41_FLASH)
    return get_kv_cache_spec(config)


def _worker_specs(monkeypatch, geometry: str) -> dict:
    """:func:`worker_specs` with ``VLLM_MLA_FIXES_DSV41_GEOMETRY`` as that worker sees it."""
    monkeypatch.setenv(fix.GEOMETRY_ENV, geometry)
    return worker_specs()


def test_workers_with_different_geometries_stop_with_both_named(monkeypatch):
    with repro.applied((12, 0)):
        split = _worker_specs(monkeypatch, fix.SPLIT)
        per_ratio = _worker_specs(monkeypatch, fix.PER_RATIO)
        assert (specs_geometry(split), specs_geometry(per_ratio)) == (
            fix.SPLIT,
            fix.PER_RATIO,
        )
        merge, extra = _engine_core_merge()
        config = repro.make_vllm_config(128)
        repro.attach_model(config, repro.DSV41_FLASH)  # the engine core reads the model's config
        monkeypatch.delenv(fix.GEOMETRY_ENV)  # the engine core decides as the engine would
        with pytest.raises(fix.PageGeometryError) as excinfo:
            merge(config, [split, per_ratio, per_ratio], *extra)
    message = str(excinfo.value)
    assert f"the engine's DeepSeek-V4.1 KV geometry is {fix.SPLIT}, but worker 1 shows" in message
    assert f"worker 1 shows {fix.PER_RATIO} (" in message
    assert f"worker 2 shows {fix.PER_RATIO} (" in message and "worker 0" not in message
    assert fix.GEOMETRY_ENV in message and "Ray workers" in message


@pytest.mark.vllm_release(*covered(DSV41, ">=0.33.0"))
def test_workers_that_agree_reach_vllms_own_merge(monkeypatch):
    monkeypatch.setenv(fix.GEOMETRY_ENV, fix.SPLIT)
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128)  # resolves the KV-cache layout the merge reads
        config = geometry.vllm_config
        # What the merge reads of the model config (a real one inspects the model in a subprocess).
        config.model_config = SimpleNamespace(
            supports_kv_cache_grouping=False,
            hf_text_config=config.model_config.hf_text_config,  # the fix decides from it
            max_model_len=config.model_config.max_model_len,
        )
        merge, extra = _engine_core_merge()
        groups = merge(config, [geometry.specs, dict(geometry.specs)], *extra)
    assert sum(len(group.layer_names) for group in groups) == len(geometry.specs)


def test_a_worker_without_the_fix_is_named_too(monkeypatch):
    """A worker whose environment lacks the plugin builds upstream's specs."""
    upstream = worker_specs()
    with repro.applied((12, 0)):
        split = _worker_specs(monkeypatch, fix.SPLIT)
        config = repro.make_vllm_config(128)
        repro.attach_model(config, repro.DSV41_FLASH)
        with pytest.raises(fix.PageGeometryError) as excinfo:
            check_workers_agree(config, [split, upstream])
    assert "worker 1 shows vLLM's own (block sizes ratio 1: [128], ratio 2: [128]: " in str(
        excinfo.value
    )
    assert "no block stride of whole 46080-B interleave units" in str(excinfo.value)


WORKERS_DISAGREE_UNDER_O = textwrap.dedent(
    """
    import os, sys
    assert False, "this interpreter keeps asserts"
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
    from vllm.v1.core import kv_cache_planning
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    with repro.applied((12, 0)):
        specs = []
        for geometry in (fix.SPLIT, fix.PER_RATIO):
            os.environ[fix.GEOMETRY_ENV] = geometry
            config = repro.make_vllm_config(128)
            repro.build_layers(config, repro.DSV41_FLASH)
            specs.append(get_kv_cache_spec(config))
        try:
            kv_cache_planning.get_global_kv_cache_groups(repro.make_vllm_config(128), specs)
        except fix.PageGeometryError as exc:
            print("PageGeometryError:", exc)
            sys.exit(0)
    print("no error: the first worker's specs won")
    sys.exit(1)
    """
)


@pytest.mark.vllm_release("0.34.0")
@pytest.mark.skipif(
    os.environ.get("VLLM_MLA_FIXES_PYTHON_O") != "1",
    reason="a fresh `python -O` interpreter imports vLLM again (about 60 s on 2 cores); "
    "VLLM_MLA_FIXES_PYTHON_O=1 runs it",
)
def test_the_error_survives_python_O():
    """Under ``python -O`` vLLM's own check is gone; the fix's error is not."""
    env = {k: v for k, v in os.environ.items() if k != fix.GEOMETRY_ENV}
    done = subprocess.run(
        [sys.executable, "-O", "-c", WORKERS_DISAGREE_UNDER_O],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"worker 0: {fix.SPLIT}; worker 1: {fix.PER_RATIO}" in done.stdout


def test_geometry_choice_reaches_ray_workers(monkeypatch):
    """What vLLM copies from the driver to Ray workers, by its own functions:
    ``get_env_vars_to_copy`` (0.32.0's Ray executor, data-parallel engine-core
    actors) and ``get_driver_env_vars`` (``ray_executor_v2``)."""
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    from vllm_mla_fixes import settings
    from vllm_mla_fixes.fixes import SETTINGS

    monkeypatch.setenv(fix.GEOMETRY_ENV, fix.PER_RATIO)
    monkeypatch.setenv(fix.DRAFTER_SWA_ENV, "64")
    monkeypatch.setenv("VLLM_MLA_FIXES", fix.INFO.name)
    monkeypatch.setenv(settings.CACHE_DIR.name, "/var/cache/vllm-mla-fixes")
    names = {setting.name for setting in SETTINGS}  # every setting, on every node
    assert names <= get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS)
    driver = get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
    assert driver[fix.GEOMETRY_ENV] == fix.PER_RATIO
    assert driver[fix.DRAFTER_SWA_ENV] == "64"
    assert driver["VLLM_MLA_FIXES"] == fix.INFO.name


# ------------------------------------------------------------ block copies


@pytest.mark.vllm_release("0.34.0")  # 0.34.0's allocate_kv_cache takes the allocator
def test_block_copy_through_the_per_cache_path_covers_each_pair_region():
    """vLLM's ``copy_kv_cache_blocks_inplace`` on the model runner's manager
    views, over an allocation larger than its blocks (what the extensible KV
    cache reserves), takes the per-cache path.  Upstream's copy leaves bytes of
    each interleaved ratio-1 pair behind; the fix's copies the pair whole,
    through manager or kernel views, and touches no other block."""
    import torch
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker import utils as worker_utils

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import simulated_sm120_host

    # No driver to pin host memory with: vLLM's copy stages its indices unpinned.
    with simulated_sm120_host(), repro.applied((12, 0)):
        geometry = repro.plan_geometry(128)
        repro.select_kernel_block_sizes(geometry)
        config = geometry.kv_cache_config
        layout = geometry.vllm_config.cache_config.get_resolved_kv_cache_layout()
        spare = 4096  # reserved beyond the blocks
        backing = {}

        def reserve(nbytes):
            backing["buffer"] = torch.zeros(nbytes + spare, dtype=torch.uint8)
            return backing["buffer"][:nbytes]

        managers = worker_utils.allocate_kv_cache(
            config, repro.CPU, layout, geometry.kernel_block_sizes, allocate=reserve
        )
        flat_groups = [group for groups in geometry.attn_groups for group in groups]
        kernel_views = worker_utils.map_kv_caches_to_kernel_blocks(managers, flat_groups)
        worker_utils.bind_kv_cache_to_layers(kernel_views, geometry.forward_context)

        buffer = backing["buffer"]
        block_stride = config.kv_cache_tensors[0].block_stride
        num_blocks = config.num_blocks
        compressed = managers["model.layers.20.attn"]
        pair_start = compressed.storage_offset()  # uint8: elements are bytes
        pair = 2 * 46080
        src, dst = 1, num_blocks - 2
        copies = [KVCacheBlockCopy(src, dst)]

        def pair_region(block):
            start = block * block_stride + pair_start
            return buffer[start : start + pair]

        def copy_with(copy, caches):
            torch.manual_seed(0)
            buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8))
            before = buffer.clone()
            copy(caches, num_blocks, copies)
            outside = torch.ones_like(buffer, dtype=torch.bool)
            outside[dst * block_stride : (dst + 1) * block_stride] = False
            assert torch.equal(buffer[outside], before[outside])
            return int((pair_region(dst) != pair_region(src)).sum())

        fixed_copy = worker_utils.copy_kv_cache_blocks_inplace
        upstream_copy = fixed_copy.__wrapped__
        runner_caches = list(managers.values())  # what the model runner hands over
        left_behind = copy_with(upstream_copy, runner_caches)
        assert left_behind > 0, "upstream's per-cache copy was expected to miss pair bytes"
        assert copy_with(fixed_copy, runner_caches) == 0
        assert copy_with(fixed_copy, list(kernel_views.values())) == 0
    print(f"upstream per-cache copy left {left_behind} of {pair} pair bytes behind")


# ------------------------------------------------------------ other models


def test_glm_kpool_warmup_keys_are_upstreams_with_the_fix_applied():
    """GLM's kpool of ratio 32 (the config shape of vLLM 0.34.0's own
    ``test_compressed_slot_mapping_warmup_includes_index_kpool``), in a process
    where the fix has also made DeepSeek-V4.1 caches."""
    from vllm.v1.attention.backends.mla.compressor_utils import CompressedSlotMappingKernel

    glm = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=256),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(index_kpool=32)),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, cp_kv_cache_interleave_size=1
        ),
    )
    upstream = CompressedSlotMappingKernel().get_warmup_keys(glm)
    with repro.applied((12, 0)):
        repro.plan_geometry(128)
        fixed = CompressedSlotMappingKernel().get_warmup_keys(glm)
    assert upstream and fixed == upstream
