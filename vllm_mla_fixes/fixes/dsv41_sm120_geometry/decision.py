"""The decision: which KV layout one engine gets, as a pure function.

:func:`decide` takes what an engine is (:class:`~.engine.EngineConfig`, read
from its ``VllmConfig``) and what the installed kernels declare, and returns a
frozen :class:`Decision`: the geometry, the page rows of every sliding-window
cache, whether upstream's own layout works and what the kernels reject of it,
and the capacity of both layouts as vLLM's planner plans them on the full
model.  It reads no live layer, no earlier decision and no state: every
process, pipeline rank and node, ``doctor`` (on the operator's
``config.json``), the truth table and the capacity benchmark call it with the
same inputs and get the same answer.  :mod:`.fix_state` keeps each engine's
answer, keyed by its :class:`~.engine.EngineConfig`.

The rule, in order:

1. ``VLLM_MLA_FIXES_DSV41_GEOMETRY=per-ratio`` forces the fallback.
2. The fix's candidate: the interleaved split, unless a setting of the line
   or the model is not proven with it (:func:`_candidate`), then per-ratio.
3. A DSpark drafter's sliding-window pages: 128 rows where FlashInfer takes
   run-time page sizes and planning both finds they hold more, else 64.
4. Where upstream's layout for the line starts and every page of it is
   inside the installed kernels' own envelopes, the fix steps aside
   (:attr:`Geometry.UPSTREAM`) unless its candidate holds at least
   :data:`GAIN_TO_APPLY` times upstream's KV tokens per GiB at the engine's
   max-model-len (``VLLM_MLA_FIXES_DSV41_GEOMETRY=interleaved-split`` skips
   this step).  An envelope that cannot be read is never "accepts".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope, model_specs, upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import (
    DSPARK,
    OFFLOADING_CONNECTOR,
    EngineConfig,
    ModelLayout,
    engine_config,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import split_unreviewed
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    DRAFTER_SWA_ENV,
    DRAFTER_SWA_ROWS,
    FP8_INDEXER_ROW,
    GAIN_TO_APPLY,
    GEOMETRY_ENV,
    PAGE_ROWS,
    SPLIT_MANAGER_BLOCK,
    UPSTREAM_SWA_BLOCK,
    V4_RECORD_BYTES,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.planning import planned_tokens
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind, Geometry

# Speculative methods that draft from token ids alone: no drafter layer, no
# drafter KV; the target's verify pass is the only writer, as without drafting.
TOKEN_ONLY_METHODS = ("ngram", "ngram_gpu", "suffix")

# Drafters with attention layers of their own that write KV in the target's
# cache groups and update draft-decode metadata in place: the indexer's
# ``update_draft_decode_metadata`` recomputes slots only for ratio > 1.
EAGLE_STYLE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "draft_model")

SPLIT_DEFAULT = (
    "default on SM12x: 128-token blocks, ratio-1 compressed/indexer pages "
    "interleaved as 64-state kernel pages"
)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One engine's KV layout, and everything it was decided from."""

    geometry: Geometry
    reason: str
    unit: int  # bytes of one interleave unit (compressed + indexer kernel page); split only
    backbone_swa_rows: int  # rows of the backbone's sliding-window pages
    drafter_swa_rows: int  # rows of a drafter's sliding-window pages
    drafter_rows_why: str
    upstream: upstream.UpstreamLayout | None  # upstream's layout for the line (None: unread)
    max_model_len: int | None
    fix_tokens: int | None  # KV tokens per GiB of the fix's candidate (None: not planned)
    upstream_tokens: int | None  # of upstream's layout, where it starts (None: not planned)
    evidence: tuple[str, ...] = ()  # what could not be read, naming the file or field

    @property
    def applies(self) -> bool:
        return self.geometry is not Geometry.UPSTREAM

    @property
    def vs_upstream(self) -> float | None:
        if self.fix_tokens is None or not self.upstream_tokens:
            return None
        return round(self.fix_tokens / self.upstream_tokens, 4)

    def swa_rows(self, layer: int, model: ModelLayout | None) -> int:
        drafter = model is not None and model.is_drafter(layer)
        return self.drafter_swa_rows if drafter else self.backbone_swa_rows

    def as_dict(self) -> dict[str, object]:
        """What ``status --json`` and ``doctor --json`` show of the decision."""
        layout = self.upstream
        return {
            "decision": self.geometry.value,
            "reason": self.reason,
            "interleave_unit_bytes": self.unit or None,
            "sliding_window_rows": self.backbone_swa_rows,
            "drafter_sliding_window_rows": self.drafter_swa_rows,
            "block_size": None if layout is None else layout.block_size,
            "upstream_starts": None if layout is None else layout.starts,
            "upstream_start_error": None if layout is None else layout.start_error,
            "upstream_works": None if layout is None else layout.works,
            "upstream_rejected": [] if layout is None else [r.as_dict() for r in layout.rejected],
            "unknown_envelopes": [] if layout is None else list(layout.unknown),
            "at_max_model_len": self.max_model_len,
            "fix_tokens_per_gib": self.fix_tokens,
            "upstream_tokens_per_gib": self.upstream_tokens,
            "vs_upstream": self.vs_upstream,
            "evidence": list(self.evidence),
        }


