"""One harness run: allocate a geometry, write random latents through vLLM's
writers and slot mappings, decode, compare, and account for every byte.

Flow (all vLLM calls are the installed release's own code):

1. :func:`.geometry.build_layout` allocates and binds the caches; the whole
   allocation is filled with a sentinel byte.
2. Block ids are drawn at random (without repeats, block 0 being vLLM's null
   block) for every request and cache group, as the shared block pool would
   hand them out, and staged into a real ``BlockTables``.
3. Two steps run: a prefill of every request but its last token, then a decode
   step of that last token.  Per step, ``BlockTables`` gathers the tables and
   computes the slot mappings; the attention groups' metadata builders (the
   FlashInfer sparse-MLA builder every step, the SWA builder in the decode
   step; in the write-only prefill step the SWA writer takes the group's slot
   mapping, which that builder passes through unchanged) build their
   metadata.  The indexer's builder needs DeepGEMM on a GPU to build, so its
   K slots come from the ``get_compressed_slot_mapping`` call its ``build()``
   makes, with the builder's own spec.  The writers then run:
   ``quantize_and_insert_k_cache`` for the sliding window (the Triton twin of
   the CUDA-only fused insert SM120 uses, same 2-D page view and
   ``block_size`` argument; its input is the already-rotated row),
   ``rope_quant_insert`` for the compressed KV cache and
   ``indexer_k_norm_rope_store`` for the indexer keys, each with the slot
   mapping vLLM gives it.  Every write is checked against the sentinel.
4. Decode: ``compute_global_topk_indices_and_lens`` maps the (random) local
   top-k of each layer to cache slots through the compressed cache's block
   table, and the SWA builder's ``decode_swa_indices`` give the window;
   :func:`.reference.sm120_sparse_decode` reads the pages with them.  The
   dense reference uses the same positions on the un-paged latents.
5. Indexer: every state of every request is read back through the indexer's
   block table and compared with the dense index keys.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field

import torch

from . import reference as ref
from .env import interpreter_problem, simulated_sm120_host
from .layout import GEOMETRIES, CacheLayer, Layout, TinyModel, build_layout, describe

SENTINEL = 0xA5
SCALE = 512**-0.5


@dataclass
class WriteRecord:
    step: str
    cache: str
    changed_bytes: int  # bytes this write changed
    foreign_bytes: int  # ... outside the cache's own pages
    clobbered_bytes: int  # ... inside other caches' pages (a subset of foreign)
    clobbered: dict[str, int] = field(default_factory=dict)  # per other cache


@dataclass
class HarnessResult:
    geometry: str
    rounding: str
    layout: list[str]
    guard_error: str | None
    ratios: tuple[int, ...] = ()
    attention: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    indexer: dict[int, dict[str, float]] = field(default_factory=dict)
    writes: list[WriteRecord] = field(default_factory=list)
    stray_bytes: int = 0
    # per step and ratio-1 cache: writer slots that differ from the kernel-table formula
    slot_mismatches: dict[str, int] = field(default_factory=dict)
    # overlaps or gaps of the caches' (kernel) pages within a cache group's blocks
    tiling_problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    status: str = ""  # the fix's applied reason, for geometries run through it

    @property
    def foreign_bytes(self) -> int:
        return sum(w.foreign_bytes for w in self.writes)

    @property
    def clobbered_bytes(self) -> int:
        return sum(w.clobbered_bytes for w in self.writes)

    @property
    def clobbered_caches(self) -> dict[str, int]:
        """Bytes written into each cache's pages by other caches' writes."""
        out: dict[str, int] = {}
        for w in self.writes:
            for name, n in w.clobbered.items():
                out[name] = out.get(name, 0) + n
        return out

    def worst(self, key: str = "vs_quantized") -> dict[str, float]:
        figs = [a[key] for a in self.attention.values()]
        return {
            "max_abs": max(f["max_abs"] for f in figs),
            "rel": max(f["rel"] for f in figs),
            "non_finite": sum(f["non_finite"] for f in figs),
            "finite_max_abs": max(f["finite_max_abs"] for f in figs),
        }

    def indexer_worst(self) -> dict[str, float]:
        return {
            "max_abs": max(f["max_abs"] for f in self.indexer.values()),
            "rel": max(f["rel"] for f in self.indexer.values()),
        }

    def summary(self) -> str:
        w = self.worst()
        u = self.worst("vs_unquantized")
        i = self.indexer_worst()
        return (
            f"[{self.geometry}] attention vs dense(fp8 as written): max abs "
            f"{w['max_abs']:.3e}, rel {w['rel']:.3e} ({w['non_finite']} non-finite outputs, "
            f"finite part max abs {w['finite_max_abs']:.3e}); vs dense(bf16): rel "
            f"{u['rel']:.3e}; indexer keys rel {i['rel']:.3e}; bytes written "
            f"outside own pages {self.foreign_bytes} (into other caches' pages "
            f"{self.clobbered_bytes}); non-sentinel bytes outside all own pages "
            f"{self.stray_bytes} ({self.seconds:.0f} s)"
        )


# --------------------------------------------------------------------------
# Inputs.
# --------------------------------------------------------------------------


@dataclass
class Inputs:
    swa: dict[int, list[torch.Tensor]]  # layer -> per request [L, 512] bf16
    latent: dict[int, list[torch.Tensor]]  # kv source -> per request [L, 512]
    k_pre: dict[int, list[torch.Tensor]]  # kv source -> per request [L, 128]
    norm_weight: dict[int, torch.Tensor]
    cos_sin: torch.Tensor  # [max_model_len, 64] fp32: cos half, sin half
    q: dict[int, torch.Tensor]  # layer -> [R, H, 512] bf16 decode queries
    sink: dict[int, torch.Tensor]  # layer -> [H] fp32
    topk: dict[int, torch.Tensor]  # compressed layer -> [R, index_topk] int32


def make_inputs(model: TinyModel, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    lens = model.seq_lens
    half = 32
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(model.max_model_len, dtype=torch.float64)[:, None] * inv_freq
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32)
    topk = {}
    for layer, ratio in enumerate(model.compress_ratios):
        if ratio == 0:
            continue
        rows = torch.full((len(lens), model.index_topk), -1, dtype=torch.int32)
        for r, length in enumerate(lens):
            states = length // ratio  # states complete once position L-1 is in
            pick = torch.randperm(states, generator=gen)[: model.index_topk]
            rows[r, : pick.numel()] = pick.to(torch.int32)
        topk[layer] = rows
    layers = range(len(model.compress_ratios))
    return Inputs(
        swa={l: [randn(n, 512) for n in lens] for l in layers},
        latent={s: [randn(n, 512) for n in lens] for s in model.kv_sources},
        k_pre={s: [randn(n, 128) for n in lens] for s in model.kv_sources},
        norm_weight={
            s: (torch.rand(128, generator=gen) + 0.5).to(torch.bfloat16)
            for s in model.kv_sources
        },
        cos_sin=cos_sin,
        q={l: randn(len(lens), model.q_heads, 512) for l in layers},
        sink={l: torch.randn(model.q_heads, generator=gen) for l in layers},
        topk=topk,
    )


# --------------------------------------------------------------------------
# Blocks, tables, steps.
# --------------------------------------------------------------------------


def allocate_blocks(layout: Layout, seed: int) -> list[list[list[int]]]:
    """Per cache group, per request: distinct block ids from the shared pool."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, UniformTypeKVCacheSpecs

    pool = list(range(1, layout.kv_cache_config.num_blocks))
    random.Random(seed).shuffle(pool)
    out = []
    for group in layout.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        first = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        per_req = []
        for length in layout.model.seq_lens:
            n = 1 if isinstance(first, CircularBufferSpec) else math.ceil(length / spec.block_size)
            if len(pool) < n:
                raise RuntimeError("the tiny model's block pool is too small")
            per_req.append([pool.pop() for _ in range(n)])
        out.append(per_req)
    return out


