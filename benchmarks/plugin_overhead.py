"""Plugin load overhead: ``import vllm`` + ``load_general_plugins()`` with and
without this plugin, each in a fresh interpreter, on the installed vLLM.

    python benchmarks/plugin_overhead.py [--repeats 3]

Prints a table; the ratio is (with plugin) / (without plugin).  "without"
sets VLLM_PLUGINS to vLLM's own LoRA resolver plugins only, so vLLM's loader
still runs; "with" leaves VLLM_PLUGINS unset, as operators do.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, time
t0 = time.perf_counter()
import vllm, vllm.plugins
t1 = time.perf_counter()
vllm.plugins.load_general_plugins()
t2 = time.perf_counter()
import vllm_mla_fixes
states = {s.name: s.label() for s in vllm_mla_fixes.status()}
print("RESULT=" + json.dumps({"import": t1 - t0, "plugins": t2 - t1, "states": states}))
"""


def one_run(with_plugin: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if not with_plugin:
        env["VLLM_PLUGINS"] = "lora_filesystem_resolver,lora_hf_hub_resolver"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT="))[7:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    one_run(True)  # warm the bytecode caches
    rows = {}
    for label, with_plugin in (("without plugin", False), ("with plugin", True)):
        runs = [one_run(with_plugin) for _ in range(args.repeats)]
        rows[label] = (statistics.median(r["import"] + r["plugins"] for r in runs),
                       statistics.median(r["plugins"] for r in runs), runs[-1]["states"])
    from importlib.metadata import version

    print(f"vLLM {version('vllm')}, median of {args.repeats} fresh interpreters, CPU")
    print("| case | import vllm + load_general_plugins (s) | load_general_plugins alone (s) |")
    print("|---|---|---|")
    for label, (total, plugins, _) in rows.items():
        print(f"| {label} | {total:.2f} | {plugins:.3f} |")
    base, with_ = rows["without plugin"][0], rows["with plugin"][0]
    print(f"\nratio with/without: {with_ / base:.3f}  (register() adds {with_ - base:+.2f} s)")
    print("fix states with plugin: " + ", ".join(f"{k}={v}" for k, v in rows["with plugin"][2].items()))


if __name__ == "__main__":
    main()
