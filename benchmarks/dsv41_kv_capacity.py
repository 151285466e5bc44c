"""KV-cache capacity of DeepSeek-V4.1-Flash's SM120 geometry: fixed vs upstream --block-size 128.

Runs on CPU in a vLLM 0.32.0 or 0.33.0 environment.  Both geometries come from
vLLM's own planner (``get_kv_cache_groups`` + ``get_kv_cache_config_from_groups``
for 1 GiB per rank), and the tokens are vLLM's own start-up figure
(``get_kv_cache_capacity``: "GPU KV cache size: N tokens" = concurrency at
``max_model_len`` x ``max_model_len``).  Per TP rank; the layout is the
dossier's 40-layer DeepSeek-V4.1-Flash (ratios [0,0]+[2]*18+[1]*20).

    CUDA_VISIBLE_DEVICES= python benchmarks/dsv41_kv_capacity.py
"""
from __future__ import annotations

import argparse
import os


def context_bytes_per_token(block_size: int, fixed: bool) -> float:
    """Bytes a long request pays per context token in the groups that grow
    with it (everything but the sliding-window and ring groups): each block of
    the shared pool costs the pool's block stride, whichever group holds it."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

    def measure():
        geometry = repro.plan_geometry(block_size, num_gpu_blocks_override=None)
        stride = geometry.kv_cache_config.kv_cache_tensors[0].block_stride
        total = 0.0
        for group in geometry.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            first = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            if not isinstance(first, (SlidingWindowSpec, CircularBufferSpec)):
                total += stride / spec.block_size
        return total

    if not fixed:
        return measure()
    with repro.applied((12, 0)):
        return measure()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 131072])
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    import vllm

    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

    rows = []
    for label, fixed in (("upstream --block-size 128 (SWA 32, one packed 128 group)", False),
                         ("fixed: ratio-1 64, ratio-2 128, SWA 64", True)):
        for max_model_len in args.max_model_len:
            if fixed:
                with repro.applied((12, 0)):
                    figures = repro.capacity(128, max_model_len)
            else:
                figures = repro.capacity(128, max_model_len)
            rows.append((label, max_model_len, figures, context_bytes_per_token(128, fixed)))

    print(f"vLLM {vllm.__version__}, FlashInfer {repro.flashinfer_version()}: "
          "DeepSeek-V4.1-Flash KV capacity per GiB per rank (fp8_ds_mla, 584 B records)")
    header = ("| geometry | max_model_len | groups | block stride (B) | blocks/GiB | "
              "tokens/GiB (vLLM) | concurrency | context B/token | vs upstream |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    baseline = {max_model_len: figures["tokens"] for label, max_model_len, figures, _ in rows
                if label.startswith("upstream")}
    for label, max_model_len, figures, per_token in rows:
        print(f"| {label} | {max_model_len} | {figures['groups']} | {figures['bytes_per_block']} | "
              f"{figures['num_blocks']} | {figures['tokens']:,} | {figures['concurrency']:.2f} | "
              f"{per_token:.0f} | {figures['tokens'] / baseline[max_model_len]:.2f}x |")


if __name__ == "__main__":
    main()
