"""Replays DeepSeek-V4.1 on SM120/SM121 (issue 5) at tiny scale.

``vllm serve`` the tiny DeepSeek-V4.1 config (6 layers, compress ratios
0/2/2/1/1/0, 128-token sliding window, indexer; dummy weights) with the
report's flags: ``--attention-backend FLASHINFER_MLA_SPARSE_DSV41
--kv-cache-dtype fp8 --block-size 128``, fp8 indexer cache, language model
only.

Greedy tokens of dummy weights prove nothing (logits differ by ~1e-6, every
mismatch is a tie), so correctness is checked at the kernel calls instead:
the call probe (``inprocess/call_probes.py``) wraps FlashInfer's SM120
sparse-MLA entry, DeepGEMM's paged MQA logits and the indexer K gather
inside the served process and recomputes each eager call in PyTorch from the
same cache views (the indexer with the self-test's readers).  It reads pages
the way the kernels do (the view's rows, offset and page stride), so it
follows whichever geometry vLLM bound.  A with-fix run passes only if every
compared attention call is within ``ATTENTION_TOLERANCE`` (0.060, relative
L2, derived from the formats), every indexer logit call within ``INDEXER_TOLERANCE`` (0.01), every
gathered key byte-equal, no record read was never written, a probe record
came from the engine process, and enough calls were compared: eager runs
every call of every step, runs with CUDA graphs at least each prompt's
prefill (eager: over the capture limit).  Measured on the CPU harness with
the probe's own decode against the dense truth
(``tests/test_gpu_cases_on_cpu.py``): the fix's geometry 6e-8 with 0
unwritten reads; a split with untranslated writer slots 0.70 with 128 of 821
reads unwritten, and 3e11 once its wrong pages hold other data.  Page
agreement for the fix's geometry is proven in full on CPU by
``vllm-mla-fixes selftest`` (``tests/dsv41_sm120_geometry/test_selftest.py``).

Without the fix a run passes only on the bug's own signal (``missing_bug_signal``):
upstream's start-up error where it refuses the line, else -- healthy first --
the page geometry SM120 has no kernel for, a read off its reference, or the
kernel's error text.  Any other failure fails the test.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gpu.inprocess.call_probes import LOG_ENV, read_log

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import SPLIT, UPSTREAM
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.bounds import real_attention_bound

TESTS = Path(__file__).resolve().parents[2]
MODEL_DIR = TESTS.parent / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
PROBE_DIR = TESTS / "gpu" / "inprocess"
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


def serve_lines(release: str) -> dict[str, tuple[Path, list[str]]]:
    """This test's serve lines on ``release`` (``tests/gpu/serve_lines.py`` builds
    them on a CPU): name -> (model, serve arguments after the model)."""
    if not release.startswith(("0.32.", "0.33.", "0.34.")):
        return {}
    lines = {}
    for block_size in (64, 128):
        flags = issue_flags(block_size)
        if "--moe-backend" not in flags:  # the SM120 CI job's choice
            flags += ["--moe-backend", "marlin"]
        lines[f"dsv41 bs{block_size}"] = (MODEL_DIR, flags)
        lines[f"dsv41 bs{block_size} eager"] = (MODEL_DIR, [*flags, "--enforce-eager"])
    return lines


# Long enough that ratio-1/ratio-2 compressed caches span several pages and the
# 128-token window is exceeded, so SWA and compressed segments both matter.
PROMPTS = [[(37 * i + 11 * j) % 1000 + 2 for j in range(300 + 40 * i)] for i in range(4)]
MAX_TOKENS = 8
_TEXT = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]
ATTENTION_LAYERS = _TEXT["num_hidden_layers"]
COMPRESSED_LAYERS = sum(1 for r in _TEXT["compress_ratios"] if r)
# FlashInfer against the PyTorch decode of the same fp8 records (relative L2):
# the records dequantise exactly, but FlashInfer's SM120 kernels round Q's NoPE
# part and P through e4m3 and P's RoPE part and the output through bf16, so the
# bound is the self-test's derived one for the model's heads (0.060 for 8; its
# derivation is in vllm_mla_fixes/fixes/dsv41_sm120_geometry/selftest/bounds.py).  A wrong page read on
# the CPU harness: 0.70 where it was never written (zeros; also counted as
# unwritten), 3e11 where it holds other data (tests/test_gpu_cases_on_cpu.py).
ATTENTION_TOLERANCE = real_attention_bound(int(_TEXT["num_attention_heads"])).value
# First start on a runner: FlashInfer JIT-compiles its SM120 sparse-MLA and
# vLLM its DeepGEMM/Triton kernels from source (no jit-cache wheel in the
# 0.32/0.33 locks); later starts reuse ~/.cache/flashinfer.
STARTUP_TIMEOUT_S = 2400


# The indexer's decode logits (DeepGEMM, fp8 MMA with fp32 sums) against the
# PyTorch scores of the same fp8 keys: summation order only, ~1e-6.
INDEXER_TOLERANCE = 0.01


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
    result: dict[str, Any] = {"healthy": False, "completions": [], "request_error": None}
    with running_server(MODEL_DIR, args, env, log_path, startup_timeout) as server:
        result["healthy"] = server.healthy
        result["gpu_memory_before"] = server.gpu_memory_before
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
        [r for r in records if r.get("probe") in ("install", "engine") or r["time"] >= ready],
        api_server_pid=server.proc.pid,
    )
    return result


CALL_PROBES = ("dsv41", "indexer_logits", "indexer_gather")


def attention_summary(records: list[dict], api_server_pid: int | None) -> dict:
    """What the probes saw in the served process after it became healthy."""
    calls = [r for r in records if r.get("probe") == "dsv41"]
    compared = [r for r in calls if "rel_error" in r]
    logits = [r for r in records if r.get("probe") == "indexer_logits"]
    logits_compared = [r for r in logits if "rel_error" in r]
    gather_calls = [r for r in records if r.get("probe") == "indexer_gather"]
    gathers = [r for r in gather_calls if "keys" in r]
    return {
        "probe_installed": any(r.get("probe") == "install" for r in records),
        # The engine's own record: the API server's "install" line does not count.
        "engine_records": sorted(
            {r["pid"] for r in records if r.get("probe") == "engine" and r["pid"] != api_server_pid}
        ),
        "compared": len(compared),
        "compared_with_compressed": sum(1 for r in compared if r.get("extra_page")),
        "skipped_in_graph_capture": sum(
            1 for r in records if r.get("probe") in CALL_PROBES and "skipped" in r
        ),
        "max_rel_error": max((r["rel_error"] for r in compared), default=None),
        "unwritten_read": sum(r["unwritten_read"] for r in compared),
        "records_read": sum(r["records_read"] for r in compared),
        # Every call's geometry, also of calls whose kernel raised.
        "page_geometries": sorted(
            {json.dumps([r.get("swa_page"), r.get("extra_page")]) for r in calls if "swa_page" in r}
        ),
        "indexer_pages": sorted(
            {json.dumps(r["indexer_page"]) for r in (*logits, *gather_calls) if "indexer_page" in r}
        ),
        "indexer_logits_compared": len(logits_compared),
        "indexer_max_rel_error": max((r["rel_error"] for r in logits_compared), default=None),
        "indexer_gathers_compared": len(gathers),
        "indexer_keys_gathered": sum(r["keys"] for r in gathers),
        "indexer_keys_differing": sum(r["keys_differing"] for r in gathers),
        "kernel_errors": sorted(
            {
                f"{r['probe']}: {r['error']}"
                for r in records
                if r.get("probe") in CALL_PROBES and "error" in r
            }
        )[:5],
        "probe_errors": sorted({r["probe_error"] for r in records if "probe_error" in r})[:5],
    }


def attention_problems(summary: dict, prompts: int, eager: bool) -> list[str]:
    """Why this run's attention and indexer calls do not prove a correct
    geometry (empty: they do).  Eager runs must have compared every call of
    every step.  With CUDA graphs the decode steps replay without Python,
    but each prompt's prefill (300-420 tokens, over the capture limit) runs
    eagerly: at least one step per prompt."""
    problems = []
    steps = MAX_TOKENS if eager else 1
    if not summary["probe_installed"]:
        problems.append("the call probe did not load in the served process")
    if not summary["engine_records"]:
        problems.append(
            "no probe record from the engine process (the module that calls FlashInfer "
            "was never imported outside the API server)"
        )
    if summary["probe_errors"]:
        problems.append(f"probe errors: {summary['probe_errors']}")
    if summary["kernel_errors"]:
        problems.append(f"kernel errors: {summary['kernel_errors']}")
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
    # Each prompt's prefill gathers its indexer keys; each eager decode step scores them.
    if summary["indexer_gathers_compared"] < prompts:
        problems.append(
            f"{summary['indexer_gathers_compared']} indexer K gathers compared, expected at "
            f"least {prompts} (one per prompt's prefill)"
        )
    if eager and summary["indexer_logits_compared"] < prompts * (MAX_TOKENS - 1):
        problems.append(
            f"{summary['indexer_logits_compared']} indexer decode-logit calls compared, "
            f"expected at least {prompts * (MAX_TOKENS - 1)} ({prompts} prompts x "
            f"{MAX_TOKENS - 1} decode steps)"
        )
    error = summary["indexer_max_rel_error"]
    if error is not None and not error <= INDEXER_TOLERANCE:
        problems.append(
            f"DeepGEMM's indexer logits differ from the PyTorch scores of the same pages: "
            f"relative error {error:.3g} > {INDEXER_TOLERANCE}"
        )
    if summary["indexer_keys_differing"]:
        problems.append(
            f"the indexer K gather copied {summary['indexer_keys_differing']} of "
            f"{summary['indexer_keys_gathered']} keys other than the pages hold"
        )
    return problems


def run_problems(result: dict, prompts: int, eager: bool) -> list[str]:
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
    return problems + attention_problems(result["attention"], prompts, eager)


# ------------------------------------------------- the bug's own signal


@dataclass(frozen=True)
class UpstreamOutcome:
    """What unpatched vLLM does with the report's line, per release and
    block size (docs/fixes/dsv41-sm120-geometry.md, dossier; reproduced on CPU by ``selftest``)."""

    starts: bool
    error_text: str | None = None  # the log line that names the failure
    swa_rows: int | None = None  # the sliding-window page FlashInfer is handed
    indexer_rows: int | None = None  # the indexer page DeepGEMM is handed


UPSTREAM_OUTCOMES = {
    ("0.32", 64): UpstreamOutcome(
        False, "No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128])"
    ),
    ("0.33", 64): UpstreamOutcome(
        False, "No common block size for 64 (FLASHINFER_MLA_SPARSE_DSV41: [128])"
    ),
    ("0.32", 128): UpstreamOutcome(True, "page_block_size=32", swa_rows=32, indexer_rows=128),
    ("0.33", 128): UpstreamOutcome(True, swa_rows=32, indexer_rows=128),
    ("0.34", 128): UpstreamOutcome(False, "needs 64-token kernel blocks"),
}


def upstream_outcome(version: str, block_size: int) -> UpstreamOutcome:
    return UPSTREAM_OUTCOMES[(".".join(version.split(".")[:2]), block_size)]


def missing_bug_signal(version: str, block_size: int, result: dict) -> list[str]:
    """Why this without-fix run did not show the bug itself (empty: it did).

    A run that failed for another reason -- a JIT error, a bad flag, too
    little memory, a server that never became healthy where upstream starts
    -- shows none of these signals and so fails the test."""
    expected = upstream_outcome(version, block_size)
    log, summary = result["log"], result["attention"]
    if not expected.starts:
        missing = []
        if result["healthy"]:
            missing.append("the server became healthy; upstream refuses this line at start-up")
        if expected.error_text not in log:
            missing.append(f"the log lacks upstream's error {expected.error_text!r}")
        return missing
    if not result["healthy"]:
        return ["the server never became healthy; upstream starts with this line"]
    if not summary["engine_records"]:
        return ["no probe record from the engine process"]
    signals = []
    if expected.error_text and expected.error_text in log:
        signals.append(f"kernel error {expected.error_text!r}")
    swa_rows = {json.loads(g)[0][0] for g in summary["page_geometries"] if json.loads(g)[0]}
    if expected.swa_rows in swa_rows:
        signals.append(f"{expected.swa_rows}-row sliding-window pages")
    indexer_rows = {json.loads(g)[0] for g in summary["indexer_pages"]}
    if expected.indexer_rows in indexer_rows:
        signals.append(f"{expected.indexer_rows}-state indexer pages")
    if (summary["max_rel_error"] or 0) > ATTENTION_TOLERANCE or summary["unwritten_read"]:
        signals.append("an attention read that differs from its reference")
    if (summary["indexer_max_rel_error"] or 0) > INDEXER_TOLERANCE or summary[
        "indexer_keys_differing"
    ]:
        signals.append("an indexer read that differs from its reference")
    if signals:
        return []
    return [
        f"healthy, but no sign of the bug: no {expected.swa_rows}-row SWA page, no "
        f"{expected.indexer_rows}-state indexer page, no read off its reference"
        + (f", no {expected.error_text!r}" if expected.error_text else "")
        + f" ({summary})"
    ]


# -------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def sm12x():
    from gpu.serving import require_gpu, require_vllm

    capability = require_gpu(
        12, why="the 64-row page geometry of FLASHINFER_MLA_SPARSE_DSV41 is SM120/SM121-only"
    )
    version = require_vllm(">=0.32.0,<0.35.0")
    return capability, version


def _record(tmp_path_factory, name: str, result: dict, problems: list[str]) -> None:
    from gpu.serving import keep_log, results_dir

    keep_log(tmp_path_factory, name, result["log"])
    lines = result["log"].splitlines()
    (results_dir(tmp_path_factory) / f"{name}.json").write_text(
        json.dumps(
            {
                "healthy": result["healthy"],
                "returncode": result["returncode"],
                "gpu_memory_before": result.get("gpu_memory_before"),
                "request_error": result["request_error"],
                "completions": result["completions"],
                "attention": result["attention"],
                "problems": problems,
                "errors": [ln for ln in lines if "Error" in ln or "error" in ln][-20:],
            },
            indent=2,
        )
    )


def upstream_works(block_size: int) -> bool:
    """Whether upstream's own layout for ``--block-size`` starts and every page
    of it is inside the installed kernels' own envelopes, judged on this
    runner's GPU by the fix's own rule (the CPU truth table checks that rule
    against vLLM's start-up: tests/dsv41_sm120_geometry/test_dsv41_truth_table.py)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream

    return bool(upstream.upstream_layout(block_size).works)


@pytest.mark.parametrize("block_size", [64, 128], ids=["bs64", "bs128"])
def test_without_fix_shows_the_bug_itself(sm12x, block_size, tmp_path, tmp_path_factory):
    """Proves: unpatched vLLM fails the report's line in the bug's own way on every release --
    upstream's start-up error where it refuses the line, else (healthy first) the page
    geometry SM120 has no kernel for, a read off its reference, or the kernel's error text.
    Eager, so that every attention call is compared.  Where upstream's layout works
    (0.34.0 with --block-size 64), the same run must instead serve and match its
    reference: that cell is no bug case, and the fix steps aside there."""
    version = sm12x[1]
    if upstream_works(block_size):
        result = serve_and_generate(
            issue_flags(block_size) + ["--enforce-eager"],
            {"VLLM_MLA_FIXES": "none"},
            tmp_path,
            prompts=PROMPTS[:1],
        )
        problems = run_problems(result, 1, eager=True)
        _record(tmp_path_factory, f"dsv41_upstream_bs{block_size}_{version}", result, problems)
        assert not problems, (problems, result["log"][-4000:])
        return
    result = serve_and_generate(
        issue_flags(block_size) + ["--enforce-eager"],
        {"VLLM_MLA_FIXES": "none"},
        tmp_path,
        prompts=PROMPTS[:1],
    )
    missing = missing_bug_signal(version, block_size, result)
    _record(
        tmp_path_factory,
        f"dsv41_without_fix_bs{block_size}_{version}",
        result,
        missing or run_problems(result, 1, eager=True),
    )
    assert not missing, (missing, result["log"][-4000:])


@pytest.mark.parametrize(
    "block_size, eager",
    [(128, False), (128, True), (64, False), (64, True)],
    ids=["bs128", "bs128-eager", "bs64", "bs64-eager"],
)
def test_with_fix_serves_and_matches_at_the_attention_call(
    sm12x, block_size, eager, tmp_path, tmp_path_factory
):
    """Proves: with the fix the issue's serve line starts, answers every prompt, and
    FlashInfer's output equals a PyTorch decode of the pages it read, DeepGEMM's indexer
    logits and the indexer K gather equal a PyTorch read of theirs, in every compared call
    (eager: every call of every step; with CUDA graphs: at least each prompt's prefill)."""
    args = issue_flags(block_size) + (["--enforce-eager"] if eager else [])
    result = serve_and_generate(args, {"VLLM_MLA_FIXES": "all"}, tmp_path)
    problems = run_problems(result, len(PROMPTS), eager)
    name = f"dsv41_with_fix_bs{block_size}{'_eager' if eager else ''}_{sm12x[1]}"
    _record(tmp_path_factory, name, result, problems)
    log = result["log"]
    assert "vllm-mla-fixes: applied dsv41-sm120-geometry" in log, log[-4000:]
    # Where upstream's layout works the fix steps aside; elsewhere the default
    # geometry, not the fallback, is what this line must get and what was compared.
    expected = UPSTREAM if upstream_works(block_size) else SPLIT
    assert f"DeepSeek-V4.1 KV geometry {expected} " in log, log[-4000:]
    if expected == SPLIT:
        assert "page_block_size=32" not in log
    assert "No common block size" not in log
    assert not problems, (problems, log[-4000:])


def test_dspark_long_prefill_selftest_passes_on_the_real_kernels(sm12x):
    """Proves (vllm#56771, issue 42): on this SM12x GPU, DeepGEMM's indexer
    logits and vLLM's top-k op pick, for every token of a 12,288-token DSpark
    prefill chunked at 2,048 tokens and of the verify beside it, only indices
    below the token's visible compressed length, and vLLM's top-k gather
    (Triton, on the GPU) loads only the token's own allocated blocks; the
    check's unbounded-index control is caught.  Every one of the check's
    kernels must be real: a stand-in's PASS would say nothing here."""
    import subprocess
    import sys

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    command = Path(sys.executable).with_name("vllm-mla-fixes")
    assert command.exists(), f"{command} is missing: install the package into this environment"
    args = [str(command), "selftest", "--geometry", "dspark-long-prefill", "--json", "--no-timing"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout)
    sources = report["kernels"]
    stand_ins = {
        k: sources[k]
        for k in (kn.INDEXER_LOGITS, kn.INDEXER_TOPK, kn.TOPK_GATHER)
        if not sources[k].startswith("real")
    }
    assert not stand_ins, stand_ins
    (geometry,) = report["geometries"]
    assert geometry["verdict"] == "pass", (
        geometry["cases"],
        geometry["aborted"],
        done.stderr[-4000:],
    )
    assert geometry["cases"]["unbounded-index control"]["compared"] == 1, geometry["cases"]
    assert done.returncode == 0, done.stderr[-4000:]