def make_block_tables(layout: Layout, blocks: list[list[list[int]]]):
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    try:
        from vllm.v1.kv_cache_interface import get_block_table_width
    except ImportError:  # before 0.34.0
        from vllm.v1.worker.block_table import get_block_table_width
    from vllm.v1.worker.gpu.block_table import BlockTables

    model, cfg = layout.model, layout.config
    sizes, widths, enabled, sharded = [], [], [], []
    for group in layout.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        first = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        sizes.append(spec.block_size)
        enabled.append(first.uses_slot_mapping)
        sharded.append(spec.dcp_sharded)
        widths.append(
            get_block_table_width(
                spec.max_num_blocks_per_req(cfg, model.max_model_len),
                spec.block_size,
                token_alignment=spec.block_table_token_alignment,
            )
        )
    tables = BlockTables(
        block_sizes=sizes,
        max_num_reqs=model.max_num_seqs,
        max_num_batched_tokens=model.max_num_batched_tokens,
        max_num_blocks_per_group=widths,
        device=torch.device("cpu"),
        slot_mapping_enabled=enabled,
        dcp_sharded=sharded,
    )
    for r in range(len(model.seq_lens)):
        tables.append_block_ids(r, tuple(g[r] for g in blocks), overwrite=True)
    tables.apply_staged_writes()
    return tables


