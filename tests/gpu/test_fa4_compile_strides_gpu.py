"""Replays vLLM #49200 (issue 4) at tiny scale on SM100/SM103.

The tiny DeepSeek-V3-style MLA model shipped in the package (2 dense layers,
8 heads = Kimi-K2.5 per rank at TP8), dummy weights, ``max_model_len`` 10240,
chunked prefill at 8192 tokens, MLA prefill through FA (FA4 on SM100), one
prompt per step (``max_num_seqs=1``): the second prefill chunk of each
prompt over 8192 tokens takes FA4's Split-KV context-chunk kernel with a
``total_q`` warm-up never compiled (see ``fa4_llm_case.py``).

Every run carries the call probe (``inprocess/call_probes.py``): each FA4
forward call in the vLLM process is logged with its ``total_q`` and FA4's own
Split-KV decision, so each test first proves the run reached the buggy path
and only then judges the outcome.

* ``LLM(...)`` in a child process per case: without the plugin
  (``VLLM_PLUGINS=""``) 0.25.x dies with the report's error; with the plugin,
  and without it but with warm-up disabled (the workaround), every prompt
  gets its 8 tokens; 0.26+ passes without the plugin.
* ``vllm serve`` + ``vllm bench serve --dataset-name random`` (9000 +- 5 %
  token prompts, one at a time in the engine), with and without the plugin:
  no failed request and no HTTP 500 with it; without it on 0.25.x the
  report's error and failed requests.

Skips elsewhere with the reason: an H100/H200 (SM90) runs MLA prefill on FA3
and never reaches this FA4 code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.inprocess.call_probes import LOG_ENV, new_split_kv_calls, read_log
from gpu.serving import (
    check_gpu_memory,
    keep_log,
    require_gpu,
    results_dir,
    run_in_own_session,
    running_server,
)
from vllm_mla_fixes.fixes.fa4_compile_strides import INFO

MODEL = Path(__file__).resolve().parents[2] / "vllm_mla_fixes" / "models" / "tiny_deepseek_v3_mla"
CASE = Path(__file__).with_name("fa4_llm_case.py")
UPSTREAM_ERROR = re.compile(
    r"ValueError: Mismatched mO\.strides\[0\] on argument #3 when calling: `__call__\(mQ: "
    r"Tensor\(\[n0, n1, n2\], bfloat16\).*output_scale: None\)`, expected to be \d+"
)
PATCHED_LINE = "vllm-mla-fixes: fa4-compile-strides: patched"
CASE_TIMEOUT_S = 1800
PROBE_DIR = Path(__file__).with_name("inprocess")
PROBE_CODE = (
    "from vllm_mla_fixes.fixes import fa4_compile_strides as f; "
    "print('BUG=%s' % (f.functional_verdict() is None))"
)


def probe_verdict(returncode: int, stdout: str, stderr: str) -> bool:
    """The fix's functional probe, from its child's output: True if this
    install has the bug.  A child that printed no verdict (it crashed, or
    FA4's CuTe code did not import) fails the test with its stderr -- it must
    not read as "not affected"."""
    verdict = re.search(r"^BUG=(True|False)$", stdout, re.MULTILINE)
    if verdict is None:
        pytest.fail(
            f"the fa4-compile-strides probe printed no BUG= line (exit {returncode}); "
            f"stderr:\n{stderr[-6000:]}",
            pytrace=False,
        )
    return verdict.group(1) == "True"


@pytest.fixture(scope="module")
def sm100():
    capability = require_gpu(
        10,
        why="FA4 Split-KV MLA prefill runs on SM100/SM103; an H100/H200 "
        "(SM90) runs MLA prefill on FA3 and cannot reproduce vLLM #49200",
    )
    from importlib.metadata import version

    installed = version("vllm")
    # the fix's own functional probe on this install (a child: it imports FA4's CuTe code)
    probe = run_in_own_session([sys.executable, "-c", PROBE_CODE], dict(os.environ), timeout=600)
    has_bug = probe_verdict(probe.returncode, probe.stdout, probe.stderr)
    return {
        "capability": capability,
        "vllm": installed,
        "affected": INFO.admits(installed) and has_bug,
    }


def _env(call_log: Path, **changes: str | None) -> dict[str, str]:
    """This process's environment with ``changes`` (None removes), plus the
    call probe for every Python process the run starts."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE_DIR), env.get("PYTHONPATH")]))
    env[LOG_ENV] = str(call_log)
    return env


def run_case(env: dict, *extra: str) -> tuple[int, str, dict | None]:
    """``fa4_llm_case.py`` in its own process group (stopped on exit and on
    timeout, EngineCore included), after a check of free GPU memory."""
    from gpu import fa4_llm_case

    with open(os.devnull, "w") as quiet:
        memory = check_gpu_memory(fa4_llm_case.ENGINE_OPTIONS, quiet)
    proc = run_in_own_session(
        [sys.executable, str(CASE), "--model", str(MODEL), *extra], env, timeout=CASE_TIMEOUT_S
    )
    log = f"[gpu test] GPU memory before start: {memory}\n" + proc.stdout + proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")), None)
    return proc.returncode, log, json.loads(line[len("RESULT=") :]) if line else None


def split_kv_summary(call_log: Path) -> dict:
    """What the call probe saw: FA4 calls, and the real Split-KV calls with a
    total_q warm-up did not compile (the only calls that can hit #49200)."""
    records = read_log(call_log)
    fa4 = [r for r in records if r.get("probe") == "fa4"]
    new = new_split_kv_calls(records)
    return {
        "probe_installed": any(r.get("probe") == "install" for r in records),
        "fa4_calls": len(fa4),
        "real_fa4_calls": sum(1 for r in fa4 if not r["compile_only"]),
        "warmup_total_q": sorted(
            {r["total_q"] for r in fa4 if r["compile_only"] and r["total_q"] is not None}
        ),
        "new_split_kv": [{k: r.get(k) for k in ("total_q", "num_splits", "error")} for r in new],
        "probe_errors": [r["probe_error"] for r in records if "probe_error" in r],
    }


def assert_reached_new_split_kv(summary: dict) -> None:
    """The run exercised the kernel the bug is in; otherwise a pass proves nothing."""
    assert summary["probe_installed"] and not summary["probe_errors"], summary
    assert summary["new_split_kv"], (
        f"no FA4 Split-KV call with a total_q warm-up did not compile: {summary}"
    )


def _record(tmp_path_factory, name: str, returncode: int, log: str, result, summary: dict) -> None:
    keep_log(tmp_path_factory, name, log)
    match = UPSTREAM_ERROR.search(log)
    (results_dir(tmp_path_factory) / f"{name}.json").write_text(
        json.dumps(
            {
                "returncode": returncode,
                "result": result,
                "upstream_error": match.group(0) if match else None,
                "patched": PATCHED_LINE in log,
                "calls": summary,
            },
            indent=2,
        )
    )


def _assert_all_served(returncode: int, log: str, result) -> None:
    assert returncode == 0 and result is not None, log[-6000:]
    assert result["output_lens"] == [8] * len(result["output_lens"]), result
    assert not UPSTREAM_ERROR.search(log)


def test_llm_without_plugin(sm100, tmp_path, tmp_path_factory):
    """Proves: unpatched 0.25.x dies with #49200 on the first new-total_q Split-KV call."""
    calls = tmp_path / "calls.jsonl"
    returncode, log, result = run_case(_env(calls, VLLM_PLUGINS=""))
    summary = split_kv_summary(calls)
    _record(
        tmp_path_factory,
        f"fa4_llm_without_plugin_{sm100['vllm']}",
        returncode,
        log,
        result,
        summary,
    )
    assert_reached_new_split_kv(summary)
    if sm100["affected"]:
        assert returncode != 0 and result is None, log[-6000:]
        assert UPSTREAM_ERROR.search(log), log[-6000:]
        assert UPSTREAM_ERROR.search(summary["new_split_kv"][0]["error"] or ""), summary
    else:
        _assert_all_served(returncode, log, result)


def test_llm_with_plugin(sm100, tmp_path, tmp_path_factory):
    """Proves: with the fix every new-total_q Split-KV call runs and every prompt completes."""
    calls = tmp_path / "calls.jsonl"
    returncode, log, result = run_case(_env(calls, VLLM_PLUGINS=None, VLLM_MLA_FIXES="all"))
    summary = split_kv_summary(calls)
    _record(
        tmp_path_factory, f"fa4_llm_with_plugin_{sm100['vllm']}", returncode, log, result, summary
    )
    assert_reached_new_split_kv(summary)
    _assert_all_served(returncode, log, result)
    assert not any(call["error"] for call in summary["new_split_kv"]), summary
    if sm100["affected"]:
        assert PATCHED_LINE in log, log[-6000:]


def test_llm_without_plugin_warmup_disabled_workaround(sm100, tmp_path, tmp_path_factory):
    """Proves: the documented workaround (no CuTe DSL warm-up) serves the same Split-KV calls."""
    calls = tmp_path / "calls.jsonl"
    returncode, log, result = run_case(
        _env(calls, VLLM_PLUGINS=""),
        "--kernel-config",
        json.dumps({"enable_cutedsl_warmup": False}),
    )
    summary = split_kv_summary(calls)
    _record(
        tmp_path_factory,
        f"fa4_llm_warmup_disabled_{sm100['vllm']}",
        returncode,
        log,
        result,
        summary,
    )
    assert_reached_new_split_kv(summary)
    _assert_all_served(returncode, log, result)


def write_word_tokenizer(directory: Path, vocab_size: int = 32000) -> None:
    """A word-level tokenizer over the tiny model's vocabulary (one word per
    id), so that ``vllm bench serve``'s random dataset can build prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {0: "<unk>", 1: "<s>", 2: "</s>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)


# ``vllm bench serve``'s random dataset: 16 prompts of 8550-9450 tokens (fixed
# seed).  The engine takes one at a time, so each prompt's second chunk is a
# Split-KV context chunk of its own 358-1258 new tokens.
BENCH_PROMPTS = 16
BENCH_ARGS = [
    "--dataset-name",
    "random",
    "--random-input-len",
    "9000",
    "--random-range-ratio",
    "0.05",
    "--random-output-len",
    "16",
    "--num-prompts",
    str(BENCH_PROMPTS),
    "--max-concurrency",
    "4",
    "--seed",
    "0",
]
SERVE_ARGS = [
    "--load-format",
    "dummy",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "10240",
    "--max-num-batched-tokens",
    "8192",
    "--max-num-seqs",
    "1",
    "--no-enable-prefix-caching",
    "--gpu-memory-utilization",
    "0.5",
    "--attention-config",
    json.dumps({"mla_prefill_backend": "FLASH_ATTN"}),
]


# The report's own load (vllm#49200): served with --tensor-parallel-size 8
# --max-model-len 10240, driven with exactly these bench flags.  One GPU here:
# the tiny model's 8 heads are Kimi-K2.5's heads per rank at TP8, so TP1 of it
# runs one rank's shapes; nothing else is scaled.
REPORT_BENCH_PROMPTS = 160
REPORT_BENCH_ARGS = [
    "--dataset-name",
    "random",
    "--random-input-len",
    "8192",
    "--random-output-len",
    "1024",
    "--num-prompts",
    str(REPORT_BENCH_PROMPTS),
    "--max-concurrency",
    "16",
]
REPORT_SERVE_ARGS = [
    "--load-format",
    "dummy",
    "--max-model-len",
    "10240",
    "--gpu-memory-utilization",
    "0.5",
]


def bench_serve(
    tmp_path: Path, env: dict, serve_args=SERVE_ARGS, bench_args=BENCH_ARGS
) -> tuple[dict, str, subprocess.CompletedProcess | None]:
    model = tmp_path / "tiny_deepseek_v3_mla"
    model.mkdir()
    (model / "config.json").write_text((MODEL / "config.json").read_text())
    write_word_tokenizer(model)
    serve_log = tmp_path / "serve.log"
    proc = None
    with running_server(model, serve_args, env, serve_log) as server:
        if server.healthy:
            bench = [
                sys.executable,
                "-m",
                "vllm.entrypoints.cli.main",
                "bench",
                "serve",
                "--model",
                str(model),
                "--tokenizer",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(server.port),
                *bench_args,
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "bench.json",
            ]
            proc = run_in_own_session(bench, env, timeout=CASE_TIMEOUT_S)
    result_file = tmp_path / "bench.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return result, serve_log.read_text(errors="replace"), proc


def _record_bench(tmp_path_factory, name: str, result: dict, server_text: str, summary: dict):
    keep_log(tmp_path_factory, name, server_text)
    (results_dir(tmp_path_factory) / f"{name}.json").write_text(
        json.dumps(
            {
                "completed": result.get("completed"),
                "failed": result.get("failed"),
                "http_500": len(re.findall(r'HTTP/1\.1" 500', server_text)),
                "upstream_error": bool(UPSTREAM_ERROR.search(server_text)),
                "patched": PATCHED_LINE in server_text,
                "calls": summary,
            },
            indent=2,
        )
    )


def test_bench_serve_random_9000_with_plugin(sm100, tmp_path, tmp_path_factory):
    """Proves: the served plugin takes the report's kind of load through new-total_q Split-KV."""
    calls = tmp_path / "calls.jsonl"
    env = _env(calls, VLLM_PLUGINS=None, VLLM_MLA_FIXES="all")
    result, server_text, proc = bench_serve(tmp_path, env)
    summary = split_kv_summary(calls)
    _record_bench(
        tmp_path_factory,
        f"fa4_bench_serve_with_plugin_{sm100['vllm']}",
        result,
        server_text,
        summary,
    )
    assert proc is not None, server_text[-6000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_reached_new_split_kv(summary)
    assert result.get("completed") == BENCH_PROMPTS, {
        k: result.get(k) for k in ("completed", "failed")
    }
    assert not result.get("failed")
    assert not re.search(r'HTTP/1\.1" 500', server_text)
    assert not UPSTREAM_ERROR.search(server_text)
    if sm100["affected"]:
        assert PATCHED_LINE in server_text


def test_bench_serve_random_9000_without_plugin(sm100, tmp_path, tmp_path_factory):
    """Proves: the same load fails on unpatched 0.25.x (so the twin above can fail too)."""
    calls = tmp_path / "calls.jsonl"
    result, server_text, proc = bench_serve(tmp_path, _env(calls, VLLM_PLUGINS=""))
    summary = split_kv_summary(calls)
    _record_bench(
        tmp_path_factory,
        f"fa4_bench_serve_without_plugin_{sm100['vllm']}",
        result,
        server_text,
        summary,
    )
    assert proc is not None, server_text[-6000:]
    assert_reached_new_split_kv(summary)
    if sm100["affected"]:
        assert UPSTREAM_ERROR.search(server_text), server_text[-6000:]
        assert result.get("completed", 0) < BENCH_PROMPTS, result
    else:
        assert result.get("completed") == BENCH_PROMPTS and not result.get("failed"), result


def test_bench_serve_the_reports_line_with_plugin(sm100, tmp_path, tmp_path_factory):
    """Proves: the report's own bench line (160 random 8192-token prompts, 1024 tokens out,
    16 at a time; TP1 of one rank's shapes) does not crash the patched server: 160 of 160
    requests complete, with FA4 (vLLM's default MLA prefill on SM100) serving the prefills.
    A must-not-crash check: its steps batch many prompts, so it need not reach Split-KV."""
    calls = tmp_path / "calls.jsonl"
    env = _env(calls, VLLM_PLUGINS=None, VLLM_MLA_FIXES="all")
    result, server_text, proc = bench_serve(
        tmp_path, env, serve_args=REPORT_SERVE_ARGS, bench_args=REPORT_BENCH_ARGS
    )
    summary = split_kv_summary(calls)
    _record_bench(
        tmp_path_factory,
        f"fa4_bench_serve_report_line_with_plugin_{sm100['vllm']}",
        result,
        server_text,
        summary,
    )
    assert proc is not None, server_text[-6000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary["probe_installed"] and not summary["probe_errors"], summary
    assert summary["real_fa4_calls"] > 0, f"FA4 served no prefill: {summary}"
    assert result.get("completed") == REPORT_BENCH_PROMPTS and not result.get("failed"), {
        k: result.get(k) for k in ("completed", "failed")
    }
    assert not re.search(r'HTTP/1\.1" 500', server_text)
    assert not UPSTREAM_ERROR.search(server_text)
    if sm100["affected"]:
        assert PATCHED_LINE in server_text


def test_llm_without_plugin_trtllm_ragged_prefill_workaround(sm100, tmp_path, tmp_path_factory):
    """Proves: the other workaround in docs/fixes/fa4-compile-strides.md, TRTLLM_RAGGED MLA
    prefill, serves every prompt of the FA4 case unpatched, and does so by keeping prefill
    off FA4 (no real FA4 call), not by luck."""
    calls = tmp_path / "calls.jsonl"
    returncode, log, result = run_case(
        _env(calls, VLLM_PLUGINS=""),
        "--attention-config",
        json.dumps({"mla_prefill_backend": "TRTLLM_RAGGED"}),
    )
    summary = split_kv_summary(calls)
    _record(
        tmp_path_factory,
        f"fa4_llm_trtllm_ragged_{sm100['vllm']}",
        returncode,
        log,
        result,
        summary,
    )
    assert summary["probe_installed"] and not summary["probe_errors"], summary
    _assert_all_served(returncode, log, result)
    assert summary["real_fa4_calls"] == 0, summary
