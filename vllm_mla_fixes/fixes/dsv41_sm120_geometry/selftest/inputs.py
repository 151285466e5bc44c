"""The un-paged inputs of a run, and the dense reference of the records they give.

Random latents per prompt and position stand in for the model's KV; the dense
reference is what each writer should store for them (:mod:`.reference`).
"""

from __future__ import annotations

import torch

from . import reference as ref
from .layout import CacheLayer, TinyModel
from .timeline import PROMPTS, Batch


class Inputs:
    """Random latents per prompt and position; a prompt that repeats another's
    prefix has that prompt's latents there (the same tokens give the same KV)."""

    def __init__(self, model: TinyModel, seed: int, device: torch.device):
        self.model = model
        self.gen = torch.Generator().manual_seed(seed)
        half = 32
        inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(model.max_model_len, dtype=torch.float64)[:, None] * inv_freq
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32)
        self.cos_sin_dev = self.cos_sin.to(device)
        self.device = device
        layers = range(len(model.compress_ratios))
        self.swa: dict[str, dict[int, torch.Tensor]] = {}
        self.latent: dict[str, dict[int, torch.Tensor]] = {}
        self.k_pre: dict[str, dict[int, torch.Tensor]] = {}
        rows = model.max_model_len
        for name, (_, shares, shared) in PROMPTS.items():
            self.swa[name] = {layer: self.randn(rows, 512) for layer in layers}
            self.latent[name] = {s: self.randn(rows, 512) for s in model.kv_sources}
            self.k_pre[name] = {s: self.randn(rows, 128) for s in model.kv_sources}
            if shares is not None:
                for table in (self.swa, self.latent, self.k_pre):
                    for key, value in table[name].items():
                        value[:shared] = table[shares][key][:shared]
        self.norm_weight = {
            s: (torch.rand(128, generator=self.gen) + 0.5).to(torch.bfloat16)
            for s in model.kv_sources
        }

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(torch.bfloat16)

    def rows(
        self, table: dict[str, dict[int, torch.Tensor]], key: int, batch: Batch, padded: int
    ) -> torch.Tensor:
        """The batch's rows of one latent table, graph-padding rows random."""
        parts = [
            table[name][key][start : start + count]
            for name, start, count in zip(batch.names, batch.starts, batch.counts)
        ]
        out = torch.cat(parts)
        if padded > out.shape[0]:
            out = torch.cat([out, self.randn(padded - out.shape[0], out.shape[1])])
        return out.to(self.device)

    def redraw(self, name: str, first: int, end: int) -> None:
        """New latents for ``name`` at positions [first, end)."""
        for table in (self.swa, self.latent, self.k_pre):
            for rows in table[name].values():
                rows[first:end] = self.randn(end - first, rows.shape[1])


class DenseReference:
    """Each prompt's records as the writers should store them, dequantised;
    computed once per prompt and cache, until the prompt's latents change."""

    def __init__(self, inputs: Inputs, mxfp8: bool):
        self.inputs = inputs
        self.model = inputs.model
        self.mxfp8 = mxfp8
        self.rounding = ref.writer_rounding()
        self.computed: dict[tuple[str, str, int], torch.Tensor] = {}

    def forget(self, name: str) -> None:
        """Drop ``name``'s rows: its latents were redrawn."""
        self.computed = {key: rows for key, rows in self.computed.items() if key[1] != name}

    def records(self, cache: CacheLayer, name: str, index: torch.Tensor) -> torch.Tensor:
        """``name``'s records ``index`` in ``cache``."""
        if cache.kind == "swa":
            return self.swa(name, cache.layer)[index]
        if cache.kind == "compressed":
            return self.compressed(name, cache.layer, cache.ratio)[index]
        count = int(index.max()) + 1
        return self.index_keys(name, cache.layer, cache.ratio, count)[index]

    def swa(self, name: str, layer: int) -> torch.Tensor:
        """Every position's sliding-window row as the SWA writer stores it
        (RoPE, bf16, then fp8 NoPE, or fp8 throughout in the SM100 MXFP8
        record), dequantised; computed once per prompt and layer."""
        key = ("swa", name, layer)
        if key not in self.computed:
            inputs = self.inputs
            rows = ref.rope_swa_rows(
                inputs.swa[name][layer], inputs.cos_sin, ref.Rounding("round-to-nearest-even")
            )
            self.computed[key] = ref.dense_swa_rows(rows, self.rounding, self.mxfp8)
        return self.computed[key]

    def compressed(self, name: str, source: int, ratio: int) -> torch.Tensor:
        """Every compressed state's row as ``rope_quant_insert`` stores it (the
        latent of the state's last token, RoPE at its first; fp8 NoPE and bf16
        RoPE, or fp8 throughout in the SM100 MXFP8 record), dequantised."""
        key = ("compressed", name, source)
        if key not in self.computed:
            states = torch.arange(self.model.max_model_len // ratio)
            latent = self.inputs.latent[name][source][states * ratio + ratio - 1]
            angles = self.inputs.cos_sin[states * ratio]
            self.computed[key] = ref.dense_compressed_rows(
                latent, angles[:, :32], angles[:, 32:], self.rounding, self.mxfp8
            )
        return self.computed[key]

    def index_keys(self, name: str, layer: int, ratio: int, count: int) -> torch.Tensor:
        """The first ``count`` index keys as the indexer's K writer stores them."""
        states = torch.arange(count)
        angles = self.inputs.cos_sin[states * ratio]
        return ref.dense_index_keys(
            self.inputs.k_pre[name][layer][states * ratio + ratio - 1],
            self.inputs.norm_weight[layer],
            self.model.rms_norm_eps,
            angles[:, :32],
            angles[:, 32:],
            self.rounding,
        )
