"""dsv41-sm120-geometry on the real vLLM 0.32.0 / 0.33.0 / 0.34.0 releases (issues 5 and 9).

First the upstream failures of 0.32.0/0.33.0 through vLLM's own start-up path
(layers -> specs -> planner -> attention groups -> kernel block sizes ->
allocation and binding) and FlashInfer's own SM120 planner (0.34.0's are in
``test_dsv41_release_0_34.py``); then the fix applied as on an SM120 device:
every page FlashInfer and the indexer read holds 64 states, the start-up
self-check passes (and fails loudly on the upstream geometry); SM90/SM100 see
no change.  The default geometry (interleaved split) binds the ratio-1 pair as
interleaved 64-state kernel pages that tile each block with the other pages,
translates the ratio-1 writer slots to the kernel-table formula, zeroes new
blocks over exactly their pages, and beats upstream's capacity; the per-ratio
fallback is chosen, and says why, where the split is not proven safe.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from fix_releases import covered
from log_records import KeptRecords

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import (
    bound_pages,
    check_no_split_drafter,
    check_page_geometry,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    decide,
    flashinfer_takes_runtime_swa_pages,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import SIMPLE_OFFLOAD_ENV
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import kernel_slots
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import status_detail
from vllm_mla_fixes.patching import State, run_fix

pytestmark = pytest.mark.vllm_release(*covered(DSV41))
# The upstream failures of 0.32.0/0.33.0; 0.34.0 fails differently (tests/dsv41_sm120_geometry/test_dsv41_release_0_34.py).
before_0_34 = pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))

REPORT_ERROR = (
    "SM120 sparse-MLA has no decode kernel for this shape: num_tokens=8, num_heads=8, "
    "topk=128, d_qk=512, page_block_size=32, model_type=dsv4, extra_topk=0."
)


def _geometry_and_reason(vllm_config) -> tuple[str, str]:
    """The decision the fix takes for the engine ``vllm_config`` describes."""
    decision = decide(vllm_config)
    return decision.geometry, decision.reason


def _patched_targets():
    """The objects the fix replaces, as vLLM currently has them."""
    from vllm.models.deepseek_v41 import attention
    from vllm.models.deepseek_v41.nvidia import flashinfer_sparse
    from vllm.v1.attention.backends.mla import compressor_utils, indexer
    from vllm.v1.worker import utils
    from vllm.v1.worker.gpu import attn_utils

    return {
        "attention.get_kv_cache_spec": attention.DeepseekV4Attention.__dict__["get_kv_cache_spec"],
        "indexer_cache.get_kv_cache_spec": attention.DeepseekV4IndexerCache.__dict__[
            "get_kv_cache_spec"
        ],
        "attention.DeepseekV4SWACache": attention.DeepseekV4SWACache,
        "flashinfer.sizes": flashinfer_sparse.DeepseekV4FlashInferMLASparseBackend.__dict__[
            "get_supported_kernel_block_sizes"
        ],
        "indexer.sizes": indexer.DeepseekV41IndexerBackend.__dict__[
            "get_supported_kernel_block_sizes"
        ],
        "warmup": compressor_utils.CompressedSlotMappingKernel.__dict__["get_warmup_keys"],
        "bind": utils.bind_kv_cache_to_layers,
        "bind (attn_utils)": attn_utils.bind_kv_cache_to_layers,
    }


@pytest.fixture(scope="module")
def upstream_128():
    """The upstream --block-size 128 geometry, bound to the layers."""
    geometry = repro.plan_geometry(128)
    repro.allocate_and_bind(geometry)
    return geometry


# ------------------------------------------------------------------ upstream


@before_0_34
def test_block_size_64_fails_no_common_block_size_for_both_backends():
    geometry = repro.plan_geometry(64)
    with pytest.raises(ValueError) as excinfo:
        repro.select_kernel_block_sizes(geometry)
    assert str(excinfo.value) == repro.BLOCK_SIZE_ERROR

    from vllm.v1.worker.utils import select_common_block_size

    errors = set()
    for group_id, groups in enumerate(geometry.attn_groups):
        for group in groups:
            try:
                select_common_block_size(
                    geometry.kernel_block_sizes[group_id], [group.backend], [group.kv_cache_spec]
                )
            except ValueError as exc:
                errors.add(str(exc))
    assert errors == {repro.BLOCK_SIZE_ERROR, repro.INDEXER_BLOCK_SIZE_ERROR}


@before_0_34
def test_block_size_128_starts_with_32_token_swa_and_128_state_ratio1_pages(upstream_128):
    assert upstream_128.kernel_block_sizes == [32, 32, 32, 32, 128, 8]
    repro.select_kernel_block_sizes(upstream_128)  # start-up passes
    pages = {
        (page.kind, page.compress_ratio): page.rows for page in repro.flashinfer_pages(upstream_128)
    }
    assert pages == {
        ("swa", 0): 32,
        ("compressed", 2): 64,
        ("compressed", 1): 128,
        ("indexer", 2): 64,
        ("indexer", 1): 128,
    }


@pytest.mark.vllm_release("0.32.0")
def test_flashinfer_070_planner_rejects_the_32_token_swa_page(upstream_128):
    assert repro.flashinfer_version() == "0.7.0.post1"
    swa_only = upstream_128.layers[repro.attention_prefix(0)]
    cache = swa_only._as_sparse_cache(swa_only.swa_cache_layer.kv_cache)
    page = repro.flashinfer_primary_page(cache)
    assert page == 32
    error = repro.sm120_decode_verdict(page, has_extra=False, **repro.REPORT_CALL)
    assert error is not None and error.startswith(REPORT_ERROR)
    assert (
        "Mismatch: page_block_size=32 is unsupported; decode kernels are instantiated only "
        "for page_block_size=64."
    ) in error
    # The ratio-1 layer's primary page is the same SWA cache: it fails the same way.
    assert repro.sm120_decode_verdict(page, has_extra=True, **repro.REPORT_CALL) is not None


@pytest.mark.vllm_release("0.33.0")
def test_flashinfer_072_takes_the_32_page_but_ratio1_indexer_pages_stay_wrong(upstream_128):
    """0.33.0's pin lifts FlashInfer's page limit (its static envelope takes any
    positive page), so the report's FlashInfer error is gone at --block-size
    128; what remains is the ratio-1 indexer cache with 128 states per page,
    while SM120's paged-MQA logits kernels take 64 (and --block-size 64 still
    fails, test above)."""
    assert repro.flashinfer_version() == "0.7.2.post1"
    assert repro.sm120_decode_verdict(32, has_extra=False, **repro.REPORT_CALL) is None
    assert repro.sm120_paged_mqa_page_sizes() == (64,)
    indexer_pages = {
        page.compress_ratio: page.rows
        for page in repro.flashinfer_pages(upstream_128)
        if page.kind == "indexer"
    }
    assert indexer_pages == {1: 128, 2: 64}


@before_0_34
def test_upstream_geometry_fails_the_self_check_with_a_clear_error(upstream_128):
    with pytest.raises(fix.PageGeometryError) as excinfo:
        check_page_geometry(bound_pages(upstream_128.forward_context), everything=True)
    message = str(excinfo.value)
    assert (
        "model.layers.0.attn.swa_cache: sliding-window KV cache, compress ratio 0, 32-token pages"
        in message
    )
    assert "model.layers.20.attn: compressed KV cache, compress ratio 1, 128-token pages" in message
    assert (
        "model.layers.20.attn.indexer.k_cache: indexer K cache, compress ratio 1, 128-state pages"
    ) in message
    assert "model.layers.2.attn:" not in message  # ratio-2 pages already hold 64 states


# ---------------------------------------------------------------------- fix


def test_fix_applies_on_sm120_and_sm121_and_reverts_cleanly():
    before = _patched_targets()
    for capability in ((12, 0), (12, 1)):
        with repro.applied(capability) as result:
            assert result.status.state is State.APPLIED, result.status.reason
            changed = _patched_targets()
            assert all(changed[name] is not before[name] for name in before), changed
        assert _patched_targets() == before


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3)])
def test_sm90_and_sm100_see_no_change(capability):
    before_targets = _patched_targets()
    before = repro.plan_geometry(128)
    with repro.applied(capability) as result:
        assert result.status.state is State.NOT_NEEDED
        assert result.patch is None
        assert f"SM{capability[0]}{capability[1]}" in result.status.reason
        assert _patched_targets() == before_targets
        after = repro.plan_geometry(128)
        assert after.specs == before.specs
        assert after.kernel_block_sizes == before.kernel_block_sizes
        assert [g.layer_names for g in after.kv_cache_config.kv_cache_groups] == [
            g.layer_names for g in before.kv_cache_config.kv_cache_groups
        ]


def test_plugin_on_this_cpu_host_changes_nothing(fresh_plugin):
    before = _patched_targets()
    fresh_plugin.register()
    status = {s.name: s for s in fresh_plugin.status()}[fix.INFO.name]
    assert status.state is State.NOT_NEEDED
    assert "not a CUDA platform" in status.reason
    assert _patched_targets() == before


def _assert_64_state_pages(geometry):
    repro.allocate_and_bind(geometry)  # the self-check runs inside and passes
    pages = repro.flashinfer_pages(geometry)
    assert {page.rows for page in pages} == {fix.PAGE_ROWS}
    assert len([p for p in pages if p.kind == "swa"]) == 40
    for page in pages:
        if page.kind != "indexer":
            assert (
                repro.sm120_decode_verdict(
                    page.rows, has_extra=page.kind == "compressed", **repro.REPORT_CALL
                )
                is None
            ), page
    assert all(p.rows in repro.sm120_paged_mqa_page_sizes() for p in pages if p.kind == "indexer")

    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    geometry.vllm_config.cache_config.enable_prefix_caching = True
    assert resolve_kv_cache_block_sizes(geometry.kv_cache_config, geometry.vllm_config) == (128, 64)


@pytest.mark.parametrize("block_size", [64, 128])
def test_default_split_gives_every_page_64_states_and_splits_only_ratio_1(block_size):
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(block_size)
        chosen = repro.select_kernel_block_sizes(geometry)  # no "No common block size"
        blocks = {name: spec.block_size for name, spec in geometry.specs.items()}
        for layer in (2, 20):
            assert blocks[f"model.layers.{layer}.attn"] == 128
            assert blocks[f"model.layers.{layer}.attn.indexer.k_cache"] == 128
        assert blocks["model.layers.0.attn.swa_cache"] == 64
        split = {
            name
            for name, size in chosen.items()
            if size != 128 and "SWA" not in name and "Compressor" not in name
        }
        assert split == {
            "FLASHINFER_MLA_SPARSE_DSV41:model.layers.20.attn",
            "DEEPSEEK_V41_INDEXER:model.layers.20.attn.indexer.k_cache",
        }
        assert {chosen[name] for name in split} == {64}
        # One 230,400-B block: 3 ratio-2 sources + the ratio-1 pair = 5 units of 46,080 B.
        assert geometry.kv_cache_config.kv_cache_tensors[0].block_stride == 230400
        _assert_64_state_pages(geometry)


@pytest.mark.parametrize("block_size", [64, 128])
def test_fallback_per_ratio_gives_every_page_64_states_without_splitting(block_size, monkeypatch):
    monkeypatch.setenv(fix.GEOMETRY_ENV, "per-ratio")
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(block_size)
        chosen = repro.select_kernel_block_sizes(geometry)
        # Manager blocks are never split: each group's kernel block is its block.
        for group, kernel in zip(
            geometry.kv_cache_config.kv_cache_groups, geometry.kernel_block_sizes
        ):
            assert kernel == group.kv_cache_spec.block_size
        for groups in geometry.attn_groups:
            for group in groups:
                assert (
                    chosen[f"{group.backend.get_name()}:{group.layer_names[0]}"]
                    == group.kv_cache_spec.block_size
                )
        blocks = {name: spec.block_size for name, spec in geometry.specs.items()}
        assert (
            blocks["model.layers.20.attn"] == blocks["model.layers.20.attn.indexer.k_cache"] == 64
        )
        assert blocks["model.layers.2.attn"] == blocks["model.layers.2.attn.indexer.k_cache"] == 128
        assert blocks["model.layers.0.attn.swa_cache"] == 64
        _assert_64_state_pages(geometry)


def test_split_binds_interleaved_ratio1_pages_that_tile_each_block():
    """The real 40-layer layout: the ratio-1 compressed and indexer caches are
    bound as 64-row kernel pages with a 46,080-B page stride (compressed page
    37,440 B, then indexer page 8,640 B), and every packed layer's pages tile
    each block exactly once."""
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128)
        repro.select_kernel_block_sizes(geometry)
        manager = repro.allocate_and_bind(geometry)
        context = geometry.forward_context
        packed = [
            name
            for name in geometry.specs
            if name.endswith(".attn") or name.endswith(".indexer.k_cache")
        ]
        block_stride = manager[packed[0]].stride(0)
        assert block_stride == 230400
        compressed, indexer = (
            context["model.layers.20.attn"].kv_cache,
            context["model.layers.20.attn.indexer.k_cache"].kv_cache,
        )
        assert compressed.stride(0) == indexer.stride(0) == 46080
        assert indexer.storage_offset() - compressed.storage_offset() == 37440
        for block in range(geometry.kv_cache_config.num_blocks):
            ranges = []
            for name in packed:
                view = context[name].kv_cache
                spec = geometry.specs[name]
                rows = view.shape[-2]
                page = spec.copy_with_new_block_size(rows * spec.tokens_per_state).page_size_bytes
                per_block = spec.block_size // (rows * spec.tokens_per_state)
                pages_per_block = block_stride // view.stride(0)
                for j in range(per_block):
                    start = view.storage_offset() + (block * pages_per_block + j) * view.stride(0)
                    ranges.append((start, start + page))
            ranges.sort()
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), block  # no overlap
            assert ranges[0][0] == block * block_stride
            assert sum(end - start for start, end in ranges) == block_stride  # no gap


@pytest.mark.parametrize(
    "geometry, pages",
    [
        (
            fix.SPLIT,
            {
                "model.layers.20.attn": 128 * 584,
                "model.layers.2.attn": 64 * 584,
                "model.layers.20.attn.indexer.k_cache": 128 * 132,
            },
        ),
        (
            fix.PER_RATIO,
            {
                "model.layers.20.attn": 64 * 584,
                "model.layers.2.attn": 64 * 584,
                "model.layers.20.attn.indexer.k_cache": 64 * 132,
            },
        ),
    ],
)
def test_fixed_specs_recompute_their_page_padding(geometry, pages, monkeypatch):
    """A bare ``replace(spec, block_size=...)`` keeps the old page's padding
    whenever the new page needs none (72 x 584 B is 576-aligned); the fix
    clears it, so its specs always carry the padding of their own page."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    upstream = repro.plan_geometry(128).specs["model.layers.20.attn"]
    assert upstream.page_size_bytes == 74880  # 128 x 584 B, 576-aligned
    assert dataclasses.replace(upstream, block_size=72).page_size_bytes == 74880  # stale
    assert (
        dataclasses.replace(upstream, block_size=72, page_size_padded=None).page_size_bytes
        == 72 * 584
    )
    monkeypatch.setenv(fix.GEOMETRY_ENV, geometry)
    with repro.applied((12, 0)):
        fixed = repro.plan_geometry(64).specs
    for name, rows_bytes in pages.items():
        spec = fixed[name]
        assert spec.page_size_bytes == -(-rows_bytes // 576) * 576, name
        fresh = MLAAttentionSpec(
            **{
                f.name: getattr(spec, f.name)
                for f in dataclasses.fields(spec)
                if f.init and f.name != "page_size_padded"
            }
        )
        assert fresh.page_size_bytes == spec.page_size_bytes


@before_0_34
def test_self_check_catches_a_geometry_changed_after_the_fix():
    """A sliding-window cache the fix built with 64-row pages, changed back
    to 32 rows before its spec (another plugin, another build): the check
    inside vLLM's bind raises before any request, naming it."""

    def another_plugin(layers):
        layers["model.layers.0.attn"].swa_cache_layer.block_size = fix.UPSTREAM_SWA_BLOCK

    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, after_build=another_plugin)
        repro.select_kernel_block_sizes(geometry)
        with pytest.raises(
            fix.PageGeometryError,
            match="swa_cache: sliding-window KV cache, compress ratio 0, 32-token pages",
        ):
            repro.allocate_and_bind(geometry)


