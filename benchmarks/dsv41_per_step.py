"""Per-step cost of dsv41-sm120-geometry's default geometry (CPU, vLLM 0.32-0.34).

The interleaved split adds one thing to every forward step: each of the two
ratio-1 attention groups (compressed KV, indexer K) turns the step's manager
slots into kernel-block slots (``kernel_slots``: three elementwise ops into
persistent buffers).  Upstream's ``--block-size 128`` layout does no such
work; for scale, the table also times vLLM's own per-step
``map_to_kernel_block_table`` on the same group (what vLLM runs every step
for any group whose kernel block is smaller than its manager block).  Both run
on the real split group that vLLM's planner builds for the tiny DeepSeek-V4.1
model, at a decode batch (64 tokens) and a prefill chunk (8,192 tokens).

    CUDA_VISIBLE_DEVICES= python benchmarks/dsv41_per_step.py \
        > benchmarks/results/dsv41_per_step_<release>.txt
"""

from __future__ import annotations

import os
import timeit

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


class _Builder:  # what kernel_slots reads of a metadata builder (real ones need a GPU)
    def __init__(self, vllm_config, device):
        self.vllm_config, self.device = vllm_config, device


def main() -> None:
    import torch
    import vllm

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import kernel_slots

    torch.set_num_threads(1)
    with repro.applied((12, 0)):
        geometry = repro.plan_geometry(128)
        repro.select_kernel_block_sizes(geometry)
        repro.allocate_and_bind(geometry)
        geometry.vllm_config.scheduler_config.max_num_batched_tokens = 8192
        group = next(
            g
            for gs in geometry.attn_groups
            for g in gs
            if g.layer_names == ["model.layers.20.attn"]
        )
        group.metadata_builders = [_Builder(geometry.vllm_config, repro.CPU)]
        requests, blocks_per_request = 64, 64
        table = torch.randint(0, 1000, (requests, blocks_per_request), dtype=torch.int32)
        # vLLM's persistent kernel block table, as its model runner sizes it (the real one is on the GPU).
        group.kernel_block_table = torch.zeros(
            1, requests, 2 * blocks_per_request, dtype=torch.int32
        )
        group.kernel_block_offsets = torch.arange(2, dtype=torch.int32)
        rounds, calls = 15, 500
        print(
            f"vLLM {vllm.__version__}, torch {torch.__version__}, CPU, 1 thread; best of {rounds} "
            f"interleaved rounds x {calls} calls"
        )
        print(
            "| tokens in the step | kernel_slots, one group (us) | two ratio-1 groups per step (us) "
            "| vLLM's map_to_kernel_block_table, one group (us) |"
        )
        print("|---|---|---|---|")
        for tokens in (64, 8192):
            slots = torch.randint(0, 1000 * 128, (tokens,), dtype=torch.int64)
            slots[-3:] = -1  # pads
            cases = {
                "slots": lambda slots=slots: kernel_slots(group, slots),
                "table": lambda: group.map_to_kernel_block_table(table),
            }
            best = {name: float("inf") for name in cases}
            for _ in range(rounds):
                for name, call in cases.items():
                    best[name] = min(best[name], timeit.timeit(call, number=calls) / calls * 1e6)
            print(
                f"| {tokens} | {best['slots']:.1f} | {2 * best['slots']:.1f} | {best['table']:.1f} |"
            )
    print(
        "\nOn a GPU each kernel_slots call is three elementwise kernels on at most "
        "max_num_batched_tokens int64 values (no allocation, no host sync); the step's "
        "metadata build runs outside CUDA graphs, as vLLM's own table mapping does."
    )


if __name__ == "__main__":
    main()
