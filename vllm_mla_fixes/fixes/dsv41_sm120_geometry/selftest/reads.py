"""The step's reads: every layer's attention, the indexer's logits and K gather.

The bytes each kernel reads must be the kept records (:mod:`.records`) of the
tokens it should read; each read is then compared with the same computation
on those records (:mod:`.reference`).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from . import bounds as bd
from . import kernels as kn
from . import records
from . import reference as ref
from .layout import CacheLayer
from .phase import Phase, RunParts
from .timed_step import TimedStep
from .timeline import Batch, ReplayView, StepPlan


def request_rows(batch: Batch, replay: ReplayView | None) -> list[tuple[int, int, int, int]]:
    """(request, first row, end row, first position) of each real request
    in the batch (or in its kept rows)."""
    ranges = replay.token_ranges() if replay is not None else batch.token_ranges()
    out = []
    for r, (first, end) in enumerate(ranges):
        last_pos = batch.starts[r] + batch.counts[r]
        out.append((r, first, end, last_pos - (end - first)))
    return out


class AttentionReads(Phase):
    """One layer's attention for every row of the step, through vLLM's
    ``_forward_decode`` / ``_forward_prefill``."""

    def __init__(self, parts: RunParts, timed: TimedStep, rng: random.Random):
        super().__init__(parts)
        self.timed = timed
        self.rng = rng

    def read_layer(
        self,
        batch: Batch,
        layer: int,
        md: dict[str, Any],  # layer prefix -> vLLM's attention metadata
        replay: ReplayView | None,
        lower: list[int],
    ) -> None:
        """Layer ``layer``'s attention for each row of the step (of its kept
        rows under ``replay``); each request's window starts no lower than its
        position in ``lower``."""
        plan, model, inputs = batch.plan, self.model, self.inputs
        reader = self.layout.readers[layer]
        ratio = model.compress_ratios[layer]
        swa_cache = self.layout.find("swa", layer)
        swa_md = md[swa_cache.name]
        spans = request_rows(batch, replay)
        rows = swa_md.num_decode_tokens + swa_md.num_prefill_tokens
        source = model.source_of(layer)
        comp_md = md.get(f"model.layers.{source}.self_attn") if source is not None else None
        comp_cache = (
            self.layout.caches[f"model.layers.{source}.self_attn"].module.kv_cache
            if source is not None
            else None
        )
        chosen = self.fill_topk(reader, ratio, spans) if ratio else {}
        q = inputs.randn(rows, model.q_heads, 512).to(self.layout.device)
        # FlashInfer writes bf16; the stand-in writes fp32, so its read compares exactly.
        out_dtype = torch.bfloat16 if self.kernels.is_real(kn.ATTENTION_DECODE) else torch.float32
        out = torch.zeros(rows, model.q_heads, 512, dtype=out_dtype, device=self.layout.device)
        nd = swa_md.num_decode_tokens
        calls = []
        if swa_md.num_prefills > 0:
            calls.append(
                (
                    kn.ATTENTION_PREFILL,
                    lambda: reader._forward_prefill(
                        q=q[nd:],
                        compressed_k_cache=comp_cache,
                        swa_k_cache=swa_cache.module.kv_cache,
                        output=out[nd:],
                        attn_metadata=comp_md,
                        swa_metadata=swa_md,
                    ),
                )
            )
        if swa_md.num_decodes > 0:
            calls.append(
                (
                    kn.ATTENTION_DECODE,
                    lambda: reader._forward_decode(
                        q=q[:nd],
                        kv_cache=comp_cache,
                        swa_metadata=swa_md,
                        attn_metadata=comp_md,
                        swa_only=ratio == 0,
                        output=out[:nd],
                    ),
                )
            )
        launches: list[kn.Launch] = []
        with self.kernels.recording(launches):
            for kernel, call in calls:
                rows_read = nd if kernel == kn.ATTENTION_DECODE else rows - nd
                timed = self.timed.kept(kernel, layer, rows_read, call)
                if not self.findings.call(plan, kernel, f"layer {layer}", timed):
                    return
        try:
            truth = self.truth(batch, layer, spans, lower, chosen)
        except records.MissingRecord as exc:
            self.findings.problem(plan, calls[-1][0], f"layer {layer}: {exc}")
            return
        self.check(plan, layer, q, out, launches, truth, nd)

    def truth(
        self,
        batch: Batch,
        layer: int,
        spans: list[tuple[int, int, int, int]],
        lower: list[int],
        chosen: dict[int, torch.Tensor],
    ) -> dict[int, tuple[list[torch.Tensor], torch.Tensor]]:
        """Per batch row: the records the writers stored for the tokens it
        should read (its window, then its chosen compressed states), raw per
        segment, and their values."""
        model = self.model
        swa = self.layout.find("swa", layer).name
        source, ratio = model.source_of(layer), model.compress_ratios[layer]
        truth = {}
        for r, first, end, pos0 in spans:
            name = batch.names[r]
            for row in range(first, end):
                pos = pos0 + row - first
                lo = max(0, pos - model.sliding_window + 1, lower[r])
                raw, values = self.stored.fetch(swa, name, torch.arange(lo, pos + 1))
                segments, kv = [raw], [values]
                if source is not None:  # a compressed layer (ratio > 0)
                    compressed = f"model.layers.{source}.self_attn"
                    raw, values = self.stored.fetch(compressed, name, chosen[row], ratio)
                    segments.append(raw)
                    kv.append(values)
                truth[row] = (segments, torch.cat(kv))
        return truth

    def check(
        self,
        plan: StepPlan,
        layer: int,
        q: torch.Tensor,
        out: torch.Tensor,
        launches: list[kn.Launch],
        truth: dict[int, tuple[list[torch.Tensor], torch.Tensor]],
        nd: int,
    ) -> None:
        """The records each launch read, byte for byte, then each row's output
        against the attention computed on exactly those records."""
        expected = {row: segments for row, (segments, _) in truth.items()}
        for launch in launches:
            stray, missed = records.attention_misreads(launch, out, expected)
            if stray or missed:
                first = records.launch_rows(launch, out).start
                kernel = kn.ATTENTION_DECODE if first < nd else kn.ATTENTION_PREFILL
                self.findings.problem(
                    plan,
                    kernel,
                    f"layer {layer}: {stray} records read are no token's it should read, "
                    f"{missed} of those tokens' records not read (page bytes)",
                )
        reader = self.layout.readers[layer]
        got, q_cpu = out.float().cpu(), q.cpu()
        for row, (_, kv) in truth.items():
            dense = ref.sink_softmax_attention(q_cpu[row], kv, reader.attn_sink.cpu(), reader.scale)
            kernel = kn.ATTENTION_DECODE if row < nd else kn.ATTENTION_PREFILL
            self.findings.note(plan, kernel, self.findings.error(kernel, got[row], dense))

    def fill_topk(
        self,
        reader: Any,  # vLLM's SM120 attention module of the layer
        ratio: int,
        spans: list[tuple[int, int, int, int]],
    ) -> dict[int, torch.Tensor]:
        """Random local top-k rows (complete states only) for every row."""
        buffer = reader.topk_indices_buffer
        buffer.fill_(-1)
        chosen = {}
        for _, first, end, pos0 in spans:
            for row in range(first, end):
                states = (pos0 + row - first + 1) // ratio
                pick = self.rng.sample(range(states), min(states, self.model.index_topk))
                chosen[row] = torch.tensor(pick, dtype=torch.int64)
                buffer[row, : len(pick)] = chosen[row].to(buffer.device, torch.int32)
        return chosen


class IndexerReads(Phase):
    """One indexer cache's reads of the step: the decode logits (and top-k)
    and the prefill K gather."""

    def __init__(self, parts: RunParts, timed: TimedStep):
        super().__init__(parts)
        self.timed = timed

    def read_indexer(
        self,
        batch: Batch,
        cache: CacheLayer,
        md: dict[str, Any],  # layer prefix -> vLLM's attention metadata
        replay: ReplayView | None,
    ) -> None:
        imd = md[cache.name]
        spans = request_rows(batch, replay)
        if imd.num_decodes > 0 and imd.decode is not None:
            self.read_logits(batch, cache, imd.decode, spans)
        if imd.prefill is not None:
            for chunk in imd.prefill.chunks:
                if not chunk.skip_kv_gather and chunk.local_total_seq_lens:
                    self.read_gathered_keys(batch, cache, chunk, spans)

    def read_logits(
        self,
        batch: Batch,
        cache: CacheLayer,
        decode: Any,  # the decode part of vLLM's indexer metadata
        spans: list[tuple[int, int, int, int]],
    ) -> None:
        """The indexer's decode logits over every state of each request, as
        ``sparse_attn_indexer`` asks DeepGEMM for them."""
        plan, model, device = batch.plan, self.model, self.layout.device
        batch_size = int(decode.seq_lens.shape[0])
        q = torch.randn(batch_size, 1, model.index_heads, 128, generator=self.inputs.gen)
        q_fp8 = (q * 64).to(torch.float8_e4m3fn)
        weights = torch.rand(batch_size, model.index_heads, generator=self.inputs.gen)
        q_dev, weights_dev = q_fp8.to(device), weights.to(device)
        read: dict[str, torch.Tensor] = {}

        def paged_logits() -> None:
            # the view sparse_attn_indexer hands DeepGEMM (kv_cache_as_quant_view, fp8 rows)
            read["logits"] = self.kernels.paged_logits(
                q_dev,
                cache.module.kv_cache.unsqueeze(-2),
                weights_dev,
                decode.seq_lens,
                decode.block_table,
                decode.schedule_metadata,
                model.max_model_len // cache.ratio,
                getattr(decode, "indices", None),  # SM100's varlen rows
            )

        launches: list[kn.Launch] = []
        timed = self.timed.kept(kn.INDEXER_LOGITS, cache.layer, batch_size, paged_logits)
        with self.kernels.recording(launches):
            if not self.findings.call(plan, kn.INDEXER_LOGITS, cache.name, timed):
                return
        logits, lens = read["logits"].float().cpu(), decode.seq_lens.cpu()
        expected = {}
        for b in range(min(batch_size, len(spans))):
            count = int(lens[b, 0])
            if count <= 0:
                continue
            name = batch.names[spans[b][0]]
            try:
                raw, keys = self.stored.fetch(cache.name, name, torch.arange(count), cache.ratio)
            except records.MissingRecord as exc:
                self.findings.problem(plan, kn.INDEXER_LOGITS, f"{cache.name}: {exc}")
                continue
            expected[b] = raw
            self.check_logits(plan, q_fp8[b, 0], weights[b], keys, logits[b, :count])
        misread = sum(records.logits_misreads(launch, expected) for launch in launches)
        if misread:
            self.findings.problem(
                plan,
                kn.INDEXER_LOGITS,
                f"{cache.name}: {misread} keys read are not the tokens' own (page bytes)",
            )

    def check_logits(
        self,
        plan: StepPlan,
        q_fp8: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        got: torch.Tensor,
    ) -> None:
        """One request's logits against the indexer's score of the stored keys,
        each position against its own bound (0 where the reader adds no
        arithmetic), then its top-k."""
        want = ref.index_logits(q_fp8, weights, keys)
        bound = self.findings.bound(kn.INDEXER_LOGITS)
        limit = (
            bd.logits_element_bound(q_fp8, weights, keys, want)
            if bound.per_element
            else torch.zeros_like(want)
        )
        error, at = bd.worst_element(got, want, limit)
        self.findings.note(plan, kn.INDEXER_LOGITS, error, at)
        k = min(self.model.index_topk, want.numel())
        outside = bd.topk_outsiders(torch.topk(got, k).indices, want, limit, k)
        if outside:
            self.findings.problem(
                plan, kn.INDEXER_LOGITS, f"top-{k}: {outside} indices outside the dense top-{k}"
            )

    def read_gathered_keys(
        self,
        batch: Batch,
        cache: CacheLayer,
        chunk: Any,  # one prefill chunk of vLLM's indexer metadata
        spans: list[tuple[int, int, int, int]],
    ) -> None:
        """The indexer's prefill K gather of one chunk, byte for byte."""
        plan, device = batch.plan, self.layout.device
        total = int(chunk.local_total_seq_lens)
        dst_k = torch.zeros(total, 128, dtype=torch.float8_e4m3fn, device=device)
        dst_scale = torch.zeros(total, 4, dtype=torch.uint8, device=device)

        def gather() -> None:
            self.kernels.gather_k(
                cache.module.kv_cache, dst_k, dst_scale, chunk.block_table, chunk.local_cu_seq_lens
            )

        if not self.findings.call(plan, kn.INDEXER_GATHER, cache.name, gather):
            return
        raw = torch.cat([dst_k.cpu().view(torch.uint8), dst_scale.cpu()], dim=1)
        got = ref.decode_records(raw, self.stored.ue8m0x4)
        cu = chunk.local_cu_seq_lens.tolist()
        members = [s for s in spans if s[1] < chunk.token_end and s[2] > chunk.token_start]
        for b, (r, *_rest) in enumerate(members[: len(cu) - 1]):
            states = torch.arange(cu[b + 1] - cu[b])
            try:
                _, want = self.stored.fetch(cache.name, batch.names[r], states, cache.ratio)
            except records.MissingRecord as exc:
                self.findings.problem(plan, kn.INDEXER_GATHER, f"{cache.name}: {exc}")
                continue
            error = self.findings.error(kn.INDEXER_GATHER, got[cu[b] : cu[b + 1]], want)
            self.findings.note(plan, kn.INDEXER_GATHER, error)
