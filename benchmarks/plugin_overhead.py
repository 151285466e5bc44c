"""What this plugin costs each vLLM process: CPU time of vLLM's own
``load_general_plugins()``, fixes on against ``VLLM_MLA_FIXES=none``, side by
side in fresh interpreters, on the installed vLLM.

    python benchmarks/plugin_overhead.py [--runs 7] [--out FILE]

Every vLLM process (API server, engine core, each worker) calls
``load_general_plugins()`` once; what it costs is measured in-process with
``time.process_time()`` around that call, after ``import vllm`` (which every
process pays anyway).  Cases, alternated run by run so that machine load
affects them alike:

* ``on``: VLLM_MLA_FIXES unset, as operators run it;
* ``none``: VLLM_MLA_FIXES=none -- the plugin loads and decides nothing;
* ``absent``: VLLM_PLUGINS names vLLM's own plugins only, so this package is
  never imported.

"on - none" is the cost of the fixes' decisions (the goal: <= 50 ms);
"on - absent" adds importing this package.  A final profiled run of ``on``
says where the remaining time goes: the plugin's functions by cumulative CPU
time, and the modules it imports that ``none`` does not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN = r"""
import cProfile, io, json, pstats, sys, time
import vllm, vllm.plugins
before = set(sys.modules)
profile = cProfile.Profile() if sys.argv[1] == "profile" else None
cpu = time.process_time()
if profile: profile.enable()
vllm.plugins.load_general_plugins()
if profile: profile.disable()
cpu = time.process_time() - cpu
result = {"cpu": cpu, "new_modules": sorted(set(sys.modules) - before)}
try:
    import vllm_mla_fixes
    result["states"] = {s.name: s.state.value for s in vllm_mla_fixes.status()}
except ImportError:
    result["states"] = {}
if profile:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats("vllm_mla_fixes|importlib._bootstrap>.:1165", 25)
    result["profile"] = text.getvalue()
print("RESULT=" + json.dumps(result))
"""

CASES = {
    "on": {},
    "none": {"VLLM_MLA_FIXES": "none"},
    "absent": {"VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver"},
}


def one_run(case: str, mode: str = "time") -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES", "PYTHONDONTWRITEBYTECODE")}
    env.update(CUDA_VISIBLE_DEVICES="", **CASES[case])
    proc = subprocess.run([sys.executable, "-c", RUN, mode], env=env, capture_output=True,
                          text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT=")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"the {case} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT="):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    for case in CASES:  # write bytecode caches, as any installed environment has them
        one_run(case)
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for _ in range(args.runs):
        for case in CASES:
            runs[case].append(one_run(case))
    cpu_ms = {case: [1000 * r["cpu"] for r in rs] for case, rs in runs.items()}
    median = {case: statistics.median(v) for case, v in cpu_ms.items()}
    profiled = one_run("on", "profile")

    from importlib.metadata import version

    lines = [f"vLLM {version('vllm')}, Python {sys.version.split()[0]}, no GPU visible; "
             f"CPU time of load_general_plugins(), {args.runs} fresh interpreters per case",
             "| case | median (ms) | min (ms) | max (ms) | modules imported |",
             "|---|---|---|---|---|"]
    for case in CASES:
        lines.append(f"| {case} | {median[case]:.1f} | {min(cpu_ms[case]):.1f} | "
                     f"{max(cpu_ms[case]):.1f} | {len(runs[case][-1]['new_modules'])} |")
    lines += ["",
              f"fixes on - VLLM_MLA_FIXES=none: {median['on'] - median['none']:+.1f} ms (goal <= 50 ms)",
              f"fixes on - plugin absent:       {median['on'] - median['absent']:+.1f} ms",
              "fix states (on): " + ", ".join(f"{k}={v}" for k, v in runs["on"][-1]["states"].items()),
              "modules imported with fixes on but not with none: "
              + (", ".join(sorted(set(runs["on"][-1]["new_modules"])
                                  - set(runs["none"][-1]["new_modules"]))) or "none"),
              "", "where the time goes (one profiled run with fixes on; cumulative, profiler "
              f"overhead included: {1000 * profiled['cpu']:.1f} ms):",
              profiled["profile"].strip()]
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)


if __name__ == "__main__":
    main()