@dataclass
class Step:
    name: str
    requests: list[tuple[int, int]]  # per request: positions [start, end)
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def token_rows(self, per_request: list[torch.Tensor]) -> torch.Tensor:
        rows = [x[a:b] for x, (a, b) in zip(per_request, self.requests, strict=True)]
        return torch.cat(rows).contiguous()


def make_step(model: TinyModel, name: str) -> Step:
    if name == "prefill":
        ranges = [(0, n - 1) for n in model.seq_lens]
    else:
        ranges = [(n - 1, n) for n in model.seq_lens]
    lens = [b - a for a, b in ranges]
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    return Step(
        name=name,
        requests=ranges,
        positions=torch.cat([torch.arange(a, b) for a, b in ranges]).to(torch.int64),
        query_start_loc=qsl,
        seq_lens=torch.tensor([b for _, b in ranges], dtype=torch.int32),
    )


def common_metadata(step: Step, tables, gid_count: int):
    """Per cache group: vLLM's CommonAttentionMetadata for the step."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_reqs = len(step.requests)
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32)
    block_tables = tables.gather_block_tables(idx_mapping, num_reqs)
    slots = tables.compute_slot_mappings(
        idx_mapping, step.query_start_loc, step.positions, step.num_tokens
    )
    qlens = step.query_start_loc[1:] - step.query_start_loc[:-1]
    out = []
    for gid in range(gid_count):
        out.append(
            CommonAttentionMetadata(
                query_start_loc=step.query_start_loc,
                query_start_loc_cpu=step.query_start_loc.clone(),
                seq_lens=step.seq_lens,
                num_reqs=num_reqs,
                num_actual_tokens=step.num_tokens,
                max_query_len=int(qlens.max()),
                max_seq_len=int(step.seq_lens.max()),
                block_table_tensor=block_tables[gid],
                slot_mapping=slots[gid].clone(),
                positions=step.positions,
                seq_lens_cpu_upper_bound=step.seq_lens.clone(),
            )
        )
    return out


# --------------------------------------------------------------------------
# Writes.
# --------------------------------------------------------------------------


def _check_write_bounds(view: torch.Tensor, slots: torch.Tensor, rows: int, record: int):
    """The interpreter has no memory protection: refuse a write outside the
    allocation instead of corrupting the process."""
    flat_bytes = view.untyped_storage().nbytes()
    valid = slots[slots >= 0].to(torch.int64)
    if valid.numel() == 0:
        return
    last = view.storage_offset() + (valid // rows) * view.stride(0) + rows * record
    if int(last.max()) > flat_bytes:
        raise ref.OutOfBounds(
            f"a write to slot {int(valid[last.argmax()])} would end at byte "
            f"{int(last.max())} of a {flat_bytes}-byte allocation"
        )


class Writer:
    def __init__(self, layout: Layout, blocks, result: HarnessResult):
        self.layout = layout
        self.blocks = blocks
        self.result = result

    def check_slots(self, step: Step, cache: CacheLayer, slots, cm) -> None:
        """Ratio-1 writers: count the slots that differ from the kernel-table
        formula ``ktable[req, pos // k] * k + pos % k`` (k = the group's kernel
        block, its manager block where blocks are not split)."""
        if cache.ratio != 1:
            return
        group = cache.attn_group
        k = group.kernel_block_size or self.layout.group_block_size(cache.group_id)
        ktable = group.map_to_kernel_block_table(cm.block_table_tensor).to(torch.int64)
        want = torch.cat([
            ktable[r, torch.arange(a, b) // k] * k + torch.arange(a, b) % k
            for r, (a, b) in enumerate(step.requests)
        ])
        got = slots[: want.numel()].to(torch.int64)
        key = f"{step.name}:{cache.name}"
        self.result.slot_mismatches[key] = int((got != want).sum())

    def own_mask(self, caches) -> torch.Tensor:
        mask = torch.zeros(self.layout.storage.numel(), dtype=torch.bool)
        for cache in caches:
            blocks = [b for per_req in self.blocks[cache.group_id] for b in per_req]
            for start, end in self.layout.own_bytes(cache, blocks):
                mask[start:end] = True
        return mask

    def attributed(self, step: str, cache: CacheLayer, fn) -> None:
        storage = self.layout.storage
        before = storage.clone()
        fn()
        changed = storage != before
        foreign = changed & ~self.own_mask([cache])
        clobbered = {}
        if bool(foreign.any()):
            for other in self.layout.caches.values():
                if other is not cache:
                    hit = int((foreign & self.own_mask([other])).sum())
                    if hit:
                        clobbered[other.name] = hit
        self.result.writes.append(
            WriteRecord(
                step, cache.name, int(changed.sum()), int(foreign.sum()),
                sum(clobbered.values()), clobbered,
            )
        )

    def swa(self, step: Step, cache: CacheLayer, slots, block_size: int,
            rows: torch.Tensor) -> None:
        from vllm.models.deepseek_v41.common.ops.cache_utils import (
            quantize_and_insert_k_cache,
        )

        view = cache.module.kv_cache
        # DeepseekV4Attention._fused_qnorm_rope_kv_insert: 2-D page view,
        # the SWA metadata's slot mapping and block size.
        cache_2d = view.view(view.shape[0], -1)
        _check_write_bounds(view, slots, block_size, ref.RECORD_BYTES)
        self.attributed(
            step.name, cache,
            lambda: quantize_and_insert_k_cache(rows, cache_2d, slots, block_size=block_size),
        )

    def compressed(self, step, cache, slots, latent, positions, cos_sin) -> None:
        from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import (
            rope_quant_insert,
        )

        view = cache.module.kv_cache
        _check_write_bounds(view, slots, view.shape[1], ref.RECORD_BYTES)
        self.attributed(
            step.name, cache,
            lambda: rope_quant_insert(latent, positions, cos_sin, view, slots, cache.ratio),
        )

    def indexer(self, step, cache, slots, k_pre, positions, cos_sin, weight, eps) -> None:
        from vllm.models.deepseek_v41.common.ops import indexer_k_norm_rope_store

        view = cache.module.kv_cache
        _check_write_bounds(view, slots, view.shape[1], ref.INDEX_RECORD)
        self.attributed(
            step.name, cache,
            lambda: indexer_k_norm_rope_store(
                k_pre, positions, cos_sin, weight, eps, view, slots, cache.ratio, False
            ),
        )


def _indexer_slots(cache: CacheLayer, cm, step: Step):
    """The indexer K slot mapping its metadata builder's build() computes."""
    from vllm.v1.attention.backends.mla.compressor_utils import (
        get_compressed_slot_mapping,
    )

    group = cache.attn_group
    if cache.ratio == 1:
        # build() passes the slot mapping of the metadata its group hands it.
        return group._with_kernel_block_table(cm).slot_mapping

    builder_spec = group.get_metadata_builder().kv_cache_spec
    return get_compressed_slot_mapping(
        step.num_tokens,
        cm.slot_mapping,
        cm.query_start_loc,
        cm.seq_lens,
        group.map_to_kernel_block_table(cm.block_table_tensor),
        builder_spec.num_states,
        cache.ratio,
    )


