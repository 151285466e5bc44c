"""Start-up cost of the DeepSeek-V4.1 decision: one :func:`decide` per
engine (its answer is kept per engine), on the 40-layer DeepSeek-V4.1-Flash
layout, with vLLM's platform answering as SM120, on CPU.

decide() describes the full model's KV-cache specs from its config and plans
the candidate layouts with vLLM's own planner: upstream's and the fix's
where upstream's works (the 2% rule), a DSpark drafter's 64- and 128-row
pages, the interleave unit.  Each row times a fresh call (nothing is
memoised inside decide) for one line, median of N after the first.

    CUDA_VISIBLE_DEVICES= python benchmarks/dsv41_decide.py \\
        > benchmarks/results/dsv41_decide_<vLLM release>.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=7, help="calls per line (median of the rest)")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    import vllm

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import simulated
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import decide
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity

    dspark = simulated.speculative_config_as_written(capacity.DSPARK_OPTIONS)
    lines = {
        "--block-size 64": (64, None, ()),
        "--block-size 128": (128, None, ()),
        "--block-size 64, DSpark (3 drafter layers)": (64, dspark, (0, 0, 0)),
        "--block-size 128, DSpark (3 drafter layers)": (128, dspark, (0, 0, 0)),
    }
    print(f"vLLM {vllm.__version__}: one decide() per engine, DeepSeek-V4.1-Flash, SM120, CPU")
    print("| line | calls | first (ms) | median of the rest (ms) | decision |")
    print("|---|---|---|---|---|")
    with simulated.sm120_platform():
        for name, (block_size, speculative, drafters) in lines.items():
            config = simulated.make_vllm_config(block_size)
            if speculative is not None:
                object.__setattr__(config, "speculative_config", speculative)
            simulated.attach_model(config, simulated.DSV41_FLASH, drafters)
            timings = []
            for _ in range(args.calls):
                start = time.perf_counter()
                decision = decide(config)
                timings.append(time.perf_counter() - start)
            print(
                f"| {name} | {len(timings)} | {timings[0] * 1e3:.1f} "
                f"| {statistics.median(timings[1:]) * 1e3:.1f} | {decision.geometry.value} |"
            )


if __name__ == "__main__":
    main()
