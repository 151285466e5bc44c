"""doctor's wall time on a DeepSeek-V4.1 line against a bare import of vLLM,
side by side in one run (A B A B ..., median of N pairs, after a warm-up pair).

doctor imports vLLM once and takes the DeepSeek-V4.1 decision in its own
process, so the gap over ``import vllm, vllm.config`` is its own work: vLLM's
serve parser and engine config, the kernel envelopes, the decision.

    CUDA_VISIBLE_DEVICES= python benchmarks/doctor_time.py \\
        > benchmarks/results/doctor_time_<vLLM release>.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parent.parent / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
LINE = ["vllm", "serve", str(MODEL), "--kv-cache-dtype", "fp8", "--block-size", "128"]


def _wall(command: list[str]) -> float:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    import vllm

    doctor = [sys.executable, "-m", "vllm_mla_fixes", "doctor", "--json", "--", *LINE]
    bare = [sys.executable, "-c", "import vllm, vllm.config"]
    _wall(doctor), _wall(bare)  # warm-up: file caches
    pairs = [(_wall(doctor), _wall(bare)) for _ in range(args.pairs)]
    ratios = [a / b for a, b in pairs]
    print(f"vLLM {vllm.__version__}: doctor on the tiny DeepSeek-V4.1 line vs `import vllm`")
    print("| command | median wall (s) | min | max |")
    print("|---|---|---|---|")
    for name, values in (
        ("doctor --json", [a for a, _ in pairs]),
        ("import vllm, vllm.config", [b for _, b in pairs]),
    ):
        print(
            f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |"
        )
    print(
        f"ratio doctor / import, pair by pair: median {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x), {args.pairs} pairs"
    )


if __name__ == "__main__":
    main()