def run_step(layout: Layout, step: Step, tables, inputs: Inputs, writer: Writer):
    """Build the step's metadata and run every writer.  Returns the SWA and
    compressed-cache metadata per cache name."""
    model = layout.model
    cms = common_metadata(step, tables, len(layout.kv_cache_config.kv_cache_groups))
    metadata = {}
    for cache in layout.caches.values():
        if cache.kind == "compressed" or (cache.kind == "swa" and step.name == "decode"):
            metadata[cache.name] = cache.attn_group.build_metadata(cms[cache.group_id])
    for cache in layout.by_kind("swa"):
        rows = step.token_rows(inputs.swa[cache.layer])
        if cache.name in metadata:
            md = metadata[cache.name]
            slots, block_size = md.slot_mapping, md.block_size
        else:
            # A write-only step: the SWA builder's build() passes the group's
            # slot mapping through and publishes its own block size; its
            # prefill index computation (slow under the interpreter) is not
            # needed for the writes.
            slots = cms[cache.group_id].slot_mapping
            block_size = cache.attn_group.get_metadata_builder().block_size
        writer.swa(step, cache, slots, block_size, rows)
    for cache in layout.by_kind("compressed"):
        slots = metadata[cache.name].slot_mapping
        writer.check_slots(step, cache, slots, cms[cache.group_id])
        latent = step.token_rows(inputs.latent[cache.layer])
        writer.compressed(step, cache, slots, latent, step.positions, inputs.cos_sin)
    for cache in layout.by_kind("indexer"):
        cm = cms[cache.group_id]
        slots = _indexer_slots(cache, cm, step)
        writer.check_slots(step, cache, slots, cm)
        writer.indexer(
            step, cache, slots, step.token_rows(inputs.k_pre[cache.layer]),
            step.positions, inputs.cos_sin, inputs.norm_weight[cache.layer],
            model.rms_norm_eps,
        )
    return metadata, cms


