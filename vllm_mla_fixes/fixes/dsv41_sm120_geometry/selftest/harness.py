"""One self-test run of a geometry: replay the serving timeline, write, read, compare, account.

For each step of :data:`.timeline.TIMELINE` (all vLLM calls are the installed
release's own code):

1. vLLM's ``KVCacheManager`` allocates the step's blocks; ``BlockTables`` gives
   the block tables and slot mappings; ``KVBlockZeroer`` zeroes the blocks the
   scheduler lists as new; ``build_attn_metadata`` builds every group's
   metadata (with the replay start and vLLM's replay padding of slots), and for
   decoder replay the kept rows' metadata on copies of the groups.
2. The writers write random latents (:mod:`.inputs`) with the slot mappings
   the metadata gives them (:mod:`.writes`: each write is attributed: bytes it
   changed outside its cache's own pages in the batch's blocks are foreign);
   the records each write left are read back at the slots it was given, kept,
   and compared with a dense PyTorch computation on the un-paged latents,
   element by element (:mod:`.records`).
3. The readers read (:mod:`.reads`, :mod:`.kernels`): every layer's attention
   for every row of the step through ``_forward_decode`` /
   ``_forward_prefill``; the indexer's decode logits and top-k, and its
   prefill K gather.  The bytes each kernel reads must be the kept records of
   the tokens it should read; each read is then compared with the same
   computation on those records.

Every finding is charged to its kernel and to the cases of its step
(:mod:`.findings`, :mod:`.results`).  At the end, bytes that differ from the
sentinel outside every cache's pages are counted (stray bytes,
:mod:`.accounting`), and each case of :data:`.timeline.CASES` gets a verdict
from the steps that exercise it.
"""

from __future__ import annotations

import contextlib
import random
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from . import kernels as kn
from . import records
from . import reference as ref
from .accounting import SENTINEL, stray_bytes, tiling_problems
from .env import drafter_pages_at_128, one_torch_thread, simulated_sm120_host
from .findings import DeviceFault, Findings
from .inputs import DenseReference, Inputs
from .layout import GEOMETRIES, Geometry, Layout, TinyModel, build_layout, describe
from .phase import RunParts
from .reads import AttentionReads, IndexerReads
from .results import GeometryResult, new_result
from .timed_step import TIMED_STEP, TimedLaunch, TimedStep, timed_work
from .timeline import PROMPTS, TIMELINE, Batch, BlockScheduler, StepPlan, Worker
from .writes import Writes

if TYPE_CHECKING:
    from vllm_mla_fixes.patching import AppliedFix


class Run:
    """The serving timeline replayed step by step on one layout: each step's
    blocks and metadata, then its writes and reads, each phase checked."""

    def __init__(
        self,
        layout: Layout,
        kernels: kn.Kernels,
        result: GeometryResult,
        seed: int,
        entering: Callable[[str], None] | None = None,
    ):
        self.layout = layout
        self.result = result
        self.model = layout.model
        self.inputs = Inputs(layout.model, seed, layout.device)
        self.dense = DenseReference(self.inputs, layout.kv_records.mxfp8)
        self.scheduler = BlockScheduler(layout)
        self.worker = Worker(layout)
        self.ever_held: set[int] = set()
        self.finished_blocks: set[int] = set()
        shares = {name: (other, shared) for name, (_, other, shared) in PROMPTS.items() if other}
        stored = records.Stored(layout.model.max_model_len, shares, ref.index_scales_are_ue8m0x4())
        self.findings = Findings(result, kernels, layout.device, self.model.q_heads, entering)
        self.timed = TimedStep(kernels, self.model.backbone_layers)
        parts = RunParts(layout, kernels, self.inputs, stored, self.findings)
        self.writes = Writes(parts, self.dense)
        self.attention = AttentionReads(parts, self.timed, random.Random(seed))
        self.indexer = IndexerReads(parts, self.timed)

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
                self.findings.problem(
                    plan, None, "no freed block was reallocated: the case did not run"
                )
        self.writes.zero_new_blocks(plan, batch)
        if plan.pad_to:
            self.writes.stale_slot_buffers()
        self.worker.build_metadata(batch)
        for ids in block_ids.values():
            self.ever_held.update(b for group in ids for b in group if b)
        shared = self.shared_prefix_bytes(batch, block_ids)
        self.writes.write(batch, block_ids)
        if shared is not None:
            mask, before = shared
            changed = int((self.layout.storage[mask] != before).sum())
            if changed:
                self.findings.problem(
                    plan, None, f"{changed} bytes of the cached prefix's pages changed"
                )
        with self.timed.during(plan):
            self.read(batch)
        if plan.name == self.timed.step:
            self.result.timed_work = timed_work(self.timed.launches)
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
            self.findings.problem(plan, None, f"offloading connector: {type(exc).__name__}: {exc}")
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
            self.findings.problem(
                plan, None, f"{name}: {lost} bytes of its pages did not come back"
            )

    def rewind(self, name: str, first: int, end: int) -> None:
        """Rejected drafts at positions [first, end): the tokens that replace
        them have other KV, so the reference takes new latents there and the
        next step must overwrite every byte the rejected drafts left."""
        self.inputs.redraw(name, first, end)
        self.dense.forget(name)

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
            self.findings.problem(
                batch.plan, None, "the prefix hit shares no block: the case did not run"
            )
            return None
        mask = self.layout.mask_of(pages)
        return mask, self.layout.storage[mask].clone()

    def read(self, batch: Batch) -> None:
        """Every layer's attention, then every indexer cache's reads; layers from
        the cut on read with the kept rows' metadata where the decoder replays."""
        model = self.model
        for layer in range(len(model.compress_ratios)):
            if batch.replay is not None and layer >= model.cut:
                self.attention.read_layer(
                    batch,
                    layer,
                    batch.replay.metadata,
                    batch.replay,
                    batch.replay.kv_start if layer > model.cut else batch.replay_start,
                )
            else:
                self.attention.read_layer(batch, layer, batch.metadata, None, batch.replay_start)
        for cache in self.layout.by_kind("indexer"):
            self.indexer.read_indexer(batch, cache, batch.metadata, None)
            if batch.replay is not None and cache.layer >= model.cut:
                self.indexer.read_indexer(batch, cache, batch.replay.metadata, batch.replay)


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
            from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import status_detail

            result.status = f"{applied.status.reason}; {status_detail()}"
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
    if GEOMETRIES[name].role == "dspark":  # its own serving and checks
        from .dspark import run_dspark_long_prefill

        return run_dspark_long_prefill(device, kernels, seed, entering)
    result = new_result(name)
    start = time.monotonic()
    try:
        with _geometry_run(name, device, kernels, result, model, seed, entering) as run:
            for plan in plans:
                run.step(plan)
            result.stray_bytes = stray_bytes(run.layout, run.ever_held)
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
        run.timed.step = timed_step
        for plan in plans:
            run.step(plan)
            if plan.name == timed_step:
                break
    return result, run.timed.launches
