"""Start-up cost of the 2% rule: the planning passes the fix runs, once per
engine, where upstream's DeepSeek-V4.1 layout works (vLLM 0.34.0 on SM12x).

Builds the dossier's 40-layer DeepSeek-V4.1-Flash layout on CPU with the fix
applied as on SM120 (``--block-size 64``), without speculation and with
DSpark's three drafter layers, and times the rule's planning
(``gain._planned_gain``: upstream's layout and the fix's candidates, each
through vLLM's spec collection, planner and capacity function) per engine.

    CUDA_VISIBLE_DEVICES= python benchmarks/dsv41_gain_planning.py \
        > benchmarks/results/dsv41_gain_planning_0.34.0.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=7, help="engines per line (median)")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    import vllm

    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import gain
    from vllm_mla_fixes.reproductions import dsv41_capacity as capacity
    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

    timings: list[float] = []
    planned = gain._planned_gain

    def timed(vllm_config, caches):
        start = time.perf_counter()
        try:
            return planned(vllm_config, caches)
        finally:
            timings.append(time.perf_counter() - start)

    gain._planned_gain = timed
    lines = {
        "no speculation": repro.EngineSettings(),
        "DSpark, 3 drafter layers": repro.EngineSettings(
            attached={
                "speculative_config": capacity.speculative_config_as_written(
                    capacity.DSPARK_OPTIONS
                )
            },
            drafter_ratios=(0, 0, 0),
        ),
    }
    print(f"vLLM {vllm.__version__}: the 2% rule's planning per engine, --block-size 64, SM120")
    print("| line | engines | first (ms) | median of the rest (ms) | decision |")
    print("|---|---|---|---|---|")
    for name, settings in lines.items():
        timings.clear()
        with repro.applied((12, 0)), repro.sm120_platform():
            for _ in range(args.engines):
                plan = repro.plan_geometry(64, settings=settings)
            decision = fix.geometry_decision(plan.vllm_config)[0]
        first, rest = timings[0], timings[1:]
        print(
            f"| {name} | {len(timings)} | {first * 1e3:.1f} "
            f"| {statistics.median(rest) * 1e3:.1f} | {decision} |"
        )


if __name__ == "__main__":
    main()
