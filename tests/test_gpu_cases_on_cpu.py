"""The parts of the GPU regression tests (``tests/gpu``) a CPU can run, run
against the real releases, so that each GPU test is shown -- by construction
-- to reach the bug and to be able to fail.

* FA4 (vLLM 0.25.1): vLLM's own scheduler and FA4's own Split-KV decision
  put every second chunk of ``fa4_llm_case.py``'s prompts on Split-KV with a
  ``total_q`` warm-up never compiled; the old plan (16 prompts per step)
  never reached Split-KV.  The GPU tests' call probe records each of those
  decisions exactly, on FA4's real interface.
* The fa4 fixture's probe: a child that prints no ``BUG=`` line -- here the
  real probe on a machine where FA4 cannot import -- fails the fixture with
  the child's stderr.
* DeepSeek-V4.1 (vLLM 0.32.0, 0.33.0, 0.34.0): the GPU test's PyTorch decode reads
  the self-test harness's pages exactly as the harness's FlashInfer stand-in
  does; against the dense truth that reader is far within
  ``ATTENTION_TOLERANCE`` for the geometry the fix builds, and far outside it
  for the split with untranslated ratio-1 writer slots, which also reads
  records nothing wrote.
* The call probe loads in vLLM's processes through ``sitecustomize`` (FA4's
  interface beside the FA4 fix; the FlashInfer SM120 entry vLLM's DeepSeek-V4.1
  module bound), and its attention check flags a kernel that addresses the
  bound pages with another page geometry.
* Declared GPU: with ``VLLM_MLA_FIXES_EXPECT_GPU_CC`` a "no GPU" skip fails,
  a session with no passed test fails, and the preflight fails on a machine
  without the GPU; without the variable all of it stays a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fix_releases import DSV41, FP8, covered

TESTS = Path(__file__).resolve().parent
GPU_TESTS = TESTS / "gpu"
ROOT = TESTS.parent


def _cpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MLA_FIXES_EXPECT_GPU_CC"}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **extra}


# ------------------------------------------------------------------- FA4


def _fa4_step_plan(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(GPU_TESTS / "fa4_step_plan.py"), *args],
        env=_cpu_env(VLLM_PLUGINS=""),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fa4_plan():
    return _fa4_step_plan()


@pytest.mark.vllm_release("0.25.1")
def test_fa4_case_puts_every_second_chunk_on_split_kv_with_a_new_total_q(fa4_plan):
    from gpu import fa4_llm_case

    long_prompts = [n for n in fa4_llm_case.PROMPT_LENS if n > 8192]
    chunks = fa4_plan["chunks"]
    assert fa4_plan["warmup_q"] == [1, 129]
    # one context chunk per long prompt, alone in its step: its own tail
    assert [c["q_lens"] for c in chunks] == [[n - 8192] for n in long_prompts]
    assert all(c["ctx_lens"] == [8192] for c in chunks)
    for chunk in chunks:
        assert chunk["num_splits"] > 1, chunk
        assert chunk["total_q"] not in fa4_plan["warmup_q"], chunk
    print({c["total_q"]: c["num_splits"] for c in chunks})


@pytest.mark.vllm_release("0.25.1")
def test_fa4_call_probe_records_fa4s_own_split_decisions(fa4_plan):
    """The GPU tests judge a run by the probe's records: they must be FA4's decisions."""
    probed = [(r["total_q"], r["num_splits"]) for r in fa4_plan["probe"]]
    assert probed == [(c["total_q"], c["num_splits"]) for c in fa4_plan["chunks"]]


@pytest.mark.vllm_release("0.25.1")
def test_fa4_old_case_never_reached_split_kv():
    """Issue 10's finding: 16 prompts per step leave no context chunk on Split-KV."""
    plan = _fa4_step_plan("--max-num-seqs", "16")
    assert plan["chunks"] and all(c["num_splits"] == 1 for c in plan["chunks"]), plan["chunks"]


def test_new_split_kv_calls_needs_split_and_a_total_q_warmup_did_not_compile():
    from gpu.inprocess.call_probes import new_split_kv_calls

    warm = [
        {"probe": "fa4", "compile_only": True, "total_q": q, "num_splits": 0 if q == 1 else 16}
        for q in (1, 129)
    ]
    real = [
        {"probe": "fa4", "compile_only": False, "total_q": q, "num_splits": s}
        for q, s in ((129, 16), (308, 8), (8192, 1), (1, 16))
    ]
    assert [r["total_q"] for r in new_split_kv_calls(warm + real)] == [308, 1]