def decide(vllm_config: object) -> Decision:
    """The decision for an engine configuration (see the module's rule)."""
    return decide_for(engine_config(vllm_config), vllm_config)


def decide_for(engine: EngineConfig, vllm_config: object) -> Decision:
    """The decision for ``engine``; ``vllm_config`` is the config it was read
    from, handed to vLLM's spec producers and planner."""
    layout, layout_problem = _upstream_layout(engine)
    if engine.forced_geometry is Geometry.PER_RATIO:
        return _fix_decision(
            engine, vllm_config, Geometry.PER_RATIO, f"{GEOMETRY_ENV}=per-ratio", 0, layout
        )
    geometry, why, unit = _candidate(engine, vllm_config)
    candidate = _fix_decision(engine, vllm_config, geometry, why, unit, layout)
    evidence = candidate.evidence + ((layout_problem,) if layout_problem else ())
    if layout is not None:
        evidence += tuple(f"kernel declaration not read: {text}" for text in layout.unknown)
    if engine.forced_geometry is Geometry.SPLIT or layout is None or not layout.works:
        reason = candidate.reason
        if layout is not None and layout.works is None:
            reason = (
                f"upstream's layout could not be judged ({'; '.join(layout.unknown)}); {reason}"
            )
        planned = None
        if layout is not None and layout.starts and candidate.fix_tokens is not None:
            try:  # what upstream's own layout would hold, for the figures
                planned = upstream_tokens(engine, vllm_config, layout.block_size)
            except Exception as exc:  # noqa: BLE001 - figures only
                evidence += (_failed(f"upstream's --block-size {layout.block_size} layout", exc),)
        return dataclasses.replace(
            candidate, reason=reason, evidence=evidence, upstream_tokens=planned
        )
    return _gain_rule(engine, vllm_config, candidate, layout, evidence)


def _upstream_layout(engine: EngineConfig) -> tuple[upstream.UpstreamLayout | None, str]:
    ratios = (1, 2) if engine.model is None else _compressed_ratios(engine.model)
    try:
        declared = upstream.declared_kernel_blocks()
        block_size = engine.block_size or upstream.picked_block_size(declared)
        return upstream.upstream_layout(block_size, ratios, declared), ""
    except Exception as exc:  # noqa: BLE001 - the backends cannot be asked here: keep the fix's layout
        return None, f"upstream's layout could not be read: {type(exc).__name__}: {exc}"


def _compressed_ratios(model: ModelLayout) -> tuple[int, ...]:
    return model.owned_ratios or (1, 2)


