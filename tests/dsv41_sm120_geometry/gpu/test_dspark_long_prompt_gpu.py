"""Replays vllm#56771 (issue 42) at tiny scale: DeepSeek-V4.1 with DSpark on
SM120/SM121 serves short prompts, and a prompt of about 4k tokens or more (12k
reliably) kills the engine with an illegal memory access in sparse-MLA prefill.

``vllm serve`` the tiny DeepSeek-V4.1 config with DSpark's fields
(``tiny_deepseek_v41_dspark/config.json``: the tiny model plus
``dspark_target_layer_ids``, ``dspark_markov_rank`` and room for 16k positions;
vLLM's default of 3 drafter layers; dummy weights) with the report's
``--speculative-config '{"method": "dspark", "num_speculative_tokens": 5}'``,
the geometry test's flags at ``--block-size 128`` and
``--max-num-batched-tokens 2048``, so the long prompt's prefill runs in six
chunks beside the short request's verify steps.  One GPU, so ``-tp 1`` where
the report had 4.  It sends a short prompt, then a 12,288-token one, then asks
``/health``.

The package has no fix for this report: the CPU evidence reached none of the
candidate PR's defects (docs/fixes/dsv41-sm120-geometry.md, "DSpark and long
prompts"), and doctor warns on such lines instead
(``vllm_mla_fixes/fixes/dsv41_sm120_geometry/dspark_long_prompt.py``).  So
the test is a strict xfail that names vllm#56771, and only the report's own
crash counts as the expected failure (``ReportedCrash``, the xfail's
``raises``):

* the engine answers both prompts and stays alive: XPASS, which strict turns
  into a failure: the crash no longer reproduces here, so doctor's warning
  must be reviewed;
* the long prompt fails and the log holds ``illegal memory access``: the
  report reproduced, XFAIL;
* anything else (never healthy, the short prompt unanswered, another error):
  a plain failure with the server log's tail, as the report says short
  prompts are served.

Needs an SM12x GPU and a release the geometry fix covers; skips with the
reason elsewhere (a failure on a runner that declares its GPU,
``tests/gpu/conftest.py``).  The serve line is parsed and built by each
release's own parser on CPU (``tests/dsv41_sm120_geometry/test_gpu_cases_dsv41_on_cpu.py``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import dspark_long_prompt
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import dspark_gather

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "tiny_deepseek_v41_dspark"
SPECULATIVE_CONFIG = {"method": "dspark", "num_speculative_tokens": dspark_gather.DRAFTS}
LONG_PROMPT_TOKENS = 12_288  # "12k reliably"
SHORT_PROMPT_TOKENS = 200
MAX_TOKENS = 8
MAX_MODEL_LEN = 16_384
VOCAB_SIZE = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]["vocab_size"]
REPORTED_CRASH_TEXT = "illegal memory access"
STARTUP_TIMEOUT_S = 2400  # first start JIT-compiles FlashInfer's SM120 kernels


def dspark_flags() -> list[str]:
    from dsv41_sm120_geometry.gpu.test_dsv41_sm120_gpu import issue_flags

    flags = issue_flags(128)
    flags[flags.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
    if "--moe-backend" not in flags:  # the SM120 CI job's choice
        flags += ["--moe-backend", "marlin"]
    return [
        *flags,
        "--max-num-batched-tokens",
        str(dspark_gather.PREFILL_BUDGET),
        "--speculative-config",
        json.dumps(SPECULATIVE_CONFIG),
    ]


def serve_lines(release: str) -> dict[str, tuple[Path, list[str]]]:
    """This test's serve line on ``release`` (``tests/gpu/serve_lines.py``)."""
    if release not in dspark_long_prompt.AFFECTED_RELEASES:
        return {}
    return {"dsv41 dspark long prompt": (MODEL_DIR, dspark_flags())}


def prompt(tokens: int, seed: int) -> list[int]:
    """Token ids in the tiny vocabulary, clear of its BOS/EOS ids 0 and 1."""
    return [(seed + 37 * i) % (VOCAB_SIZE - 2) + 2 for i in range(tokens)]


class ReportedCrash(AssertionError):
    """The failure vllm#56771 reports: the long prompt's request fails and the
    server log names an illegal memory access."""


@pytest.fixture(scope="module")
def sm12x():
    from importlib.metadata import version

    from gpu.serving import require_gpu

    require_gpu(12, why="vllm#56771 is a crash in SM120 sparse-MLA prefill")
    release = version("vllm")
    if release not in dspark_long_prompt.AFFECTED_RELEASES:
        pytest.skip(
            f"needs vLLM {' / '.join(dspark_long_prompt.AFFECTED_RELEASES)} (the releases "
            f"the report holds for), found {release}"
        )
    return release


def _alive(server) -> bool:
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.mark.xfail(
    strict=True,
    raises=ReportedCrash,
    reason=f"{dspark_long_prompt.UPSTREAM_REPORT}: no fix in this package; passing means the "
    "crash no longer reproduces, and doctor's warning (dspark_long_prompt.py) must be reviewed",
)
def test_dspark_serves_a_12k_token_prompt(sm12x, tmp_path, tmp_path_factory):
    """Proves (vllm#56771 replayed): with DSpark (5 speculative tokens) and the
    geometry fix on, the tiny DeepSeek-V4.1 answers a short prompt, then a
    12,288-token prompt, and the server is still healthy afterwards."""
    from gpu.serving import complete, keep_log, running_server

    log_path = tmp_path / "serve.log"
    env = {**os.environ, "VLLM_MLA_FIXES": "all"}
    short_tokens: list[str] = []
    short_error = long_error = None
    with running_server(MODEL_DIR, dspark_flags(), env, log_path, STARTUP_TIMEOUT_S) as server:
        if server.healthy:
            try:
                short = complete(
                    server,
                    MODEL_DIR,
                    prompt(SHORT_PROMPT_TOKENS, 3),
                    MAX_TOKENS,
                    logprobs=1,
                    return_tokens_as_token_ids=True,
                )
                short_tokens = short["choices"][0]["logprobs"]["tokens"]
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                short_error = f"{type(exc).__name__}: {exc}"
        if server.healthy and short_error is None:
            try:
                complete(server, MODEL_DIR, prompt(LONG_PROMPT_TOKENS, 5), MAX_TOKENS)
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                long_error = f"{type(exc).__name__}: {exc}"
        healthy, alive = server.healthy, server.healthy and _alive(server)
    log = log_path.read_text(errors="replace")
    keep_log(tmp_path_factory, f"dsv41_dspark_long_prompt_{sm12x}", log)
    tail = log[-4000:]
    assert healthy, f"the DSpark line never became healthy (the report serves it)\n{tail}"
    # A plain failure, not the expected one: the report says short prompts are served.
    assert short_error is None and len(short_tokens) == MAX_TOKENS, (
        short_error,
        short_tokens,
        tail,
    )
    if long_error is not None or not alive:
        failure = (
            f"{LONG_PROMPT_TOKENS:,}-token prompt: {long_error or 'answered'}; "
            f"server alive after it: {alive}"
        )
        if REPORTED_CRASH_TEXT in log:
            raise ReportedCrash(
                f"{dspark_long_prompt.UPSTREAM_REPORT} reproduced: {failure}\n{tail}"
            )
        raise AssertionError(f"{failure}, without the report's {REPORTED_CRASH_TEXT!r}\n{tail}")
