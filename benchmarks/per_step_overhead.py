"""Per-step overhead of the fixes, on the installed vLLM (CPU).

``to_cute_tensor`` of fa4-compile-strides runs on every forward step, for
every tensor argument of every FA4 call.  For real tensors the replacement
adds one ``hasattr`` check before the original.  (The other per-step
replacement, DeepSeek-V4.1's kernel-block slots on SM12x, has its own script:
``dsv41_per_step.py``.)

    CUDA_VISIBLE_DEVICES= python benchmarks/per_step_overhead.py   # vLLM 0.25.x
"""

from __future__ import annotations

import importlib
import timeit


def main() -> None:
    from vllm_mla_fixes.fixes import fa4_compile_strides as fix
    from vllm_mla_fixes.reproductions import fa4_on_cpu as repro

    env = repro.prepare()
    utils = importlib.import_module(fix.UTILS_MODULE)
    original = utils.to_cute_tensor
    replaced = fix.symbolic_spec_converter(original)
    tensor = env.torch.zeros(130, 8, 192, dtype=env.torch.bfloat16)
    calls, rounds = 2000, 15
    variants = {"original": original, "with fix": replaced}
    runs = {label: [] for label in variants}
    for _ in range(rounds):  # interleaved, so drift in machine load hits both alike
        for label, convert in variants.items():
            runs[label].append(timeit.timeit(lambda convert=convert: convert(tensor), number=calls))
    timings = {label: min(r) / calls * 1e6 for label, r in runs.items()}
    print(
        "to_cute_tensor on a real (130, 8, 192) bf16 tensor, best of "
        f"{rounds} interleaved rounds x {calls} calls, CPU"
    )
    print("| function | us per call |")
    print("|---|---|")
    for label, us in timings.items():
        print(f"| {label} | {us:.2f} |")
    print(f"\nratio with fix / original: {timings['with fix'] / timings['original']:.3f}")
    print(
        "an FA4 prefill call converts about 8 tensors: added time per call "
        f"{8 * (timings['with fix'] - timings['original']):+.2f} us"
    )


if __name__ == "__main__":
    main()
