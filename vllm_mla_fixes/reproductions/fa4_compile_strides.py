"""FA4 MLA prefill on vLLM 0.25.x, reproduced on CPU through vLLM's own code.

The reproduction of vLLM #49200 (``Mismatched mO.strides[0]``) and the
fix's proof: the report's kernel compiled by vLLM's warm-up and called
unpatched for a context chunk of total_q 129, 130 and 300; then the fix
applied through the plugin's ``run_fix``, recompiled and called again; then
a sweep of batch compositions, each planned by vLLM and called.  How FA4
runs on a machine without a GPU is :mod:`vllm_mla_fixes.reproductions.fa4_on_cpu`.

Run ``python -m vllm_mla_fixes.reproductions.fa4_compile_strides --help``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vllm_mla_fixes import atomic, children
from vllm_mla_fixes.reproductions.fa4_on_cpu import (
    B200_SMS,
    CONTEXT_TOKENS,
    NUM_HEADS,
    V_HEAD_DIM,
    WARMUP_LONG_K,
    Step,
    compile_warmup,
    expose_fa4_package,
    forward_cache,
    prepare,
    run_step,
)

UPSTREAM_SIGNATURE = (
    "`__call__(mQ: Tensor([n0, n1, n2], bfloat16), mK: Tensor([n3, n4, n5], bfloat16), "
    "mV: Tensor([n6, n7, n8], bfloat16), mO: Tensor([n9, n10, n11, n12], float32), "
    "mLSE: Tensor([n13, n14, n15], float32), softmax_scale: float32, "
    "mCuSeqlensQ: Tensor([n16], int32), mCuSeqlensK: Tensor([n17], int32), mSeqUsedQ: None, "
    "mSeqUsedK: None, mDynamicCausal: None, mPageTable: None, window_size_left: None, "
    "window_size_right: None, learnable_sink: None, descale_tensors: None, "
    "blocksparse_tensors: None, aux_tensors: None, output_scale: None)`"
)


def upstream_error(expected_stride: int) -> str:
    """The exact text of vLLM #49200's error for a kernel warmed up with a
    stride[0] of ``expected_stride``."""
    return (
        f"ValueError: Mismatched mO.strides[0] on argument #3 when calling: "
        f"{UPSTREAM_SIGNATURE}, expected to be {expected_stride}"
    )


REPORT_STRIDE = 129 * NUM_HEADS * V_HEAD_DIM  # 132096: the report's kernel's mO.strides[0]


def default_steps() -> list[Step]:
    """Batch compositions of a context chunk, for the four context-chunk
    kernels of vLLM's warm-up (q_stage 1/2 x Split-KV or not).  total_q
    crosses the q_stage line (128), the M-block lines (multiples of 256) and
    the points where num_splits changes, down to one split (b*m > 8 M-blocks
    per head at 132 SMs); contexts cross the 64-block line (8065 tokens)."""
    steps = [
        Step((q,), (WARMUP_LONG_K,))
        for q in (
            1,
            2,
            17,
            64,
            127,
            128,
            129,
            130,
            200,
            255,
            256,
            257,
            300,
            384,
            511,
            512,
            513,
            640,
            767,
            768,
            769,
            1000,
            1024,
            1025,
            1280,
            1536,
            1537,
            1792,
            2047,
            2048,
            2049,
            2304,
            2305,
            3000,
            4096,
            8192,
        )
    ]
    for ctx in (4096, 8064, 8065, 8128, 8200, 9000, 10239, 16384, 65536):
        steps += [Step((100,), (ctx,)), Step((300,), (ctx,))]
    # a long prompt's continuation batched with new prompts (no context yet)
    for q_lens in (
        (129, 1),
        (130, 17),
        (300, 64),
        (200, 56, 44),
        (64, 64),
        (1, 127),
        (128, 1),
        (256, 256),
        (500, 12),
        (33, 33, 33, 33),
        (700, 300),
        (129,) * 4,
        (129,) * 8,
        (129,) * 9,
        (1,) * 16,
        (2000, 1000),
    ):
        steps.append(Step(q_lens, (WARMUP_LONG_K,) + (0,) * (len(q_lens) - 1)))
    # several prompts with context in the same chunk (the workspace splits 64K tokens)
    for batch_lens, contexts in (
        ((130, 40), (8192, 4096)),
        ((1, 1), (8192, 8192)),
        ((300, 300), (9000, 8100)),
        ((64,) * 8, (8192,) * 8),
        ((64,) * 9, (7281,) * 9),
    ):
        steps.append(Step(batch_lens, contexts))
    return steps


def full_steps() -> list[Step]:
    """The CI sweep plus more of the same regimes, for a run that compiled the
    whole warm-up plan (causal and non-LSE kernels too)."""
    steps = default_steps()
    steps += [Step((q,), (WARMUP_LONG_K,)) for q in range(2, 8192, 97)]
    for n in (2, 3, 5, 6, 7, 12, 16):
        steps.append(Step((129,) * n, (WARMUP_LONG_K,) + (0,) * (n - 1)))
        steps.append(Step((64,) * n, (min(WARMUP_LONG_K, 65536 // n),) * n))
    for ctx in (20000, 32768):
        steps += [Step((1,), (ctx,)), Step((4000,), (ctx,))]
    return steps


# --------------------------------------------------------------------------
# The scenario: reproduce, fix, re-run, sweep


def apply_fix(env: types.SimpleNamespace) -> str:
    from vllm_mla_fixes.fixes import fa4_compile_strides
    from vllm_mla_fixes.patching import run_fix

    result = run_fix(fa4_compile_strides.FIX, env.vllm.__version__)
    return result.status.label() if result.status.state.value != "applied" else "applied"


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for dist in ("vllm", "nvidia-cutlass-dsl", "quack-kernels", "torch", "apache-tvm-ffi"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def scenario(
    reproduce: bool = True, sweep: str = "default", log: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """``reproduce``: compile the report's kernel unpatched and call it with
    total_q 129, 130 and 300.  Then apply the fix (through the plugin's
    ``run_fix``), recompile, and call 130 and 300 again.  ``sweep``:
    ``none``, ``default`` (both Split-KV context kernels) or ``full`` (the whole
    warm-up plan) -- plan and call every composition, counting new kernels."""
    env = prepare()
    result: dict[str, Any] = {
        "versions": versions(),
        "planning_sms": "132 SMs",
        "compile_sms": B200_SMS,
        "compiles": [],
        "calls": [],
        "sweep": None,
    }
    if reproduce:
        result["compiles"] += compile_warmup(env, "report", "unpatched")
        log(
            f"unpatched: compiled {result['compiles'][-1]['probe']} in "
            f"{result['compiles'][-1]['seconds']} s"
        )
        for q in (129, 130, 300):
            record = run_step(env, Step((q,), (CONTEXT_TOKENS,)), "unpatched")
            result["calls"].append(record)
            log(
                f"unpatched total_q={q}: {record['outcome']} {whole_words(record.get('error', ''), 160)}"
            )
    status = apply_fix(env)
    result["fix"] = status
    log(f"fix: {status}")
    if status != "applied":
        return result
    result["cache_entries_after_fix"] = len(forward_cache(env))
    if reproduce:
        result["compiles"] += compile_warmup(env, "report", "fixed")
        for q in (130, 300):
            record = run_step(env, Step((q,), (CONTEXT_TOKENS,)), "fixed")
            result["calls"].append(record)
            log(
                f"fixed total_q={q}: {record['outcome']} {whole_words(record.get('error', ''), 160)}"
            )
    if sweep != "none":
        result["compiles"] += compile_warmup(
            env, "context" if sweep == "default" else "all", "fixed"
        )
        steps = default_steps() if sweep == "default" else full_steps()
        before = len(forward_cache(env))
        start = time.perf_counter()
        records = [run_step(env, step, "sweep") for step in steps]
        after = len(forward_cache(env))
        result["sweep"] = {
            "kind": sweep,
            "size": len(steps),
            "reached_launch": sum(r["outcome"] == "reached-launch" for r in records),
            "cache_entries_before": before,
            "cache_entries_after": after,
            "new_kernels": after - before,
            "total_q_range": [min(s.total_q for s in steps), max(s.total_q for s in steps)],
            "num_splits_seen": sorted({r["num_splits"] for r in records}),
            "seconds": round(time.perf_counter() - start, 1),
            "failures": [r for r in records if r["outcome"] != "reached-launch"],
        }
        log(
            f"sweep: {result['sweep']['reached_launch']}/{len(steps)} reached launch, "
            f"new kernels {after - before}"
        )
    return result


def gate(cpu_package: bool = True) -> dict[str, Any]:
    """The fix's gate on this install, without compiling anything: the
    plugin's verdict, the probe's, and -- where the fix applies -- what it
    replaced and whether reverting restores vLLM."""
    from vllm_mla_fixes import installed_vllm_version
    from vllm_mla_fixes.fixes import fa4_compile_strides as fix
    from vllm_mla_fixes.patching import CannotProbe, TargetMismatch, run_fix

    version = installed_vllm_version()
    out: dict[str, Any] = {
        "vllm": version,
        "admitted": fix.INFO.admits(version or "0"),
        "bare_package": expose_fa4_package() if cpu_package else False,
    }
    result = run_fix(fix.FIX, version or "0")  # as the gate above reads a missing vLLM
    out["status"] = result.status.state.value
    out["status_reason"] = result.status.reason
    # what register() costs a process that never runs FA4 (API server, engine core)
    out["register_imported"] = {
        name: name in sys.modules for name in ("cutlass", fix.INTERFACE_MODULE)
    }

    def functional() -> dict[str, object]:
        try:
            reason = fix.functional_verdict()
        except (CannotProbe, TargetMismatch) as exc:
            return {"needed": None, "reason": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001
            return {"needed": None, "reason": f"probe failed: {type(exc).__name__}: {exc}"}
        return {"needed": reason is None, "reason": reason}

    # importing FA4's interface (as vLLM's worker does) fires an armed hook
    out["after_import"] = functional()
    out["deferred_outcome"] = fix.deferred_outcome()
    if result.patch is None or fix.deferred_outcome() != "patched":
        out["functional_probe"] = out["after_import"]
        return out
    utils = importlib.import_module(fix.UTILS_MODULE)
    interface = importlib.import_module(fix.INTERFACE_MODULE)
    cache = interface._flash_attn_fwd.compile_cache
    out["patched"] = {
        name: getattr(sys.modules[name].__dict__.get(fix.TARGET), fix.MARK, None) == fix.INFO.name
        for name in sorted(sys.modules)
        if name.startswith("vllm.") and fix.TARGET in getattr(sys.modules[name], "__dict__", {})
    }
    out["cache"] = {
        "type": type(cache).__name__,
        "entries": len(cache.cache),
        "path": str(getattr(cache, "cache_path", "")) or None,
    }
    result.patch.revert()
    restored = interface._flash_attn_fwd.compile_cache
    out["reverted"] = {
        "cache_restored": restored is not cache,
        "target_restored": getattr(utils.to_cute_tensor, fix.MARK, None) is None
        and interface.to_cute_tensor is utils.to_cute_tensor,
    }
    out["functional_probe"] = functional()  # on the installed, unpatched code
    return out


def _child(args: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run this module in a fresh interpreter; its JSON result, or why none."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        watch = ("--watch-parent", str(os.getpid()))
        try:
            proc = children.run(
                [sys.executable, "-W", "ignore", "-m", __name__, *args, *watch, "--json", out],
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return None, f"no result within {timeout:.0f} s"
        if not os.path.exists(out):
            return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"
        with open(out, encoding="utf-8") as f:
            return json.load(f), ""


def verify(report: Callable[[str], None]) -> bool:
    """``vllm-mla-fixes verify``: check FA4 on this install; where it has the
    bug, reproduce the upstream error on CPU through vLLM's warm-up kernel,
    then show the fix removes it (a child interpreter, 5 CuTe compiles: about
    1.5-2 min on 2 cores)."""
    gate_result, why = _child(["--gate"], timeout=900)
    if gate_result is None:
        report(f"could not inspect vLLM's FA4 here: {why}")
        return False
    probe = gate_result["functional_probe"]
    if probe["needed"] is False:
        report(f"vLLM {gate_result['vllm']}: FA4 does not have this bug: {probe['reason']}")
        return True
    if probe["needed"] is None:
        report(f"vLLM {gate_result['vllm']}: cannot check FA4 here: {probe['reason']}")
        return False
    report(
        "FA4 freezes compile-only strides here; compiling vLLM's FA4 warm-up kernels for an "
        "SM100 target on CPU (8 heads, d_qk 192, d_v 128; ~15 s per kernel)"
    )
    result, why = _child(["--sweep", "default"], timeout=3600)
    if result is None:
        report(f"the CPU reproduction failed: {why}")
        return False
    return summarize(result, report)


def whole_words(text: str, limit: int) -> str:
    """``text``, or its words up to ``limit`` characters and an ellipsis: a
    report line never ends in a cut word."""
    if len(text) <= limit:
        return text
    return text[: limit + 1].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


def summarize(result: dict[str, Any], report: Callable[[str], None]) -> bool:
    """Report lines for a scenario result; whether it shows bug then fix."""
    calls = {(c["phase"], c["total_q"]): c for c in result["calls"]}
    for c in result["compiles"]:
        if c["phase"] == "unpatched":
            report(f"warm-up compile {c['probe']} (unpatched): {c['seconds']} s")
    reproduced = True
    for q in (130, 300):
        c = calls.get(("unpatched", q), {})
        report(f"upstream total_q={q}: {c.get('error') or c.get('outcome')}")
        reproduced &= c.get("error") == upstream_error(REPORT_STRIDE)
    warm_ok = calls.get(("unpatched", 129), {}).get("outcome") == "reached-launch"
    report(
        f"upstream total_q=129 (the warm-up shape): {calls.get(('unpatched', 129), {}).get('outcome')}"
    )
    if result.get("fix") != "applied":
        report(f"fix not applied: {result.get('fix')}")
        return False
    fixed = True
    for q in (130, 300):
        c = calls.get(("fixed", q), {})
        detail = (
            "every argument check passed; the launch then fails for want of a GPU: "
            if c.get("outcome") == "reached-launch"
            else ""
        )
        report(
            f"fixed    total_q={q}: {c.get('outcome')} ({detail}{whole_words(c.get('error', ''), 90)})"
        )
        fixed &= c.get("outcome") == "reached-launch"
    sweep = result.get("sweep")
    if sweep:
        report(
            f"sweep: {sweep['reached_launch']}/{sweep['size']} compositions pass the argument "
            f"checks (total_q {sweep['total_q_range'][0]}-{sweep['total_q_range'][1]}, "
            f"num_splits {sweep['num_splits_seen']}); compile cache {sweep['cache_entries_before']} "
            f"-> {sweep['cache_entries_after']} entries"
        )
        fixed &= sweep["reached_launch"] == sweep["size"] and sweep["new_kernels"] == 0
    return reproduced and warm_ok and fixed


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("none", "default", "full"), default="default")
    parser.add_argument(
        "--no-reproduce", action="store_true", help="skip the unpatched compile and calls"
    )
    parser.add_argument(
        "--gate",
        action="store_true",
        help="only evaluate the fix's gate, apply and revert it (no compiling)",
    )
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--watch-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.watch_parent is not None:  # started by verify: ends with it
        children.watch_parent(args.watch_parent)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.gate:
        result = gate()
        text = json.dumps(result, indent=1, default=str)
        print(text)
        if args.json:
            atomic.write_atomic(Path(args.json), text)
        return 0
    result = scenario(
        reproduce=not args.no_reproduce, sweep=args.sweep, log=lambda line: print(line, flush=True)
    )
    if args.json:
        atomic.write_atomic(Path(args.json), json.dumps(result, indent=1, default=str))
    ok = summarize(result, lambda line: print(line, flush=True)) if not args.no_reproduce else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
