"""Replays the GLM-5.x start-up crash (issue 3) at tiny scale on SM90/SM100.

``vllm serve`` a 2-layer GlmMoeDsa config with dummy weights and the report's
flags, three ways: without the fix, without it but with ``--enforce-eager``,
and with it.  Needs FLASHMLA_SPARSE (compute capability 9.x or 10.x) and a
vLLM 0.25.x install; skips with the reason elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpu.serving import keep_log, require_gpu, require_vllm, results_dir, serve

from vllm_mla_fixes.fixes import fp8_ds_mla_reshape
from vllm_mla_fixes.reproductions.fp8_ds_mla import TINY_GLM_DSA

FLAGS = [
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--kv-cache-dtype",
    "fp8",
    "--attention-backend",
    "FLASHMLA_SPARSE",
    "--block-size",
    "64",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "4096",
    "--gpu-memory-utilization",
    "0.4",
]
UPSTREAM_ERROR = "is invalid for input of size"
# Logged by vLLM 0.25's GPU model runner once every CUDA graph is captured;
# the profiling line ("... CUDA graph memory ...") comes before capture and proves nothing.
CAPTURE_FINISHED = "Graph capturing finished in"
PROMPTS = [[11 + i, 23, 57, 101, 300 + i, 7] for i in range(4)]


def serve_lines(release: str) -> dict[str, tuple[Path, list[str]]]:
    """This test's serve lines on ``release`` (``tests/gpu/serve_lines.py`` builds
    them on a CPU): name -> (model, serve arguments after the model)."""
    if release not in fp8_ds_mla_reshape.INFO.covered_releases:
        return {}
    return {
        "fp8 (cuda graphs)": (TINY_GLM_DSA.parent, FLAGS),
        "fp8 --enforce-eager": (TINY_GLM_DSA.parent, [*FLAGS, "--enforce-eager"]),
    }


@pytest.fixture(scope="module")
def gpu():
    capability = require_gpu(9, 10, why="FLASHMLA_SPARSE runs only on SM90/SM100")
    require_vllm(">=0.25.0,<0.26.0")
    return capability


def _record(tmp_path_factory, name, result):
    keep_log(tmp_path_factory, name, result.log)
    (results_dir(tmp_path_factory) / f"{name}.json").write_text(
        json.dumps(
            {
                "healthy": result.healthy,
                "returncode": result.returncode,
                "upstream_error": next(
                    (ln for ln in result.log.splitlines() if UPSTREAM_ERROR in ln), None
                ),
                "completions": result.completions,
                "graph_capture_finished": result.has(CAPTURE_FINISHED),
            },
            indent=2,
        )
    )


def test_without_fix_reproduces_the_upstream_error(gpu, tmp_path, tmp_path_factory):
    """Proves: unpatched 0.25.x cannot start the report's serve line (the report's reshape error)."""
    result = serve(
        TINY_GLM_DSA.parent,
        FLAGS,
        {"VLLM_MLA_FIXES": "none"},
        tmp_path / "serve.log",
        startup_timeout=600,
    )
    _record(tmp_path_factory, "fp8_without_fix", result)
    assert not result.healthy
    assert result.has("shape '[32, 64, 576]' is invalid for input of size 1343488"), result.log[
        -4000:
    ]


def test_without_fix_enforce_eager_fails_at_kv_cache_init(gpu, tmp_path, tmp_path_factory):
    """Proves: the report's workaround (--enforce-eager) fails the same way at KV-cache start-up."""
    result = serve(
        TINY_GLM_DSA.parent,
        [*FLAGS, "--enforce-eager"],
        {"VLLM_MLA_FIXES": "none"},
        tmp_path / "serve.log",
        startup_timeout=600,
    )
    _record(tmp_path_factory, "fp8_without_fix_enforce_eager", result)
    assert not result.healthy
    assert result.has(UPSTREAM_ERROR) and result.has(", 64, 576]' is invalid"), result.log[-4000:]


def test_with_fix_serves_completions_with_cuda_graphs(gpu, tmp_path, tmp_path_factory):
    """Proves: with the fix the same serve line starts with CUDA graphs and completes requests."""
    result = serve(
        TINY_GLM_DSA.parent,
        FLAGS,
        {"VLLM_MLA_FIXES": "all"},
        tmp_path / "serve.log",
        prompts=PROMPTS,
    )
    _record(tmp_path_factory, "fp8_with_fix", result)
    assert result.has("vllm-mla-fixes: applied fp8-ds-mla-reshape"), result.log[-4000:]
    assert result.healthy, result.log[-4000:]
    assert not result.has(UPSTREAM_ERROR)
    assert len(result.completions) == len(PROMPTS)
    for completion in result.completions:
        assert completion["usage"]["completion_tokens"] == 8
    assert result.has(CAPTURE_FINISHED) and not result.has("enforce_eager=True"), result.log[-4000:]
