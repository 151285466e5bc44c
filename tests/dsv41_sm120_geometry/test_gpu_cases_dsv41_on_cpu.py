"""The parts of the DeepSeek-V4.1 GPU regression test
(``tests/dsv41_sm120_geometry/gpu/test_dsv41_sm120_gpu.py``) a CPU can run, run against the real
releases (vLLM 0.32.0, 0.33.0, 0.34.0), so that the test is shown -- by
construction -- to reach the bug and to be able to fail (the shared parts are
in ``tests/test_gpu_cases_on_cpu.py``).

* The GPU test's PyTorch decode reads the self-test harness's pages exactly as
  the harness's FlashInfer stand-in does; against the dense truth that reader
  is far within ``ATTENTION_TOLERANCE`` for the geometry the fix builds, and
  far outside it for the split with untranslated ratio-1 writer slots, which
  also reads records nothing wrote.
* The call probe loads in vLLM's processes through ``sitecustomize`` (the
  FlashInfer SM120 entry vLLM's DeepSeek-V4.1 module bound), and its attention
  check flags a kernel that addresses the bound pages with another page geometry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fix_releases import covered
from gpu_case_helpers import GPU_TESTS, assert_built, cpu_env, read_serve_lines

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41

ROOT = Path(__file__).resolve().parents[2]

API_SERVER_PID, ENGINE_PID = 100, 200


@pytest.fixture(scope="module")
def serve_lines():
    return read_serve_lines()


@pytest.fixture(scope="module")
def harness_reads():
    """Per geometry, the first step of the self-test's serving timeline
    (``vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest``: vLLM's allocation, metadata and writers; caches
    filled with a sentinel and new blocks zeroed, as vLLM's zeroer does), with
    the GPU probe reading the pages of every attention call beside the harness's
    FlashInfer stand-in: the fix's default geometry, and the control (the split
    with untranslated ratio-1 writer slots)."""
    import torch
    from gpu.inprocess import call_probes

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import TIMELINE

    device = kn.detect_device()
    runs = {}
    for geometry in ("split", "control"):
        captured: list[dict[str, Any]] = []  # torch tensors, by what they hold

        def observe(out, _captured=captured, **call):
            probe = torch.empty(call["query"].shape, dtype=torch.float32)
            read, unwritten = call_probes.reference_sparse_mla(**call, out=probe)
            _captured.append(
                {
                    "harness": out.float().clone(),
                    "probe": probe,
                    "read": read,
                    "unwritten": unwritten,
                }
            )

        kernels = kn.Kernels.for_device(device)
        kernels.attention_observer = observe
        runs[geometry] = (
            captured,
            harness.run_geometry(geometry, device, kernels, plans=TIMELINE[:1]),
        )
    return runs


@pytest.mark.vllm_release(*covered(DSV41))
def test_dsv41_probe_reads_pages_as_the_harness_reader(harness_reads):
    from gpu.inprocess.call_probes import relative_error

    for geometry, (captured, _) in harness_reads.items():
        assert captured, geometry
        for call in captured:
            assert relative_error(call["probe"], call["harness"]) < 1e-5, geometry


@pytest.mark.vllm_release(*covered(DSV41))
def test_dsv41_attention_tolerance_against_a_broken_and_the_fixed_geometry(harness_reads):
    """The GPU comparison's tolerance holds for the fix and is exceeded by orders of
    magnitude by a wrong page (the harness reader's error against the dense truth,
    which the probe reproduces); the broken geometry also reads unwritten records."""
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import ATTENTION_TOLERANCE

    attention = ("attention prefill (FlashInfer SM120 sparse MLA)",)
    errors = {
        g: max(result.kernels[k].worst for k in attention)
        for g, (_, result) in harness_reads.items()
    }
    unwritten = {
        g: sum(call["unwritten"] for call in captured) for g, (captured, _) in harness_reads.items()
    }
    print({g: (f"{errors[g]:.3g}", unwritten[g]) for g in errors})
    assert errors["split"] <= ATTENTION_TOLERANCE / 100, errors
    assert unwritten["split"] == 0
    assert errors["control"] >= 10 * ATTENTION_TOLERANCE, errors
    assert unwritten["control"] > 0


@pytest.mark.vllm_release(*covered(DSV41))
def test_dsv41_call_probe_wraps_the_entry_vllm_calls(tmp_path):
    """Imported through sitecustomize, vLLM's modules call the probes, which call through:
    FlashInfer's SM120 entry, DeepGEMM's paged MQA logits in the sparse indexer, the
    indexer K gather."""
    from gpu.inprocess.call_probes import LOG_ENV, read_log

    code = (
        "import vllm.models.deepseek_v41.nvidia.flashinfer_sparse as m, vllm.utils.flashinfer as u; "
        "import vllm.model_executor.layers.sparse_attn_indexer as i, vllm.utils.deep_gemm as d; "
        "import vllm._custom_ops as o; "
        "f = m.flashinfer_trtllm_batch_decode_sparse_mla_dsv4; "
        "print(f is not u.flashinfer_trtllm_batch_decode_sparse_mla_dsv4 "
        "and f.__wrapped__ is u.flashinfer_trtllm_batch_decode_sparse_mla_dsv4 "
        "and i.fp8_fp4_paged_mqa_logits.__wrapped__ is d.fp8_fp4_paged_mqa_logits "
        "and o.cp_gather_indexer_k_quant_cache.__wrapped__.__module__ == 'vllm._custom_ops')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=cpu_env(
            PYTHONPATH=str(GPU_TESTS / "inprocess"), **{LOG_ENV: str(tmp_path / "calls.jsonl")}
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("True"), proc.stderr[-6000:]
    # importing is not running the model: the engine record comes with the first call
    assert not [r for r in read_log(tmp_path / "calls.jsonl") if r.get("probe") == "engine"]


def _paged_records(pages: int, rows: int, seed: int):
    """A uint8 NHD cache [pages, rows, 1, 584] of valid V4 records (random
    fp8 NoPE, bf16 RoPE, UE8M0 scales near 2**-4)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(pages, rows * 584, dtype=torch.uint8)
    nope = (torch.randn(pages, rows, 448, generator=gen) * 64).to(torch.float8_e4m3fn)
    rope = torch.randn(pages, rows, 64, generator=gen).to(torch.bfloat16)
    data = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=2)
    cache[:, : rows * 576] = data.reshape(pages, rows * 576)
    scales = torch.randint(120, 124, (pages, rows, 8), generator=gen, dtype=torch.uint8)
    cache[:, rows * 576 :] = scales.reshape(pages, rows * 8)
    return cache.view(pages, rows, 1, 584)


