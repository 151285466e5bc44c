"""The serving timeline the harness replays, and each step's metadata as vLLM builds it.

Three prompts go through nine steps (:data:`TIMELINE`), chosen so that every
path a default DeepSeek-V4.1 server takes runs at least once, with as few
tokens as that takes (the CPU runs vLLM's Triton kernels in an interpreter):

* ``A`` (260 tokens) is prefilled in three chunks (128, 101 and 31 tokens; the
  third starts at an odd position), then decodes;
* ``B`` repeats A's first 256 tokens: a prefix-cache hit, whose sliding-window
  KV vLLM replays from position 128 (SWA bounded replay), and a prefill of 148
  rows, longer than the window, so decoder replay runs the layers after the
  last kv source on its last 128 rows through copies of the attention groups;
* A and B decode in a batch padded to four requests, as a FULL CUDA graph runs
  it;
* ``C`` is admitted after A finished and gets A's freed blocks, whose stale
  contents vLLM's ``KVBlockZeroer`` clears first;
* B and C then verify drafts as a speculative decoder (DSpark) does: each
  request carries 1 + 3 tokens (its sampled token and three drafts), in a
  batch padded as a FULL CUDA graph runs it (C's tokens cross a 64-state
  kernel page); C's last two drafts are rejected, so the next verify step
  rewinds C and writes those positions again, with other KV.  Before that,
  B's blocks are offloaded and reloaded through the regions vLLM's CPU
  offloading connector registers (:func:`offload_regions`).

The scheduler side is vLLM's own ``KVCacheManager`` (prefix hits, null blocks
below a replay, sliding-window block release, the free-block queue, the list of
new blocks to zero), driven as ``Scheduler`` drives it; the replay start comes
from ``Scheduler._mark_prefix_replay``.  The worker side is vLLM's too:
``BlockTables`` (block tables and slot mappings, padded as for a CUDA graph),
``_pad_replayed_slots_kernel``, ``build_attn_metadata`` with
``ReplayAttnMetadata``, and for decoder replay ``_gather_replay_batch_kernel``
and ``DeepseekV41ModelState._copy_attn_groups``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import torch

from .layout import Layout

CASES: dict[str, str] = {
    "chunked-prefill": "a 260-token prompt prefilled in 3 chunks (128, 101, 31 tokens)",
    "prefix-hit": "a prompt sharing 256 cached tokens: prefix hit, SWA bounded replay from 128",
    "decoder-replay": "layers after the last kv source read through decoder-replay group copies",
    "indexer-prefill": "indexer K gathered through the prefill chunks' block tables",
    "graph-padded": "decode batch padded 2 -> 4 requests (FULL CUDA graph), stale slot buffers",
    "freed-blocks": "a prompt on a finished request's freed blocks, stale contents zeroed",
    "verify": "a verify step: 1 + 3 tokens per request (sampled + drafts), across a 64-state page",
    "rewind": "2 of 3 drafts rejected: positions rewound and written again with other KV",
    "graph-padded-draft": "the verify batch padded 2 -> 4 requests, 8 -> 16 tokens (FULL graph)",
    "offload-reload": "B's blocks offloaded to CPU and reloaded through the OffloadingConnector's "
    "own transfer regions over clobbered pages; B's later reads must match",
}

DRAFTS = 3  # draft tokens per request in a verify step (num_speculative_tokens)


@dataclass(frozen=True)
class StepPlan:
    name: str
    work: tuple[tuple[str, int | None], ...]  # (request, tokens) in batch order; None: the rest
    cases: tuple[str, ...]
    pad_to: int = 0  # FULL CUDA-graph padding of requests (and of tokens, unless pad_tokens)
    finish: tuple[str, ...] = ()  # requests that finish after this step
    pad_tokens: int = 0  # FULL CUDA-graph padding of tokens, where it differs from pad_to
    # Verify steps: drafts each request accepts; the rejected ones are rewound.
    accept: tuple[tuple[str, int], ...] = ()
    # Requests whose blocks are offloaded and reloaded (KV offloading) after the step.
    offload: tuple[str, ...] = ()


PROMPTS: dict[str, tuple[int, str | None, int]] = {
    # name: (prompt length, request whose prompt it starts with, shared length)
    "A": (260, None, 0),
    "B": (276, "A", 256),
    "C": (60, None, 0),  # its drafts, verified at 61-64, cross the 64-state page
}

TIMELINE: tuple[StepPlan, ...] = (
    StepPlan("A prefill 1/3", (("A", 128),), ("chunked-prefill", "indexer-prefill")),
    StepPlan("A prefill 2/3", (("A", 101),), ("chunked-prefill", "indexer-prefill")),
    StepPlan("A prefill 3/3", (("A", 31),), ("chunked-prefill", "indexer-prefill")),
    StepPlan(
        "A decode + B prefill on A's prefix",
        (("A", 1), ("B", None)),
        ("prefix-hit", "decoder-replay", "indexer-prefill"),
    ),
    StepPlan(
        "A, B decode padded to 4", (("A", 1), ("B", 1)), ("graph-padded",), pad_to=4, finish=("A",)
    ),
    StepPlan(
        "B decode + C prefill on freed blocks",
        (("B", 1), ("C", None)),
        ("freed-blocks", "indexer-prefill"),
    ),
    StepPlan(
        "B, C decode, then B offloaded and reloaded",
        (("B", 1), ("C", 1)),
        ("freed-blocks", "offload-reload"),
        offload=("B",),
    ),
    StepPlan(
        "B, C verify 1+3 padded to 4",
        (("B", 1 + DRAFTS), ("C", 1 + DRAFTS)),
        ("verify", "graph-padded-draft", "offload-reload"),
        pad_to=4,
        pad_tokens=4 * (1 + DRAFTS),
        accept=(("B", DRAFTS), ("C", 1)),
    ),
    StepPlan(
        "B, C verify after C's rewind",
        (("B", 1 + DRAFTS), ("C", 1 + DRAFTS)),
        ("verify", "rewind"),
        accept=(("B", DRAFTS), ("C", DRAFTS)),
    ),
)


def prompt_tokens(name: str) -> list[int]:
    """Token ids: distinct per prompt, except the prefix a prompt shares."""
    length, shares, shared = PROMPTS[name]
    base = {"A": 1000, "B": 5000, "C": 9000}[name]
    own = list(range(base, base + length))
    if shares is None:
        return own
    return prompt_tokens(shares)[:shared] + own[shared:]


# ------------------------------------------------------------------ scheduler


class BlockScheduler:
    """vLLM's ``KVCacheManager`` on the layout's KV cache config, driven as
    vLLM's scheduler drives it (prefix caching on)."""

    def __init__(self, layout: Layout, prompts: Callable[[str], list[int]] = prompt_tokens):
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        config = kv_cache_utils.generate_scheduler_kv_cache_config([layout.kv_cache_config])
        scheduler_block, hash_block = kv_cache_utils.resolve_kv_cache_block_sizes(
            config, layout.config
        )
        kv_cache_utils.init_none_hash(sha256)
        self.manager = KVCacheManager(
            config,
            max_model_len=layout.model.max_model_len,
            scheduler_block_size=scheduler_block,
            hash_block_size=hash_block,
            enable_caching=True,
        )
        self.window = max(g.kv_cache_spec.prefix_replay_tokens for g in config.kv_cache_groups)
        self.hasher = kv_cache_utils.get_request_block_hasher(hash_block, sha256)
        self.requests: dict[str, Any] = {}
        self.held: dict[str, set[int]] = {}  # every block a request has held
        self.prompts = prompts

    def schedule(self, name: str, tokens: int | None) -> tuple[int, int, int]:
        """Allocate ``name``'s next ``tokens`` (None: the rest of its prompt);
        returns (first position, token count, replay start)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request

        request = self.requests.get(name)
        replay_start = 0
        if request is None:
            request = Request(
                name,
                self.prompts(name),
                SamplingParams(max_tokens=16),
                None,
                block_hasher=self.hasher,
            )
            self.requests[name] = request
            blocks, hit, _ = self.manager.get_computed_blocks(request)
            if 0 < hit <= self.window:
                raise AssertionError(f"{name}: a hit of {hit} tokens would be dropped")
            replay = Scheduler._mark_prefix_replay(
                SimpleNamespace(prefix_replay_tokens=self.window), request, hit, False
            )
            replay_start = int(request.replay_start)
            computed = hit - replay
            count = request.num_tokens - computed if tokens is None else tokens
            allocated = self.manager.allocate_slots(
                request,
                max(count - replay, 0),
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
            )
            request.num_computed_tokens = computed
        else:
            if request.num_computed_tokens == request.num_tokens:  # it sampled a token
                request.append_output_token_ids(7)
            count = request.num_tokens - request.num_computed_tokens if tokens is None else tokens
            allocated = self.manager.allocate_slots(request, count)
        if allocated is None:
            raise RuntimeError(
                f"the tiny model's block pool cannot hold {name}'s next {count} tokens"
            )
        self.held.setdefault(name, set()).update(
            b for ids in self.manager.get_block_ids(name) for b in ids if b
        )
        return request.num_computed_tokens, count, replay_start

    def advance(self, name: str, count: int, accepted: int | None = None) -> None:
        """After a step: ``count`` tokens were computed; for a verify step,
        only the sampled token and ``accepted`` drafts stay (vLLM's scheduler
        takes the rejected ones back from ``num_computed_tokens``)."""
        request = self.requests[name]
        if accepted is None:
            request.num_computed_tokens += count
            return
        request.append_output_token_ids([7] * accepted)
        request.num_computed_tokens += 1 + accepted

    def block_ids(self, name: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.manager.get_block_ids(name))

    def new_block_ids(self) -> list[int]:
        """The blocks vLLM's scheduler hands the worker to zero this step."""
        return list(self.manager.take_new_block_ids())

    def finish(self, name: str) -> None:
        self.manager.free(self.requests.pop(name))


