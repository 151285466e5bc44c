"""dsv41-sm120-geometry on the real vLLM 0.34.0 release (issue 9, item 3).

0.34.0 changed the failure, not the bug: both DeepSeek-V4.1 backends now take
64-token kernel blocks on SM12x, the sliding-window cache is still 32 tokens
and the compressed/indexer caches still follow ``--block-size``.  First the two
new failure modes through vLLM's start-up path (layers -> specs -> planner ->
attention groups -> metadata builders -> allocation and binding) on an SM120
platform stand-in (only the device-capability query is stood in), then the fix
on top.
"""

from __future__ import annotations

import pytest

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import bound_pages, check_page_geometry
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import decide
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
from vllm_mla_fixes.patching import State

pytestmark = [pytest.mark.vllm_release("0.34.0"), pytest.mark.usefixtures("kernels_as_locked")]

# The three reviewed definitions 0.34.0 changed, with their new fingerprints.
CHANGED_IN_0_34 = {
    (
        fix.FLASHINFER_MODULE,
        "DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes",
    ): "544fde42b12dfc4a",
    (
        fix.INDEXER_MODULE,
        "DeepseekV41IndexerBackend.get_supported_kernel_block_sizes",
    ): "b0712154722b009f",
    (fix.WORKER_UTILS_MODULE, "bind_kv_cache_to_layers"): "70806dab17e278c2",
}


def _geometry_and_reason(vllm_config) -> tuple[str, str]:
    """The decision the fix takes for the engine ``vllm_config`` describes."""
    decision = decide(vllm_config)
    return decision.geometry, decision.reason


@pytest.fixture
def sm120():
    with repro.sm120_platform():
        yield


def _pages(geometry) -> dict[tuple[str, int], set[int]]:
    pages: dict[tuple[str, int], set[int]] = {}
    for page in repro.flashinfer_pages(geometry):
        pages.setdefault((page.kind, page.compress_ratio), set()).add(page.rows)
    return pages


# ---------------------------------------------------------------- the review


def test_the_three_changed_definitions_are_the_reviewed_0_34_code():
    for (module, qualname), fingerprint in CHANGED_IN_0_34.items():
        assert patching.definition_fingerprint(module, qualname) == fingerprint
        assert fix.REVIEWED[module, qualname][fingerprint] == "0.34.0"
    # The wrapper passes the binding call through: 0.34.0 binds with exactly these two arguments.
    source = patching.definition_source(fix.WORKER_UTILS_MODULE, "bind_kv_cache_to_layers")
    assert (
        "def bind_kv_cache_to_layers(\n    kv_caches: dict[str, torch.Tensor],\n"
        "    forward_context: dict[str, Attention],\n) -> None:" in source
    )


def test_backends_take_64_token_kernel_blocks_on_sm12x_only(sm120):
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLASparseBackend,
    )
    from vllm.utils.deep_gemm import get_paged_mqa_page_sizes
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend

    assert get_paged_mqa_page_sizes() == (64,)  # vLLM's own: SM120 paged-MQA takes 64-state pages
    for backend in (DeepseekV4FlashInferMLASparseBackend, DeepseekV41IndexerBackend):
        assert backend.get_supported_kernel_block_sizes() == [64]
    with repro.sm120_platform((9, 0)):
        assert get_paged_mqa_page_sizes() == (32, 64)
        assert DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes() == [128]


# ------------------------------------------------------------------ upstream