@before_0_34  # 0.34.0 cannot bind upstream's --block-size 128 at all
def test_upstream_layouts_bound_beside_the_fix_are_not_checked():
    """Layers the fix laid out nothing for (an engine whose decision is
    upstream's, or specs planned before the fix) are upstream's own: binding
    them with the fix installed is not the fix's to refuse."""
    geometry = repro.plan_geometry(128)
    with repro.applied((12, 0)):
        repro.allocate_and_bind(geometry)


@before_0_34
def test_tiny_config_geometry():
    model = repro.tiny_model()
    assert set(model["compress_ratios"]) == {0, 1, 2}
    with pytest.raises(ValueError, match="No common block size for 64"):
        repro.select_kernel_block_sizes(repro.plan_geometry(64, model))
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, model)
        repro.select_kernel_block_sizes(geometry)
        repro.allocate_and_bind(geometry)
        assert {page.rows for page in repro.flashinfer_pages(geometry)} == {64}


def test_compressor_warmup_covers_the_64_state_pages():
    """The compressed-slot-mapping kernel sees ``num_states`` (64) as its block
    size.  Upstream warms ``--block-size // ratio``: the same Triton
    specialisation for 64/128, a different one for e.g. 16."""
    from vllm.v1.attention.backends.mla.compressor_utils import (
        _COMPRESSED_SLOT_MAPPING_KERNEL as kernel,
    )

    def config(block_size):
        vllm_config = repro.make_vllm_config(block_size)
        vllm_config.model_config = SimpleNamespace(
            hf_text_config=SimpleNamespace(**repro.tiny_model())
        )
        return vllm_config

    def runtime_key(vllm_config):
        parallel = vllm_config.parallel_config
        return kernel.dispatch(
            compress_ratio=2,
            block_size=fix.PAGE_ROWS,
            dcp_world_size=parallel.decode_context_parallel_size,
            cp_interleave=parallel.cp_kv_cache_interleave_size,
        )

    for block_size in (64, 128):
        assert runtime_key(config(block_size)) in kernel.get_warmup_keys(config(block_size))
    assert runtime_key(config(16)) not in kernel.get_warmup_keys(config(16))
    with repro.applied((12, 0)):
        # The key is added for the compress ratios of the caches the engine's
        # decision lays out, decided from its config alone (issue 37).
        assert runtime_key(config(16)) in kernel.get_warmup_keys(config(16))


