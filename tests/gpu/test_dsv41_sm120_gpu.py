"""Replays DeepSeek-V4.1 on SM120/SM121 (issue 5) at tiny scale.

``vllm serve`` the tiny DeepSeek-V4.1 config (6 layers, compress ratios
0/2/2/1/1/0, 128-token sliding window, indexer; dummy weights) with the
report's flags: ``--attention-backend FLASHINFER_MLA_SPARSE_DSV41
--kv-cache-dtype fp8 --block-size 128``, fp8 indexer cache, language model
only.

Greedy tokens of dummy weights prove nothing (logits differ by ~1e-6, every
mismatch is a tie), so correctness is checked at the attention call instead:
the call probe (``inprocess/call_probes.py``) wraps FlashInfer's SM120
sparse-MLA entry inside the served process and, after every eager call,
decodes the same records through the same cache views and indices in
PyTorch.  It reads pages the way FlashInfer does (the view's rows, offset
and page stride), so it follows whichever geometry vLLM bound.  A test
passes only if every compared call's relative L2 error is below
``ATTENTION_TOLERANCE`` (0.02) and no record read was never written.  Runs
with ``--enforce-eager`` must have compared every call of every step; CUDA
graph replays bypass Python, so runs with graphs compare the calls that ran
eagerly and count them in the results file.  The tolerance catches a
kernel that addresses the bound pages differently from their geometry
(rows, page stride, footer offset); the unwritten count, writers and
readers that disagree on pages (read slots
nothing wrote: KV caches start zeroed and a fresh server hands these few
prompts blocks no request used before).  Measured on the CPU harness with
the probe's own decode against the dense truth, which only the harness has
(``tests/test_gpu_cases_on_cpu.py``): the fix's geometry 6e-8 with 0
unwritten reads; a split with untranslated writer slots 0.70 with 128 of 821
reads unwritten, and 3e11 once its wrong pages hold other data -- a case
the GPU check sees only through the unwritten count.  Page agreement for the
fix's geometry is proven in full on CPU by ``vllm-mla-fixes selftest`` (``tests/test_selftest.py``).

MoE: the tiny model's experts are MXFP4.  ``VLLM_MLA_FIXES_GPU_MOE_BACKEND``
passes ``--moe-backend`` (the SM120 CI job sets ``marlin``, the report's
choice; unset, vLLM picks its default).

Needs an SM12x GPU and vLLM 0.32.x-0.34.x; skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
from pathlib import Path

import pytest

from gpu.inprocess.call_probes import LOG_ENV, read_log
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import SPLIT

MODEL_DIR = Path(__file__).resolve().parents[2] / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
PROBE_DIR = Path(__file__).with_name("inprocess")
BACKEND = "FLASHINFER_MLA_SPARSE_DSV41"
COMMON = [
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--language-model-only",
    "--kv-cache-dtype",
    "fp8",
    "--attention-config",
    json.dumps({"indexer_kv_dtype": "fp8"}),
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "8",
    "--gpu-memory-utilization",
    "0.5",
    "--seed",
    "0",
]
MOE_BACKEND = os.environ.get("VLLM_MLA_FIXES_GPU_MOE_BACKEND")  # "marlin" on the SM120 job


def issue_flags(block_size: int) -> list[str]:
    return [
        "--attention-backend",
        BACKEND,
        "--block-size",
        str(block_size),
        *COMMON,
        *(["--moe-backend", MOE_BACKEND] if MOE_BACKEND else []),
    ]


# Long enough that ratio-1/ratio-2 compressed caches span several pages and the
# 128-token window is exceeded, so SWA and compressed segments both matter.
PROMPTS = [[(37 * i + 11 * j) % 1000 + 2 for j in range(300 + 40 * i)] for i in range(4)]
MAX_TOKENS = 8
_TEXT = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]
ATTENTION_LAYERS = _TEXT["num_hidden_layers"]
COMPRESSED_LAYERS = sum(1 for r in _TEXT["compress_ratios"] if r)
# FlashInfer against the PyTorch decode of the same fp8 records (relative L2):
# the records dequantise exactly to bf16, so only bf16 rounding of P and of
# the output is left, a few 1e-3.  A wrong page read on the CPU harness:
# 0.70 where it was never written (zeros; also counted as unwritten), 3e11
# where it holds other data (tests/test_gpu_cases_on_cpu.py, vLLM 0.32.0).
ATTENTION_TOLERANCE = 0.02
# First start on a runner: FlashInfer JIT-compiles its SM120 sparse-MLA and
# vLLM its DeepGEMM/Triton kernels from source (no jit-cache wheel in the
# 0.32/0.33 locks); later starts reuse ~/.cache/flashinfer.
STARTUP_TIMEOUT_S = 2400


# ------------------------------------------------------------------ serving


def serve_and_generate(
    args: list[str],
    env: dict[str, str],
    tmp_path: Path,
    prompts=PROMPTS,
    startup_timeout: float = STARTUP_TIMEOUT_S,
) -> dict:
    """``vllm serve`` with the call probe; wait for /health; greedy completions; stop."""
    from gpu.serving import complete, running_server

    call_log = tmp_path / "calls.jsonl"
    log_path = tmp_path / "serve.log"
    env = {
        **os.environ,
        **env,
        LOG_ENV: str(call_log),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE_DIR), os.environ.get("PYTHONPATH")])),
    }
    result = {"healthy": False, "completions": [], "request_error": None}
    with running_server(MODEL_DIR, args, env, log_path, startup_timeout) as server:
        result["healthy"] = server.healthy
        # Start-up's dummy runs call FlashInfer on caches nothing wrote; judge requests only.
        ready = time.time()
        for prompt in prompts if server.healthy else []:
            try:
                choice = complete(
                    server,
                    MODEL_DIR,
                    prompt,
                    MAX_TOKENS,
                    logprobs=1,
                    return_tokens_as_token_ids=True,
                )["choices"][0]
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                result["request_error"] = f"{type(exc).__name__}: {exc}"
                break
            result["completions"].append(
                [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            )
    result["returncode"] = server.proc.returncode
    result["log"] = log_path.read_text(errors="replace")
    records = read_log(call_log)
    result["attention"] = attention_summary(
        [r for r in records if r.get("probe") != "dsv41" or r["time"] >= ready]
    )
    return result


def attention_summary(records: list[dict]) -> dict:
    calls = [r for r in records if r.get("probe") == "dsv41"]
    compared = [r for r in calls if "rel_error" in r]
    return {
        "probe_installed": any(r.get("probe") == "install" for r in records),
        "compared": len(compared),
        "compared_with_compressed": sum(1 for r in compared if r.get("extra_page")),
        "skipped_in_graph_capture": sum(1 for r in calls if "skipped" in r),
        "max_rel_error": max((r["rel_error"] for r in compared), default=None),
        "unwritten_read": sum(r["unwritten_read"] for r in compared),
        "records_read": sum(r["records_read"] for r in compared),
        "page_geometries": sorted(
            {json.dumps([r.get("swa_page"), r.get("extra_page")]) for r in compared}
        ),
        "probe_errors": sorted({r["probe_error"] for r in records if "probe_error" in r})[:5],
    }


def attention_problems(summary: dict, prompts: int, steps: int) -> list[str]:
    """Why this run's attention calls do not prove a correct geometry (empty:
    they do).  ``steps``: forward steps per prompt whose calls must all have
    been compared (MAX_TOKENS in an eager run; 0 where CUDA graphs hide some)."""
    problems = []
    if not summary["probe_installed"]:
        problems.append("the call probe did not load in the served process")
    if summary["probe_errors"]:
        problems.append(f"probe errors: {summary['probe_errors']}")
    if summary["compared"] < prompts * steps * ATTENTION_LAYERS:
        problems.append(
            f"{summary['compared']} attention calls compared, expected at least "
            f"{prompts * steps * ATTENTION_LAYERS} ({prompts} prompts x {steps} "
            f"steps x {ATTENTION_LAYERS} layers)"
        )
    if summary["compared_with_compressed"] < prompts * steps * COMPRESSED_LAYERS:
        problems.append(
            f"{summary['compared_with_compressed']} calls with a compressed segment, "
            f"expected at least {prompts * steps * COMPRESSED_LAYERS}"
        )
    if summary["max_rel_error"] is not None and not summary["max_rel_error"] <= ATTENTION_TOLERANCE:
        problems.append(
            f"FlashInfer differs from the PyTorch decode of the same pages: relative "
            f"error {summary['max_rel_error']:.3g} > {ATTENTION_TOLERANCE}"
        )
    if summary["unwritten_read"]:
        problems.append(
            f"{summary['unwritten_read']} of {summary['records_read']} records read "
            f"were never written"
        )
    return problems


def run_problems(result: dict, prompts: int, steps: int = 0) -> list[str]:
    """Everything a correct run must satisfy; empty for a correct run."""
    problems = []
    if not result["healthy"]:
        problems.append("the server did not become healthy")
    if result["request_error"]:
        problems.append(f"request failed: {result['request_error']}")
    if len(result["completions"]) != prompts or any(
        len(c) != MAX_TOKENS for c in result["completions"]
    ):
        problems.append(f"{len(result['completions'])} of {prompts} completions")
    return problems + attention_problems(result["attention"], prompts, steps)


# -------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def sm12x():
    from gpu.serving import require_gpu, require_vllm

    capability = require_gpu(
        12, why="the 64-row page geometry of FLASHINFER_MLA_SPARSE_DSV41 is SM120/SM121-only"
    )
    version = require_vllm(">=0.32.0,<0.35.0")
    return capability, version


def _results_dir(tmp_path_factory) -> Path:
    out = Path(os.environ.get("VLLM_MLA_FIXES_GPU_RESULTS") or tmp_path_factory.mktemp("results"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _record(tmp_path_factory, name: str, result: dict, problems: list[str]) -> None:
    lines = result["log"].splitlines()
    (_results_dir(tmp_path_factory) / f"{name}.json").write_text(
        json.dumps(
            {
                "healthy": result["healthy"],
                "returncode": result["returncode"],
                "request_error": result["request_error"],
                "completions": result["completions"],
                "attention": result["attention"],
                "problems": problems,
                "errors": [ln for ln in lines if "Error" in ln or "error" in ln][-20:],
            },
            indent=2,
        )
    )


def test_without_fix_block_size_64_upstream_outcome(sm12x, tmp_path, tmp_path_factory):
    """Proves: unpatched --block-size 64 is broken on every release (0.32/0.33 refuse to start)."""
    version = sm12x[1]
    result = serve_and_generate(
        issue_flags(64) + ["--enforce-eager"],
        {"VLLM_MLA_FIXES": "none"},
        tmp_path,
        prompts=PROMPTS[:1],
    )
    problems = run_problems(result, 1, MAX_TOKENS)
    _record(tmp_path_factory, f"dsv41_without_fix_bs64_{version}", result, problems)
    if version.startswith(("0.32.", "0.33.")):
        assert not result["healthy"]
        assert (
            "No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128])" in result["log"]
        ), result["log"][-4000:]
    else:  # 0.34: starts, with 32-state ratio-2 indexer pages SM120 cannot take
        assert problems, "unpatched 0.34 --block-size 64 served correctly: the fix is not needed"


def test_without_fix_block_size_128_upstream_outcome(sm12x, tmp_path, tmp_path_factory):
    """Proves: unpatched --block-size 128 is broken on every release.

    0.32.0 (FlashInfer 0.7.0.post1): the first FlashInfer call rejects the
    32-token SWA page.  0.33.0 (0.7.2.post1 accepts it): the ratio-1 indexer
    pages (128 states) are outside SM120's paged-MQA kernels -- whatever form
    that takes (error, wrong pages), the run must fail a check the fixed run
    passes.  0.34.0: refuses to start.  Eager, so that every attention call is compared."""
    version = sm12x[1]
    result = serve_and_generate(
        issue_flags(128) + ["--enforce-eager"],
        {"VLLM_MLA_FIXES": "none"},
        tmp_path,
        prompts=PROMPTS[:1],
    )
    problems = run_problems(result, 1, MAX_TOKENS)
    _record(tmp_path_factory, f"dsv41_without_fix_bs128_{version}", result, problems)
    if version.startswith("0.32."):
        assert "page_block_size=32" in result["log"], result["log"][-4000:]
    elif version.startswith("0.34."):
        assert "needs 64-token kernel blocks" in result["log"], result["log"][-4000:]
    assert problems, f"unpatched {version} --block-size 128 served correctly: {result['attention']}"


@pytest.mark.parametrize(
    "block_size, eager",
    [(128, False), (128, True), (64, False)],
    ids=["bs128", "bs128-eager", "bs64"],
)
def test_with_fix_serves_and_matches_at_the_attention_call(
    sm12x, block_size, eager, tmp_path, tmp_path_factory
):
    """Proves: with the fix the issue's serve line starts, answers every prompt, and FlashInfer's
    output equals a PyTorch decode of the pages it read, in every compared call (eager: every
    call of every step; with CUDA graphs: the calls that ran eagerly)."""
    args = issue_flags(block_size) + (["--enforce-eager"] if eager else [])
    result = serve_and_generate(args, {"VLLM_MLA_FIXES": "all"}, tmp_path)
    problems = run_problems(result, len(PROMPTS), MAX_TOKENS if eager else 0)
    name = f"dsv41_with_fix_bs{block_size}{'_eager' if eager else ''}_{sm12x[1]}"
    _record(tmp_path_factory, name, result, problems)
    log = result["log"]
    assert "vllm-mla-fixes: applied dsv41-sm120-geometry" in log, log[-4000:]
    # The default geometry, not the fallback, is what this line must get and what was compared.
    assert f"DeepSeek-V4.1 KV geometry {SPLIT} " in log, log[-4000:]
    assert "page_block_size=32" not in log and "No common block size" not in log
    assert not problems, (problems, log[-4000:])
