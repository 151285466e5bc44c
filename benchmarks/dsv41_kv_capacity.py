"""KV-cache capacity of DeepSeek-V4.1-Flash's SM120 geometries against upstream --block-size 128.

Runs on CPU in a vLLM 0.32.0 or 0.33.0 environment.  Every geometry comes from
vLLM's own planner (``get_kv_cache_groups`` + ``get_kv_cache_config_from_groups``
for 1 GiB per rank), and the tokens are vLLM's own start-up figure
(``get_kv_cache_capacity``: "GPU KV cache size: N tokens" = concurrency at
``max_model_len`` x ``max_model_len``).  Per TP rank; the layout is the
dossier's 40-layer DeepSeek-V4.1-Flash (ratios [0,0]+[2]*18+[1]*20).

Rows: upstream ``--block-size 128`` (does not run on SM120: the baseline),
the fix's default geometry (interleaved split) and its fallback (per-ratio,
chosen with speculative decoding, a KV connector, ...; forced here with
``VLLM_MLA_FIXES_DSV41_GEOMETRY=per-ratio``).

    CUDA_VISIBLE_DEVICES= python benchmarks/dsv41_kv_capacity.py \
        > benchmarks/results/dsv41_kv_capacity_<release>.txt
"""

from __future__ import annotations

import argparse
import contextlib
import os

GEOMETRIES = (
    ("upstream --block-size 128 (SWA 32, one packed 128 group)", None),
    (
        "fixed, default: interleaved split (128-token blocks, ratio-1 64-state kernel pages "
        "interleaved, SWA 64)",
        "interleaved-split",
    ),
    ("fixed, fallback: per-ratio (ratio-1 64, ratio-2 128, SWA 64)", "per-ratio"),
)


@contextlib.contextmanager
def geometry(name: str | None):
    """Upstream (None), or the fix applied as on SM120 with ``name`` in force."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

    if name is None:
        yield
        return
    saved = os.environ.get(fix.GEOMETRY_ENV)
    os.environ[fix.GEOMETRY_ENV] = name
    try:
        with repro.applied((12, 0)) as result:
            if result.status.state.value != "applied":
                raise SystemExit(f"the fix did not apply: {result.status.label()}")
            yield
            decided = fix.status_detail()
            if f"geometry {name} " not in decided:
                raise SystemExit(f"asked for {name}, the fix chose: {decided}")
    finally:
        if saved is None:
            os.environ.pop(fix.GEOMETRY_ENV, None)
        else:
            os.environ[fix.GEOMETRY_ENV] = saved


def context_bytes_per_token(block_size: int) -> float:
    """Bytes a long request pays per context token in the groups that grow
    with it (everything but the sliding-window and ring groups): each block of
    the shared pool costs the pool's block stride, whichever group holds it."""
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

    plan = repro.plan_geometry(block_size, num_gpu_blocks_override=None)
    stride = plan.kv_cache_config.kv_cache_tensors[0].block_stride
    total = 0.0
    for group in plan.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        first = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        if not isinstance(first, (SlidingWindowSpec, CircularBufferSpec)):
            total += stride / spec.block_size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 131072])
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    import vllm

    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

    rows = []
    for label, name in GEOMETRIES:
        with geometry(name):
            per_token = context_bytes_per_token(128)
            for max_model_len in args.max_model_len:
                rows.append((label, max_model_len, repro.capacity(128, max_model_len), per_token))

    print(
        f"vLLM {vllm.__version__}, FlashInfer {repro.flashinfer_version()}: "
        "DeepSeek-V4.1-Flash KV capacity per GiB per rank (fp8_ds_mla, 584 B records)"
    )
    header = (
        "| geometry | max_model_len | groups | block stride (B) | blocks/GiB | "
        "tokens/GiB (vLLM) | concurrency | context B/token | vs upstream |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    baseline = {
        max_model_len: figures["tokens"]
        for label, max_model_len, figures, _ in rows
        if label.startswith("upstream")
    }
    for label, max_model_len, figures, per_token in rows:
        print(
            f"| {label} | {max_model_len} | {figures['groups']} | {figures['bytes_per_block']} | "
            f"{figures['num_blocks']} | {figures['tokens']:,} | {figures['concurrency']:.2f} | "
            f"{per_token:.0f} | {figures['tokens'] / baseline[max_model_len]:.3f}x |"
        )


if __name__ == "__main__":
    main()