def test_dsv41_call_probe_flags_a_kernel_that_misreads_the_page_geometry(tmp_path, monkeypatch):
    """What the GPU tolerance catches: a kernel addressing the bound pages with another
    geometry (here 32-row pages over 64-row ones) is far off; a faithful one is not."""
    import torch
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import ATTENTION_TOLERANCE
    from gpu.inprocess import call_probes

    monkeypatch.setenv(call_probes.LOG_ENV, str(tmp_path / "calls.jsonl"))
    cache = _paged_records(pages=6, rows=64, seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens, heads = 5, 8
    args = dict(
        query=torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16) * 0.05,
        swa_kv_cache=cache,
        sparse_indices=torch.randint(0, 6 * 64, (tokens, 128), generator=gen),
        swa_topk_lens=torch.tensor([128, 100, 64, 7, 128]),
        bmm1_scale=512**-0.5,
        sinks=torch.zeros(heads),
        workspace_buffer=None,
        kv_layout="NHD",
    )
    misread = cache.view(torch.uint8).reshape(-1)[: 12 * 32 * 584].view(12, 32, 1, 584)

    def faithful_kernel(**kwargs):
        call_probes.reference_sparse_mla(**kwargs)

    def misreading_kernel(**kwargs):
        call_probes.reference_sparse_mla(**{**kwargs, "swa_kv_cache": misread})

    errors = {}
    for name, kernel in (("faithful", faithful_kernel), ("misreading", misreading_kernel)):
        module = type("FlashInferSparse", (), {call_probes.DSV41_ENTRY: staticmethod(kernel)})
        call_probes.instrument_dsv41(module)
        getattr(module, call_probes.DSV41_ENTRY)(
            **args, out=torch.empty(tokens, heads, 512, dtype=torch.bfloat16)
        )
        *_, engine, record = call_probes.read_log(tmp_path / "calls.jsonl")
        assert engine["probe"] == "engine" and engine["pid"] == os.getpid(), engine
        assert record["records_read"] == 427 and record["unwritten_read"] == 0, record
        errors[name] = record["rel_error"]
    print(errors)
    assert errors["faithful"] <= ATTENTION_TOLERANCE / 4, errors
    assert errors["misreading"] >= 10 * ATTENTION_TOLERANCE, errors


