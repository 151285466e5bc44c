"""vllm#56771, which this package does not fix: DeepSeek-V4.1 with DSpark
speculative decoding on SM120/SM121 crashes the engine on long prompts.

Upstream:   vllm-project/vllm#56771 (open): DeepSeek-V4.1-Flash with
            ``--speculative-config '{"method": "dspark", ...}'`` on 4x RTX PRO 6000
            serves short prompts; a prompt of about 4k tokens or more (12k
            reliably) ends in an illegal memory access in SM120 sparse-MLA
            prefill.  No flag but DSpark off avoids it.  Candidate fix: vllm
            PR #57388 (open, unmerged).
Affected:   every release the geometry fix covers (0.32.0, 0.33.0, 0.34.0): the
            code sites the PR changes are the same in the three.
Hardware:   SM120, SM121 (FlashInfer's SM120 sparse-MLA prefill).

What this package does about it
    Nothing is changed in vLLM.  Issue 42's first step ran each of the PR's
    defects with vLLM's own code on CPU, on every covered release
    (reproductions/dspark_gather.py; tests/dsv41_sm120_geometry/
    test_dspark_long_prompt_evidence.py).  The metadata vLLM's builders make
    for a 12,288-token prompt's last prefill chunk beside a 1 + 5 token
    verify, and for a padded verify step, was used throughout.  vLLM's gather
    then stays in each request's blocks for every index its indexer can emit
    (it does read past them given an index past them).  Every top-k row the
    attention reads is written in the step.  FlashInfer's workspace keeps no
    state between calls.  The gathered rows hold -1 past each row's length.
    None of the defects is reached, so no change would have a test that can
    fail.  What the SM120 indexer kernels emit for a long prompt, and the
    crash itself, need a GPU (docs/fixes/dsv41-sm120-geometry.md, "DSpark
    and long prompts"): ``vllm-mla-fixes selftest --geometry
    dspark-long-prefill`` (:data:`SELFTEST_COMMAND`) checks the first on the
    operator's GPU, and doctor's warning names it.  What doctor says is the part this package owns: a
    DSpark line on SM12x is not READY while it admits prompts of the length
    the report crashes on, and doctor names the report, the length and the
    ways out.

Remove when
    The oldest release the geometry fix covers carries vllm#57388 (or
    another fix of #56771), or a fix in this package removes each defect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO

if TYPE_CHECKING:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig
    from vllm_mla_fixes.report import Finding

AFFECTED_RELEASES = INFO.covered_releases
"""The releases doctor warns on: the code sites vllm PR #57388 changes are
the same in every release the geometry fix covers."""
UPSTREAM_REPORT = "vllm#56771"
CANDIDATE_FIX = "vllm PR #57388"
REPORTED_PROMPT_TOKENS = 4096
"""The prompt length from which the report says the engine crashes ("about
4k tokens or more"); 12k tokens crash it reliably."""
SHORT_MAX_MODEL_LEN = 3072
"""The longest ``--max-model-len`` doctor calls short of the report's length:
a quarter below it, since the report gives "about" 4k, not a bound."""
DSPARK_OFF_ADVICE = "serve without --speculative-config"
SHORT_PROMPTS_FLAG = f"--max-model-len {SHORT_MAX_MODEL_LEN}"
SELFTEST_COMMAND = "vllm-mla-fixes selftest --geometry dspark-long-prefill"
"""Checks, on the serving GPU's own indexer kernels, that a 12,288-token DSpark
prefill's top-k indices stay below each token's visible length and that vLLM's
gather loads only the request's blocks (the GPU test runs it)."""


def findings(engine: EngineConfig) -> list[Finding]:
    """Doctor's finding on vllm#56771 for a DeepSeek-V4.1 line judged as
    served on SM12x; none where the line does not use DSpark."""
    from vllm_mla_fixes.report import Finding

    if engine.speculative_method != "dspark":
        return []
    longest = engine.max_model_len
    if longest is not None and longest <= SHORT_MAX_MODEL_LEN:
        return [
            Finding(
                "info",
                INFO.name,
                f"DSpark on SM12x: {UPSTREAM_REPORT} reports engine crashes on prompts of about "
                f"{REPORTED_PROMPT_TOKENS:,} tokens or more; this line's --max-model-len "
                f"{longest:,} keeps every prompt shorter (not checked on hardware by this "
                "project)",
            )
        ]
    admits = "no --max-model-len bound" if longest is None else f"prompts up to {longest:,} tokens"
    return [
        Finding(
            "warn",
            INFO.name,
            f"DSpark on SM12x: {UPSTREAM_REPORT} (open) reports an illegal memory access in "
            f"SM120 sparse-MLA prefill on prompts of about {REPORTED_PROMPT_TOKENS:,} tokens "
            f"or more (12k reliably), on every release this fix covers; this line admits "
            f"{admits}, and vllm-mla-fixes does not fix that crash ({CANDIDATE_FIX}, the "
            "candidate upstream fix, is unmerged)",
            f"DSpark off: {DSPARK_OFF_ADVICE}; or prompts short of the reported length: "
            f"{SHORT_PROMPTS_FLAG}; to check the indices the serving GPU picks on a long "
            f"prompt: {SELFTEST_COMMAND}",
        )
    ]
