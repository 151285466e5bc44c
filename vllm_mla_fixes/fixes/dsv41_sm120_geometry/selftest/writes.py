"""The step's writes: vLLM's zeroer on the new blocks, then every cache's writer.

Each write is attributed (bytes it changed outside its cache's own pages in
the batch's blocks are foreign); the records it left are read back at the
slots it was given, kept as the readers' truth (:mod:`.records`), and
compared with the dense reference element by element.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import bounds as bd
from . import kernels as kn
from . import records
from . import reference as ref
from .accounting import SENTINEL
from .inputs import DenseReference
from .layout import CacheLayer
from .phase import Phase, RunParts
from .timeline import Batch, StepPlan


class Write(NamedTuple):
    """One writer call of a step, and what it is given."""

    kernel: str
    cache: CacheLayer
    slots: torch.Tensor
    rows: int  # records a page, as the writer addresses its pages
    width: int  # bytes a record
    ratio: int  # 0: a record per token (the window KV); else one per group of ratio tokens
    positions: torch.Tensor
    kept: torch.Tensor | None  # decoder replay: the batch rows written
    call: Callable[[], object]


class Writes(Phase):
    """Each step's zeroing and writes, checked; the records they leave are
    kept in ``stored`` for the reads."""

    def __init__(self, parts: RunParts, dense: DenseReference):
        super().__init__(parts)
        self.dense = dense
        self.result = parts.findings.result

    def zero_new_blocks(self, plan: StepPlan, batch: Batch) -> None:
        """vLLM's ``KVBlockZeroer`` on the blocks the scheduler lists as new:
        afterwards every cache's pages in them must read zero, and nothing
        outside them may change."""
        if not batch.new_block_ids:
            return
        storage = self.layout.storage
        caches = {name: batch.new_block_ids for name in self.layout.caches}
        pages = self.layout.mask_of(caches)
        rows = self.layout.mask_of(caches, padded=False)  # what readers read; vLLM zeroes that
        stale = (storage != 0) & (storage != SENTINEL) & rows
        self.result.stale_bytes_zeroed += int(stale.sum())
        before = storage.clone()
        tally = self.result.kernel(kn.ZEROER)
        tally.writes += 1
        if not self.findings.call(
            plan,
            kn.ZEROER,
            "new blocks",
            lambda: self.layout.zeroer.zero_block_ids(batch.new_block_ids),
        ):
            return
        foreign = int(((storage != before) & ~pages).sum())
        tally.foreign_bytes += foreign
        if foreign:
            self.findings.problem(
                plan, kn.ZEROER, f"zeroing changed {foreign} bytes outside the new blocks"
            )
        left = int(((storage != 0) & rows).sum())
        if left:
            self.findings.problem(
                plan, kn.ZEROER, f"{left} bytes of the new blocks' pages were not zeroed"
            )

    def stale_slot_buffers(self) -> None:
        """Fill the fix's persistent slot buffers with valid-looking slots, as a
        longer earlier step leaves them: graph-padding rows must not reuse them."""
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import SLOT_BUFFERS

        for slots, blocks in list(SLOT_BUFFERS.values()):
            slots.copy_(torch.arange(slots.numel(), device=slots.device))
            blocks.fill_(1)

    def own_mask(
        self, cache: CacheLayer, names: list[str], block_ids: dict[str, tuple[list[int], ...]]
    ) -> torch.Tensor:
        ids = [b for name in names for b in block_ids[name][cache.group_id]]
        return self.layout.mask_of({cache.name: ids})

    def attributed(
        self,
        plan: StepPlan,
        kernel: str,
        cache: CacheLayer,
        names: list[str],
        block_ids: dict[str, tuple[list[int], ...]],
        write: Callable[[], object],
    ) -> bool:
        storage = self.layout.storage
        before = storage.clone()
        tally = self.result.kernel(kernel)
        tally.writes += 1
        if not self.findings.call(plan, kernel, cache.name, write):  # a refused write is a finding
            return False
        foreign = int(((storage != before) & ~self.own_mask(cache, names, block_ids)).sum())
        if foreign:
            tally.foreign_bytes += foreign
            for case in plan.cases:
                self.result.case(case).foreign_bytes += foreign
            self.findings.problem(
                plan, kernel, f"{cache.name}: {foreign} bytes written outside its pages"
            )
        return True

    def write(self, batch: Batch, block_ids: dict[str, tuple[list[int], ...]]) -> None:
        """Every cache's writer for the step, each write attributed, then the
        records it left kept and compared with the dense reference."""
        for write in (*self.swa_writes(batch), *self.latent_writes(batch)):
            if write.ratio == 1:
                self.check_ratio1_slots(write.cache, batch, write.slots)
            if self.write_checked(batch.plan, write, batch.names, block_ids):
                self.keep_records(batch, write)

    def swa_writes(self, batch: Batch) -> list[Write]:
        model, inputs, replay = self.model, self.inputs, batch.replay
        out = []
        for cache in self.layout.by_kind("swa"):
            swa_md = batch.metadata[cache.name]
            rows = inputs.rows(inputs.swa, cache.layer, batch, batch.num_tokens_padded)
            slots, pos, kept = swa_md.slot_mapping, batch.positions, None
            if replay is not None and cache.layer > model.cut:
                # Layers past the cut run, and write their window KV, on the kept rows only.
                swa_md, kept = replay.metadata[cache.name], replay.rows
                rows, slots, pos = rows[kept], swa_md.slot_mapping, replay.positions
            call = functools.partial(
                self.kernels.write_swa,
                cache.module.kv_cache,
                rows,
                pos,
                inputs.cos_sin_dev,
                slots,
                swa_md.block_size,
                self.layout.readers[cache.layer],
                swa_md,
            )
            width = self.layout.kv_records.swa_bytes_per_token
            out.append(
                Write(kn.SWA_WRITER, cache, slots, swa_md.block_size, width, 0, pos, kept, call)
            )
        return out

    def latent_writes(self, batch: Batch) -> list[Write]:
        """The compressed KV's and the indexer keys' writes."""
        inputs, positions, padded = self.inputs, batch.positions, batch.num_tokens_padded
        out = []
        for cache in self.layout.by_kind("compressed"):
            latent = inputs.rows(inputs.latent, cache.layer, batch, padded)
            slots = batch.metadata[cache.name].slot_mapping
            call = functools.partial(
                self.kernels.write_compressed,
                cache.module.kv_cache,
                latent,
                positions,
                inputs.cos_sin_dev,
                slots,
                cache.ratio,
            )
            width = self.layout.kv_records.compressed_bytes_per_token
            rows = int(cache.module.kv_cache.shape[1])
            out.append(
                Write(
                    kn.COMPRESSED_WRITER,
                    cache,
                    slots,
                    rows,
                    width,
                    cache.ratio,
                    positions,
                    None,
                    call,
                )
            )
        for cache in self.layout.by_kind("indexer"):
            slots = batch.metadata[cache.name].slot_mapping
            call = functools.partial(
                self.kernels.write_indexer,
                cache.module.kv_cache,
                inputs.rows(inputs.k_pre, cache.layer, batch, padded),
                positions,
                inputs.cos_sin_dev,
                inputs.norm_weight[cache.layer].to(self.layout.device),
                self.model.rms_norm_eps,
                slots,
                cache.ratio,
            )
            rows = int(cache.module.kv_cache.shape[1])
            out.append(
                Write(
                    kn.INDEXER_WRITER,
                    cache,
                    slots,
                    rows,
                    ref.INDEX_RECORD,
                    cache.ratio,
                    positions,
                    None,
                    call,
                )
            )
        return out

    def write_checked(
        self,
        plan: StepPlan,
        write: Write,
        names: list[str],
        block_ids: dict[str, tuple[list[int], ...]],
    ) -> bool:
        """The write, attributed (False where it was refused or failed).  The
        Triton interpreter has no memory protection: a write that would end
        outside the allocation is refused instead of corrupting the process."""
        view = write.cache.module.kv_cache
        valid = write.slots[write.slots >= 0].to(torch.int64).cpu()
        if valid.numel():
            end = (
                view.storage_offset()
                + (valid // write.rows) * view.stride(0)
                + write.rows * write.width
            )
            if int(end.max()) > self.layout.storage.numel():
                self.findings.problem(
                    plan,
                    write.kernel,
                    f"{write.cache.name}: slot {int(valid[end.argmax()])} "
                    "lies outside the KV allocation; write refused",
                )
                return False
        return self.attributed(plan, write.kernel, write.cache, names, block_ids, write.call)

    def keep_records(self, batch: Batch, write: Write) -> None:
        """The records the write left, read back at the slots it was given and
        kept (the readers' truth), each compared with the dense reference,
        element by element (:func:`.bounds.writer_element_bound`)."""
        bound = bd.writer_bound(self.kernels)
        view = write.cache.module.kv_cache
        tokens = records.written(batch, write.positions, write.slots, write.ratio, write.kept)
        for name, (index, slots) in tokens.items():
            raw = ref.record_bytes(view, slots, write.rows, write.width)
            self.stored.store(write.cache.name, name, index, raw)
            got = ref.decode_records(raw, self.stored.ue8m0x4)
            want = self.dense.records(write.cache, name, index)
            limit = (
                bd.writer_element_bound(got, want, raw)
                if bound.per_element
                else torch.zeros_like(got)
            )
            error, at = bd.worst_element(got, want, limit)
            self.findings.note(batch.plan, write.kernel, error, at, bound)

    def check_ratio1_slots(self, cache: CacheLayer, batch: Batch, slots: torch.Tensor) -> None:
        """Ratio-1 writers: count slots that differ from the kernel-table formula
        ``ktable[req, pos // k] * k + pos % k`` (k: the kernel block, the manager
        block where blocks are not split); rows vLLM pads for a replay stay -1."""
        if cache.ratio != 1:
            return
        group = cache.attn_group
        k = group.kernel_block_size or self.layout.group_block_size(cache.group_id)
        table = batch.block_tables[cache.group_id][: len(batch.names)]
        ktable = group.map_to_kernel_block_table(table.clone()).to(torch.int64).cpu()
        got = slots[: batch.num_tokens].to(torch.int64).cpu()
        want = []
        for r, (start, count, replay) in enumerate(
            zip(batch.starts, batch.counts, batch.replay_start)
        ):
            pos = torch.arange(start, start + count)
            slot = ktable[r, pos // k] * k + pos % k
            if replay:
                slot[(pos >= replay) & (pos < replay + self.model.sliding_window)] = -1
            want.append(slot)
        self.result.slot_mismatches += int((got != torch.cat(want)).sum())
