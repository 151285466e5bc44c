"""What this plugin costs each vLLM process: CPU time of vLLM's own
``load_general_plugins()``, fixes on against ``VLLM_MLA_FIXES=none``, side by
side in fresh interpreters, on the installed vLLM.

    python benchmarks/plugin_overhead.py [--runs 7] [--out FILE]

Every vLLM process (API server, engine core, each worker) calls
``load_general_plugins()`` once; what it costs is measured in-process with
``time.process_time()`` around that call, after ``import vllm`` (which every
process pays anyway).  Cases, alternated run by run so that machine load
affects them alike:

* ``on``: VLLM_MLA_FIXES unset, as operators run it; the fixes' source
  screens come from the cache the first process wrote (``screen_cache``), as
  in every vLLM process after the first one on a machine;
* ``on, cold cache``: the same with an empty screen cache, as the very first
  process after installing or upgrading vLLM or this package;
* ``none``: VLLM_MLA_FIXES=none -- the plugin loads and decides nothing;
* ``absent``: VLLM_PLUGINS names vLLM's own plugins only, so this package is
  never imported;
* ``on``/``none, KV-cache module loaded``: both with ``vllm.v1.kv_cache_interface``
  imported before the timed call, as it is in vLLM's processes.

"on - none" is the cost of the fixes' decisions (the goal: <= 50 ms);
"on - absent" adds importing this package.  A final profiled run of ``on`` and
of ``on, cold cache`` says where the remaining time goes: the plugin's functions by cumulative CPU
time, and the modules it imports that ``none`` does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

RUN = r"""
import cProfile, importlib, io, json, os, pstats, sys, time
import vllm, vllm.plugins
for name in filter(None, os.environ.get("BENCH_PREIMPORT", "").split(",")):
    importlib.import_module(name)
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
    stats.sort_stats("cumulative").print_stats("vllm_mla_fixes", 20)
    result["profile"] = text.getvalue()
print("RESULT=" + json.dumps(result))
"""

# The DeepSeek-V4.1 fix screens vLLM's sources only on SM12x; no GPU here, so its
# probe is timed in-process with the capability given (as the CPU tests do).
SM120_PROBE = r"""
import json, sys, time
import vllm, vllm.plugins
from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
if not fix.INFO.admits(vllm.__version__):
    print("RESULT=null"); sys.exit()
cpu = time.process_time()
verdict = fix.probe((12, 0))
print("RESULT=" + json.dumps({"cpu": time.process_time() - cpu, "verdict": verdict}))
"""

CASES = {
    "on": {},
    "on, cold cache": {},  # a fresh cache folder per run, below
    "none": {"VLLM_MLA_FIXES": "none"},
    "absent": {"VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver"},
    # As in a real `vllm serve`: the API server, engine core and workers have
    # imported vLLM's KV-cache interface (the one vLLM module the fp8 probe
    # imports) before they load plugins.
    "on, KV-cache module loaded": {"BENCH_PREIMPORT": "vllm.v1.kv_cache_interface"},
    "none, KV-cache module loaded": {
        "BENCH_PREIMPORT": "vllm.v1.kv_cache_interface",
        "VLLM_MLA_FIXES": "none",
    },
}


SCREENS = tempfile.mkdtemp(prefix="plugin-overhead-screens-")


def sm120_probe_ms(cache: str) -> float | None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(CUDA_VISIBLE_DEVICES="", VLLM_MLA_FIXES_CACHE_DIR=cache)
    out = subprocess.run(
        [sys.executable, "-c", SM120_PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    result = json.loads(
        next(ln for ln in out.splitlines() if ln.startswith("RESULT="))[len("RESULT=") :]
    )
    return None if result is None else 1000 * result["cpu"]


def one_run(case: str, mode: str = "time") -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES", "PYTHONDONTWRITEBYTECODE", "BENCH_PREIMPORT")
    }
    cache = (
        tempfile.mkdtemp(dir=SCREENS) if case == "on, cold cache" else os.path.join(SCREENS, "warm")
    )
    env.update(CUDA_VISIBLE_DEVICES="", VLLM_MLA_FIXES_CACHE_DIR=cache, **CASES[case])
    proc = subprocess.run(
        [sys.executable, "-c", RUN, mode], env=env, capture_output=True, text=True
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"the {case} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT=") :])


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
    profiled = {case: one_run(case, "profile") for case in ("on", "on, cold cache")}

    from importlib.metadata import version

    lines = [
        f"vLLM {version('vllm')}, Python {sys.version.split()[0]}, no GPU visible; "
        f"CPU time of load_general_plugins(), {args.runs} fresh interpreters per case",
        "| case | median (ms) | min (ms) | max (ms) | modules imported |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        lines.append(
            f"| {case} | {median[case]:.1f} | {min(cpu_ms[case]):.1f} | "
            f"{max(cpu_ms[case]):.1f} | {len(runs[case][-1]['new_modules'])} |"
        )
    lines += [
        "",
        f"fixes on - VLLM_MLA_FIXES=none: {median['on'] - median['none']:+.1f} ms (goal <= 50 ms)",
        f"cold cache - VLLM_MLA_FIXES=none: {median['on, cold cache'] - median['none']:+.1f} ms "
        "(first process after an install or upgrade)",
        f"fixes on - plugin absent:       {median['on'] - median['absent']:+.1f} ms",
        "with vllm.v1.kv_cache_interface already imported, on - none: "
        f"{median['on, KV-cache module loaded'] - median['none, KV-cache module loaded']:+.1f} ms",
        "fix states (on): " + ", ".join(f"{k}={v}" for k, v in runs["on"][-1]["states"].items()),
        "modules imported with fixes on but not with none: "
        + (
            ", ".join(
                sorted(set(runs["on"][-1]["new_modules"]) - set(runs["none"][-1]["new_modules"]))
            )
            or "none"
        ),
    ]
    warm = os.path.join(SCREENS, "sm120")
    cold_probe = [sm120_probe_ms(tempfile.mkdtemp(dir=SCREENS)) for _ in range(3)]
    if None not in cold_probe:
        sm120_probe_ms(warm)
        warm_probe = [sm120_probe_ms(warm) for _ in range(3)]
        lines += [
            "",
            "dsv41-sm120-geometry probe as on SM12x (in-process, capability (12, 0); median of 3 "
            f"fresh interpreters): cold cache {statistics.median(cold_probe):.1f} ms, "
            f"cached {statistics.median(warm_probe):.1f} ms",
        ]
    for case, result in profiled.items():
        lines += [
            "",
            f"where the time goes, {case} (one profiled run; cumulative, profiler overhead "
            f"included: {1000 * result['cpu']:.1f} ms):",
            result["profile"].strip(),
        ]
    shutil.rmtree(SCREENS, ignore_errors=True)
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)


if __name__ == "__main__":
    main()