def _indexer_cache(pages: int, rows: int, seed: int):
    """A DeepSeek-V4.1 fp8 indexer cache view [pages, rows, 132]: per page
    rows x 128 fp8 keys, then rows x 4 bytes of fp32 scale."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(pages, rows * 128, generator=gen) * 32).to(torch.float8_e4m3fn)
    scales = torch.rand(pages, rows, generator=gen) * 0.02 + 0.005
    cache = torch.cat([keys.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    return cache.contiguous().view(pages, rows, 132)


def _as_32_row_pages(cache):
    """The same bytes addressed as 32-row pages: a kernel with another page geometry."""
    return cache.reshape(-1).view(cache.shape[0] * 2, 32, 132)


@pytest.mark.vllm_release("0.34.0")  # release-independent probe code; once is enough
def test_indexer_probe_flags_decode_logits_read_with_another_page_geometry(tmp_path, monkeypatch):
    """The served indexer's DeepGEMM call, recomputed from the bound view with the
    self-test's reader: a kernel that reads the pages as the view binds them agrees
    (the self-test's DeepGEMM stand-in), one addressing 32-row pages does not."""
    import torch
    from gpu.inprocess import call_probes

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.kernels import paged_mqa_logits_stand_in

    monkeypatch.setenv(call_probes.LOG_ENV, str(tmp_path / "calls.jsonl"))
    cache = _indexer_cache(pages=6, rows=64, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(2, 1, 4, 128, generator=gen) * 8).to(torch.float8_e4m3fn)
    weights = torch.rand(2, 4, generator=gen)
    lens = torch.tensor([150, 70], dtype=torch.int32)
    # Padded as vLLM pads block tables, so a kernel with 32-row pages stays in bounds.
    table = torch.tensor([[4, 1, 5, 0, 0], [2, 0, 3, 0, 0]], dtype=torch.int32)

    def kernel_reading(view):
        # vLLM's signature of fp8_fp4_paged_mqa_logits (0.34.0), DeepGEMM's semantics
        def fp8_fp4_paged_mqa_logits(
            q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len
        ):
            return paged_mqa_logits_stand_in(
                q[0], view, weights, context_lens.reshape(-1, 1), block_tables, max_model_len
            )

        return fp8_fp4_paged_mqa_logits

    errors = {}
    for name, view in (("faithful", cache), ("misreading", _as_32_row_pages(cache))):
        module = type("Indexer", (), {call_probes.INDEXER_LOGITS_ENTRY: kernel_reading(view)})
        call_probes.instrument_indexer_logits(module)
        getattr(module, call_probes.INDEXER_LOGITS_ENTRY)(
            (q, None), cache, weights, lens, table, None, 256
        )
        record = call_probes.read_log(tmp_path / "calls.jsonl")[-1]
        assert record["indexer_page"] == [64, 64 * 132] and record["rows"] == 2, record
        errors[name] = record["rel_error"]
    print(errors)
    assert errors["faithful"] <= 1e-6, errors
    assert errors["misreading"] >= 0.1, errors


@pytest.mark.vllm_release("0.34.0")
def test_indexer_probe_counts_gathered_keys_read_with_another_page_geometry(tmp_path, monkeypatch):
    import torch
    from gpu.inprocess import call_probes

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.kernels import gather_indexer_k_stand_in

    monkeypatch.setenv(call_probes.LOG_ENV, str(tmp_path / "calls.jsonl"))
    cache = _indexer_cache(pages=6, rows=64, seed=5)
    # Padded as vLLM pads block tables, so a kernel with 32-row pages stays in bounds.
    table = torch.tensor([[4, 1, 5, 0, 0], [2, 0, 3, 0, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 150, 220], dtype=torch.int32)

    def kernel_reading(view):
        # vLLM's signature of ops.cp_gather_indexer_k_quant_cache
        def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
            gather_indexer_k_stand_in(view, dst_k, dst_scale, block_table, cu_seq_lens)

        return cp_gather_indexer_k_quant_cache

    differing = {}
    for name, view in (("faithful", cache), ("misreading", _as_32_row_pages(cache))):
        module = type("CustomOps", (), {call_probes.INDEXER_GATHER_ENTRY: kernel_reading(view)})
        call_probes.instrument_indexer_gather(module)
        dst_k = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
        dst_scale = torch.zeros(256, 4, dtype=torch.uint8)
        getattr(module, call_probes.INDEXER_GATHER_ENTRY)(cache, dst_k, dst_scale, table, cu)
        record = call_probes.read_log(tmp_path / "calls.jsonl")[-1]
        assert record["keys"] == 220, record
        differing[name] = record["keys_differing"]
    print(differing)
    assert differing["faithful"] == 0
    assert differing["misreading"] >= 100, differing


def _summary(records):
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import attention_summary

    return attention_summary(
        [{"probe": "install", "pid": API_SERVER_PID}, *records], api_server_pid=API_SERVER_PID
    )


def _engine_record():
    return {"probe": "engine", "pid": ENGINE_PID, "module": "flashinfer_sparse"}


def _attention_call(error=0.004, extra=True, unwritten=0, swa_rows=64):
    return {
        "probe": "dsv41",
        "pid": ENGINE_PID,
        "rel_error": error,
        "records_read": 200,
        "unwritten_read": unwritten,
        "swa_page": [swa_rows, 37376],
        "extra_page": [64, 46080] if extra else None,
    }


def _indexer_calls(decode_steps: int, rows: int = 64, error=1e-6, differing=0):
    logits = {
        "probe": "indexer_logits",
        "pid": ENGINE_PID,
        "indexer_page": [rows, 46080],
        "rows": 1,
        "rel_error": error,
    }
    gather = {
        "probe": "indexer_gather",
        "pid": ENGINE_PID,
        "indexer_page": [rows, 46080],
        "keys": 150,
        "keys_differing": differing,
    }
    return [gather] + [logits] * decode_steps


def _run(records, healthy=True, log=""):
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import MAX_TOKENS

    return {
        "healthy": healthy,
        "request_error": None,
        "completions": [[5] * MAX_TOKENS] if healthy else [],
        "log": log,
        "attention": _summary(records),
    }


def test_dsv41_run_judgement_fails_vacuous_wrong_and_unwritten_runs():
    """The with-fix GPU test cannot pass on a run whose attention calls prove nothing."""
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import (
        ATTENTION_LAYERS,
        COMPRESSED_LAYERS,
        MAX_TOKENS,
        run_problems,
    )

    def steps(count):
        return [
            _attention_call(extra=layer < COMPRESSED_LAYERS)
            for _ in range(count)
            for layer in range(ATTENTION_LAYERS)
        ]

    eager = [_engine_record(), *steps(MAX_TOKENS), *_indexer_calls(MAX_TOKENS - 1)]
    assert run_problems(_run(eager), 1, eager=True) == []
    assert run_problems(_run([]), 1, eager=True)  # nothing compared
    assert run_problems(_run(eager[:-1]), 1, eager=True)  # an indexer call missing
    assert run_problems(_run(eager[1:]), 1, eager=True)  # no engine-process record
    api_only = [{**_engine_record(), "pid": API_SERVER_PID}, *eager[1:]]
    assert run_problems(_run(api_only), 1, eager=True)  # the API server's record does not count
    assert run_problems(_run(eager + [_attention_call(0.7)]), 1, eager=True)  # a wrong page
    assert run_problems(_run(eager + [_attention_call(float("inf"))]), 1, eager=True)
    assert run_problems(_run(eager + [_attention_call(0.0, unwritten=3)]), 1, eager=True)
    assert run_problems(_run(eager + _indexer_calls(1, error=0.5)), 1, eager=True)
    assert run_problems(_run(eager + _indexer_calls(0, differing=2)), 1, eager=True)
    assert run_problems(_run(eager + [{"probe": "dsv41", "probe_error": "x"}]), 1, eager=True)
    assert run_problems({**_run(eager), "healthy": False}, 1, eager=True)

    # With CUDA graphs: 0 compared calls no longer pass; each prompt's prefill must be there.
    graphs = [_engine_record(), *steps(1), *_indexer_calls(0)]
    assert run_problems(_run(graphs), 1, eager=False) == []
    assert run_problems(_run([_engine_record()]), 1, eager=False)
    assert run_problems(_run(graphs), 2, eager=False)  # one prompt's prefill missing
    assert run_problems(_run(graphs[:-1]), 1, eager=False)  # no indexer gather


@pytest.mark.parametrize(
    "version, block_size",
    # 0.34.0 with --block-size 64 is no bug case: upstream's layout works there.
    [(v, b) for v in covered(DSV41) for b in (64, 128) if (v, b) != ("0.34.0", 64)],
)
def test_dsv41_without_fix_fails_on_an_unrelated_failure(version, block_size):
    """Each without-fix GPU case passes only on the bug's own signal: a server that never
    became healthy, an out-of-memory error or a healthy run without the signal fail it."""
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import missing_bug_signal, upstream_outcome

    expected = upstream_outcome(version, block_size)
    unrelated = [
        _run([], healthy=False, log="torch.OutOfMemoryError: CUDA out of memory"),
        _run([], healthy=False, log="RuntimeError: Ninja build failed"),
        _run([_engine_record()], healthy=True, log="INFO: Application startup complete."),
    ]
    for run in unrelated:
        assert missing_bug_signal(version, block_size, run), run["log"]

    if not expected.starts:
        refused = _run([], healthy=False, log=f"ERROR ... {expected.error_text}")
        assert missing_bug_signal(version, block_size, refused) == []
        started = _run([_engine_record()], healthy=True, log=expected.error_text)
        assert missing_bug_signal(version, block_size, started)
        return
    fine = [_engine_record(), _attention_call(), *_indexer_calls(1)]
    assert missing_bug_signal(version, block_size, _run(fine))
    assert expected.indexer_rows is not None  # an upstream that starts hands DeepGEMM pages
    signals = [
        [_attention_call(swa_rows=expected.swa_rows)],
        _indexer_calls(1, rows=expected.indexer_rows),
        [_attention_call(error=0.7)],
        _indexer_calls(1, differing=5),
    ]
    for records in signals:
        assert missing_bug_signal(version, block_size, _run([*fine, *records])) == []
        # the same signal, but the engine never started: not the bug
        unhealthy = _run([*fine, *records], healthy=False)
        assert missing_bug_signal(version, block_size, unhealthy)
    no_engine = _run([_attention_call(swa_rows=expected.swa_rows)])
    assert missing_bug_signal(version, block_size, no_engine)


@pytest.mark.vllm_release(*covered(DSV41))
def test_dsv41_gpu_serve_lines_parse_and_build_with_the_releases_own_parser(serve_lines):
    """Every DeepSeek-V4.1 GPU test line: the report's flags reach the engine arguments
    as the test means them, and the release builds its VllmConfig from them (CPU platform)."""
    lines = {name: seen for name, seen in serve_lines["serve"].items() if "dspark" not in name}
    assert sorted(lines) == sorted(f"dsv41 bs{b}{e}" for b in (64, 128) for e in ("", " eager")), (
        lines
    )
    for name, seen in lines.items():
        assert_built(seen)
        assert seen["engine_config"]["architectures"] == ["DeepseekV41ForCausalLM"], name
        assert seen["attention_backend"].endswith("FLASHINFER_MLA_SPARSE_DSV41"), seen
        assert seen["block_size"] == int(name.split()[1][2:]), seen
        assert (seen["kv_cache_dtype"], seen["indexer_kv_dtype"]) == ("fp8", "fp8"), seen
        assert seen["enforce_eager"] == name.endswith("eager"), seen
        assert seen["load_format"] == "dummy", seen


@pytest.mark.vllm_release(*covered(DSV41))
def test_dsv41_dspark_long_prompt_line_builds_the_reports_drafter(serve_lines):
    """vllm#56771's GPU replay (``gpu/test_dspark_long_prompt_gpu.py``): the release
    builds a DSpark engine from the line, with the report's 5 speculative tokens, a
    V4.1 DSpark drafter whose config has the fields vLLM's drafter reads, and room for
    the 12,288-token prompt in 2,048-token prefill chunks."""
    from dsv41_sm120_geometry.gpu import test_dspark_long_prompt_gpu as replay

    seen = serve_lines["serve"]["dsv41 dspark long prompt"]
    assert_built(seen)
    built = seen["engine_config"]
    assert built["architectures"] == ["DeepseekV41ForCausalLM"], seen
    assert built["max_model_len"] >= replay.LONG_PROMPT_TOKENS + replay.MAX_TOKENS, seen
    assert seen["max_num_batched_tokens"] < replay.LONG_PROMPT_TOKENS // 4, seen  # several chunks
    speculative = built["speculative"]
    assert (speculative["method"], speculative["num_speculative_tokens"]) == ("dspark", 5), seen
    assert speculative["draft_architectures"] == ["DSparkV41DraftModel"], seen
    fields = speculative["draft_fields"]
    assert fields["dspark_target_layer_ids"] and fields["dspark_markov_rank"], fields
    assert seen["attention_backend"].endswith("FLASHINFER_MLA_SPARSE_DSV41"), seen
    assert (seen["block_size"], seen["load_format"]) == (128, "dummy"), seen


def test_dspark_replay_model_is_the_tiny_model_with_dsparks_fields():
    """The replay's config.json differs from the tiny DeepSeek-V4.1 only in DSpark's
    fields and its position limit, so the geometry tests' model is what it serves."""
    import json

    from dsv41_sm120_geometry.gpu import test_dspark_long_prompt_gpu as replay

    tiny = json.loads((ROOT / "vllm_mla_fixes/models/tiny_deepseek_v41/config.json").read_text())
    dspark = json.loads((replay.MODEL_DIR / "config.json").read_text())
    added = {"dspark_target_layer_ids", "dspark_markov_rank"}
    changed = {"max_position_embeddings"}
    text, tiny_text = dspark.pop("text_config"), tiny.pop("text_config")
    assert dspark == tiny
    assert set(text) - set(tiny_text) == added
    assert {k for k in tiny_text if text[k] != tiny_text[k]} == changed
    assert text["max_position_embeddings"] >= replay.MAX_MODEL_LEN