# --------------------------------------------------------------------------
# Decode and checks.
# --------------------------------------------------------------------------


def _sparse_cache(view: torch.Tensor) -> torch.Tensor:
    # DeepseekV4FlashInferSM120Attention._as_sparse_cache: NHD [pages, pbs, 1, C]
    return view if view.dim() == 4 else view.unsqueeze(-2)


def decode_layer(layout: Layout, layer: int, step: Step, metadata, inputs: Inputs,
                 rounding: ref.Rounding):
    from vllm.models.deepseek_v41.common.ops import compute_global_topk_indices_and_lens

    model = layout.model
    ratio = model.compress_ratios[layer]
    swa_cache = layout.find("swa", layer)
    swa_md = metadata[swa_cache.name]
    num_tokens = swa_md.num_decode_tokens
    assert num_tokens == step.num_tokens and swa_md.num_prefills == 0
    q, sink = inputs.q[layer], inputs.sink[layer]

    extra_cache = extra_idx = extra_len = None
    if ratio:
        source = layout.find("compressed", model.source_of(layer))
        fi_md = metadata[source.name]
        # DeepseekV4FlashInferSM120Attention._forward_decode
        global_idx, extra_len = compute_global_topk_indices_and_lens(
            inputs.topk[layer][:num_tokens],
            swa_md.token_to_req_indices,
            fi_md.block_table[: swa_md.num_decodes],
            fi_md.block_size // ratio,
            swa_md.is_valid_token[:num_tokens],
        )
        extra_idx = global_idx.view(num_tokens, 1, -1)
        extra_cache = _sparse_cache(source.module.kv_cache)
    paged = ref.sm120_sparse_decode(
        q, _sparse_cache(swa_cache.module.kv_cache), swa_md.decode_swa_indices,
        swa_md.decode_swa_lens, extra_cache, extra_idx, extra_len, sink, SCALE,
    )

    dense = torch.empty_like(paged)
    plain = torch.empty_like(paged)
    gpu = torch.empty_like(paged)
    rne = ref.Rounding("round-to-nearest-even")
    cs = inputs.cos_sin
    for t, (r, (_, end)) in enumerate(enumerate(step.requests)):
        pos = end - 1
        lo = max(0, pos - model.sliding_window + 1)
        window = inputs.swa[layer][r][lo : pos + 1]
        rows_q = [ref.dense_swa_rows(window, rounding)]
        rows_g = [ref.dense_swa_rows(window, rne)]
        rows_p = [window.float()]
        if ratio:
            states = inputs.topk[layer][t]
            states = states[states >= 0].to(torch.int64)
            tokens = states * ratio + ratio - 1
            latent = inputs.latent[model.source_of(layer)][r][tokens]
            angles = cs[states * ratio]
            for rows, how in ((rows_q, rounding), (rows_g, rne)):
                rows.append(
                    ref.dense_compressed_rows(latent, angles[:, :32], angles[:, 32:], how)
                )
            rot = ref.gptj_rotate(latent[:, ref.NOPE :].float(), angles[:, :32], angles[:, 32:])
            rows_p.append(torch.cat([latent[:, : ref.NOPE].float(), rot], dim=1))
        dense[t] = ref.sink_softmax_attention(q[t], torch.cat(rows_q), sink, SCALE)
        plain[t] = ref.sink_softmax_attention(q[t], torch.cat(rows_p), sink, SCALE)
        gpu[t] = ref.sink_softmax_attention(q[t], torch.cat(rows_g), sink, SCALE)
    return {
        # the paged decode against the dense one, fp8 applied as the writers did
        "vs_quantized": ref.error_figures(paged, dense),
        # ... against the dense one on the un-quantised bf16 latents
        "vs_unquantized": ref.error_figures(paged, plain),
        # the fp8 floor a GPU writer (round-to-nearest-even) leaves
        "gpu_fp8_floor": ref.error_figures(gpu, plain),
    }