def test_block_size_64_starts_with_32_state_ratio2_pages_and_32_token_swa_pages(sm120):
    from vllm.utils.deep_gemm import get_paged_mqa_page_sizes

    geometry, error = repro.start_upstream(64)
    assert geometry is not None, error
    assert _pages(geometry) == {
        ("swa", 0): {32},
        ("compressed", 1): {64},
        ("compressed", 2): {32},
        ("indexer", 1): {64},
        ("indexer", 2): {32},
    }
    # vLLM says SM120's paged-MQA logits take 64-state pages only, but the
    # kernels' own declarations take every page of this layout (DeepGEMM's
    # host check: 32 and 64 rows; FlashInfer 0.7.4: run-time page sizes).
    assert 32 not in get_paged_mqa_page_sizes()
    assert repro.kernel_verdicts(repro.flashinfer_pages(geometry)) == ((), ())
    with pytest.raises(fix.PageGeometryError) as excinfo:
        check_page_geometry(bound_pages(geometry.forward_context), everything=True)
    message = str(excinfo.value)
    assert (
        "model.layers.2.attn.indexer.k_cache: indexer K cache, compress ratio 2, 32-state pages"
        in message
    )
    assert (
        "model.layers.0.attn.swa_cache: sliding-window KV cache, compress ratio 0, 32-token pages"
        in message
    )


def test_block_size_128_fails_at_start_up_splitting_packed_blocks(sm120):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend
    from vllm.v1.attention.backends.utils import KVCacheLayout

    geometry, error = repro.start_upstream(128)
    assert geometry is None
    assert error == repro.SPLIT_ERROR
    assert (
        "needs 64-token kernel blocks, which packed 128-token KV cache blocks cannot be split into"
        in error
    )
    # The message's way out is a layout the DeepSeek-V4.1 indexer refuses.
    assert KVCacheLayout.LBNHC not in DeepseekV41IndexerBackend.supported_kv_cache_layouts()


# ---------------------------------------------------------------------- fix


def test_fix_is_applied_on_0_34_0():
    with repro.applied((12, 0)) as result:
        assert result.status.state is State.APPLIED, result.status.reason


def test_fix_steps_aside_for_block_size_64_where_upstream_works(sm120):
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(64)
        repro.select_kernel_block_sizes(geometry)
        repro.create_metadata_builders(geometry)
        repro.allocate_and_bind(geometry)
        pages = repro.flashinfer_pages(geometry)
        decided, reason = _geometry_and_reason(geometry.vllm_config)
    assert decided == fix.UPSTREAM
    assert reason.startswith(
        "not-needed: upstream's --block-size 64 layout is within the installed kernels' "
        "envelopes; planned on the model's layers at max_model_len 8192: the fix's "
        "interleaved-split layout holds 71,488 KV tokens per GiB, upstream's 70,961 (1.007x, "
        "under the 1.02x"
    ), reason
    assert _pages(geometry) == {
        ("swa", 0): {32},
        ("compressed", 1): {64},
        ("compressed", 2): {32},
        ("indexer", 1): {64},
        ("indexer", 2): {32},
    }
    assert repro.kernel_verdicts(pages) == ((), ())


@pytest.mark.parametrize(
    "block_size, forced", [(64, fix.SPLIT), (128, None)], ids=["64-forced-split", "128"]
)
def test_fix_lays_out_64_row_pages(sm120, block_size, forced, monkeypatch):
    """--block-size 128 does not start upstream: the fix lays out its split;
    VLLM_MLA_FIXES_DSV41_GEOMETRY forces it where upstream works too."""
    if forced:
        monkeypatch.setenv(fix.GEOMETRY_ENV, forced)
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(block_size)
        repro.select_kernel_block_sizes(geometry)
        repro.create_metadata_builders(geometry)
        repro.allocate_and_bind(geometry)  # the fix's self-check runs inside and passes
        pages = repro.flashinfer_pages(geometry)
        assert _geometry_and_reason(geometry.vllm_config)[0] == fix.SPLIT
    assert {page.rows for page in pages} == {fix.PAGE_ROWS}
    assert {(page.kind, page.compress_ratio) for page in pages} == {
        ("swa", 0),
        ("compressed", 1),
        ("compressed", 2),
        ("indexer", 1),
        ("indexer", 2),
    }
    assert len([page for page in pages if page.kind == "swa"]) == 40
    for page in pages:
        if page.kind != "indexer":
            assert (
                repro.sm120_decode_verdict(
                    page.rows, has_extra=page.kind == "compressed", **repro.REPORT_CALL
                )
                is None
            ), page