def test_unreviewed_target_leaves_vllm_untouched(monkeypatch, tmp_path):
    from vllm_mla_fixes import screen_cache

    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, str(tmp_path))  # screen this table afresh
    before = _patched_targets()
    target = (fix.ATTENTION_MODULE, "DeepseekV4Attention.get_kv_cache_spec")
    monkeypatch.setitem(fix.REVIEWED, target, {"0000000000000000": "not this release"})
    result = run_fix(fix.for_capability((12, 0)), repro._installed_vllm())
    assert result.status.state is State.SKIPPED
    assert (
        "unexpected target" in result.status.reason and "get_kv_cache_spec" in result.status.reason
    )
    assert _patched_targets() == before


def test_capacity_is_measured_from_vllms_planner(monkeypatch):
    upstream = repro.capacity(128, max_model_len=8192)
    with repro.applied((12, 0)):
        split = repro.capacity(128, max_model_len=8192)
    monkeypatch.setenv(fix.GEOMETRY_ENV, "per-ratio")
    with repro.applied((12, 0)):
        per_ratio = repro.capacity(128, max_model_len=8192)
    assert upstream["bytes_per_block"] == split["bytes_per_block"] == 230400
    assert per_ratio["bytes_per_block"] == 138240
    assert split["tokens"] >= upstream["tokens"] > per_ratio["tokens"] > 0