def check_indexer(layout: Layout, cache: CacheLayer, cms, inputs: Inputs,
                  rounding: ref.Rounding) -> dict[str, float]:
    """Read every state of every request through the indexer's block table."""
    from vllm.models.deepseek_v41.common.ops import compute_global_topk_indices_and_lens

    model = layout.model
    ratio = cache.ratio
    view = cache.module.kv_cache
    states_per_page = view.shape[1]
    table = cache.attn_group.map_to_kernel_block_table(cms[cache.group_id].block_table_tensor)
    got, want = [], []
    for r, length in enumerate(model.seq_lens):
        n = length // ratio
        local = torch.arange(n, dtype=torch.int32)[None, :]
        global_idx, lens = compute_global_topk_indices_and_lens(
            local,
            torch.tensor([r], dtype=torch.int32),
            table,
            states_per_page,
            torch.ones(1, dtype=torch.bool),
        )
        assert int(lens[0]) == n
        got.append(ref.read_index_keys(view, global_idx[0]))
        states = torch.arange(n)
        angles = inputs.cos_sin[states * ratio]
        want.append(
            ref.dense_index_keys(
                inputs.k_pre[cache.layer][r][states * ratio + ratio - 1],
                inputs.norm_weight[cache.layer], model.rms_norm_eps,
                angles[:, :32], angles[:, 32:], rounding,
            )
        )
    return ref.error_figures(torch.cat(got), torch.cat(want))


def stray_bytes(layout: Layout, blocks) -> int:
    """Bytes that differ from the sentinel outside every cache's own pages."""
    own = torch.zeros(layout.storage.numel(), dtype=torch.bool)
    for cache in layout.caches.values():
        ids = [b for per_req in blocks[cache.group_id] for b in per_req]
        for start, end in layout.own_bytes(cache, ids):
            own[start:end] = True
    return int(((layout.storage != SENTINEL) & ~own).sum())


def _fix_detail() -> str:
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix

    return fix.status_detail()


