"""KV-cache capacity of DeepSeek-V4.1-Flash's SM120 geometries against upstream.

Runs on CPU in a vLLM 0.32.0, 0.33.0 or 0.34.0 environment.  The figures come
from vLLM's own planner and start-up token figure, per GiB per TP rank, for the
dossier's 40-layer DeepSeek-V4.1-Flash layout; the computation lives in
``vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions.capacity`` (``doctor`` quotes it too).

Rows: upstream ``--block-size 128`` and ``--block-size 64``; the fix's default geometry (interleaved split) and its
fallback (per-ratio, forced with ``VLLM_MLA_FIXES_DSV41_GEOMETRY=per-ratio``);
and the geometry the fix's own decision chooses for a serve line with a DSpark
``--speculative-config``, compared with upstream's layouts of the same model
with DSpark's drafter layers.  The last column holds each row against the
best upstream layout that works (starts, and every page inside the installed
kernels' own envelopes), ``n/a`` where none does.

    CUDA_VISIBLE_DEVICES= python benchmarks/dsv41_kv_capacity.py \
        > benchmarks/results/dsv41_kv_capacity_<release>.txt
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 131072])
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    import vllm

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import simulated
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import truth_table as table

    lens = tuple(args.max_model_len)
    rows = capacity.benchmark_rows(lens)
    # The kernel blocks vLLM's backends declare depend on the device.
    with simulated.sm120_platform():
        best = {
            count: table.best_working_upstream(
                (12, 0), simulated.EngineSettings(drafter_ratios=(0,) * count), lens
            )
            for count in sorted({row.drafter_layers for row in rows})
        }
    print(
        f"vLLM {vllm.__version__}, FlashInfer {repro.flashinfer_version()}: "
        "DeepSeek-V4.1-Flash KV capacity per GiB per rank (fp8_ds_mla, 584 B records)"
    )
    header = (
        "| geometry | max_model_len | groups | block stride (B) | blocks/GiB | "
        "tokens/GiB (vLLM) | concurrency | context B/token | vs upstream 128 | vs upstream 64 | "
        "vs best working upstream |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for row in rows:
        vs128 = row.versus(capacity.baseline(rows, row.max_model_len, 128, row.drafter_layers))
        vs64 = row.versus(capacity.baseline(rows, row.max_model_len, 64, row.drafter_layers))
        print(
            f"| {row.label} | {row.max_model_len} | {row.groups} | {row.block_stride} | "
            f"{row.num_blocks} | {row.tokens:,} | {row.concurrency:.2f} | "
            f"{row.context_bytes_per_token:.0f} | {vs128:.3f}x | {vs64:.3f}x | "
            f"{_versus_best(row, best[row.drafter_layers])} |"
        )
    print()
    print("Geometry the fix chose for each fixed row (its geometry_decision on the row's config):")
    for row in rows:
        if row.label.startswith("fixed") and row.max_model_len == rows[0].max_model_len:
            print(f"- {row.label.split(' (')[0]}: {row.geometry} ({row.reason})")


def _versus_best(row, best: tuple[int, dict[int, int]] | None) -> str:
    """The row against the best upstream layout that starts and whose every
    page the installed kernels' envelopes take (``n/a`` where none does);
    upstream's own rows show their own figure."""
    if best is None:
        return "n/a"
    return f"{row.tokens / best[1][row.max_model_len]:.3f}x"


if __name__ == "__main__":
    main()