# ------------------------------------------------------------ geometry decision


def _config(**changes):
    config = repro.make_vllm_config(128)
    repro.attach_model(config, repro.DSV41_FLASH)
    for name, value in changes.items():
        object.__setattr__(config, name, value)
    return config


def test_geometry_decision_defaults_to_the_split_and_says_why():
    with repro.applied((12, 0)):
        geometry, reason = _geometry_and_reason(_config())
    assert geometry == fix.SPLIT and reason.startswith("default on SM12x")


@pytest.mark.parametrize(
    "changes, why",
    [
        (
            dict(speculative_config=SimpleNamespace(method="eagle3", num_speculative_tokens=2)),
            "speculative method eagle3",
        ),
        ("kv_connector", "KV connector NixlConnector is configured"),
        ("dcp", "decode_context_parallel_size is 2"),
        ("lmcache", "KV connector LMCacheMPConnector is configured"),
    ],
)
def test_geometry_decision_falls_back_where_the_split_is_not_proven(changes, why):
    from vllm.config import KVTransferConfig

    config = repro.make_vllm_config(128)
    if changes == "kv_connector":
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        )
    elif changes == "dcp":
        object.__setattr__(config.parallel_config, "decode_context_parallel_size", 2)
    elif changes == "lmcache":
        config.cache_config.kv_offloading_size = 8.0
        config.cache_config.kv_offloading_backend = "lmcache"
    else:
        for name, value in changes.items():
            object.__setattr__(config, name, value)
    with repro.applied((12, 0)):
        geometry, reason = _geometry_and_reason(config)
        assert geometry == fix.PER_RATIO and reason.startswith(why), reason