def tiling_problems(layout: Layout) -> list[str]:
    """Per cache group and block: the caches' pages (kernel pages where split)
    must not overlap and must cover exactly the bytes of their manager pages."""
    problems = []
    for gid in range(len(layout.kv_cache_config.kv_cache_groups)):
        caches = [c for c in layout.caches.values() if c.group_id == gid]
        for block in range(layout.kv_cache_config.num_blocks):
            pages = sorted(r for c in caches for r in layout.own_bytes(c, [block]))
            manager = sorted(
                (c.manager_view.storage_offset() + block * c.manager_view.stride(0),
                 c.manager_view.storage_offset() + block * c.manager_view.stride(0)
                 + c.spec.page_size_bytes)
                for c in caches
            )
            if any(a[1] > b[0] for a, b in zip(pages, pages[1:])):
                problems.append(f"group {gid} block {block}: pages overlap")
            if _merged(pages) != _merged(manager):
                problems.append(f"group {gid} block {block}: pages {_merged(pages)} do not "
                                f"tile the manager pages {_merged(manager)}")
    return problems


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def run_harness(geometry: str, model: TinyModel | None = None, seed: int = 0) -> HarnessResult:
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(f"cannot run vLLM's Triton kernels on CPU: {problem}")
    model = model or TinyModel()
    geo = GEOMETRIES[geometry]
    rounding = ref.writer_rounding()
    start = time.monotonic()
    with simulated_sm120_host():
        with contextlib.ExitStack() as stack:
            if geo.via_plugin:
                from .applied import applied_fix, untranslated_ratio1_slots

                result_of_fix = stack.enter_context(applied_fix())
                if geo.untranslated:
                    stack.enter_context(untranslated_ratio1_slots())
            layout = build_layout(geo, model, SENTINEL)
            result = HarnessResult(
                geometry=geometry, rounding=rounding.name, layout=describe(layout),
                guard_error=layout.guard_error, ratios=model.compress_ratios,
            )
            if geo.via_plugin:
                result.status = f"{result_of_fix.status.reason}; {_fix_detail()}"
            result.tiling_problems = tiling_problems(layout)
            inputs = make_inputs(model, seed)
            blocks = allocate_blocks(layout, seed)
            tables = make_block_tables(layout, blocks)
            writer = Writer(layout, blocks, result)
            run_step(layout, make_step(model, "prefill"), tables, inputs, writer)
            decode = make_step(model, "decode")
            metadata, cms = run_step(layout, decode, tables, inputs, writer)
            for layer in range(len(model.compress_ratios)):
                result.attention[layer] = decode_layer(
                    layout, layer, decode, metadata, inputs, rounding
                )
            for cache in layout.by_kind("indexer"):
                result.indexer[cache.layer] = check_indexer(layout, cache, cms, inputs, rounding)
            result.stray_bytes = stray_bytes(layout, blocks)
    result.seconds = time.monotonic() - start
    return result


def figures_table(results: list[HarnessResult]) -> str:
    """The error and sentinel figures of several runs, as a text table."""
    head = (
        "geometry", "max abs err", "rel err", "non-finite", "finite max abs err",
        "rel err vs bf16",
        "indexer rel err", "bytes outside own pages", "into other caches' pages",
        "stray bytes",
    )
    rows = [head]
    for r in results:
        w, u, i = r.worst(), r.worst("vs_unquantized"), r.indexer_worst()
        rows.append((
            r.geometry, f"{w['max_abs']:.3e}", f"{w['rel']:.3e}", str(w["non_finite"]),
            f"{w['finite_max_abs']:.3e}", f"{u['rel']:.3e}", f"{i['rel']:.3e}",
            str(r.foreign_bytes), str(r.clobbered_bytes), str(r.stray_bytes),
        ))
    widths = [max(len(row[k]) for row in rows) for k in range(len(head))]
    lines = [
        " | ".join(cell.ljust(widths[k]) for k, cell in enumerate(row)) for row in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    notes = []
    for r in results:
        if r.clobbered_caches:
            hit = ", ".join(f"{k} ({v} B)" for k, v in sorted(r.clobbered_caches.items()))
            notes.append(f"  {r.geometry}: caches whose pages other writes hit: {hit}")
        per_layer = ", ".join(
            f"layer {layer} (ratio {r.ratios[layer]}) {a['vs_quantized']['rel']:.1e}"
            for layer, a in r.attention.items()
        )
        notes.append(f"  {r.geometry}: rel err per layer: {per_layer}")
    floor = max(a["gpu_fp8_floor"]["rel"] for r in results for a in r.attention.values())
    notes.append(
        "  rel err = max |paged - dense| / max |dense| over every layer's decode "
        "(non-finite paged outputs count as infinite error); dense applies fp8 as the "
        f"writers did ({results[0].rounding}); 'vs bf16' compares with the un-quantised "
        f"latents (a GPU writer's fp8 floor on these inputs: {floor:.3e}).\n"
        "  bytes outside own pages: bytes a write changed outside its cache's pages in "
        "the blocks its group was given; into other caches' pages: the part of them "
        "that hit another cache's pages; stray: bytes differing from the sentinel "
        "outside every cache's pages after the run."
    )
    return "\n".join(lines + notes)