# --------------------------------------------------------------------- worker


@dataclass
class Batch:
    """One step's batch as the model runner lays it out."""

    plan: StepPlan
    names: list[str]  # batch order
    starts: list[int]
    counts: list[int]
    replay_start: list[int]
    prefilling: list[bool]
    rows: list[int]  # BlockTables row of each request
    num_reqs: int  # as the builders see it (padded under a FULL graph)
    num_tokens: int  # real tokens
    num_tokens_padded: int
    positions: torch.Tensor  # [num_tokens_padded] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    slots: torch.Tensor  # [groups, num_tokens_padded]
    block_tables: tuple[torch.Tensor, ...]
    new_block_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)  # layer prefix -> metadata
    replay: Any = None  # ReplayView when decoder replay runs this step

    def token_ranges(self) -> list[tuple[int, int]]:
        """(first, end) batch rows of each real request."""
        out, at = [], 0
        for count in self.counts:
            out.append((at, at + count))
            at += count
        return out


@dataclass
class ReplayView:
    """Decoder replay: the kept rows, and metadata built on the group copies."""

    rows: torch.Tensor  # [kept] outer batch row of each kept row
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    kv_start: list[int]
    metadata: dict[str, object]

    def token_ranges(self) -> list[tuple[int, int]]:
        qsl = self.query_start_loc.tolist()
        return list(zip(qsl[:-1], qsl[1:]))


