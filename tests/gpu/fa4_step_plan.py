"""On CPU: the FA4 context-chunk calls ``fa4_llm_case.py`` makes, from vLLM's
own scheduler and FA4's own Split-KV decision (vLLM 0.25.x; child process).

1. ``EngineArgs(**ENGINE_OPTIONS).create_engine_config()`` and the scheduler
   class it selects (the async scheduler) schedule the case's prompts; each
   step's prefill requests that already have context are one MLA context
   chunk (query = the step's new prefill tokens, key = their contexts).
2. FA4's ``_flash_attn_fwd`` decides the chunk's kernel with fake tensors
   (``vllm_mla_fixes.reproductions.fa4_on_cpu.plan``: B200 stand-in,
   compile-only, nothing launches), with the GPU test's call probe
   (``inprocess/call_probes.py``) installed on the same interface, so the
   probe's record of each call is checked against the decision too.

Needs ``CUDA_VISIBLE_DEVICES=""``.  Prints one JSON line.

    python tests/gpu/fa4_step_plan.py [--max-num-seqs N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "inprocess")]

import call_probes  # noqa: E402
import fa4_llm_case  # noqa: E402

MODEL = HERE.parents[1] / "vllm_mla_fixes" / "models" / "tiny_deepseek_v3_mla"


def scheduled_context_chunks(max_num_seqs: int) -> list[dict]:
    """Per scheduler step with a context chunk: new tokens and context of each
    prefill request that has context, and the step's whole prefill query."""
    from vllm.platforms import current_platform

    # No GPU here: vLLM's platform has no device type, which the config needs.
    type(current_platform).device_type = "cpu"
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    options = {**fa4_llm_case.ENGINE_OPTIONS, "max_num_seqs": max_num_seqs}
    config = EngineArgs(model=str(MODEL), **options).create_engine_config()
    config.cache_config.num_gpu_blocks = 4096
    block_size = config.cache_config.block_size
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)]
    )
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        config, kv_cache_config, StructuredOutputManager(config), block_size=block_size
    )
    params = SamplingParams(max_tokens=fa4_llm_case.MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(fa4_llm_case.prompt_token_ids()):
        scheduler.add_request(Request(str(i), ids, params, None))
    chunks = []
    for step in range(2000):
        if not scheduler.has_requests():
            break
        out = scheduler.schedule()
        counts = out.num_scheduled_tokens
        # num_computed_tokens is already advanced by this step's schedule()
        before = {rid: scheduler.requests[rid].num_computed_tokens - n for rid, n in counts.items()}
        prefills = [
            rid for rid in counts if before[rid] < scheduler.requests[rid].num_prompt_tokens
        ]
        with_context = [rid for rid in prefills if before[rid] > 0]
        if with_context:
            chunks.append(
                {
                    "step": step,
                    "scheduler": scheduler_cls.__name__,
                    "q_lens": [counts[rid] for rid in prefills],
                    "ctx_lens": [before[rid] for rid in prefills],
                }
            )
        sampled = [
            [7]
            if scheduler.requests[rid].num_computed_tokens
            >= scheduler.requests[rid].num_prompt_tokens
            else []
            for rid in counts
        ]
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=list(counts),
                req_id_to_index={rid: i for i, rid in enumerate(counts)},
                sampled_token_ids=sampled,
            ),
        )
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--max-num-seqs", type=int, default=fa4_llm_case.ENGINE_OPTIONS["max_num_seqs"]
    )
    args = parser.parse_args()
    chunks = scheduled_context_chunks(args.max_num_seqs)

    from vllm_mla_fixes.reproductions import fa4_on_cpu as repro

    env = repro.prepare()
    warmup_q = sorted({r.compile_spec.max_seqlen_q for r in repro.warmup_requests(env)})
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[call_probes.LOG_ENV] = str(Path(tmp) / "calls.jsonl")
        call_probes.instrument_fa4(env.interface)
        for chunk in chunks:
            decision = repro.plan(env, repro.Step(tuple(chunk["q_lens"]), tuple(chunk["ctx_lens"])))
            chunk["num_splits"] = decision.num_splits
            chunk["total_q"] = sum(chunk["q_lens"])
        probed = call_probes.read_log(os.environ[call_probes.LOG_ENV])
    print(
        json.dumps(
            {
                "chunks": chunks,
                "warmup_q": warmup_q,
                "probe": [
                    {k: r.get(k) for k in ("total_q", "num_splits", "compile_only")}
                    for r in probed
                    if r.get("probe") == "fa4"
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