def test_cpu_kv_offloading_keeps_the_split(monkeypatch):
    """``--kv-offloading-size`` selects vLLM's OffloadingConnector, which moves
    whole packed blocks (the self-test's offload-reload case); its simple
    variant (VLLM_USE_SIMPLE_KV_OFFLOAD=1) is not reviewed and falls back."""
    from vllm.config import KVTransferConfig

    monkeypatch.delenv(SIMPLE_OFFLOAD_ENV, raising=False)
    offloading = repro.make_vllm_config(128)
    offloading.cache_config.kv_offloading_size = 8.0
    repro.attach_model(offloading, repro.DSV41_FLASH)
    explicit = repro.make_vllm_config(128)
    repro.attach_model(explicit, repro.DSV41_FLASH)
    explicit.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both"
    )
    with repro.applied((12, 0)):
        for config in (offloading, explicit):
            assert _geometry_and_reason(config)[0] == fix.SPLIT
        monkeypatch.setenv(SIMPLE_OFFLOAD_ENV, "1")
        geometry, reason = _geometry_and_reason(offloading)
    assert geometry == fix.PER_RATIO
    assert reason.startswith("KV connector SimpleCPUOffloadConnector is configured")


def _speculative(method: str, num_speculative_tokens: int = 3):
    """vLLM's own ``SpeculativeConfig`` with the fields the geometry decision
    and the planner read (a full one loads the draft model's config)."""
    from vllm.config import SpeculativeConfig

    config = SpeculativeConfig.__new__(SpeculativeConfig)
    fields = dict(
        method=method, num_speculative_tokens=num_speculative_tokens, disable_eagle_block_drop=False
    )
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


def _dspark():
    return _speculative("dspark")


def test_dspark_keeps_the_split_when_no_drafter_layer_has_a_ratio_1_cache():
    """DeepSeek-V4.1-Flash with DSpark's three sliding-window drafter layers
    (numbered 40-42, past the backbone): the split stays, says why, and its
    ratio-1 pages are still interleaved 64-state pages."""
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0, 0, 0))
        geometry_name, reason = _geometry_and_reason(geometry.vllm_config)
        assert geometry_name == fix.SPLIT, reason
        assert "with DSpark: no drafter layer owns or reads a ratio-1" in reason
        assert geometry.specs["model.layers.20.attn"].block_size == fix.SPLIT_MANAGER_BLOCK
        assert geometry.specs["model.layers.39.attn.swa_cache"].block_size == fix.PAGE_ROWS
        drafter_rows = decide(geometry.vllm_config).drafter_swa_rows
        for layer in (40, 41, 42):
            spec = geometry.specs[f"model.layers.{layer}.attn.swa_cache"]
            assert spec.block_size == drafter_rows
        assert f"drafter sliding-window pages hold {drafter_rows} tokens" in reason
        assert "geometry interleaved-split" in status_detail()


# FlashInfer's SM120 DeepSeek-V4 decode kernels take the page size at run time
# from 0.7.2.post1 (0.33.0's pin); 0.32.0 pins 0.7.0.post1, 64 rows only.
RUNTIME_PAGES = {"0.32.0": False, "0.33.0": True, "0.34.0": True}


def test_drafter_sliding_window_pages_follow_the_installed_flashinfer(request):
    """DSpark's drafter layers get 128-row sliding-window pages, all in one
    KV-cache group, where the installed FlashInfer's own envelope takes
    run-time page sizes; 64 where it does not.  The backbone keeps 64."""
    import flashinfer

    release = request.config.vllm_release
    assert flashinfer_takes_runtime_swa_pages() is RUNTIME_PAGES[release], flashinfer.__version__
    rows = fix.DRAFTER_SWA_ROWS if RUNTIME_PAGES[release] else fix.PAGE_ROWS
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0, 0, 0))
        repro.select_kernel_block_sizes(geometry)
        repro.allocate_and_bind(geometry)  # the start-up self-check runs inside and passes
        pages = {page.layer: page.rows for page in bound_pages(geometry.forward_context)}
    assert {pages[f"model.layers.{layer}.attn.swa_cache"] for layer in (40, 41, 42)} == {rows}
    assert pages["model.layers.39.attn.swa_cache"] == fix.PAGE_ROWS
    drafter_groups = {
        gid
        for gid, group in enumerate(geometry.kv_cache_config.kv_cache_groups)
        for name in group.layer_names
        if name.startswith(("model.layers.40.", "model.layers.41.", "model.layers.42."))
    }
    for layer in (40, 41, 42):
        assert geometry.specs[f"model.layers.{layer}.attn.swa_cache"].block_size == rows
    if rows == fix.DRAFTER_SWA_ROWS:
        assert len(drafter_groups) == 1, drafter_groups


