"""DeepSeek-V4.1 SM120 page geometry: the CPU correctness harness's figures.

For each geometry, the harness (``vllm_mla_fixes/selftest``) allocates the tiny
model's caches with vLLM's own code, writes random latents through vLLM's
Triton writers and slot mappings (``TRITON_INTERPRET=1``), decodes by reading
the pages as FlashInfer's SM120 kernel does, and compares with a dense
computation on the un-paged latents; a sentinel fill counts the bytes each
write changed outside its cache's own pages.

Geometries (see ``vllm_mla_fixes/selftest/layout.py``):

* ``plugin``              the fix's default geometry, the interleaved split
                          (128-token blocks; the ratio-1 compressed/indexer
                          pair in interleaved 64-state kernel pages; ratio-1
                          writers on kernel-block slots), produced by this
                          project's fix module;
* ``plugin-fallback``     the fix module with a KV connector configured: it
                          chooses its per-ratio fallback;
* ``per-ratio``           the fallback built directly from the spec classes;
* ``split-untranslated``  control: the fix's split with the slot translation
                          taken out (PR #56509's bug class).

Needs a vLLM 0.32.0 or 0.33.0 environment; about a minute per geometry on two cores.

    CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 python benchmarks/dsv41_harness_figures.py \
        [--geometry NAME ...] [--layout] > benchmarks/results/dsv41_harness_figures_<release>.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ("plugin", "plugin-fallback", "per-ratio", "split-untranslated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", action="append", choices=DEFAULT,
                        help="geometry to run (repeatable; default: all four)")
    parser.add_argument("--layout", action="store_true",
                        help="also print each geometry's cache layout")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from vllm_mla_fixes.selftest.env import prepare_process_env

    prepare_process_env()
    from vllm_mla_fixes.selftest.harness import figures_table, run_harness

    import vllm

    print(f"vLLM {vllm.__version__}")
    results = []
    for geometry in args.geometry or DEFAULT:
        result = run_harness(geometry)
        print(result.summary(), flush=True)
        if result.status:
            print(f"    fix status: {result.status}")
        mismatched = sum(result.slot_mismatches.values())
        print(f"    ratio-1 writer slots differing from ktable[req, pos // k] * k + pos % k: "
              f"{mismatched} of the writes' slots; page tiling problems: "
              f"{len(result.tiling_problems)}")
        if args.layout:
            print("\n".join(f"    {line}" for line in result.layout))
            if result.guard_error:
                print(f"    vLLM's own mapping refused the split: {result.guard_error}")
        results.append(result)
    print()
    print(figures_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
