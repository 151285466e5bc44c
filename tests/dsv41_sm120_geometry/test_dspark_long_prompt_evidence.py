"""Issue 42, step 1: which of vllm PR #57388's defects vLLM's own DSpark path
reaches on CPU (vllm#56771: long prompts crash DeepSeek-V4.1 with DSpark on SM12x).

A 12,288-token prompt is prefilled in chunks of ``--max-num-batched-tokens``
2048 beside a request verifying 1 + 5 tokens, then both verify in a batch
padded for a FULL CUDA graph (``dspark_gather.serve_long_prompt``: vLLM's
``KVCacheManager``, ``BlockTables`` and ``build_attn_metadata``, pretended
SM120).  On the metadata of the last chunk's step and of the padded verify
step, vLLM's own ``compute_global_topk_indices_and_lens`` runs in Triton's
interpreter as ``_forward_prefill`` / ``_forward_decode`` call it.
"""

from __future__ import annotations

import collections
from typing import Any

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes import dsv41_sm120_geometry
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import dspark_gather as dg
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import dspark
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import (
    interpreter_problem,
    prepare_process_env,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.report import geometry_verdict
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.results import (
    DSPARK_CASE,
    DSPARK_CONTROL,
    new_result,
)

prepare_process_env()

pytestmark = pytest.mark.vllm_release(*fix_releases.covered(dsv41_sm120_geometry.INFO))

PROMPT_TOKENS = 12_288  # the report's "12k reliably"
SENTINEL = -7  # a value no vLLM writer puts in the top-k buffer


@pytest.fixture(scope="module")
def serving() -> tuple[Any, dg.Served]:
    """The layout and what was served on it (the self-test check's tests
    write index keys into the layout's pages after the evidence tests)."""
    problem = interpreter_problem()
    if problem:
        pytest.skip(problem)
    with dg.tiny_dspark_layout(PROMPT_TOKENS + 4096) as layout:
        return layout, dg.serve_long_prompt(layout, PROMPT_TOKENS)


@pytest.fixture(scope="module")
def served(serving) -> dg.Served:
    return serving[1]


def _calls(served: dg.Served, path: str, padded: bool) -> list[dg.GatherCall]:
    return [
        c
        for c in served.calls
        if c.path == path and ("padded" in c.step) == padded and c.compress_ratio in (1, 2)
    ]


def test_the_steps_are_the_long_prompt_s_last_chunk_and_a_padded_verify(served):
    """The metadata is a DSpark step's: the chunk's tokens reach position
    12,287 and the verify request's 6 tokens are decodes; then 4 requests of
    6 tokens (2 of them CUDA-graph padding) decode."""
    prefill = _calls(served, "prefill", padded=False)
    decode = _calls(served, "decode", padded=False)
    verify = _calls(served, "decode", padded=True)
    assert {c.compress_ratio for c in prefill} == {1, 2}
    assert all(int(c.positions.max()) == PROMPT_TOKENS - 1 for c in prefill)
    assert all(len(c.positions) == dg.VERIFY_TOKENS for c in decode)
    assert all(len(c.positions) == 4 * dg.VERIFY_TOKENS for c in verify)
    assert all(int((~c.is_valid).sum()) == 2 * dg.VERIFY_TOKENS for c in verify)


def test_no_gather_read_leaves_the_request_s_blocks_on_vllm_s_inputs(served):
    """Every index the indexer can emit (0 and the largest positions each
    token sees, -1 after) loads a block-table cell in the token's own row,
    below the blocks its request holds: the missing upper bound is not
    reached by vLLM's own metadata."""
    for call in served.calls:
        reads = dg.gather_reads(call, dg.legal_indices(call, served.topk))
        assert reads, call.step
        assert dg.out_of_bounds(reads) == [], (call.step, call.layer, call.path)


@pytest.mark.parametrize("past", ["its blocks", "its row"])
def test_the_kernel_reads_past_the_blocks_given_an_index_past_them(served, past):
    """The detector works: vLLM's gather loads whatever cell an index names.
    One block past the request's blocks reads its own row's unallocated
    cell; one row's width past reads the next row, or below the table."""
    for call in _calls(served, "prefill", padded=False) + _calls(served, "decode", padded=True):
        indices = torch.full((len(call.positions), served.topk), -1, dtype=torch.int32)
        for token, row in enumerate(call.token_to_req.tolist()):
            blocks = call.allocated[row] if past == "its blocks" else call.block_table.shape[1]
            indices[token, 0] = blocks * call.block_size
        kinds = collections.Counter(r.kind for r in dg.gather_reads(call, indices))
        if past == "its blocks":
            assert kinds == {"past its blocks": len(call.positions)}
        else:
            assert "in bounds" not in kinds and "past its blocks" not in kinds
            assert sum(kinds.values()) == len(call.positions)


def test_every_top_k_row_the_attention_reads_is_written_in_the_step(served):
    """The attention reads rows [0, decode + prefill tokens) of the buffer;
    the indexer's full path sets rows [0, the forward's tokens) to -1 first,
    and its short-context fill (run here on the step's positions, over a
    buffer of sentinels) writes rows [0, its metadata's tokens).  Both cover
    every row read, CUDA-graph padding included."""
    for step, (read, indexer_rows, forward_rows) in served.rows.items():
        assert read <= indexer_rows <= forward_rows, step
        for ratio in (1, 2):
            buffer = dg.short_context_rows(
                served.positions[step], indexer_rows, served.topk, ratio, SENTINEL
            )
            assert not (buffer[:read] == SENTINEL).any(), (step, ratio)


def test_no_stale_lane_past_topk_length_on_vllm_s_inputs(served):
    """The gathered rows hand FlashInfer -1 in every lane at or past the
    row's length, for the indexer's rows (left-packed, -1 after) and for
    padding rows the full path reset: no input for FlashInfer
    0.7.0.post1's lane overread (flashinfer#5075) on this step."""
    for call in served.calls:
        assert dg.stale_lanes(call, dg.legal_indices(call, served.topk)) == [], call.step


def test_short_context_fill_gives_padding_tokens_stale_lanes(served):
    """Where the indexer takes its short-context path on a padded batch,
    padding tokens (``is_valid_token`` false, length 0) get indices from their
    positions, so their lanes past length 0 are not -1: the one input of
    flashinfer#5075's kind vLLM's code makes (0.32.0's FlashInfer reads it)."""
    for call in _calls(served, "decode", padded=True):
        step_positions = served.positions[call.step]
        buffer = dg.short_context_rows(
            step_positions, len(step_positions), served.topk, call.compress_ratio, SENTINEL
        )
        stale = dg.stale_lanes(call, buffer[: len(call.positions)])
        assert stale == (~call.is_valid).nonzero().flatten().tolist()


def test_flashinfer_normalises_2d_prefill_indices_as_3d_decode_ones():
    """The PR's fourth point is no defect: the installed FlashInfer's SM120
    entry point flattens [T, 1, topk] to the same rows as [T, topk]."""
    assert dg.normalised_alike(tokens=5, topk=64)


@pytest.mark.vllm_release(fix_releases.oldest(dsv41_sm120_geometry.INFO))
def test_flashinfer_0_7_0_keeps_no_state_between_calls_in_the_workspace():
    """FlashInfer 0.7.0.post1 (0.32.0's) hands a decode or verify call (at
    most 64 tokens) split-K scratch from byte 0 of the shared workspace,
    which the same call writes and then merges; a prefill call gets none.
    So an eager prefill between two graph replays overwrites nothing a
    replay reads before writing it.  (TP4: 16 heads; 128 window slots and
    the index top-k of 512.)"""
    verify = dg.split_k_scratch(tokens=4 * dg.VERIFY_TOKENS, heads=16, topk=128, extra_topk=512)
    assert verify[0][0] == 0 and verify[0][1] <= verify[1][0]
    assert verify[1][1] < 128 << 20
    assert dg.split_k_scratch(tokens=2042, heads=16, topk=128, extra_topk=512) == []


# ------------------------- selftest --geometry dspark-long-prefill, its core on CPU
# (the whole geometry in a subprocess costs ~50 s here: the GPU tests run that)


@pytest.fixture(scope="module")
def indexed(serving) -> tuple[kn.Kernels, list]:
    """This device's indexer rows for every call (stand-ins on CPU), once."""
    layout, served = serving
    kernels = kn.Kernels.for_device(kn.detect_device())
    rows = dspark.indexer_rows(served, layout, kernels, new_result(dspark.GEOMETRY))
    return kernels, rows


@pytest.mark.vllm_release(fix_releases.newest(dsv41_sm120_geometry.INFO))
def test_the_selftest_check_passes_on_cpu_with_its_control_caught(served, indexed):
    """The stand-in indexer's indices and vLLM's gather on them stay in
    bounds, the unbounded-index control is caught, and the verdict says the
    indexer was a stand-in."""
    kernels, rows = indexed
    result = new_result(dspark.GEOMETRY)
    dspark.check_indices(served, rows, kernels, result)
    assert geometry_verdict(result) == "pass", result.cases
    assert result.cases[DSPARK_CONTROL].compared == 1
    assert result.kernel(kn.TOPK_GATHER).compared > 0
    assert all(r is not None and (r >= 0).any() for r in rows)
    line = dspark.verdict_line(result, kernels)
    assert "control caught" in line and "says nothing about the indices" in line


@pytest.mark.vllm_release(fix_releases.newest(dsv41_sm120_geometry.INFO))
def test_an_index_past_the_visible_length_fails_the_check(served, indexed):
    """One index past its token's visible length in the run itself: FAIL,
    naming the step, layer, token, index and the cell vLLM's gather read."""
    kernels, rows = indexed
    result = new_result(dspark.GEOMETRY)
    place, token = dspark.control_call(served.calls)
    dspark.check_indices(served, rows, kernels, result, corrupt=(place, token))
    assert geometry_verdict(result) == "FAIL"
    problems = result.cases[DSPARK_CASE].problems
    call = served.calls[place]
    position = int(call.positions[token])
    assert len(problems) == 2, problems
    assert all(call.layer in p and f"position {position}" in p for p in problems)
    assert "visible length" in problems[0] and "the gather read cell" in problems[1]


@pytest.mark.vllm_release(fix_releases.newest_covered())
def test_the_printed_dspark_check_command_runs_and_passes_here():
    """The command doctor's DSpark finding prints, run as the operator runs it:
    on this CPU it passes with its control caught (the indexer a stand-in,
    which its verdict says); the GPU test runs it on the real kernels."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    command = Path(sys.executable).with_name("vllm-mla-fixes")
    argv = [str(command), "selftest", "--geometry", "dspark-long-prefill", "--json", "--no-timing"]
    done = subprocess.run(
        argv if command.exists() else [sys.executable, "-m", "vllm_mla_fixes", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (geometry,) = json.loads(done.stdout)["geometries"]
    assert geometry["verdict"] == "pass", geometry["cases"]
    assert geometry["cases"]["unbounded-index control"]["compared"] == 1, geometry["cases"]
