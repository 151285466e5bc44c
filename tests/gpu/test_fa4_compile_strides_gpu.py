"""Replays vLLM #49200 (issue 4) at tiny scale on SM100/SM103.

The tiny DeepSeek-V3-style MLA model shipped in the package (2 dense layers,
8 heads = Kimi-K2.5 per rank at TP8), dummy weights, ``max_model_len`` 10240,
chunked prefill at 8192 tokens, MLA prefill through FA (FA4 on SM100),
token-ID prompts of 8300-10000 tokens: the second prefill chunk of each long
prompt runs FA4's Split-KV context-chunk kernel compiled by vLLM's warm-up.

* ``LLM(...)`` in a child process per case: without the plugin
  (``VLLM_PLUGINS=""``) 0.25.x dies with the report's error; with the plugin,
  and without it but with warm-up disabled (the workaround), every prompt
  gets its 8 tokens; 0.26+ passes without the plugin.
* The report's load at small scale: ``vllm serve`` with the plugin, then
  ``vllm bench serve --dataset-name random --random-input-len 8192
  --random-output-len 1024 --num-prompts 160 --max-concurrency 16``: 160/160,
  no HTTP 500.

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

from gpu.serving import require_gpu, running_server
from vllm_mla_fixes.fixes.fa4_compile_strides import INFO

MODEL = Path(__file__).resolve().parents[2] / "vllm_mla_fixes" / "models" / "tiny_deepseek_v3_mla"
CASE = Path(__file__).with_name("fa4_llm_case.py")
UPSTREAM_ERROR = re.compile(
    r"ValueError: Mismatched mO\.strides\[0\] on argument #3 when calling: `__call__\(mQ: "
    r"Tensor\(\[n0, n1, n2\], bfloat16\).*output_scale: None\)`, expected to be \d+")
PATCHED_LINE = "vllm-mla-fixes: fa4-compile-strides: patched"
CASE_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def sm100():
    capability = require_gpu(10, why="FA4 Split-KV MLA prefill runs on SM100/SM103; an H100/H200 "
                                     "(SM90) runs MLA prefill on FA3 and cannot reproduce vLLM #49200")
    from importlib.metadata import version

    installed = version("vllm")
    # the fix's own functional probe on this install (a child: it imports FA4's CuTe code)
    probe = subprocess.run(
        [sys.executable, "-c", "from vllm_mla_fixes.fixes import fa4_compile_strides as f; "
                               "print('BUG=%s' % (f.functional_verdict() is None))"],
        capture_output=True, text=True, timeout=600)
    has_bug = "BUG=True" in probe.stdout
    return {"capability": capability, "vllm": installed, "affected": INFO.admits(installed) and has_bug}


def _results_dir(tmp_path_factory) -> Path:
    out = Path(os.environ.get("VLLM_MLA_FIXES_GPU_RESULTS", tmp_path_factory.mktemp("results")))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_case(env: dict, *extra: str) -> tuple[int, str, dict | None]:
    proc = subprocess.run([sys.executable, str(CASE), "--model", str(MODEL), *extra], env=env,
                          capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT=")), None)
    return proc.returncode, log, json.loads(line[len("RESULT="):]) if line else None


def _record(tmp_path_factory, name: str, returncode: int, log: str, result) -> None:
    match = UPSTREAM_ERROR.search(log)
    (_results_dir(tmp_path_factory) / f"{name}.json").write_text(json.dumps({
        "returncode": returncode, "result": result,
        "upstream_error": match.group(0) if match else None,
        "patched": PATCHED_LINE in log}, indent=2))


def _assert_all_served(returncode: int, log: str, result) -> None:
    assert returncode == 0 and result is not None, log[-6000:]
    assert result["output_lens"] == [8] * len(result["output_lens"]), result
    assert not UPSTREAM_ERROR.search(log)


def test_llm_without_plugin(sm100, tmp_path_factory):
    returncode, log, result = run_case(_env(VLLM_PLUGINS=""))
    _record(tmp_path_factory, "fa4_llm_without_plugin", returncode, log, result)
    if sm100["affected"]:
        assert returncode != 0 and result is None
        assert UPSTREAM_ERROR.search(log), log[-6000:]
    else:
        _assert_all_served(returncode, log, result)


def test_llm_with_plugin(sm100, tmp_path_factory):
    returncode, log, result = run_case(_env(VLLM_PLUGINS=None, VLLM_MLA_FIXES="all"))
    _record(tmp_path_factory, "fa4_llm_with_plugin", returncode, log, result)
    _assert_all_served(returncode, log, result)
    if sm100["affected"]:
        assert PATCHED_LINE in log, log[-6000:]


def test_llm_without_plugin_warmup_disabled_workaround(sm100, tmp_path_factory):
    returncode, log, result = run_case(_env(VLLM_PLUGINS=""), "--kernel-config",
                                       json.dumps({"enable_cutedsl_warmup": False}))
    _record(tmp_path_factory, "fa4_llm_warmup_disabled", returncode, log, result)
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
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def test_bench_serve_random_8192_with_plugin(sm100, tmp_path, tmp_path_factory):
    model = tmp_path / "tiny_deepseek_v3_mla"
    model.mkdir()
    (model / "config.json").write_text((MODEL / "config.json").read_text())
    write_word_tokenizer(model)
    env = _env(VLLM_PLUGINS=None, VLLM_MLA_FIXES="all")
    serve_log = tmp_path / "serve.log"
    serve_args = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "10240",
                  "--max-num-batched-tokens", "8192", "--max-num-seqs", "16",
                  "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                  "--attention-config", json.dumps({"mla_prefill_backend": "FLASH_ATTN"})]
    with running_server(model, serve_args, env, serve_log) as server:
        assert server.healthy, serve_log.read_text(errors="replace")[-6000:]
        bench = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                 "--model", str(model), "--tokenizer", str(model), "--host", "127.0.0.1",
                 "--port", str(server.port), "--dataset-name", "random", "--random-input-len", "8192",
                 "--random-output-len", "1024", "--num-prompts", "160", "--max-concurrency", "16",
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
        proc = subprocess.run(bench, env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    server_text = serve_log.read_text(errors="replace")
    result = json.loads((tmp_path / "bench.json").read_text()) if (tmp_path / "bench.json").exists() else {}
    (_results_dir(tmp_path_factory) / "fa4_bench_serve_with_plugin.json").write_text(json.dumps({
        "completed": result.get("completed"), "failed": result.get("failed"),
        "http_500": len(re.findall(r'HTTP/1\.1" 500', server_text)),
        "upstream_error": bool(UPSTREAM_ERROR.search(server_text)),
        "patched": PATCHED_LINE in server_text}, indent=2))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result.get("completed") == 160, {k: result.get(k) for k in ("completed", "failed")}
    assert not result.get("failed")
    assert not re.search(r'HTTP/1\.1" 500', server_text)
    assert not UPSTREAM_ERROR.search(server_text)
    if sm100["affected"]:
        assert PATCHED_LINE in server_text
