"""Replays DeepSeek-V4.1 on SM120/SM121 (issue 5) at tiny scale.

``vllm serve`` the tiny DeepSeek-V4.1 config (compress ratios 0, 1 and 2,
sliding window, indexer; dummy weights) with the report's flags:
``--attention-backend FLASHINFER_MLA_SPARSE_DSV41 --kv-cache-dtype fp8
--block-size 128``, fp8 indexer cache, language model only.  Without the fix
the upstream failures are recorded; with it the server must answer /health
200, and its greedy tokens must equal those of the same dummy weights
through a reference path: the same model in-process with FlashInfer's SM120
sparse-MLA call replaced by a PyTorch decode that reads the same pages as the
kernel does (record, footer scales, sink).  With dummy weights "no U+FFFD"
proves nothing; equality with the reference does.

Needs an SM12x GPU and vLLM 0.32.x/0.33.x; skips with the reason elsewhere.
Run this file as a script (``--reference OUT.json``) for the reference run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

MODEL_DIR = Path(__file__).resolve().parents[2] / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
BACKEND = "FLASHINFER_MLA_SPARSE_DSV41"
COMMON = ["--load-format", "dummy", "--skip-tokenizer-init", "--language-model-only",
          "--kv-cache-dtype", "fp8", "--attention-config", json.dumps({"indexer_kv_dtype": "fp8"}),
          "--max-model-len", "2048", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
          "--seed", "0"]
MOE_BACKEND = os.environ.get("VLLM_MLA_FIXES_GPU_MOE_BACKEND")  # e.g. "marlin", the report's workaround
ISSUE_FLAGS = ["--attention-backend", BACKEND, "--block-size", "128", *COMMON,
               *(["--moe-backend", MOE_BACKEND] if MOE_BACKEND else [])]
# Long enough that ratio-1/ratio-2 compressed caches span several pages and the
# 128-token window is exceeded, so SWA and compressed segments both matter.
PROMPTS = [[(37 * i + 11 * j) % 1000 + 2 for j in range(300 + 40 * i)] for i in range(4)]
MAX_TOKENS = 8
TIE_NATS = 1e-2  # reference top-1/top-2 gap below which a flipped token is a tie, not an error


# ------------------------------------------------------------ reference path

def _storage_bytes(view):
    import torch

    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _read_records(cache, idx):
    """K=V rows [N, 512] (fp32) of the packed 584-byte records at flat indices
    ``idx`` of an NHD ``[pages, rows, 1, 584]`` cache: page ``idx // rows``,
    data at ``page * stride + row * 576`` (448 fp8-e4m3 NoPE, 64 bf16 RoPE),
    footer at ``page * stride + rows * 576 + row * 8`` (7 UE8M0 scales, one per
    64 NoPE dims)."""
    import torch

    rows = cache.shape[1]
    flat = _storage_bytes(cache)
    base = cache.storage_offset() + torch.div(idx, rows, rounding_mode="floor") * cache.stride(0)
    row = idx % rows
    data = flat[(base + row * 576)[:, None] + torch.arange(576, device=idx.device)]
    footer = flat[(base + rows * 576 + row * 8)[:, None] + torch.arange(7, device=idx.device)]
    scale = torch.exp2(footer.float() - 127.0).repeat_interleave(64, dim=1)
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).float() * scale
    rope = data[:, 448:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


def reference_sparse_mla(*, query, swa_kv_cache, sparse_indices, swa_topk_lens, out, bmm1_scale,
                         sinks, compressed_kv_cache=None, extra_sparse_indices=None,
                         extra_sparse_topk_lens=None, **_unused):
    """Stands in for ``flashinfer_trtllm_batch_decode_sparse_mla_dsv4`` (SM120
    entry, packed fp8 caches): one softmax over the SWA segment and the
    compressed segment, the attention sink in the denominator."""
    import torch

    tokens, heads, dim = query.shape[0], query.shape[-2], query.shape[-1]
    keys, masks = [], []
    segments = [(swa_kv_cache, sparse_indices, swa_topk_lens)]
    if extra_sparse_indices is not None:
        segments.append((compressed_kv_cache, extra_sparse_indices, extra_sparse_topk_lens))
    for cache, indices, lengths in segments:
        idx = indices.reshape(tokens, -1).long()
        width = idx.shape[1]
        valid = (torch.arange(width, device=idx.device)[None, :] < lengths.long().clamp(0, width)[:, None])
        valid &= idx >= 0
        rows = _read_records(cache, idx.clamp(min=0).reshape(-1)).view(tokens, width, dim)
        keys.append(rows)
        masks.append(valid)
    kv = torch.cat(keys, dim=1)
    valid = torch.cat(masks, dim=1)
    q = query.reshape(tokens, heads, dim).float()
    logits = torch.einsum("thd,tnd->thn", q, kv) * bmm1_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :].expand(tokens, heads)
    peak = torch.maximum(logits.amax(dim=-1), sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(logits - peak[..., None])
    denominator = weights.sum(dim=-1) + torch.exp(sink - peak)
    result = torch.einsum("thn,tnd->thd", weights, kv) / denominator.clamp_min(1e-30)[..., None]
    out.view(tokens, heads, dim).copy_(result.to(out.dtype))
    return out


def reference_run(output: Path) -> None:
    """Greedy tokens and top-5 logprobs of the tiny model with the PyTorch decode."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.models.deepseek_v41.nvidia import flashinfer_sparse

    flashinfer_sparse.flashinfer_trtllm_batch_decode_sparse_mla_dsv4 = reference_sparse_mla
    llm = LLM(model=str(MODEL_DIR), load_format="dummy", skip_tokenizer_init=True,
              language_model_only=True, kv_cache_dtype="fp8", attention_backend=BACKEND,
              attention_config={"indexer_kv_dtype": "fp8"}, block_size=128, max_model_len=2048,
              max_num_seqs=8, gpu_memory_utilization=0.5, seed=0, enforce_eager=True,
              **({"moe_backend": MOE_BACKEND} if MOE_BACKEND else {}))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                            detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    results = []
    for request in outputs:
        completion = request.outputs[0]
        results.append({
            "tokens": list(completion.token_ids),
            "logprobs": [{int(t): float(lp.logprob) for t, lp in step.items()}
                         for step in completion.logprobs],
        })
    output.write_text(json.dumps(results))