@pytest.mark.vllm_release("0.25.1")
def test_fa4_probe_without_a_verdict_fails_the_fixture():
    """On CPU the fix's real probe cannot import FA4: the child prints no BUG= line."""
    from gpu.test_fa4_compile_strides_gpu import PROBE_CODE, probe_verdict

    proc = subprocess.run(
        [sys.executable, "-c", PROBE_CODE],
        env=_cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "BUG=" not in proc.stdout
    with pytest.raises(pytest.fail.Exception) as failure:
        probe_verdict(proc.returncode, proc.stdout, proc.stderr)
    message = str(failure.value)
    assert "printed no BUG= line" in message and "vllm.vllm_flash_attn" in message, message
    assert probe_verdict(0, "BUG=True\n", "") is True
    assert probe_verdict(0, "BUG=False\n", "") is False


_FA4_THROUGH_SITECUSTOMIZE = """
import json
from vllm_mla_fixes.reproductions import fa4_compile_strides as repro
env = repro.prepare()                      # imports FA4's interface: the probe wraps it
forward = env.interface._flash_attn_fwd
wrapped = hasattr(forward, "__wrapped__")
fix = repro.apply_fix(env)                 # replaces the compile cache on the wrapper
decision = repro.plan(env, repro.Step((300,), (8192,)))
looked_up = repro.forward_cache(env).looked_up
print(json.dumps({"wrapped": wrapped, "fix": fix, "splits": decision.num_splits,
                  "key_looked_up_in_fixed_cache": decision.key is not None and bool(looked_up)}))
"""


@pytest.mark.vllm_release("0.25.1")
def test_fa4_call_probe_loads_through_sitecustomize_beside_the_fix(tmp_path):
    """The GPU runs' way in: PYTHONPATH=tests/gpu/inprocess; the fix still takes effect."""
    from gpu.inprocess.call_probes import LOG_ENV, read_log

    log = tmp_path / "calls.jsonl"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FA4_THROUGH_SITECUSTOMIZE],
        env=_cpu_env(
            VLLM_PLUGINS="", PYTHONPATH=str(GPU_TESTS / "inprocess"), **{LOG_ENV: str(log)}
        ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "wrapped": True,
        "fix": "applied",
        "splits": 8,
        "key_looked_up_in_fixed_cache": True,
    }, seen
    fa4 = [r for r in read_log(log) if r.get("probe") == "fa4"]
    assert [(r["total_q"], r["num_splits"], r["compile_only"]) for r in fa4] == [(300, 8, True)]