def _gain_rule(
    engine: EngineConfig,
    vllm_config: object,
    candidate: Decision,
    layout: upstream.UpstreamLayout,
    evidence: tuple[str, ...],
) -> Decision:
    """Upstream's layout works: the fix applies only where its own holds at
    least :data:`GAIN_TO_APPLY` times as many KV tokens per GiB."""
    aside = (
        f"not-needed: upstream's --block-size {layout.block_size} layout is within the "
        "installed kernels' envelopes"
    )
    planned = None
    if engine.model is not None and engine.max_model_len is not None:
        try:
            planned = upstream_tokens(engine, vllm_config, layout.block_size)
        except Exception as exc:  # noqa: BLE001 - upstream's working layout is kept, and why
            evidence += (_failed(f"upstream's --block-size {layout.block_size} layout", exc),)
    stepped_aside = dataclasses.replace(
        candidate,
        geometry=Geometry.UPSTREAM,
        unit=0,
        backbone_swa_rows=UPSTREAM_SWA_BLOCK,
        drafter_swa_rows=UPSTREAM_SWA_BLOCK,
        drafter_rows_why="upstream's own sliding-window pages",
        upstream_tokens=planned,
        evidence=evidence,
    )
    if candidate.fix_tokens is None or planned is None:
        missing = engine.model_problem or (
            "no max-model-len to plan the layouts at"
            if engine.max_model_len is None
            else "planning failed (see the evidence)"
        )
        return dataclasses.replace(
            stepped_aside, reason=f"{aside}; not planned: {missing}", evidence=evidence
        )
    ratio = candidate.fix_tokens / planned
    figures = (
        f"planned on the model's layers at max_model_len {engine.max_model_len}: the fix's "
        f"{candidate.geometry.value} layout holds {candidate.fix_tokens:,} KV tokens per GiB, "
        f"upstream's {planned:,} ({ratio:.3f}x, "
        f"{'at least' if ratio >= GAIN_TO_APPLY else 'under'} the {GAIN_TO_APPLY:.2f}x that "
        "a layout nobody has run on hardware must gain)"
    )
    if ratio < GAIN_TO_APPLY:
        return dataclasses.replace(stepped_aside, reason=f"{aside}; {figures}")
    return dataclasses.replace(
        candidate,
        reason=f"{figures}; {candidate.reason}",
        upstream_tokens=planned,
        evidence=evidence,
    )


def _fix_decision(
    engine: EngineConfig,
    vllm_config: object,
    geometry: Geometry,
    why: str,
    unit: int,
    layout: upstream.UpstreamLayout | None,
) -> Decision:
    """The fix's layout for ``geometry``, its drafter rows planned, its
    capacity planned where the model's topology is known."""
    rows, rows_why = _drafter_rows(engine, vllm_config, geometry, unit)
    tokens = None
    evidence: tuple[str, ...] = () if engine.model is not None else (engine.model_problem,)
    if engine.model is not None and engine.max_model_len is not None:
        try:
            tokens = _fix_tokens(engine, vllm_config, geometry, unit, rows)
        except Exception as exc:  # noqa: BLE001 - named as evidence; the layout stands
            evidence += (_failed(f"the fix's {geometry.value} layout", exc),)
    if engine.model is not None and engine.model.drafter_layers:
        why += f"; drafter sliding-window pages hold {rows} tokens ({rows_why})"
    return Decision(
        geometry=geometry,
        reason=why,
        unit=unit,
        backbone_swa_rows=PAGE_ROWS,
        drafter_swa_rows=rows,
        drafter_rows_why=rows_why,
        upstream=layout,
        max_model_len=engine.max_model_len,
        fix_tokens=tokens,
        upstream_tokens=None,
        evidence=evidence,
    )


# ------------------------------------------------------------- the candidate


def _candidate(engine: EngineConfig, vllm_config: object) -> tuple[Geometry, str, int]:
    """(geometry, why, interleave unit) of the fix's own layout."""
    unreviewed = _split_unreviewed()
    if unreviewed:
        return Geometry.PER_RATIO, unreviewed, 0
    trigger = _config_trigger(engine)
    if trigger:
        return Geometry.PER_RATIO, trigger, 0
    if engine.model is None:
        return Geometry.PER_RATIO, f"the split cannot be laid out: {engine.model_problem}", 0
    misfit = _drafter_misfit(engine) or _pairing_misfit(engine.model)
    if misfit:
        return Geometry.PER_RATIO, misfit, 0
    unit, misfit = _pair_unit(engine, vllm_config)
    if misfit:
        return Geometry.PER_RATIO, misfit, 0
    return Geometry.SPLIT, SPLIT_DEFAULT + _speculative_note(engine), unit


def _split_unreviewed() -> str:
    try:
        return split_unreviewed() or ""
    except Exception as exc:  # noqa: BLE001 - vLLM's sources unreadable: the fallback, say why
        return f"cannot read vLLM's sources here: {type(exc).__name__}: {exc}"