@pytest.mark.vllm_release(*covered(DSV41, ">=0.33.0"))
@pytest.mark.parametrize(("count", "rows"), [(1, 64), (3, 128)])
def test_drafter_pages_are_planned_both_ways_and_hold_at_least_upstream(count, rows):
    """Issue 25, item 4: where FlashInfer takes run-time page sizes, the fix
    plans a DSpark drafter's sliding-window pages at 128 and at 64 rows with
    vLLM's own planner on the engine's layers and keeps the one holding more.
    One drafter layer fits the backbone's 64-row groups (128 rows would open a
    tenth group: 0.940x); three do not.  Either way the line holds at least
    upstream's working --block-size 64 layout with the same drafter layers."""
    import re

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity

    lens = (8192,)
    settings = repro.EngineSettings(
        attached={"speculative_config": _dspark()}, drafter_ratios=(0,) * count
    )
    with repro.sm120_platform(), capacity.forced_geometry(None):
        fixed = capacity.measure("dspark", 128, lens, settings)
        with repro.applied((12, 0)):
            decision = decide(repro.plan_geometry(128, settings=settings).vllm_config)
        with capacity.drafter_pages_kept_at_64():
            narrow = capacity.measure("dspark, 64-row drafter pages", 128, lens, settings)
    upstream = capacity.upstream_rows(lens, settings.drafter_ratios)
    assert decision.drafter_swa_rows == rows, decision
    figures = re.search(
        r"128-row pages hold ([\d,]+) KV tokens per GiB, 64-row ([\d,]+)",
        decision.drafter_rows_why,
    )
    assert figures is not None, decision.drafter_rows_why
    wide, narrow_planned = (int(f.replace(",", "")) for f in figures.groups())
    assert narrow_planned == narrow[0].tokens  # the planning is the benchmark's figure
    assert fixed[0].tokens == max(wide, narrow_planned) == decision.fix_tokens
    assert f"drafter sliding-window pages hold {rows} tokens" in decision.reason
    best_upstream = capacity.baseline(upstream, 8192, 64, count)
    assert fixed[0].versus(best_upstream) >= 1.0, (fixed[0].tokens, best_upstream.tokens)


@pytest.mark.vllm_release("0.34.0")
@pytest.mark.parametrize(
    ("drafters", "geometry_name", "figure"),
    [((), fix.UPSTREAM, "(1.007x, under the 1.02x"), ((0, 0, 0), fix.SPLIT, "(1.066x, at least")],
    ids=["no-speculation", "dspark"],
)
def test_the_two_percent_rule_is_planned_on_the_models_layers(drafters, geometry_name, figure):
    """Issue 25, item 4, and issue 37: 0.34.0's own --block-size 64 layout
    works on SM12x.  The decision plans both layouts with vLLM's planner on
    the full model's specs, built from its config (drafter layers included),
    before any layer is built: without speculation the fix gains 1.007x and
    steps aside; with DSpark's three drafter layers 1.066x, so it applies.
    Each sliding-window cache is built with its final rows, the rows vLLM's
    own ``DeepseekV4Attention.__init__`` registers its index kernels' JIT
    warm-up with (``swa_cache_layer.block_size``); the bound pages pass the
    fix's start-up check."""
    speculative = _dspark() if drafters else None
    with repro.applied((12, 0)), repro.sm120_platform():
        geometry = repro.plan_geometry(64, speculative_config=speculative, drafter_ratios=drafters)
        repro.select_kernel_block_sizes(geometry)
        repro.create_metadata_builders(geometry)
        repro.allocate_and_bind(geometry)  # the fix's page check runs here
        decided, reason = _geometry_and_reason(geometry.vllm_config)
    assert decided == geometry_name and figure in reason, reason
    window_rows = {
        name: spec.block_size for name, spec in geometry.specs.items() if "swa_cache" in name
    }
    built_rows = {
        layer.swa_cache_layer.prefix: layer.swa_cache_layer.block_size
        for layer in geometry.layers.values()
    }
    assert built_rows == window_rows  # what the warm-up registers is what is planned
    drafter_names = {f"model.layers.{40 + i}.attn.swa_cache" for i in range(len(drafters))}
    if geometry_name == fix.UPSTREAM:
        assert set(window_rows.values()) == {fix.UPSTREAM_SWA_BLOCK}
        return
    assert {rows for name, rows in window_rows.items() if name not in drafter_names} == {64}
    assert {window_rows[name] for name in drafter_names} == {fix.DRAFTER_SWA_ROWS}
    pages = {(p.kind, p.rows) for p in repro.flashinfer_pages(geometry)}
    assert pages == {
        ("swa", 64),
        ("swa", fix.DRAFTER_SWA_ROWS),
        ("compressed", 64),
        ("indexer", 64),
    }


def test_drafter_sliding_window_pages_can_be_kept_at_64(monkeypatch):
    monkeypatch.setenv(fix.DRAFTER_SWA_ENV, "64")
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0, 0, 0))
        _, reason = _geometry_and_reason(geometry.vllm_config)
    assert geometry.specs["model.layers.40.attn.swa_cache"].block_size == fix.PAGE_ROWS
    assert f"drafter sliding-window pages hold 64 tokens ({fix.DRAFTER_SWA_ENV}=64)" in reason


@pytest.mark.vllm_release(*covered(DSV41, ">=0.33.0"))
def test_drafter_pages_can_be_forced_to_128(monkeypatch):
    """``=128`` skips the planning: one drafter layer keeps 128-row pages,
    where planning would give it 64."""
    monkeypatch.setenv(fix.DRAFTER_SWA_ENV, "128")
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0,))
    assert geometry.specs["model.layers.40.attn.swa_cache"].block_size == fix.DRAFTER_SWA_ROWS
    decision = decide(geometry.vllm_config)
    assert (decision.drafter_swa_rows, decision.drafter_rows_why) == (
        128,
        f"{fix.DRAFTER_SWA_ENV}=128",
    )


@pytest.mark.parametrize("value", ["7", "-1", "abc", "256"])
def test_drafter_rows_other_than_64_or_128_count_as_unset(monkeypatch, value):
    monkeypatch.delenv(fix.DRAFTER_SWA_ENV, raising=False)
    with repro.applied((12, 0)):
        config = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0,))
        unset = decide(config.vllm_config).drafter_swa_rows
        monkeypatch.setenv(fix.DRAFTER_SWA_ENV, value)
        assert decide(config.vllm_config).drafter_swa_rows == unset


