"""One ``LLM(...)`` run for test_fa4_compile_strides_gpu (a child process per case).

The tiny DeepSeek-V3-style MLA model (8 heads: Kimi-K2.5 per rank at TP8),
dummy weights, chunked prefill at 8192 tokens, MLA prefill through FA
(FA4 on SM100): prompts over 8192 tokens run a second chunk whose context
(8192 tokens) takes FA4's Split-KV path -- the kernels vLLM's warm-up
compiled.  Prints one ``RESULT=`` JSON line on success.

    python tests/gpu/fa4_llm_case.py --model DIR [--kernel-config JSON]
"""
from __future__ import annotations

import argparse
import json
import random

PROMPT_LENS = (8500, 8700, 9100, 9500, 10000, 300, 8300)
MAX_TOKENS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kernel-config", default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = dict(
        model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=10240, max_num_batched_tokens=8192, max_num_seqs=16,
        enable_prefix_caching=False, gpu_memory_utilization=0.5,
        attention_config={"mla_prefill_backend": "FLASH_ATTN"})
    if args.kernel_config:
        options["kernel_config"] = json.loads(args.kernel_config)
    llm = LLM(**options)
    rng = random.Random(4)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 32000) for _ in range(n)])
               for n in PROMPT_LENS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                   detokenize=False))
    print("RESULT=" + json.dumps({
        "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
        "output_lens": [len(o.outputs[0].token_ids) for o in outputs]}), flush=True)


if __name__ == "__main__":
    main()