def _kwargs_supported(func: Callable[..., object], **candidates: object) -> dict[str, object]:
    params = inspect.signature(func).parameters
    return {k: v for k, v in candidates.items() if k in params}


class Worker:
    """The model runner's per-step work up to the attention metadata."""

    def __init__(self, layout: Layout):
        from vllm.v1.kv_cache_interface import SlidingWindowSpec, UniformTypeKVCacheSpecs

        try:
            from vllm.v1.kv_cache_interface import get_block_table_width
        except ImportError:  # before 0.34.0
            from vllm.v1.worker.block_table import get_block_table_width
        from vllm.v1.worker.gpu.block_table import BlockTables

        self.layout = layout
        model, cfg = layout.model, layout.config
        sizes, widths, enabled, sharded, reach = [], [], [], [], []
        self.cacheable, self.ring_groups = [], []
        for gid, group in enumerate(layout.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            first = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            sizes.append(spec.block_size)
            enabled.append(first.uses_slot_mapping)
            sharded.append(spec.dcp_sharded)
            # 0.33+: the sliding window's reach, for nulling SWA entries below it
            reach.append(
                getattr(first, "num_retained_tokens", 0)
                if isinstance(first, SlidingWindowSpec)
                else 0
            )
            if first.prefix_cacheable:
                self.cacheable.append(gid)
            if not first.uses_slot_mapping:
                self.ring_groups.append(gid)
            widths.append(
                get_block_table_width(
                    spec.max_num_blocks_per_req(cfg, model.max_model_len),
                    spec.block_size,
                    token_alignment=spec.block_table_token_alignment,
                )
            )
        self.tables = BlockTables(
            block_sizes=sizes,
            max_num_reqs=model.max_num_seqs,
            max_num_batched_tokens=model.max_num_batched_tokens,
            max_num_blocks_per_group=widths,
            device=layout.device,
            slot_mapping_enabled=enabled,
            dcp_sharded=sharded,
            **_kwargs_supported(BlockTables.__init__, sliding_window_reach=reach),
        )
        self.masks_swa = (
            "num_computed_tokens" in inspect.signature(BlockTables.gather_block_tables).parameters
        )
        self.num_computed = torch.zeros(model.max_num_seqs, dtype=torch.int32, device=layout.device)
        self.rows: dict[str, int] = {}
        # Decoder replay's copies of the attention groups (the replayed layers', the
        # first SWA layer's), made once as DeepseekV41ModelState makes them.
        self.replay_groups: tuple[list[list[object]], list[list[object]]] | None = None

    # ---------------------------------------------------------------- a step

    def prepare(
        self,
        plan: StepPlan,
        scheduled: list[tuple[str, int, int, int, bool]],
        block_ids: dict[str, tuple[list[int], ...]],
        new_block_ids: list[int],
    ) -> Batch:
        device = self.layout.device
        for name, *_ in scheduled:
            if name not in self.rows:
                self.rows[name] = min(
                    set(range(self.layout.model.max_num_seqs)) - set(self.rows.values())
                )
            self.tables.append_block_ids(self.rows[name], block_ids[name], overwrite=True)
        self.tables.apply_staged_writes()
        names = [s[0] for s in scheduled]
        starts = [s[1] for s in scheduled]
        counts = [s[2] for s in scheduled]
        replay_start = [s[3] for s in scheduled]
        prefilling = [s[4] for s in scheduled]
        rows = [self.rows[n] for n in names]
        num_tokens = sum(counts)
        num_reqs = max(plan.pad_to, len(names))
        padded = max(plan.pad_tokens or plan.pad_to, num_tokens)
        positions = torch.full((padded,), 0, dtype=torch.int64)
        positions[:num_tokens] = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])
        # Graph-padding rows keep whatever the persistent buffer last held.
        positions[num_tokens:] = 999
        qsl = torch.full((num_reqs + 1,), num_tokens, dtype=torch.int32)
        qsl[0] = 0
        qsl[1 : len(names) + 1] = torch.cumsum(torch.tensor(counts), 0)
        seq_lens = torch.zeros(num_reqs, dtype=torch.int32)
        seq_lens[: len(names)] = torch.tensor([s + c for s, c in zip(starts, counts)])
        for name, start in zip(names, starts):
            self.num_computed[self.rows[name]] = start
        idx = torch.tensor(rows, dtype=torch.int32, device=device)
        positions, qsl_dev, seq_lens = (t.to(device) for t in (positions, qsl, seq_lens))
        gather = {"num_computed_tokens": self.num_computed} if self.masks_swa else {}
        block_tables = self.tables.gather_block_tables(idx, num_reqs, **gather)
        slots = self.tables.compute_slot_mappings(
            idx, qsl_dev[: len(names) + 1], positions, padded
        ).clone()
        return Batch(
            plan,
            names,
            starts,
            counts,
            replay_start,
            prefilling,
            rows,
            num_reqs,
            num_tokens,
            padded,
            positions,
            qsl_dev,
            seq_lens,
            slots,
            tuple(block_tables),
            new_block_ids,
        )

    def build_metadata(self, batch: Batch) -> None:
        """vLLM's replay padding of the cacheable groups' slots, then every
        group's metadata through ``build_attn_metadata``."""
        from vllm.models.deepseek_v41.nvidia.model_state import (
            ReplayAttnMetadata,
            _pad_replayed_slots_kernel,
        )
        from vllm.v1.attention.backends.utils import PAD_SLOT_ID

        device = self.layout.device
        replay_start = torch.zeros(batch.num_reqs, dtype=torch.int32, device=device)
        replay_start[: len(batch.names)] = torch.tensor(batch.replay_start, dtype=torch.int32)
        if any(batch.replay_start):
            cacheable = torch.tensor(self.cacheable, dtype=torch.int32, device=device)
            _pad_replayed_slots_kernel[(len(batch.names),)](
                batch.slots,
                batch.slots.stride(0),
                cacheable,
                batch.query_start_loc,
                batch.positions,
                replay_start,
                self.window,
                PAD_SLOT_ID,
                NUM_GROUPS=len(self.cacheable),
                BLOCK=1024,
            )
        full_graph = batch.plan.pad_to > 0
        batch.metadata = self._build(
            self.layout.attn_groups,
            batch,
            batch.num_reqs,
            batch.num_tokens_padded if full_graph else batch.num_tokens,
            batch.query_start_loc,
            batch.positions,
            batch.slots,
            ReplayAttnMetadata(replay_start),
        )
        batch.replay = self._decoder_replay(batch, replay_start)

    @property
    def window(self) -> int:
        return self.layout.model.sliding_window

    def _build(
        self,
        attn_groups: list[list[object]],  # vLLM's AttentionGroups, per KV-cache group
        batch: Batch,
        num_reqs: int,
        num_tokens: int,
        qsl: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        replay: object,  # vLLM's ReplayAttnMetadata
    ) -> dict[str, object]:
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

        lens = batch.seq_lens[:num_reqs]
        query_lens = (qsl[1 : num_reqs + 1] - qsl[:num_reqs]).tolist()
        is_prefilling = torch.tensor(batch.prefilling, device=self.layout.device)
        return cast(
            "dict[str, object]",
            build_attn_metadata(
                attn_groups=attn_groups,
                num_reqs=num_reqs,
                num_tokens=num_tokens,
                query_start_loc_gpu=qsl[: num_reqs + 1],
                query_start_loc_cpu=qsl[: num_reqs + 1].cpu(),
                max_query_len=max(query_lens),
                seq_lens=lens,
                max_seq_len=int(lens.max()),
                block_tables=[t[:num_reqs] for t in batch.block_tables],
                slot_mappings=slots,
                kv_cache_config=self.layout.kv_cache_config,
                seq_lens_cpu_upper_bound=lens.cpu(),
                positions=positions,
                is_prefilling=is_prefilling,
                model_specific_attn_metadata=replay,
            ),
        )

    def _decoder_replay(self, batch: Batch, replay_start: torch.Tensor) -> ReplayView | None:
        """Eager decoder replay (``DeepseekV41ModelState._prepare_replay_batch``):
        when a prefilling request schedules more rows than the window, the
        layers from the last kv source on run each request's last
        ``min(rows, window)`` rows, with metadata built on copies of the groups
        that hold them."""
        from vllm.models.deepseek_v41.nvidia.model_state import (
            DeepseekV41ModelState,
            ReplayAttnMetadata,
            _gather_replay_batch_kernel,
        )

        model = self.layout.model
        if model.cut >= len(model.compress_ratios) - 1 or batch.plan.pad_to:
            return None
        kept = [min(c, self.window) if p else c for c, p in zip(batch.counts, batch.prefilling)]
        if kept == batch.counts:
            return None
        device = self.layout.device
        num_reqs = len(batch.names)
        kept_qsl_np = [0, *itertools.accumulate(kept)]
        outer_qsl = batch.query_start_loc[: num_reqs + 1].cpu()
        dropped_before = (outer_qsl - torch.tensor(kept_qsl_np, dtype=torch.int32)).to(device)
        num_kept = sum(kept)
        groups = batch.slots.shape[0]
        rows = torch.empty(num_kept, dtype=torch.int64, device=device)
        kept_qsl = torch.empty(num_reqs + 1, dtype=torch.int32, device=device)
        kept_positions = torch.empty(num_kept, dtype=torch.int64, device=device)
        kept_slots = torch.empty(groups, num_kept, dtype=batch.slots.dtype, device=device)
        kv_start = torch.empty(num_reqs, dtype=torch.int32, device=device)
        _gather_replay_batch_kernel[(num_reqs,)](
            batch.query_start_loc,
            dropped_before,
            batch.seq_lens,
            replay_start,
            batch.positions,
            batch.slots,
            batch.slots.stride(0),
            rows,
            kept_qsl,
            kept_positions,
            kept_slots,
            kept_slots.stride(0),
            kv_start,
            self.window,
            NUM_GROUPS=groups,
            BLOCK=1024,
        )
        prefixes, first_swa = self._replay_prefixes()
        if self.replay_groups is None:
            state = SimpleNamespace(vllm_config=self.layout.config, device=device)
            self.replay_groups = (
                DeepseekV41ModelState._copy_attn_groups(state, self.layout.attn_groups, prefixes),
                DeepseekV41ModelState._copy_attn_groups(
                    state, self.layout.attn_groups, {first_swa}
                ),
            )
        replay_groups, first_swa_groups = self.replay_groups
        metadata = self._build(
            replay_groups,
            batch,
            num_reqs,
            num_kept,
            kept_qsl,
            kept_positions,
            kept_slots,
            ReplayAttnMetadata(kv_start),
        )
        metadata[first_swa] = self._build(
            first_swa_groups,
            batch,
            num_reqs,
            num_kept,
            kept_qsl,
            kept_positions,
            kept_slots,
            ReplayAttnMetadata(replay_start),
        )[first_swa]
        return ReplayView(rows, kept_qsl, kept_positions, kept_slots, kv_start.tolist(), metadata)

    def _replay_prefixes(self) -> tuple[set[str], str]:
        """``DecoderReplayLayers.metadata_prefixes`` and ``first_swa_prefix`` of
        the tiny model: from the cut on, each layer's SWA cache, the compressed
        cache it reads and the indexer cache it owns."""
        model = self.layout.model
        prefixes: set[str] = set()
        for layer in range(model.cut, len(model.compress_ratios)):
            prefixes.add(f"model.layers.{layer}.self_attn.swa_cache")
            source = model.source_of(layer)
            if source is not None:
                prefixes.add(f"model.layers.{source}.self_attn")
            if layer in model.kv_sources:
                prefixes.add(f"model.layers.{layer}.self_attn.indexer.k_cache")
        return prefixes, f"model.layers.{model.cut}.self_attn.swa_cache"