def test_dspark_drafter_with_a_ratio_1_cache_falls_back_and_names_the_layer():
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0, 1, 0))
        geometry_name, reason = _geometry_and_reason(geometry.vllm_config)
    assert geometry_name == fix.PER_RATIO
    assert reason.startswith(
        "speculative method dspark with model.layers.41.attn (drafter layer that reads a "
        "ratio-1 compressed cache): its ratio-1 slots are not translated"
    )


def test_split_bound_with_a_ratio_1_drafter_stops_at_binding_naming_it():
    """The check where caches are bound: a drafter holding a ratio-1 cache
    beside a bound split (the decision bypassed) stops start-up."""
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_dspark(), drafter_ratios=(0, 0))
        repro.select_kernel_block_sizes(geometry)
        repro.allocate_and_bind(geometry)  # the split binds; the drafters pass the check
        geometry.layers["model.layers.41.attn"].compress_ratio = 1
        with pytest.raises(fix.PageGeometryError, match=r"model\.layers\.41\.attn \(drafter"):
            check_no_split_drafter(geometry.forward_context)


@pytest.mark.parametrize(
    "method, geometry_name, why",
    [
        ("ngram", fix.SPLIT, "with ngram: drafts come from token ids, no drafter KV"),
        ("suffix", fix.SPLIT, "with suffix: drafts come from token ids, no drafter KV"),
        ("eagle", fix.PER_RATIO, "speculative method eagle (its drafter layers write KV"),
        ("eagle3", fix.PER_RATIO, "speculative method eagle3 (its drafter layers write KV"),
        ("mtp", fix.PER_RATIO, "speculative method mtp (its drafter layers write KV"),
        ("dflash", fix.PER_RATIO, "speculative method dflash (its drafter layers write KV"),
        ("medusa", fix.PER_RATIO, "speculative method medusa is not reviewed with the split"),
    ],
)
def test_each_speculative_method_gets_the_geometry_its_drafter_allows(method, geometry_name, why):
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128, speculative_config=_speculative(method))
        name, reason = _geometry_and_reason(geometry.vllm_config)
    assert name == geometry_name and why in reason, reason


def test_operator_can_force_the_fallback(monkeypatch):
    monkeypatch.setenv(fix.GEOMETRY_ENV, "per-ratio")
    with repro.applied((12, 0)):
        assert _geometry_and_reason(_config()) == (fix.PER_RATIO, f"{fix.GEOMETRY_ENV}=per-ratio")
    monkeypatch.delenv(fix.GEOMETRY_ENV)
    with repro.applied((12, 0)):
        unset = _geometry_and_reason(_config())
    # a value that is not allowed counts as unset (the plugin warns about it when it loads)
    for value in ("bogus", "per_ratio", ""):
        monkeypatch.setenv(fix.GEOMETRY_ENV, value)
        with repro.applied((12, 0)):
            assert _geometry_and_reason(_config()) == unset, value


def test_unreviewed_split_target_keeps_the_fix_with_the_fallback_geometry(monkeypatch):
    """A changed definition that only the split needs: the fix still applies,
    with per-ratio blocks, leaves the split's targets alone, and says why."""
    from vllm.v1.worker import utils

    before = (
        utils.map_kv_caches_to_kernel_blocks,
        utils.AttentionGroup.__dict__["_with_kernel_block_table"],
    )
    target = (fix.WORKER_UTILS_MODULE, "AttentionGroup._with_kernel_block_table")
    monkeypatch.setitem(fix.REVIEWED, target, {"0000000000000000": "not this release"})
    with repro.applied((12, 0)) as result:
        assert result.status.state is State.APPLIED
        assert (
            utils.map_kv_caches_to_kernel_blocks,
            utils.AttentionGroup.__dict__["_with_kernel_block_table"],
        ) == before
        geometry = repro.plan_geometry(128)
        assert geometry.specs["model.layers.20.attn"].block_size == 64
        name, reason = _geometry_and_reason(geometry.vllm_config)
        assert name == fix.PER_RATIO
        assert "not reviewed" in reason and "_with_kernel_block_table" in reason
        assert "geometry per-ratio" in status_detail()


def test_status_says_which_geometry_is_in_force(fresh_plugin, swap_fix):
    """``status`` after a model's specs were built in this process names the
    geometry and the reason; before, it states the rule."""
    swap_fix(dataclasses.replace(fix.FIX, probe=lambda: None))  # this CPU host stands in for SM120
    fresh_plugin.register()
    try:
        entry = {s.name: s for s in fresh_plugin.status()}[fix.INFO.name]
        assert entry.state is State.APPLIED
        assert (
            "geometry chosen per engine when its model loads: upstream (the fix steps aside) "
            "where upstream's layout for the line starts and every page is inside the installed "
            "kernels' own envelopes, unless the fix's layout, planned on the model's layers, "
            "holds at least 1.02x its KV tokens; else interleaved-split by default"
        ) in entry.reason
        repro.plan_geometry(128)
        entry = {s.name: s for s in fresh_plugin.status()}[fix.INFO.name]
        assert entry.reason.endswith(
            "geometry interleaved-split (default on SM12x: 128-token "
            "blocks, ratio-1 compressed/indexer pages interleaved as "
            "64-state kernel pages)"
        )
    finally:
        fresh_plugin.revert_all()


def test_engine_log_names_the_geometry_the_gpu_test_asserts(monkeypatch):
    """The served process logs the geometry once; the SM120 GPU test asserts
    this line to prove the default geometry (not the fallback) was compared."""
    import logging

    import vllm.logger  # noqa: F401  its logging set-up clears child handlers: run it first

    handler = KeptRecords()
    records = handler.records
    logger = logging.getLogger("vllm.mla_fixes")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # a served process logs INFO
    try:
        with repro.applied((12, 0)):
            repro.plan_geometry(128)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records if "KV geometry" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"DeepSeek-V4.1 KV geometry {fix.SPLIT} (" in lines[0]