# --------------------------------------------------------------- DSV4.1


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
        captured = []

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
    from gpu.test_dsv41_sm120_gpu import ATTENTION_TOLERANCE

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
        env=_cpu_env(
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
    from gpu.inprocess import call_probes
    from gpu.test_dsv41_sm120_gpu import ATTENTION_TOLERANCE

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


API_SERVER_PID, ENGINE_PID = 100, 200


def _summary(records):
    from gpu.test_dsv41_sm120_gpu import attention_summary

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
    from gpu.test_dsv41_sm120_gpu import MAX_TOKENS

    return {
        "healthy": healthy,
        "request_error": None,
        "completions": [[5] * MAX_TOKENS] if healthy else [],
        "log": log,
        "attention": _summary(records),
    }


def test_dsv41_run_judgement_fails_vacuous_wrong_and_unwritten_runs():
    """The with-fix GPU test cannot pass on a run whose attention calls prove nothing."""
    from gpu.test_dsv41_sm120_gpu import (
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
    from gpu.test_dsv41_sm120_gpu import missing_bug_signal, upstream_outcome

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


def test_relative_error_of_two_zero_outputs_is_zero():
    import torch
    from gpu.inprocess.call_probes import relative_error

    zeros = torch.zeros(4, 8)
    assert relative_error(zeros, zeros) == 0.0
    assert relative_error(torch.ones(4, 8), zeros) == float("inf")
    assert relative_error(torch.full((4, 8), float("nan")), torch.ones(4, 8)) == float("inf")


# ---------------------------------------------------------- declared GPU


def test_declared_gpu_turns_skip_into_failure_only_for_the_declared_gpu():
    from gpu.conftest import skip_is_failure

    no_gpu = "needs a CUDA GPU with compute capability 12.x: the 64-row page geometry ..."
    assert skip_is_failure(no_gpu, 12) and not skip_is_failure(no_gpu, None)
    assert not skip_is_failure("this GPU is SM120; needs SM10x: FA4 ...", 12)
    assert skip_is_failure("this GPU is SM90; needs SM12x: ...", 12)
    assert not skip_is_failure("this GPU is SM100; needs SM9x/SM10x: ...", 10)
    assert not skip_is_failure("needs vLLM >=0.25.0,<0.26.0, found 0.32.0", 12)


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=_cpu_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_gpu_tests_on_a_machine_without_the_declared_gpu():
    """No GPU here: the GPU tests skip; declared, the same skips fail the session."""
    target = str(GPU_TESTS / "test_fp8_ds_mla_reshape_gpu.py")
    plain = _pytest(target)
    assert plain.returncode == 0 and "3 skipped" in plain.stdout, plain.stdout[-3000:]
    declared = _pytest(target, VLLM_MLA_FIXES_EXPECT_GPU_CC="9")
    assert declared.returncode == 1, declared.stdout[-3000:]
    assert "3 errors" in declared.stdout, declared.stdout[-3000:]  # the fixture skipped
    assert (
        "VLLM_MLA_FIXES_EXPECT_GPU_CC=9 declares an SM9x GPU on this runner, but the test "
        "skipped: needs a CUDA GPU" in declared.stdout
    ), declared.stdout[-3000:]


def test_declared_gpu_session_with_no_passed_test_fails(tmp_path):
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from gpu.conftest import pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401
        """)
    )
    (tmp_path / "test_other_release.py").write_text(
        textwrap.dedent("""\
        import pytest

        def test_for_another_release():
            pytest.skip("needs vLLM >=0.32.0,<0.35.0, found 0.25.1")
        """)
    )
    plain = _pytest(str(tmp_path), "--rootdir", str(tmp_path))
    assert plain.returncode == 0, plain.stdout[-3000:]
    declared = _pytest(str(tmp_path), "--rootdir", str(tmp_path), VLLM_MLA_FIXES_EXPECT_GPU_CC="12")
    assert declared.returncode == 1, declared.stdout[-3000:]
    assert "1 skipped" in declared.stdout and "no GPU test passed" in declared.stdout


def test_preflight_fails_only_where_a_gpu_is_declared():
    script = str(GPU_TESTS / "preflight.py")
    plain = subprocess.run(
        [sys.executable, script], env=_cpu_env(), capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    declared = subprocess.run(
        [sys.executable, script],
        env=_cpu_env(VLLM_MLA_FIXES_EXPECT_GPU_CC="12"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert declared.returncode == 1, declared.stdout + declared.stderr
    assert "torch.cuda.is_available() is False" in declared.stderr


def test_cuda_toolkit_env_points_at_the_locked_nvcc(tmp_path):
    """The gpu nox sessions' CUDA_HOME: the lock's nvidia/cu13 wheels, with nvcc and cudart."""
    sys.path.insert(0, str(GPU_TESTS))
    try:
        import cuda_toolkit
    finally:
        sys.path.remove(str(GPU_TESTS))
    if cuda_toolkit.locked_toolkit() is None:
        pytest.skip("this release's lock has no nvidia/cu13 toolkit wheels")
    env = cuda_toolkit.toolkit_env(tmp_path / "links")
    home = Path(env["CUDA_HOME"])
    version = subprocess.run(
        [str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and "release 13." in version.stdout, (
        version.stdout + version.stderr
    )
    assert (home / "include" / "cuda_runtime.h").exists()
    assert (tmp_path / "links" / "libcudart.so").resolve().exists()
    assert f"-L{tmp_path / 'links'}" in env["FLASHINFER_EXTRA_LDFLAGS"]


# ------------------------------------------------------ processes, memory


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (re)parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


_SPAWN_GRANDCHILD = (
    "import subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(p.pid, flush=True); time.sleep({hang})"
)


@pytest.mark.vllm_release("0.34.0")  # no vLLM involved: one session is enough (about 5 s)
def test_timeout_stops_the_whole_process_group():
    """A hung GPU case (its EngineCore a grandchild) leaves nothing behind."""
    from gpu.serving import run_in_own_session

    code = _SPAWN_GRANDCHILD.format(hang=600)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_in_own_session([sys.executable, "-c", code], _cpu_env(), timeout=3)
    grandchild = int(timed_out.value.output.split()[0])
    assert not _running(grandchild)


@pytest.mark.vllm_release("0.34.0")
def test_exited_leader_leaves_no_orphan_in_its_group():
    from gpu.serving import run_in_own_session

    code = _SPAWN_GRANDCHILD.format(hang=0)
    done = run_in_own_session([sys.executable, "-c", code], _cpu_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert not _running(int(done.stdout.split()[0]))


def test_too_little_free_gpu_memory_names_the_holders():
    from gpu.serving import memory_problem, parse_gpu_memory

    busy = parse_gpu_memory("20480, 143771\n", "4242, python3, 120000\n")
    assert busy == {"free_gib": 20.0, "total_gib": 140.4, "holders": ["4242, python3, 120000"]}
    problem = memory_problem(busy, 0.5)
    assert "only 20.0 GiB of GPU memory free of 140.4 GiB" in problem
    assert "4242, python3, 120000" in problem and "kill <pid>" in problem
    assert memory_problem(parse_gpu_memory("143000, 143771", ""), 0.5) is None
    assert memory_problem(None, 0.5) is None  # no nvidia-smi: nothing to check


def test_gpu_session_without_a_gpu_or_a_declaration_refuses_to_run():
    """``preflight.py --declared`` is what the gpu-<release> nox sessions run first."""
    script = str(GPU_TESTS / "preflight.py")
    refused = subprocess.run(
        [sys.executable, script, "--declared"],
        env=_cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "refusing to run the GPU tests" in refused.stderr
    declared = subprocess.run(
        [sys.executable, script, "--declared"],
        env=_cpu_env(VLLM_MLA_FIXES_EXPECT_GPU_CC="12"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert declared.returncode == 0 and declared.stdout.strip() == "12", declared.stderr


# ----------------------------------------------------------- serve lines


@pytest.fixture(scope="module")
def serve_lines():
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(GPU_TESTS / "serve_lines.py")],
        env=_cpu_env(VLLM_PLUGINS=""),
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")), None)
    assert proc.returncode == 0 and line, proc.stderr[-6000:]
    return json.loads(line[len("RESULT=") :])


def _built(seen: dict) -> None:
    assert "engine_config_error" not in seen, seen["engine_config_error"]


@pytest.mark.vllm_release(*covered(DSV41))
def test_dsv41_gpu_serve_lines_parse_and_build_with_the_releases_own_parser(serve_lines):
    """Every DeepSeek-V4.1 GPU test line: the report's flags reach the engine arguments
    as the test means them, and the release builds its VllmConfig from them (CPU platform)."""
    lines = serve_lines["serve"]
    assert sorted(lines) == sorted(f"dsv41 bs{b}{e}" for b in (64, 128) for e in ("", " eager")), (
        lines
    )
    for name, seen in lines.items():
        _built(seen)
        assert seen["engine_config"]["architectures"] == ["DeepseekV41ForCausalLM"], name
        assert seen["attention_backend"].endswith("FLASHINFER_MLA_SPARSE_DSV41"), seen
        assert seen["block_size"] == int(name.split()[1][2:]), seen
        assert (seen["kv_cache_dtype"], seen["indexer_kv_dtype"]) == ("fp8", "fp8"), seen
        assert seen["enforce_eager"] == name.endswith("eager"), seen
        assert seen["load_format"] == "dummy", seen


@pytest.mark.vllm_release(*covered(FP8))
def test_fp8_and_fa4_gpu_lines_parse_and_build_with_the_releases_own_parser(serve_lines):
    serve, bench, llm = serve_lines["serve"], serve_lines["bench"], serve_lines["llm"]
    for name in ("fp8 (cuda graphs)", "fp8 --enforce-eager"):
        _built(serve[name])
        assert serve[name]["engine_config"]["architectures"] == ["GlmMoeDsaForCausalLM"]
        assert (serve[name]["attention_backend"], serve[name]["kv_cache_dtype"]) == (
            "FLASHMLA_SPARSE",
            "fp8",
        )
    assert serve["fp8 --enforce-eager"]["enforce_eager"] is True
    for name in ("fa4 bench serve", "fa4 report's line"):
        _built(serve[name])
        assert serve[name]["max_model_len"] == 10240
    assert serve["fa4 bench serve"]["mla_prefill_backend"].endswith("FLASH_ATTN")
    # The report's line leaves the prefill backend to vLLM (FLASH_ATTN first on SM100).
    assert serve["fa4 report's line"]["mla_prefill_backend"] is None
    assert bench["fa4 report's bench"] == {
        "dataset_name": "random",
        "random_input_len": 8192,
        "random_output_len": 1024,
        "num_prompts": 160,
        "max_concurrency": 16,
    }
    assert llm["fa4 case"]["max_num_seqs"] == 1
    assert llm["fa4 case"]["mla_prefill_backend"].endswith("FLASH_ATTN")
    assert llm["fa4 case TRTLLM_RAGGED"]["mla_prefill_backend"].endswith("TRTLLM_RAGGED")
    assert llm["fa4 case warm-up off"]["enable_cutedsl_warmup"] is False
