"""KV offloading over the interleaved split (issue 18, item 2), on the real releases.

vLLM's CPU offloading connector (``--kv-offloading-size``) registers the
bound manager-block views and, for DeepSeek-V4.1's packed layout, moves each
block id as one region of the whole block stride.  The self-test's
``offload-reload`` case takes those regions from the connector worker's own
``register_kv_caches``, copies a request's blocks out, overwrites every byte of
their pages and copies the regions back (it passes in ``vllm-mla-fixes
selftest``, tests/dsv41_sm120_geometry/test_selftest.py).  Here the case is shown to see a wrong
mover: per-layer manager pages, what a connector that copies each layer's
un-padded page would move, lose interleaved ratio-1 bytes and are caught.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# The connector worker is the same code on 0.32.0-0.34.0
# (docs/fixes/dsv41-sm120-geometry.md); the full self-test runs the passing case
# on all three.  One release keeps CI cheap.
pytestmark = pytest.mark.vllm_release("0.34.0")


def _offload_step():
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import TIMELINE

    prefill = TIMELINE[0]  # A's first chunk: 128 tokens, both ratio-1 kernel pages of a block
    return (dataclasses.replace(prefill, cases=("offload-reload",), offload=("A",)),)


def _run(geometry: str):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    return harness.run_geometry(geometry, kn.detect_device(), plans=_offload_step())


def _per_layer_pages(layout):
    """Each offloaded cache's manager page, un-padded, per block id."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )

    group_ids = tuple(get_offloading_group_ids(layout.kv_cache_config))
    regions: dict[int, list[tuple[torch.Tensor, int]]] = {gid: [] for gid in group_ids}
    for cache in layout.caches.values():
        if cache.group_id not in group_ids:
            continue
        view = cache.manager_view
        size = view.element_size()
        pages = torch.as_strided(
            layout.storage,
            (view.shape[0], cache.spec.page_size_bytes),
            (view.stride(0) * size, 1),
            view.storage_offset() * size,
        )
        regions[cache.group_id].append((pages, cache.spec.unpadded_page_size_bytes))
    return group_ids, regions


def test_a_per_layer_page_mover_loses_interleaved_ratio1_bytes(monkeypatch):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import timeline

    monkeypatch.setattr(timeline, "offload_regions", _per_layer_pages)
    result = _run("split")
    assert result.aborted is None, result.layout[-1]
    problems = result.cases["offload-reload"].problems
    assert problems and "bytes of its pages did not come back" in problems[0], problems