class _BuilderStandIn:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device


def test_new_blocks_are_zeroed_over_exactly_the_pages_they_hold():
    """vLLM's ``KVBlockZeroer`` (built as the worker builds it) zeroes, for
    each newly allocated block, spans that cover every bound page of the block
    -- both interleaved ratio-1 pages of each cache included -- and nothing
    outside the block."""
    from vllm.v1.worker.utils import KVBlockZeroer

    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128)
        repro.select_kernel_block_sizes(geometry)
        repro.allocate_and_bind(geometry)
        context = geometry.forward_context
        zeroer = KVBlockZeroer(
            repro.CPU,
            [g for gs in geometry.attn_groups for g in gs],
            geometry.kernel_block_sizes,
            context,
            geometry.kv_cache_config.num_blocks,
        )
        addrs, strides, sizes = (t.tolist() for t in zeroer._meta[:3])
        base = context["model.layers.20.attn"].kv_cache.untyped_storage().data_ptr()
        block_stride = geometry.kv_cache_config.kv_cache_tensors[0].block_stride
        for block in (1, geometry.kv_cache_config.num_blocks - 1):
            zeroed = sorted(
                (a - base + block * s * 4, a - base + block * s * 4 + n * 4)
                for a, s, n in zip(addrs, strides, sizes)
            )
            assert (
                zeroed[0][0] >= block * block_stride and zeroed[-1][1] <= (block + 1) * block_stride
            )
            for name in (
                "model.layers.20.attn",
                "model.layers.20.attn.indexer.k_cache",
                "model.layers.2.attn",
                "model.layers.0.attn.swa_cache",
            ):
                view = context[name].kv_cache
                spec = geometry.specs[name]
                rows = view.shape[-2] * spec.tokens_per_state
                page = view.shape[-2] * view.shape[-1]  # the rows' bytes (alignment padding aside)
                per_block = spec.block_size // rows
                for j in range(per_block):
                    start = view.storage_offset() + (
                        block * block_stride // view.stride(0) + j
                    ) * view.stride(0)
                    assert any(a <= start and start + page <= b for a, b in zeroed), (
                        name,
                        block,
                        j,
                    )


def test_slot_translation_is_the_kernel_table_formula_and_keeps_pads():
    """``kernel_slots`` on a real split attention group: each manager slot
    becomes ``ktable[req, pos // 64] * 64 + pos % 64`` of vLLM's own kernel
    block table, pads stay -1, and the result lives in the builder's
    persistent buffer (the same storage every step)."""
    import torch

    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128)
        repro.select_kernel_block_sizes(geometry)
        repro.allocate_and_bind(geometry)
        group = next(
            g
            for gs in geometry.attn_groups
            for g in gs
            if g.layer_names == ["model.layers.20.attn"]
        )
        # What the fix reads of a builder (the real ones need a GPU to build).
        group.metadata_builders = [_BuilderStandIn(geometry.vllm_config, repro.CPU)]
        assert group.kernel_block_size == 64 and group.kernel_block_stride == 5
        group.kernel_block_table = torch.zeros(1, 4, 64, dtype=torch.int32)
        group.kernel_block_offsets = torch.arange(2, dtype=torch.int32)
        table = torch.tensor([[3, 1, 6], [2, 5, 4]], dtype=torch.int32)
        positions = [torch.arange(0, 300), torch.arange(100, 257)]
        manager = torch.cat(
            [table[r, p // 128].long() * 128 + p % 128 for r, p in enumerate(positions)]
        )
        manager = torch.cat([manager, torch.full((7,), -1)])
        ktable = group.map_to_kernel_block_table(table).long()
        want = torch.cat([ktable[r, p // 64] * 64 + p % 64 for r, p in enumerate(positions)])
        got = kernel_slots(group, manager)
        assert torch.equal(got[: want.numel()], want)
        assert torch.equal(got[want.numel() :], torch.full((7,), -1))
        again = kernel_slots(group, manager[:50])
        assert again.data_ptr() == got.data_ptr()


def test_dspark_with_three_drafter_layers_holds_more_than_upstream_block_128(request):
    """Issue 18's goal, from vLLM's own planner and token figure: the split
    with DSpark's default three drafter layers holds at least upstream's
    --block-size 128 capacity (same model, same drafter layers) at 8k and 128k
    where the drafter pages hold 128 rows.  0.32.0's FlashInfer decodes 64-row
    primary pages only: there the drafter layers open a tenth KV-cache group,
    and the split holds 0.993x / 0.997x (docs/measurements.md, issue 18's closing note)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity

    drafters = (0, 0, 0)
    lens = capacity.MAX_MODEL_LENS
    upstream = capacity.measure(
        "upstream", 128, lens, repro.EngineSettings(drafter_ratios=drafters), fixed=False
    )
    settings = repro.EngineSettings(
        attached={"speculative_config": _dspark()}, drafter_ratios=drafters
    )
    fixed = capacity.measure("dspark", 128, lens, settings)
    ratios = [row.versus(base) for row, base in zip(fixed, upstream, strict=True)]
    assert {row.geometry for row in fixed} == {fix.SPLIT}
    if RUNTIME_PAGES[request.config.vllm_release]:
        assert [round(r, 3) for r in ratios] == [1.051, 1.019]
    else:
        assert [round(r, 3) for r in ratios] == [0.993, 0.997]