# ------------------------------------------------------------------ serving

def serve_and_generate(args: list[str], env: dict[str, str], log_path: Path, prompts=PROMPTS,
                       startup_timeout: float = 1200) -> dict:
    """``vllm serve``; wait for /health; greedy completions as token ids; stop."""
    from gpu.serving import complete, running_server  # pytest only: this file also runs as a script

    result = {"healthy": False, "completions": [], "request_error": None}
    with running_server(MODEL_DIR, args, {**os.environ, **env}, log_path, startup_timeout) as server:
        result["healthy"] = server.healthy
        for prompt in prompts if server.healthy else []:
            try:
                choice = complete(server, MODEL_DIR, prompt, MAX_TOKENS, logprobs=5,
                                  return_tokens_as_token_ids=True)["choices"][0]
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                result["request_error"] = f"{type(exc).__name__}: {exc}"
                break
            tokens = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            result["completions"].append({"tokens": tokens, "text": choice.get("text", "")})
    result["returncode"] = server.proc.returncode
    result["log"] = log_path.read_text(errors="replace")
    return result


def compare_greedy(served: list[list[int]], reference: list[dict]) -> list[str]:
    """Mismatches between served and reference greedy tokens.  A token may
    differ only where the reference's top-two logprobs are within
    ``TIE_NATS`` (numerical tie); after a tie the continuations are not comparable."""
    problems = []
    for i, (tokens, ref) in enumerate(zip(served, reference, strict=True)):
        for step, (got, want) in enumerate(zip(tokens, ref["tokens"], strict=True)):
            if got == want:
                continue
            top = sorted(ref["logprobs"][step].values(), reverse=True)
            gap = top[0] - top[1] if len(top) > 1 else math.inf
            if gap >= TIE_NATS:
                problems.append(f"prompt {i} step {step}: served {got}, reference {want} "
                                f"(reference margin {gap:.4f} nats)")
            break
    return problems


