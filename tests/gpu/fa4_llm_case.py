"""One ``LLM(...)`` run for test_fa4_compile_strides_gpu (a child process per case).

The tiny DeepSeek-V3-style MLA model (8 heads: Kimi-K2.5 per rank at TP8),
dummy weights, chunked prefill at 8192 tokens, MLA prefill through FA
(FA4 on SM100).  ``max_num_seqs=1`` runs one prompt at a time, so the
second chunk of a prompt over 8192 tokens is alone in its step: its
``L - 8192`` new tokens (108-1808 here) attend to an 8192-token context, few
enough M-blocks that FA4 takes Split-KV (2-18 splits on a B200), each with
a ``total_q`` that warm-up (q = 1 and 129) never compiled.  Several prompts
per step (the old ``max_num_seqs=16``) put the next prompt's first chunk in
the same step, and the ~8k-token query leaves no room for Split-KV.
``tests/test_gpu_cases_on_cpu.py`` derives this plan with vLLM 0.25.1's
scheduler and FA4's own split decision.  Prints one ``RESULT=`` JSON line
on success.

    python tests/gpu/fa4_llm_case.py --model DIR [--kernel-config JSON] [--attention-config JSON]
"""

from __future__ import annotations

import argparse
import json
import random

PROMPT_LENS = (8500, 8700, 9100, 9500, 10000, 300, 8300)
MAX_TOKENS = 8
ENGINE_OPTIONS = dict(
    load_format="dummy",
    skip_tokenizer_init=True,
    dtype="bfloat16",
    max_model_len=10240,
    max_num_batched_tokens=8192,
    max_num_seqs=1,
    enable_prefix_caching=False,
    gpu_memory_utilization=0.5,
    attention_config={"mla_prefill_backend": "FLASH_ATTN"},
)


def prompt_token_ids() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 32000) for _ in range(n)] for n in PROMPT_LENS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kernel-config", default=None)
    parser.add_argument("--attention-config", default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = dict(model=args.model, **ENGINE_OPTIONS)
    if args.kernel_config:
        options["kernel_config"] = json.loads(args.kernel_config)
    if args.attention_config:
        options["attention_config"] = json.loads(args.attention_config)
    llm = LLM(**options)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids()]
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    )
    print(
        "RESULT="
        + json.dumps(
            {
                "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
                "output_lens": [len(o.outputs[0].token_ids) for o in outputs],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
