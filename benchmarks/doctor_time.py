"""doctor's wall time on a DeepSeek-V4.1 line against a bare import of vLLM and
against vLLM's own check of the same line, side by side in one run (A B C A B C
..., median of N rounds, after a warm-up round).

doctor imports vLLM once and takes the DeepSeek-V4.1 decision in its own
process.  Its time over ``import vllm, vllm.config`` is vLLM's own work on the
line (the ``vllm serve`` parser, ``create_engine_config`` with the model's class
and tokenizer) plus doctor's (the kernel envelopes, the decision, the report).
The third command is vLLM's part alone, as ``vllm serve`` runs it before it
starts the engine (vLLM's code only, no vllm-mla-fixes): the floor for any
doctor that checks the line with vLLM's own code.

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
# What `vllm serve ARGS` runs before it starts the engine, with vLLM's code
# alone: its CLI parser, then the engine config.  Without a GPU vLLM's platform
# has no device type, so it is set to cuda as on the node the line is for.
VLLM_SERVE_CHECK = """
import sys
import vllm.platforms
vllm.platforms.current_platform.device_type = "cuda"
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args(["serve", *sys.argv[1:]])
args.model = args.model_tag or args.model
AsyncEngineArgs.from_cli_args(args).create_engine_config()
"""


def _wall(command: list[str], **env_vars: str) -> float:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", **env_vars}
    start = time.perf_counter()
    subprocess.run(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=1800,
        check=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import vllm

    doctor = [sys.executable, "-m", "vllm_mla_fixes", "doctor", "--json", "--", *LINE]
    bare = [sys.executable, "-c", "import vllm, vllm.config"]
    vllms_own = [sys.executable, "-c", VLLM_SERVE_CHECK, *LINE[2:]]
    # VLLM_PLUGINS empty: vLLM loads no general plugin, so not this package's.
    commands = (
        ("doctor --json", doctor, {}),
        ("import vllm, vllm.config", bare, {}),
        ("vLLM's own serve parser + create_engine_config", vllms_own, {"VLLM_PLUGINS": ""}),
    )
    for _, command, env_vars in commands:  # warm-up: file caches
        _wall(command, **env_vars)
    rounds = [
        [_wall(command, **env_vars) for _, command, env_vars in commands]
        for _ in range(args.rounds)
    ]
    print(f"vLLM {vllm.__version__}: doctor on the tiny DeepSeek-V4.1 line vs `import vllm`")
    print("| command | median wall (s) | min | max |")
    print("|---|---|---|---|")
    for column, (name, _, _) in enumerate(commands):
        values = [row[column] for row in rounds]
        print(
            f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |"
        )
    for column, versus in ((1, "import"), (2, "vLLM's own check")):
        ratios = [row[0] / row[column] for row in rounds]
        print(
            f"ratio doctor / {versus}, round by round: median {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x), {args.rounds} rounds"
        )
    floor = [row[2] / row[1] for row in rounds]
    print(f"ratio vLLM's own check / import: median {statistics.median(floor):.2f}x")


if __name__ == "__main__":
    main()