# -------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def sm12x():
    from gpu.serving import require_gpu, require_vllm

    capability = require_gpu(12, why="the 64-row page geometry of FLASHINFER_MLA_SPARSE_DSV41 "
                                      "is SM120/SM121-only")
    version = require_vllm(">=0.32.0,<0.34.0")
    return capability, version


def _results_dir(tmp_path_factory) -> Path:
    out = Path(os.environ.get("VLLM_MLA_FIXES_GPU_RESULTS") or tmp_path_factory.mktemp("results"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _record(tmp_path_factory, name: str, result: dict, **extra) -> None:
    lines = result["log"].splitlines()
    (_results_dir(tmp_path_factory) / f"{name}.json").write_text(json.dumps({
        "healthy": result["healthy"], "returncode": result["returncode"],
        "request_error": result["request_error"], "completions": result["completions"],
        "errors": [l for l in lines if "Error" in l or "error" in l][-20:], **extra}, indent=2))


def test_without_fix_block_size_64_fails_at_startup(sm12x, tmp_path, tmp_path_factory):
    args = [a if a != "128" else "64" for a in ISSUE_FLAGS]
    result = serve_and_generate(args, {"VLLM_MLA_FIXES": "none"}, tmp_path / "serve.log",
                                prompts=[], startup_timeout=900)
    _record(tmp_path_factory, "dsv41_without_fix_bs64", result)
    assert not result["healthy"]
    assert "No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128])" in result["log"], \
        result["log"][-4000:]


def test_without_fix_block_size_128_upstream_outcome(sm12x, tmp_path, tmp_path_factory):
    """0.32.0 (FlashInfer 0.7.0.post1): the first FlashInfer call rejects the
    32-token SWA page.  0.33.0 (FlashInfer 0.7.2.post1): recorded only -- the
    CPU tests show FlashInfer accepts the page there and the ratio-1 indexer
    pages (128 states) remain outside SM120's paged-MQA kernels."""
    result = serve_and_generate(ISSUE_FLAGS, {"VLLM_MLA_FIXES": "none"}, tmp_path / "serve.log",
                                prompts=PROMPTS[:1], startup_timeout=1200)
    _record(tmp_path_factory, f"dsv41_without_fix_bs128_{sm12x[1]}", result)
    if sm12x[1].startswith("0.32."):
        assert "page_block_size=32" in result["log"], result["log"][-4000:]
        assert not (result["healthy"] and result["completions"])


def test_with_fix_serves_and_matches_the_reference(sm12x, tmp_path, tmp_path_factory):
    reference_file = tmp_path / "reference.json"
    env = {**os.environ, "VLLM_MLA_FIXES": "all"}
    reference = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--reference",
                                str(reference_file)], env=env, capture_output=True, text=True,
                               timeout=1800)
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-4000:]
    expected = json.loads(reference_file.read_text())

    result = serve_and_generate(ISSUE_FLAGS, {"VLLM_MLA_FIXES": "all"}, tmp_path / "serve.log")
    served = [c["tokens"] for c in result["completions"]]
    problems = compare_greedy(served, expected) if len(served) == len(PROMPTS) else ["missing completions"]
    _record(tmp_path_factory, f"dsv41_with_fix_{sm12x[1]}", result, reference=expected,
            mismatches=problems)
    log = result["log"]
    assert "vllm-mla-fixes: applied dsv41-sm120-geometry" in log, log[-4000:]
    assert result["healthy"], log[-4000:]
    assert result["request_error"] is None, result["request_error"]
    assert "page_block_size=32" not in log and "No common block size" not in log
    assert "\ufffd" not in "".join(c["text"] for c in result["completions"])
    assert not problems, problems


def test_with_fix_block_size_64_starts(sm12x, tmp_path, tmp_path_factory):
    args = [a if a != "128" else "64" for a in ISSUE_FLAGS]
    result = serve_and_generate(args, {"VLLM_MLA_FIXES": "all"}, tmp_path / "serve.log",
                                prompts=PROMPTS[:1])
    _record(tmp_path_factory, f"dsv41_with_fix_bs64_{sm12x[1]}", result)
    assert result["healthy"], result["log"][-4000:]
    assert len(result["completions"]) == 1 and len(result["completions"][0]["tokens"]) == MAX_TOKENS


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", type=Path, required=True, help="write the reference tokens here")
    reference_run(parser.parse_args().reference)