def _config_trigger(engine: EngineConfig) -> str | None:
    """The first engine setting under which the split is not proven safe."""
    method = engine.speculative_method
    if method in EAGLE_STYLE_METHODS:
        return (
            f"speculative method {method} (its drafter layers write KV through their own "
            "metadata and update draft-decode metadata in place, where the indexer's "
            "update_draft_decode_metadata recomputes slots only for ratio > 1: not "
            "reviewed with the split)"
        )
    if method is not None and method != DSPARK and method not in TOKEN_ONLY_METHODS:
        return f"speculative method {method} is not reviewed with the split"
    if engine.kv_connector is not None and engine.kv_connector != OFFLOADING_CONNECTOR:
        # vLLM's CPU offloading moves a packed layout's whole blocks; others may not
        return (
            f"KV connector {engine.kv_connector} is configured (not reviewed with the split: it "
            "may move manager-block pages per layer, where the split's ratio-1 pages interleave)"
        )
    for field, size in (
        ("decode_context_parallel_size", engine.decode_context_parallel),
        ("prefill_context_parallel_size", engine.prefill_context_parallel),
    ):
        if size > 1:
            return (
                f"{field} is {size} (context-parallel slot sharding is not reviewed with the split)"
            )
    if engine.hisparse:
        return "HiSparse is configured (not reviewed with the split)"
    if engine.mxfp8_record:
        return "the KV record is MXFP8 (the split is proven on the V4 fp8_ds_mla record)"
    return None


def _drafter_misfit(engine: EngineConfig) -> str | None:
    """Under DSpark: a drafter layer that reads a ratio-1 compressed cache
    (its writes would take manager-block slots), from the model config."""
    model = engine.model
    if engine.speculative_method != DSPARK or model is None:
        return None
    for layer in model.layers:
        if model.is_drafter(layer) and model.ratio(layer) == 1:
            return (
                f"speculative method dspark with {model_specs.attention_prefix(layer)} (drafter "
                "layer that reads a ratio-1 compressed cache): its ratio-1 slots are not translated"
            )
    return None


def _pairing_misfit(model: ModelLayout) -> str | None:
    ratios = set(model.owned_ratios)
    if not ratios <= {1, 2}:
        return f"compress ratios {sorted(ratios)} (the split is reviewed for ratios 1 and 2)"
    compressed = [n for n in model.layers if model.owns_compressed(n) and model.ratio(n) == 1]
    indexers = [n for n in compressed if model.owns_indexer(n)]
    if not compressed:
        return "no ratio-1 cache to split (the per-ratio geometry is the same)"
    if len(compressed) != len(indexers):
        return (
            f"{len(compressed)} ratio-1 compressed caches but {len(indexers)} ratio-1 indexer "
            "caches (they interleave in pairs)"
        )
    return None


def _pair_unit(engine: EngineConfig, vllm_config: object) -> tuple[int, str | None]:
    """(interleave unit in bytes, None), or (0, why the split does not fit),
    from the specs of the model's ratio-1 compressed and indexer caches."""
    assert engine.model is not None
    specs = model_specs.model_specs(vllm_config, engine, SPLIT_MANAGER_BLOCK, {})
    pair: dict[CacheKind, Any] = {
        cache.kind: specs[cache.name]
        for cache in model_specs.caches(engine.model)
        if cache.compress_ratio == 1 and cache.kind in (CacheKind.COMPRESSED, CacheKind.INDEXER)
    }
    pages = 0
    for kind, expected in (
        (CacheKind.COMPRESSED, V4_RECORD_BYTES),
        (CacheKind.INDEXER, FP8_INDEXER_ROW),
    ):
        spec = pair[kind]
        record = getattr(spec, "state_content_bytes", None) or spec.head_size
        if record != expected:
            return 0, (
                f"{kind.value} record of {record} B (the split is proven on the "
                f"{V4_RECORD_BYTES}-B V4 record and the {FP8_INDEXER_ROW}-B fp8 indexer row)"
            )
        kernel_page = spec.copy_with_new_block_size(PAGE_ROWS).page_size_bytes
        manager_page = spec.copy_with_new_block_size(SPLIT_MANAGER_BLOCK).page_size_bytes
        if manager_page != 2 * kernel_page:
            return 0, (
                f"{kind.value}: a {SPLIT_MANAGER_BLOCK}-token page ({manager_page} B) is not two "
                f"{PAGE_ROWS}-state pages ({kernel_page} B)"
            )
        pages += kernel_page
    return pages, None


def _speculative_note(engine: EngineConfig) -> str:
    if engine.speculative_method == DSPARK:
        return (
            "; with DSpark: no drafter layer owns or reads a ratio-1 compressed or indexer "
            "cache (read from the model config), so only the target's verify pass writes "
            "ratio-1 pages, through kernel-table slots"
        )
    if engine.speculative_method in TOKEN_ONLY_METHODS:
        return (
            f"; with {engine.speculative_method}: drafts come from token ids, no drafter KV; only "
            "the target's verify pass writes ratio-1 pages, through kernel-table slots"
        )
    return ""


