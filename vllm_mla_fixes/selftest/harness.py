"""One self-test run of a geometry: replay the serving timeline, write, read, compare, account.

For each step of :data:`.timeline.TIMELINE` (all vLLM calls are the installed
release's own code):

1. vLLM's ``KVCacheManager`` allocates the step's blocks; ``BlockTables`` gives
   the block tables and slot mappings; ``KVBlockZeroer`` zeroes the blocks the
   scheduler lists as new; ``build_attn_metadata`` builds every group's
   metadata (with the replay start and vLLM's replay padding of slots), and for
   decoder replay the kept rows' metadata on copies of the groups.
2. The writers write random latents with the slot mappings the metadata gives
   them (each write is attributed: bytes it changed outside its cache's own
   pages in the batch's blocks are foreign); the records each write left are
   read back at the slots it was given, kept, and compared with a dense
   PyTorch computation on the un-paged latents, element by element
   (:mod:`.records`).
3. The readers read (:mod:`.kernels`): every layer's attention for every row
   of the step through ``_forward_decode`` / ``_forward_prefill``; the
   indexer's decode logits and top-k, and its prefill K gather.  The bytes
   each kernel reads must be the kept records of the tokens it should read;
   each read is then compared with the same computation on those records.

At the end, bytes that differ from the sentinel outside every cache's pages
are counted (stray bytes), and each case of :data:`.timeline.CASES` gets a
verdict from the steps that exercise it.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from . import bounds as bd
from . import kernels as kn
from . import records
from . import reference as ref
from .env import drafter_pages_at_128, one_torch_thread, simulated_sm120_host
from .layout import (
    GEOMETRIES,
    CacheLayer,
    Geometry,
    Layout,
    TinyModel,
    build_layout,
    describe,
)
from .timeline import (
    CASES,
    PROMPTS,
    TIMELINE,
    Batch,
    BlockScheduler,
    ReplayView,
    StepPlan,
    Worker,
)

if TYPE_CHECKING:
    from vllm_mla_fixes.patching import AppliedFix

SENTINEL = 0xA5
# How far a read may be off against the dense reference: :mod:`.bounds` derives
# each comparison's bound from the formats (0 where nothing rounds differently).
# The decode step whose kernel launches are timed on a GPU: a CUDA-graph padded
# decode of two requests, the same batch in every geometry.
TIMED_STEP = next(plan.name for plan in TIMELINE if "graph-padded" in plan.cases)
TIMED_KERNELS = (kn.ATTENTION_DECODE, kn.INDEXER_LOGITS)


# ------------------------------------------------------------------ results


@dataclass
class Tally:
    """What one kernel (or one case) saw over the run."""

    compared: int = 0  # reads (or writes' records) compared with the dense reference
    worst: float = 0.0  # worst error of a comparison
    bound: bd.Bound | None = None  # what the comparisons may be off by (a kernel's tally)
    worst_margin: float = 0.0  # worst error / bound of a comparison
    worst_bound: float = 0.0  # the bound of that comparison (per element: of that element)
    foreign_bytes: int = 0  # bytes written outside own pages
    writes: int = 0
    problems: list[str] = field(default_factory=list)

    def note(self, error: float, bound: float) -> None:
        self.compared += 1
        if not error <= self.worst:  # NaN counts as worst
            self.worst = error
        ratio = bd.margin(error, bound)
        if not ratio <= self.worst_margin or self.compared == 1:
            self.worst_margin, self.worst_bound = ratio, bound

    def fail(self, problem: str) -> None:
        if len(self.problems) < 8:
            self.problems.append(problem)
        elif len(self.problems) == 8:
            self.problems.append("...")


@dataclass
class GeometryResult:
    geometry: str
    title: str
    role: str
    block_size: int = 0
    status: str = ""
    layout: list[str] = field(default_factory=list)
    guard_error: str | None = None
    kernels: dict[str, Tally] = field(default_factory=dict)
    cases: dict[str, Tally] = field(default_factory=dict)
    stray_bytes: int = 0
    tiling_problems: list[str] = field(default_factory=list)
    slot_mismatches: int = 0  # ratio-1 writer slots != ktable[req, pos // k] * k + pos % k
    stale_bytes_zeroed: int = 0
    reused_blocks: int = 0
    offloaded_bytes: int = 0  # bytes copied out and back by the offload-reload case
    aborted: str | None = None
    crashed_in: str | None = None  # the kernel of a device fault (or of its process's death)
    # What the timed step launches of each timed kernel: the layers, launches
    # and rows (the same in every geometry, or their times do not compare).
    timed_work: dict[str, dict[str, object]] = field(default_factory=dict)
    seconds: float = 0.0

    def kernel(self, name: str) -> Tally:
        return self.kernels.setdefault(name, Tally())

    def case(self, name: str) -> Tally:
        return self.cases.setdefault(name, Tally())

    @property
    def foreign_bytes(self) -> int:
        return sum(t.foreign_bytes for t in self.kernels.values())

    def failed_cases(self) -> list[str]:
        return [name for name, tally in self.cases.items() if tally.problems]

    @property
    def clean(self) -> bool:
        """Every read matched, every byte accounted for."""
        return (
            self.aborted is None
            and not any(t.problems for t in self.kernels.values())
            and not self.failed_cases()
            and self.stray_bytes == 0
            and not self.tiling_problems
            and self.slot_mismatches == 0
        )


def new_result(name: str) -> GeometryResult:
    """An empty result for geometry ``name``, every case listed."""
    geometry = GEOMETRIES[name]
    result = GeometryResult(geometry.name, geometry.title, geometry.role)
    for case in CASES:
        result.case(case)
    return result


class DeviceFault(Exception):
    """A kernel call failed with a CUDA error.  Such an error (an illegal
    address, a launch failure) is sticky: every later call in the process fails
    too, so the geometry stops at the kernel that raised it."""

    def __init__(self, kernel: str, step: str, error: str):
        super().__init__(f"device fault in {kernel} at step '{step}': {error}")
        self.kernel = kernel


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error (PyTorch's, or one Triton raises at launch)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(mark in text for mark in ("CUDA error", "CUDA driver error", "Triton Error [CUDA]"))


# ------------------------------------------------------------------ inputs


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


# ---------------------------------------------------------------------- run


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


class TimedLaunch(NamedTuple):
    """One launch of a timed kernel in the timed step."""

    layer: int
    rows: int  # query rows the launch reads for
    launch: kn.Launch


def timed_work(launches: dict[str, list[TimedLaunch]]) -> dict[str, dict[str, object]]:
    return {
        kernel: {
            "layers": sorted({t.layer for t in timed}),
            "launches": len(timed),
            "rows": sum(t.rows for t in timed),
        }
        for kernel, timed in launches.items()
    }


class Run:
    def __init__(
        self,
        layout: Layout,
        kernels: kn.Kernels,
        result: GeometryResult,
        seed: int,
        entering: Callable[[str], None] | None = None,
    ):
        self.layout = layout
        self.entering = entering
        self.kernels = kernels
        self.result = result
        self.model = layout.model
        self.inputs = Inputs(layout.model, seed, layout.device)
        self.rounding = ref.writer_rounding()
        self.scheduler = BlockScheduler(layout)
        self.worker = Worker(layout)
        self.rng = random.Random(seed)
        self.ever_held: set[int] = set()
        self.finished_blocks: set[int] = set()
        self.dense: dict[tuple, torch.Tensor] = {}  # dense reference rows, computed once
        shares = {name: (other, shared) for name, (_, other, shared) in PROMPTS.items() if other}
        self.stored = records.Stored(
            layout.model.max_model_len, shares, ref.index_scales_are_ue8m0x4()
        )
        self.timed_step = TIMED_STEP
        self.in_timed_step = False
        # The timed step's launches of each timed kernel, kept from that step on.
        self.timed_launches: dict[str, list[TimedLaunch]] = {k: [] for k in TIMED_KERNELS}

    # ---------------------------------------------------------- one step

    def step(self, plan: StepPlan) -> None:
        scheduled = []
        for name, tokens in plan.work:
            prompt_len = PROMPTS[name][0]
            start, count, replay = self.scheduler.schedule(name, tokens)
            scheduled.append((name, start, count, replay, start < prompt_len))
        block_ids = {name: self.scheduler.block_ids(name) for name, *_ in scheduled}
        new_ids = self.scheduler.new_block_ids()
        batch = self.worker.prepare(plan, scheduled, block_ids, new_ids)
        if "freed-blocks" in plan.cases and plan.name.startswith("B decode + C"):
            reused = set(new_ids) & self.finished_blocks
            self.result.reused_blocks = len(reused)
            if not reused:
                self.problem(plan, None, "no freed block was reallocated: the case did not run")
        self.zero_new_blocks(plan, batch)
        if plan.pad_to:
            self.stale_slot_buffers()
        self.worker.build_metadata(batch)
        for ids in block_ids.values():
            self.ever_held.update(b for group in ids for b in group if b)
        shared = self.shared_prefix_bytes(batch, block_ids)
        self.write(batch, block_ids)
        if shared is not None:
            mask, before = shared
            changed = int((self.layout.storage[mask] != before).sum())
            if changed:
                self.problem(plan, None, f"{changed} bytes of the cached prefix's pages changed")
        self.in_timed_step = plan.name == self.timed_step
        try:
            self.read(batch)
        finally:
            self.in_timed_step = False
        if plan.name == self.timed_step:
            self.result.timed_work = timed_work(self.timed_launches)
        for name in plan.offload:
            self.offload_and_reload(plan, name, block_ids[name])
        accepted = dict(plan.accept)
        for name, start, count, _, _ in scheduled:
            self.scheduler.advance(name, count, accepted.get(name))
            if name in accepted and accepted[name] < count - 1:
                self.rewind(name, start + 1 + accepted[name], start + count)
        for name in plan.finish:
            self.finished_blocks.update(self.scheduler.held[name])
            self.scheduler.finish(name)

    def offload_and_reload(
        self, plan: StepPlan, name: str, block_ids: tuple[list[int], ...]
    ) -> None:
        """KV offloading of one request: copy out the regions vLLM's offloading
        connector moves for its blocks, clobber every page its blocks hold in
        the offloaded groups (as if the GPU blocks had been reused), copy the
        regions back.  Every byte of those pages must come back; the request's
        later reads check it again against the dense reference."""
        from .timeline import offload_regions

        try:
            group_ids, regions = offload_regions(self.layout)
        except Exception as exc:  # the connector refusing the layout is a finding
            self.problem(plan, None, f"offloading connector: {type(exc).__name__}: {exc}")
            return
        saved = []
        for gid in group_ids:
            ids = torch.tensor([b for b in block_ids[gid] if b], dtype=torch.int64)
            for tensor, size in regions[gid]:
                saved.append((tensor, ids, tensor[ids, :size].cpu()))
        pages = self.layout.mask_of(
            {
                cache.name: [b for b in block_ids[cache.group_id] if b]
                for cache in self.layout.caches.values()
                if cache.group_id in group_ids
            },
            padded=False,  # the connector moves un-padded pages; readers read no padding
        )
        storage = self.layout.storage
        before = storage[pages].clone()
        storage[pages] = SENTINEL ^ 0xFF
        for tensor, ids, data in saved:
            tensor[ids, : data.shape[1]] = data.to(tensor.device)
        self.result.offloaded_bytes += sum(data.numel() for _, _, data in saved)
        lost = int((storage[pages] != before).sum())
        if lost:
            self.problem(plan, None, f"{name}: {lost} bytes of its pages did not come back")

    def rewind(self, name: str, first: int, end: int) -> None:
        """Rejected drafts at positions [first, end): the tokens that replace
        them have other KV, so the reference takes new latents there and the
        next step must overwrite every byte the rejected drafts left."""
        inputs = self.inputs
        for table in (inputs.swa, inputs.latent, inputs.k_pre):
            for rows in table[name].values():
                rows[first:end] = inputs.randn(end - first, rows.shape[1])
        self.dense = {key: rows for key, rows in self.dense.items() if key[1] != name}

    def call(self, plan: StepPlan, kernel: str, where: str, run: Callable[[], object]) -> bool:
        """One kernel call; its failure is a finding on ``kernel`` (False).  On a
        GPU the call is synchronised, so that an asynchronous fault is charged to
        the kernel that caused it; a CUDA error ends the geometry (:class:`DeviceFault`)."""
        if self.entering is not None:
            self.entering(kernel)
        try:
            run()
            if self.layout.device.type == "cuda":
                torch.cuda.synchronize(self.layout.device)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.problem(plan, kernel, f"{where}: {error}")
            if is_device_fault(exc):
                raise DeviceFault(kernel, plan.name, error) from exc
            return False
        finally:
            if self.entering is not None:
                self.entering("")
        return True

    def timed(
        self, kernel: str, layer: int, rows: int, call: Callable[[], object]
    ) -> Callable[[], object]:
        """``call``, its launches kept where it is the timed step's launch of a
        timed kernel on a backbone layer: every geometry has those (upstream's
        layout has no drafter layer), so each times the same work."""
        if (
            not self.in_timed_step
            or kernel not in self.timed_launches
            or layer >= self.model.backbone_layers
        ):
            return call

        def recorded() -> None:
            launches: list[kn.Launch] = []
            with self.kernels.recording(launches):
                call()
            self.timed_launches[kernel] += [TimedLaunch(layer, rows, x) for x in launches]

        return recorded

    def problem(self, plan: StepPlan, kernel: str | None, text: str) -> None:
        line = f"{plan.name}: {text}"
        if kernel is not None:
            self.result.kernel(kernel).fail(line)
        for case in plan.cases:
            self.result.case(case).fail(line)

    def note(
        self,
        plan: StepPlan,
        kernel: str,
        error: float,
        limit: float | None = None,
        bound: bd.Bound | None = None,
    ) -> None:
        """One comparison on ``kernel``: ``error`` against ``limit`` (default: the
        value of ``bound``, by default the kernel's reader bound; a per-element
        bound gives the limit of the element furthest past it)."""
        bound = bound or self.bound(kernel)
        limit = bound.value if limit is None else limit
        tally = self.result.kernel(kernel)
        tally.bound = bound
        tally.note(error, limit)
        for case in plan.cases:
            self.result.case(case).note(error, limit)
        if not error <= limit:
            self.problem(plan, kernel, f"{kernel} off by {error:.3g} (bound {limit:.3g})")

    def bound(self, kernel: str) -> bd.Bound:
        return bd.bound_for(kernel, self.kernels, self.model.q_heads)

    # ---------------------------------------------------------- zeroing

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
        if not self.call(
            plan,
            kn.ZEROER,
            "new blocks",
            lambda: self.layout.zeroer.zero_block_ids(batch.new_block_ids),
        ):
            return
        foreign = int(((storage != before) & ~pages).sum())
        tally.foreign_bytes += foreign
        if foreign:
            self.problem(plan, kn.ZEROER, f"zeroing changed {foreign} bytes outside the new blocks")
        left = int(((storage != 0) & rows).sum())
        if left:
            self.problem(plan, kn.ZEROER, f"{left} bytes of the new blocks' pages were not zeroed")

    def stale_slot_buffers(self) -> None:
        """Fill the fix's persistent slot buffers with valid-looking slots, as a
        longer earlier step leaves them: graph-padding rows must not reuse them."""
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.slots import _SLOT_BUFFERS

        for slots, blocks in list(_SLOT_BUFFERS.values()):
            slots.copy_(torch.arange(slots.numel(), device=slots.device))
            blocks.fill_(1)

    def shared_prefix_bytes(
        self, batch: Batch, block_ids: dict[str, tuple[list[int], ...]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Bytes of the prefix-cache pages a request reuses (blocks another
        request wrote), to check that nothing writes them."""
        if "prefix-hit" not in batch.plan.cases:
            return None
        cacheable = set(self.worker.cacheable)
        held_by_others = {
            name: set(b for ids in self.scheduler.block_ids(name) for b in ids)
            for name in self.scheduler.requests
        }
        pages: dict[str, list[int]] = {}
        for name, replay in zip(batch.names, batch.replay_start, strict=True):
            if not replay:
                continue
            for cache in self.layout.caches.values():
                if cache.group_id not in cacheable:
                    continue
                ids = block_ids[name][cache.group_id]
                shared = [
                    b
                    for b in ids
                    if b
                    and any(
                        b in blocks for other, blocks in held_by_others.items() if other != name
                    )
                ]
                pages.setdefault(cache.name, []).extend(shared)
        if not any(pages.values()):
            self.problem(batch.plan, None, "the prefix hit shares no block: the case did not run")
            return None
        mask = self.layout.mask_of(pages)
        return mask, self.layout.storage[mask].clone()

    # ---------------------------------------------------------- writes

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
        if not self.call(plan, kernel, cache.name, write):  # a refused write is a finding
            return False
        foreign = int(((storage != before) & ~self.own_mask(cache, names, block_ids)).sum())
        if foreign:
            tally.foreign_bytes += foreign
            for case in plan.cases:
                self.result.case(case).foreign_bytes += foreign
            self.problem(plan, kernel, f"{cache.name}: {foreign} bytes written outside its pages")
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
                self.problem(
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
            want = self.dense_records(write.cache, name, index)
            limit = (
                bd.writer_element_bound(got, want, raw)
                if bound.per_element
                else torch.zeros_like(got)
            )
            error, at = bd.worst_element(got, want, limit)
            self.note(batch.plan, write.kernel, error, at, bound)

    def dense_records(self, cache: CacheLayer, name: str, index: torch.Tensor) -> torch.Tensor:
        """The dense reference of ``name``'s records ``index`` in ``cache``."""
        if cache.kind == "swa":
            return self.dense_swa(name, cache.layer)[index]
        if cache.kind == "compressed":
            return self.dense_compressed(name, cache.layer, cache.ratio)[index]
        count = int(index.max()) + 1
        return self.dense_index_keys(name, cache.layer, cache.ratio, count)[index]

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

    # ---------------------------------------------------------- reads

    def read(self, batch: Batch) -> None:
        model = self.model
        for layer in range(len(model.compress_ratios)):
            if batch.replay is not None and layer >= model.cut:
                self.read_attention(
                    batch,
                    layer,
                    batch.replay.metadata,
                    batch.replay,
                    batch.replay.kv_start if layer > model.cut else batch.replay_start,
                )
            else:
                self.read_attention(batch, layer, batch.metadata, None, batch.replay_start)
        for cache in self.layout.by_kind("indexer"):
            self.read_indexer(batch, cache, batch.metadata, None)
            if batch.replay is not None and cache.layer >= model.cut:
                self.read_indexer(batch, cache, batch.replay.metadata, batch.replay)

    def request_rows(
        self, batch: Batch, replay: ReplayView | None
    ) -> list[tuple[int, int, int, int]]:
        """(request, first row, end row, first position) of each real request
        in the batch (or in its kept rows)."""
        ranges = replay.token_ranges() if replay is not None else batch.token_ranges()
        out = []
        for r, (first, end) in enumerate(ranges):
            last_pos = batch.starts[r] + batch.counts[r]
            out.append((r, first, end, last_pos - (end - first)))
        return out

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

    def read_attention(
        self,
        batch: Batch,
        layer: int,
        md: dict[str, Any],  # layer prefix -> vLLM's attention metadata
        replay: ReplayView | None,
        lower: list[int],
    ) -> None:
        plan, model, inputs = batch.plan, self.model, self.inputs
        reader = self.layout.readers[layer]
        ratio = model.compress_ratios[layer]
        swa_cache = self.layout.find("swa", layer)
        swa_md = md[swa_cache.name]
        spans = self.request_rows(batch, replay)
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
                timed = self.timed(kernel, layer, rows_read, call)
                if not self.call(plan, kernel, f"layer {layer}", timed):
                    return
        try:
            truth = self.attention_truth(batch, layer, spans, lower, chosen)
        except records.MissingRecord as exc:
            self.problem(plan, calls[-1][0], f"layer {layer}: {exc}")
            return
        self.check_attention(plan, layer, q, out, launches, truth, nd)

    def attention_truth(
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

    def check_attention(
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
                self.problem(
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
            self.note(plan, kernel, self.error(kernel, got[row], dense))

    def dense_swa(self, name: str, layer: int) -> torch.Tensor:
        """Every position's sliding-window row as the SWA writer stores it
        (RoPE, bf16, then fp8 NoPE, or fp8 throughout in the SM100 MXFP8
        record), dequantised; computed once per prompt and layer."""
        key = ("swa", name, layer)
        if key not in self.dense:
            inputs = self.inputs
            rows = ref.rope_swa_rows(
                inputs.swa[name][layer], inputs.cos_sin, ref.Rounding("round-to-nearest-even")
            )
            self.dense[key] = ref.dense_swa_rows(rows, self.rounding, self.layout.kv_records.mxfp8)
        return self.dense[key]

    def dense_compressed(self, name: str, source: int, ratio: int) -> torch.Tensor:
        """Every compressed state's row as ``rope_quant_insert`` stores it (the
        latent of the state's last token, RoPE at its first; fp8 NoPE and bf16
        RoPE, or fp8 throughout in the SM100 MXFP8 record), dequantised."""
        key = ("compressed", name, source)
        if key not in self.dense:
            states = torch.arange(self.model.max_model_len // ratio)
            latent = self.inputs.latent[name][source][states * ratio + ratio - 1]
            angles = self.inputs.cos_sin[states * ratio]
            self.dense[key] = ref.dense_compressed_rows(
                latent, angles[:, :32], angles[:, 32:], self.rounding, self.layout.kv_records.mxfp8
            )
        return self.dense[key]

    def error(self, kernel: str, got: torch.Tensor, want: torch.Tensor) -> float:
        """Relative error as the kernel's bound measures it: L2 for a real
        attention kernel (it rounds through fp8/bf16), max-abs otherwise."""
        got, want = got.float(), want.float()
        if not bool(torch.isfinite(got).all()):
            return float("inf")
        if self.bound(kernel).measure == bd.REL_L2:
            norm = float(want.norm())
            return float((got - want).norm()) / norm if norm else float((got - want).norm())
        scale = float(want.abs().max()) if want.numel() else 0.0
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        return diff / scale if scale else diff

    def dense_index_keys(self, name: str, layer: int, ratio: int, count: int) -> torch.Tensor:
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

    def read_indexer(
        self,
        batch: Batch,
        cache: CacheLayer,
        md: dict[str, Any],  # layer prefix -> vLLM's attention metadata
        replay: ReplayView | None,
    ) -> None:
        imd = md[cache.name]
        spans = self.request_rows(batch, replay)
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
        timed = self.timed(kn.INDEXER_LOGITS, cache.layer, batch_size, paged_logits)
        with self.kernels.recording(launches):
            if not self.call(plan, kn.INDEXER_LOGITS, cache.name, timed):
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
                self.problem(plan, kn.INDEXER_LOGITS, f"{cache.name}: {exc}")
                continue
            expected[b] = raw
            self.check_logits(plan, q_fp8[b, 0], weights[b], keys, logits[b, :count])
        misread = sum(records.logits_misreads(launch, expected) for launch in launches)
        if misread:
            self.problem(
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
        bound = self.bound(kn.INDEXER_LOGITS)
        limit = (
            bd.logits_element_bound(q_fp8, weights, keys, want)
            if bound.per_element
            else torch.zeros_like(want)
        )
        error, at = bd.worst_element(got, want, limit)
        self.note(plan, kn.INDEXER_LOGITS, error, at)
        k = min(self.model.index_topk, want.numel())
        outside = bd.topk_outsiders(torch.topk(got, k).indices, want, limit, k)
        if outside:
            self.problem(
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

        if not self.call(plan, kn.INDEXER_GATHER, cache.name, gather):
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
                self.problem(plan, kn.INDEXER_GATHER, f"{cache.name}: {exc}")
                continue
            error = self.error(kn.INDEXER_GATHER, got[cu[b] : cu[b + 1]], want)
            self.note(plan, kn.INDEXER_GATHER, error)

    # ---------------------------------------------------------- the end

    def stray_bytes(self) -> int:
        """Bytes that differ from the sentinel outside every cache's pages in
        every block the run allocated."""
        own = self.layout.mask_of({name: sorted(self.ever_held) for name in self.layout.caches})
        return int(((self.layout.storage != SENTINEL) & ~own).sum())


def tiling_problems(layout: Layout) -> list[str]:
    """Per cache group and block: the caches' pages (kernel pages where split)
    must not overlap and must cover exactly the bytes of their manager pages."""
    problems = []
    for gid in range(len(layout.kv_cache_config.kv_cache_groups)):
        caches = [c for c in layout.caches.values() if c.group_id == gid]
        for block in range(1, layout.kv_cache_config.num_blocks):
            pages = sorted(r for c in caches for r in layout.own_bytes(c, [block]))
            manager = sorted(
                (
                    c.manager_view.element_size()
                    * (c.manager_view.storage_offset() + block * c.manager_view.stride(0)),
                    c.manager_view.element_size()
                    * (c.manager_view.storage_offset() + block * c.manager_view.stride(0))
                    + c.spec.page_size_bytes,
                )
                for c in caches
            )
            if any(a[1] > b[0] for a, b in zip(pages, pages[1:])):
                problems.append(f"group {gid} block {block}: pages overlap")
            if _merged(pages) != _merged(manager):
                problems.append(
                    f"group {gid} block {block}: pages {_merged(pages)} do not "
                    f"tile the manager pages {_merged(manager)}"
                )
    return problems


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


@contextlib.contextmanager
def _fix_for(geometry: Geometry, device: kn.Device) -> Iterator[AppliedFix | None]:
    """The fix applied as the plugin applies it on SM12x (any device: its
    code paths never consult the capability), with the control's change."""
    if not geometry.via_plugin:
        yield None
        return
    from .applied import applied_fix, untranslated_ratio1_slots

    with applied_fix() as applied:
        if geometry.untranslated:
            with untranslated_ratio1_slots():
                yield applied
        else:
            yield applied


@contextlib.contextmanager
def _geometry_run(
    name: str,
    device: kn.Device,
    kernels: kn.Kernels,
    result: GeometryResult,
    model: TinyModel | None,
    seed: int,
    entering: Callable[[str], None] | None = None,
) -> Iterator[Run]:
    """A run of geometry ``name`` on ``device``, its layout built by vLLM
    inside what the geometry needs (the fix applied or not, vLLM's SM120
    host on CPU, the attention entry point on ``kernels``); ``result`` gets
    the layout's facts."""
    geometry = GEOMETRIES[name]
    model = model or TinyModel()
    if not geometry.via_plugin:
        model = model.without_drafter()
    cpu = device.kind == "cpu"
    host = simulated_sm120_host() if cpu else contextlib.nullcontext()
    threads = one_torch_thread() if cpu else contextlib.nullcontext()
    with (
        threads,
        host,
        drafter_pages_at_128(),
        _fix_for(geometry, device) as applied,
        kernels.attention_entry(),
    ):
        layout = build_layout(geometry, model, SENTINEL, device.torch_device)
        result.block_size = layout.block_size
        result.layout = describe(layout)
        result.guard_error = layout.guard_error
        if applied is not None:
            from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix

            result.status = f"{applied.status.reason}; {fix.status_detail()}"
        result.tiling_problems = tiling_problems(layout)
        yield Run(layout, kernels, result, seed, entering)


def run_geometry(
    name: str,
    device: kn.Device,
    kernels: kn.Kernels | None = None,
    model: TinyModel | None = None,
    seed: int = 0,
    plans: tuple[StepPlan, ...] = TIMELINE,
    entering: Callable[[str], None] | None = None,
) -> GeometryResult:
    """Replay the timeline (or its first ``plans``) on one geometry; never
    raises for what it finds.  ``entering`` is told each kernel before it is
    called and ``""`` after it returns (a process that dies in a kernel is
    charged to it)."""
    kernels = kernels or kn.Kernels.for_device(device)
    result = new_result(name)
    start = time.monotonic()
    try:
        with _geometry_run(name, device, kernels, result, model, seed, entering) as run:
            for plan in plans:
                run.step(plan)
            result.stray_bytes = run.stray_bytes()
    except DeviceFault as fault:
        result.aborted = str(fault)
        result.crashed_in = fault.kernel
    except Exception as exc:
        result.aborted = f"{type(exc).__name__}: {exc}"
        result.layout.append(traceback.format_exc(limit=6))
    result.seconds = time.monotonic() - start
    return result


def timed_step_launches(
    name: str,
    device: kn.Device,
    kernels: kn.Kernels,
    plans: tuple[StepPlan, ...] = TIMELINE,
    timed_step: str = TIMED_STEP,
    model: TinyModel | None = None,
    entering: Callable[[str], None] | None = None,
) -> tuple[GeometryResult, dict[str, list[TimedLaunch]]]:
    """Replay ``plans`` on geometry ``name`` up to and including the step
    named ``timed_step``; its result and the launches of the timed kernels
    that step made (the run stops there, so their arguments stay as that step
    left them).  Raises what stops the run."""
    if timed_step not in [plan.name for plan in plans]:
        raise ValueError(f"no step named {timed_step!r} to time")
    result = new_result(name)
    with _geometry_run(name, device, kernels, result, model, 0, entering) as run:
        run.timed_step = timed_step
        for plan in plans:
            run.step(plan)
            if plan.name == timed_step:
                break
    return result, run.timed_launches