# ------------------------------------------------------------------ offloading


def offload_regions(layout: Layout) -> tuple[tuple[int, ...], dict[int, list[tuple[Any, int]]]]:
    """What vLLM's CPU offloading connector (``--kv-offloading-size``) moves per
    block id: its worker's own ``register_kv_caches`` on the bound manager
    views, captured where it hands the regions to its transfer worker.
    Returns (offloaded group ids, group id -> [(``[num_blocks, bytes]`` tensor,
    bytes moved per block)])."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    captured: list[Any] = []

    class CapturingSpec:  # the OffloadingSpec's part registration uses
        replicated_layout = False

        def get_worker(self, kv_caches: object) -> None:  # vLLM's canonical KV caches
            captured.append(kv_caches)

    # Canonical page mappings ask the model for its KV heads: MLA keeps one latent head.
    model_config = SimpleNamespace(**vars(layout.config.model_config))
    model_config.get_total_num_kv_heads = lambda: 1
    config = SimpleNamespace(**vars(layout.config))
    config.model_config = model_config
    worker = OffloadingConnectorWorker.__new__(OffloadingConnectorWorker)
    worker.spec, worker.vllm_config, worker.kv_cache_config = (
        CapturingSpec(),
        config,
        layout.kv_cache_config,
    )
    worker.register_kv_caches({c.name: c.manager_view for c in layout.caches.values()})
    (caches,) = captured
    group_ids = tuple(get_offloading_group_ids(layout.kv_cache_config))
    regions = {
        gid: [(caches.tensors[ref.tensor_idx].tensor, ref.page_size_bytes) for ref in refs]
        for gid, refs in zip(group_ids, caches.group_data_refs)
    }
    return group_ids, regions
