"""fa4-compile-strides on CPU: compile time per FA4 kernel, the batch-composition
sweep and the forward compile-cache count, on the installed vLLM 0.25.x.

    python benchmarks/fa4_compile_cache.py [--sweep default|full] [--from-json PATH]

Runs ``python -m vllm_mla_fixes.reproductions.fa4_compile_strides`` in a
child interpreter (``CUDA_VISIBLE_DEVICES=""``): vLLM's warm-up API compiles
the SM100 MLA prefill kernels (8 heads, d_qk 192, d_v 128) unpatched and
patched; each composition is planned by vLLM's ``_flash_attn_fwd`` and the
cached kernel called in a forked child.  ``--from-json`` prints the table of
a result the harness wrote before.  Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HARNESS = "vllm_mla_fixes.reproductions.fa4_compile_strides"


def run(sweep: str) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", HARNESS, "--sweep", sweep, "--json", out],
            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        if not os.path.exists(out):
            sys.exit(f"harness failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f), wall


def table(result: dict, wall: float | None) -> None:
    v = result["versions"]
    print(
        f"vLLM {v['vllm']}, nvidia-cutlass-dsl {v['nvidia-cutlass-dsl']}, quack-kernels "
        f"{v['quack-kernels']}, torch {v['torch']}; CPU ({os.cpu_count()} cores), "
        f"target sm_100a; warm-up compiles see a B200 ({result['compile_sms']} SMs), "
        f"compositions are planned by FA4's fake mode ({result['planning_sms']})"
    )
    print()
    print(
        "| phase | warm-up probe (q, k, mask, lse) | compile (s) | new kernels | cache entries after |"
    )
    print("|---|---|---|---|---|")
    for c in result["compiles"]:
        print(
            f"| {c['phase']} | {c['probe']} | {c['seconds']:.1f} | {c['new_kernels']} | {c['cache_entries']} |"
        )
    real = [c["seconds"] for c in result["compiles"] if c["new_kernels"]]
    if real:
        print(
            f"\ncompile per kernel: median {statistics.median(real):.1f} s, min {min(real):.1f} s, "
            f"max {max(real):.1f} s over {len(real)} kernels (the first includes CuTe-DSL start-up)"
        )
    print()
    print("| call | total_q | num_splits | outcome |")
    print("|---|---|---|---|")
    for c in result["calls"]:
        outcome = c["outcome"]
        if outcome == "argument-check-failed":
            outcome += (
                ": " + c["error"].split(" when calling")[0] + " ... " + c["error"].split("`, ")[-1]
            )
        print(f"| {c['phase']} | {c['total_q']} | {c['num_splits']} | {outcome} |")
    sweep = result.get("sweep")
    if sweep:
        print()
        print(
            "| sweep | compositions | pass argument checks | total_q | num_splits seen "
            "| cache before | cache after | new kernels | seconds |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print(
            f"| {sweep['kind']} | {sweep['size']} | {sweep['reached_launch']} | "
            f"{sweep['total_q_range'][0]}-{sweep['total_q_range'][1]} | "
            f"{', '.join(map(str, sweep['num_splits_seen']))} | {sweep['cache_entries_before']} | "
            f"{sweep['cache_entries_after']} | {sweep['new_kernels']} | {sweep['seconds']} |"
        )
    if wall is not None:
        print(f"\nwall time of the whole run: {wall:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("default", "full"), default="default")
    parser.add_argument("--from-json", help="print the table of a saved harness result")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            table(json.load(f), None)
        return
    table(*run(args.sweep))


if __name__ == "__main__":
    main()