# ------------------------------------------------------------ drafter pages


def flashinfer_takes_runtime_swa_pages() -> bool:
    """Whether every installed kernel on the sliding-window cache takes
    128-row pages, as its own envelope declares (FlashInfer 0.7.2.post1 on;
    0.7.0.post1 instantiates 64 rows only).  Unknown keeps 64-row pages."""
    return envelope.accepts_rows(envelope.SWA, DRAFTER_SWA_ROWS) is True


def _drafter_rows(
    engine: EngineConfig, vllm_config: object, geometry: Geometry, unit: int
) -> tuple[int, str]:
    """Rows of a drafter's sliding-window pages (of every layer numbered past
    the backbone) under the fix, and why."""
    if engine.forced_drafter_rows == PAGE_ROWS:
        return PAGE_ROWS, f"{DRAFTER_SWA_ENV}={PAGE_ROWS}"
    if not flashinfer_takes_runtime_swa_pages():
        return PAGE_ROWS, "the installed FlashInfer decodes 64-row primary pages only"
    if engine.forced_drafter_rows == DRAFTER_SWA_ROWS:
        return DRAFTER_SWA_ROWS, f"{DRAFTER_SWA_ENV}={DRAFTER_SWA_ROWS}"
    if engine.model is None or not engine.model.drafter_layers:
        return PAGE_ROWS, "no drafter layers"
    if engine.max_model_len is None:
        return PAGE_ROWS, "no max-model-len to plan the drafter's pages at"
    try:
        tokens = {
            rows: _fix_tokens(engine, vllm_config, geometry, unit, rows)
            for rows in (DRAFTER_SWA_ROWS, PAGE_ROWS)
        }
    except Exception as exc:  # noqa: BLE001 - keep the kernel page rows, say why
        return PAGE_ROWS, f"{_failed('the drafter pages both ways', exc)}; kept at {PAGE_ROWS}"
    chosen = max(tokens, key=lambda r: (tokens[r], r == PAGE_ROWS))  # a tie keeps 64
    layers = engine.model.drafter_layers
    return chosen, (
        f"planned both with the model's {layers} drafter layer{'s' if layers > 1 else ''}: "
        f"{DRAFTER_SWA_ROWS}-row pages hold {tokens[DRAFTER_SWA_ROWS]:,} KV tokens per GiB, "
        f"{PAGE_ROWS}-row {tokens[PAGE_ROWS]:,}"
    )


# ----------------------------------------------------------------- capacity


def fix_specs(
    engine: EngineConfig, vllm_config: object, geometry: Geometry, unit: int, drafter_rows: int
) -> dict[str, object]:
    """Every cache's spec under the fix's ``geometry``, as its spec producers
    hand them to vLLM's planner."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.specs import fixed_spec

    assert engine.model is not None
    model = engine.model
    swa = {n: drafter_rows if model.is_drafter(n) else PAGE_ROWS for n in model.layers}
    specs = model_specs.model_specs(
        vllm_config, engine, engine.block_size or SPLIT_MANAGER_BLOCK, swa
    )
    owned = {
        cache.name
        for cache in model_specs.caches(model)
        if cache.kind in (CacheKind.COMPRESSED, CacheKind.INDEXER)
    }
    return {
        name: fixed_spec(spec, geometry, unit) if name in owned else spec
        for name, spec in specs.items()
    }


def _fix_tokens(
    engine: EngineConfig, vllm_config: object, geometry: Geometry, unit: int, drafter_rows: int
) -> int:
    assert engine.max_model_len is not None
    specs = fix_specs(engine, vllm_config, geometry, unit, drafter_rows)
    return planned_tokens(vllm_config, engine, specs, engine.max_model_len)


def upstream_tokens(engine: EngineConfig, vllm_config: object, block_size: int) -> int:
    """Upstream's KV tokens per GiB at ``block_size``, its sliding-window 32 rows."""
    assert engine.max_model_len is not None
    specs = model_specs.model_specs(vllm_config, engine, block_size, {})
    return planned_tokens(vllm_config, engine, specs, engine.max_model_len)


def _failed(what: str, exc: Exception) -> str:
    return f"planning {what} with vLLM's planner failed: {type(exc).__name__}: {exc}"
