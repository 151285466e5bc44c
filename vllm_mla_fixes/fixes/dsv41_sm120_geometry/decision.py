"""Geometry decision: which layout (interleaved split or per-ratio) an engine
configuration gets on SM12x, and why; what ``status`` says about it; how many
rows a drafter's sliding-window pages hold."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

from vllm_mla_fixes import settings
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope, upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import (
    split_unreviewed,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    DRAFTER_SWA_ENV,
    DRAFTER_SWA_ROWS,
    FP8_INDEXER_ROW,
    GAIN_TO_APPLY,
    GEOMETRY_ENV,
    INFO,
    PAGE_ROWS,
    PER_RATIO,
    SPLIT,
    SPLIT_MANAGER_BLOCK,
    UPSTREAM,
    V4_RECORD_BYTES,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.state import (
    _ORIGINAL_PRODUCERS,
    GAIN_MEMO,
    _logger,
    _state,
)


@dataclasses.dataclass(frozen=True)
class Decision:
    geometry: str  # SPLIT or PER_RATIO
    reason: str
    unit: int = 0  # bytes of one interleave unit (compressed + indexer kernel page), SPLIT only


_SPLIT_DEFAULT = (
    "default on SM12x: 128-token blocks, ratio-1 compressed/indexer pages "
    "interleaved as 64-state kernel pages"
)


DSPARK = "dspark"


# Speculative methods that draft from token ids alone: no drafter layer, no
# drafter KV; the target's verify pass (1 + N tokens, metadata rebuilt and its
# ratio-1 slots translated every step) is the only writer, as without drafting.
TOKEN_ONLY_METHODS = ("ngram", "ngram_gpu", "suffix")


# Drafters with attention layers of their own that write KV in the target's
# cache groups and update draft-decode metadata in place: the indexer's
# ``update_draft_decode_metadata`` recomputes slots only for ratio > 1.
EAGLE_STYLE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "draft_model")


def speculative_method(vllm_config: Any) -> str | None:
    config = getattr(vllm_config, "speculative_config", None)
    if config is None:
        return None
    return str(getattr(config, "method", None) or "unknown").lower()


def _speculative_trigger(method: str | None) -> str | None:
    """Why the split is not used with this speculative method, or None (the
    per-method reasons are what ``status``, ``doctor`` and the README say)."""
    if method is None or method == DSPARK or method in TOKEN_ONLY_METHODS:
        return None
    if method in EAGLE_STYLE_METHODS:
        return (
            f"speculative method {method} (its drafter layers write KV through their own "
            "metadata and update draft-decode metadata in place, where the indexer's "
            "update_draft_decode_metadata recomputes slots only for ratio > 1: not "
            "reviewed with the split)"
        )
    return f"speculative method {method} is not reviewed with the split"


def _speculative_note(method: str | None) -> str:
    """What the in-force split adds to its reason under speculative decoding."""
    if method == DSPARK:
        rows, why = drafter_swa_rows()
        return (
            "; with DSpark: no drafter layer owns or reads a ratio-1 compressed or indexer "
            "cache (checked on the model's layers), so only the target's verify pass "
            f"writes ratio-1 pages, through kernel-table slots; drafter sliding-window pages "
            f"hold {rows} tokens ({why})"
        )
    if method in TOKEN_ONLY_METHODS:
        return (
            f"; with {method}: drafts come from token ids, no drafter KV; only the target's "
            "verify pass writes ratio-1 pages, through kernel-table slots"
        )
    return ""


def drafter_ratio1_layer(
    forward_context: dict[str, Any], num_backbone_layers: int | None
) -> str | None:
    """The first drafter layer that owns or reads a ratio-1 compressed or
    indexer cache, described, or None.  A drafter layer is one vLLM's
    speculator marked ``is_draft_layer``, or an attention layer numbered past
    the backbone."""
    attention = sys.modules.get(ATTENTION_MODULE)
    if attention is None:
        return None
    for name, layer in forward_context.items():
        past_backbone = (
            num_backbone_layers is not None
            and isinstance(getattr(layer, "layer_id", None), int)
            and layer.layer_id >= num_backbone_layers
        )
        if not (getattr(layer, "is_draft_layer", False) or past_backbone):
            continue
        if isinstance(layer, attention.DeepseekV4IndexerCache) and layer.compress_ratio == 1:
            return f"{name} (drafter indexer cache, compress ratio 1)"
        if isinstance(layer, attention.DeepseekV4Attention) and layer.compress_ratio == 1:
            role = "owns" if layer.is_kv_source else "reads"
            return f"{name} (drafter layer that {role} a ratio-1 compressed cache)"
    return None


def _drafter_layers(forward_context: dict[str, Any]) -> list[str]:
    return [
        name for name, layer in forward_context.items() if getattr(layer, "is_draft_layer", False)
    ]


def _backbone_layers(vllm_config: Any) -> int | None:
    text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    value = getattr(text, "num_hidden_layers", None)
    return value if isinstance(value, int) else None


def _dspark_misfit(vllm_config: Any) -> str | None:
    """Under DSpark, once the model's layers are registered: why its drafter
    does not fit the split, or None."""
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    if not context:
        return None
    if not _drafter_layers(context):
        return (
            "speculative method dspark, but no drafter layer is registered with the model's "
            "layers, so they cannot be checked for ratio-1 caches"
        )
    layer = drafter_ratio1_layer(context, _backbone_layers(vllm_config))
    if layer is not None:
        return f"speculative method dspark with {layer}: its ratio-1 slots are not translated"
    return None


OFFLOADING_CONNECTOR = "OffloadingConnector"


SIMPLE_OFFLOAD_ENV = "VLLM_USE_SIMPLE_KV_OFFLOAD"


def kv_connector_name(vllm_config: Any) -> str | None:
    """The KV connector the engine runs: the configured one, else the one
    ``--kv-offloading-size`` selects (``VllmConfig`` does this itself; a
    serve line read by ``doctor`` has not been through it), else None."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:
        return str(getattr(transfer, "kv_connector", None) or "unknown")
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "kv_offloading_size", None) is None:
        return None
    if (getattr(cache, "kv_offloading_backend", None) or "native") != "native":
        return "LMCacheMPConnector"
    if os.environ.get(SIMPLE_OFFLOAD_ENV, "").strip().lower() in ("1", "true"):
        return "SimpleCPUOffloadConnector"
    return OFFLOADING_CONNECTOR


def _kv_transfer_trigger(vllm_config: Any) -> str | None:
    connector = kv_connector_name(vllm_config)
    if connector is None or connector == OFFLOADING_CONNECTOR:
        # vLLM's CPU offloading moves a packed layout's whole blocks (every
        # layer's pages of a block id); the self-test's offload-reload case
        # clobbers and reloads them through its own transfer regions.
        return None
    return (
        f"KV connector {connector} is configured (not reviewed with the split: it may move "
        "manager-block pages per layer, where the split's ratio-1 pages interleave)"
    )


def _config_triggers(vllm_config: Any) -> str | None:
    """The first engine setting under which the split is not proven safe."""
    speculative = _speculative_trigger(speculative_method(vllm_config))
    if speculative:
        return speculative
    transfer = _kv_transfer_trigger(vllm_config)
    if transfer:
        return transfer
    parallel = getattr(vllm_config, "parallel_config", None)
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, field, 1) or 1
        if size > 1:
            return (
                f"{field} is {size} (context-parallel slot sharding is not reviewed with the split)"
            )
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "hisparse_config", None) is not None:
        return "HiSparse is configured (not reviewed with the split)"
    attention_module = sys.modules.get(ATTENTION_MODULE)
    if attention_module is not None and attention_module._use_v41_mxfp8_kv_record():
        return "the KV record is MXFP8 (the split is proven on the V4 fp8_ds_mla record)"
    return None


def _ratio1_pair_unit(vllm_config: Any) -> tuple[int, str | None]:
    """(interleave unit in bytes, None) from the model's real ratio-1 caches,
    or (0, why the split does not fit this model).  Reads the layers vLLM
    registered in the static forward context; (0, None) before they exist."""
    attention = sys.modules.get(ATTENTION_MODULE)
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    if attention is None or not context:
        return 0, None
    sources = [
        layer
        for layer in context.values()
        if isinstance(layer, attention.DeepseekV4Attention) and layer.is_kv_source
    ]
    indexers = [
        layer for layer in context.values() if isinstance(layer, attention.DeepseekV4IndexerCache)
    ]
    ratios = {int(layer.compress_ratio) for layer in [*sources, *indexers]}
    if not ratios <= {1, 2}:
        return 0, f"compress ratios {sorted(ratios)} (the split is reviewed for ratios 1 and 2)"
    ratio1 = [layer for layer in sources if layer.compress_ratio == 1]
    ratio1_index = [layer for layer in indexers if layer.compress_ratio == 1]
    if not ratio1:
        return 0, "no ratio-1 cache to split (the per-ratio geometry is the same)"
    if len(ratio1) != len(ratio1_index):
        return 0, (
            f"{len(ratio1)} ratio-1 compressed caches but {len(ratio1_index)} ratio-1 "
            "indexer caches (they interleave in pairs)"
        )
    pages = []
    for layer, cls in (
        (ratio1[0], attention.DeepseekV4Attention),
        (ratio1_index[0], attention.DeepseekV4IndexerCache),
    ):
        spec = _ORIGINAL_PRODUCERS[cls](layer, vllm_config)
        state_bytes = getattr(spec, "state_content_bytes", None) or spec.head_size
        expected = V4_RECORD_BYTES if cls is attention.DeepseekV4Attention else FP8_INDEXER_ROW
        if state_bytes != expected:
            return 0, (
                f"{cls.__name__} record of {state_bytes} B (the split is proven on the "
                f"{V4_RECORD_BYTES}-B V4 record and the {FP8_INDEXER_ROW}-B fp8 indexer row)"
            )
        kernel_page = spec.copy_with_new_block_size(PAGE_ROWS).page_size_bytes
        manager_page = spec.copy_with_new_block_size(SPLIT_MANAGER_BLOCK).page_size_bytes
        if manager_page != 2 * kernel_page:
            return 0, (
                f"{cls.__name__}: a {SPLIT_MANAGER_BLOCK}-token page ({manager_page} B) is "
                f"not two {PAGE_ROWS}-state pages ({kernel_page} B)"
            )
        pages.append(kernel_page)
    return sum(pages), None


@dataclasses.dataclass(frozen=True)
class UpstreamGain:
    """The 2% rule, planned on one engine's real layers (:mod:`.gain`): the
    fix's best layout against upstream's working one, in KV tokens per GiB at
    the engine's max-model-len; ``ratio`` None where they could not be planned."""

    ratio: float | None
    note: str

    @property
    def applies(self) -> bool:
        return self.ratio is not None and self.ratio >= GAIN_TO_APPLY


def upstream_gain(vllm_config: Any) -> UpstreamGain | None:
    """The 2% rule as planned for this engine, or None before it was (the
    layers are still being built, or upstream's layout is not in question)."""
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    for prefix in _state["upstream_swa_caches"]:
        layer = (context or {}).get(prefix)
        if layer is not None:
            return getattr(layer, GAIN_MEMO, None)
    return None


def _decide(vllm_config: Any, consider_upstream: bool = True) -> Decision:
    """The geometry for ``vllm_config``; ``consider_upstream=False``: the
    fix's own candidate, as if upstream's layout did not work."""
    if _state["planning_decision"] is not None:
        return _state["planning_decision"]
    # interleaved-split, an invalid value (warned about at plugin load) and none
    # all leave the choice to the checks below
    if settings.value(settings.DSV41_GEOMETRY) == PER_RATIO:
        return Decision(PER_RATIO, f"{GEOMETRY_ENV}=per-ratio")
    outgained = ""
    if consider_upstream and settings.value(settings.DSV41_GEOMETRY) != SPLIT:
        aside = upstream_steps_aside_reason(vllm_config)
        if aside:
            gain = upstream_gain(vllm_config)
            if gain is None or not gain.applies:
                return Decision(UPSTREAM, aside + (f"; {gain.note}" if gain else ""))
            outgained = f"{gain.note}; "
    candidate = _candidate(vllm_config)
    return dataclasses.replace(candidate, reason=outgained + candidate.reason)


def _candidate(vllm_config: Any) -> Decision:
    if _state["split_unreviewed"]:
        return Decision(PER_RATIO, _state["split_unreviewed"])
    trigger = _config_triggers(vllm_config)
    if trigger:
        return Decision(PER_RATIO, trigger)
    method = speculative_method(vllm_config)
    if method == DSPARK:
        misfit = _dspark_misfit(vllm_config)
        if misfit:
            return Decision(PER_RATIO, misfit)
    unit, misfit = _ratio1_pair_unit(vllm_config)
    if misfit:
        return Decision(PER_RATIO, misfit)
    return Decision(SPLIT, _SPLIT_DEFAULT + _speculative_note(method), unit)


def upstream_steps_aside_reason(vllm_config: Any) -> str | None:
    """Why the fix leaves this line to upstream's own layout, or None.

    It steps aside where upstream's layout for the line starts and every page
    of it is inside the installed kernels' own envelopes.  An envelope that
    cannot be read is never "accepts", so the fix then keeps its layout.
    Where it steps aside, :mod:`.gain` still plans both layouts once the
    engine's layers exist, and the fix applies after all where its own holds
    at least :data:`GAIN_TO_APPLY` times upstream's KV tokens."""
    try:
        layout = upstream.for_config(vllm_config)
    except Exception:  # noqa: BLE001 - vLLM's backends unreadable here: keep the fix's layout
        return None
    if layout.works:
        return (
            f"not-needed: upstream's --block-size {layout.block_size} layout is within the "
            "installed kernels' envelopes"
        )
    return None


def stepped_aside() -> bool:
    """Whether this process decided to leave upstream's layout in place."""
    return any(d.geometry == UPSTREAM for d in _state["decisions"].values())


def geometry_decision(vllm_config: Any) -> tuple[str, str]:
    """(geometry, reason) this fix uses for ``vllm_config`` on SM12x.

    ``vllm_config`` is a ``VllmConfig`` or any object with the same attribute
    names (``speculative_config``, ``kv_transfer_config``, ``cache_config``,
    ``parallel_config``, ``attention_config``; missing ones count as unset), so
    ``doctor`` can ask before a server starts.  Once the model's layers are
    registered, the ratio-1 caches' real page sizes are checked too."""
    if _state["split_unreviewed"] is None:
        try:
            _state["split_unreviewed"] = split_unreviewed() or ""
        except Exception as exc:  # vLLM not importable here: say so, choose the fallback
            _state["split_unreviewed"] = f"cannot read vLLM's sources here: {exc}"
    decision = _decide(vllm_config)
    return decision.geometry, decision.reason


def _decision_for_specs(vllm_config: Any) -> Decision:
    if _state["planning_decision"] is not None:  # a candidate planned: nothing recorded
        return _state["planning_decision"]
    decision = _decide(vllm_config)
    if decision.geometry == SPLIT and not decision.unit:
        decision = Decision(
            PER_RATIO,
            "the model's ratio-1 caches are not registered in the "
            "forward context, so the interleave unit is unknown",
        )
    key = (decision.geometry, decision.reason)
    if key not in _state["decisions"]:
        _state["decisions"][key] = decision
        _logger().info(
            "vllm-mla-fixes (%s): DeepSeek-V4.1 KV geometry %s (%s)",
            INFO.name,
            decision.geometry,
            decision.reason,
        )
    return decision


def status_detail() -> str:
    """What ``status`` adds to the applied reason: the geometry in force in
    this process, or the rule when no model was loaded here."""
    decided = list(_state["decisions"].values())
    if decided:
        planned = _state["drafter_rows"]
        drafter = (
            ""
            if planned is None
            else f"; drafter sliding-window pages: {planned[0]} rows ({planned[1]})"
        )
        return "; ".join(f"geometry {d.geometry} ({d.reason})" for d in decided) + drafter
    if _state["split_unreviewed"]:
        return f"geometry {PER_RATIO} ({_state['split_unreviewed']})"
    return (
        f"geometry chosen when the model loads: {UPSTREAM} (the fix steps aside) where "
        "upstream's layout for the line starts and every page is inside the installed "
        "kernels' own envelopes, unless the fix's layout, planned on the engine's layers, "
        f"holds at least {GAIN_TO_APPLY:.2f}x its KV tokens; else {SPLIT} by default (also with DSpark "
        "drafters that own or read no ratio-1 cache, ngram and suffix), "
        f"{PER_RATIO} with EAGLE-style or other speculative methods, a KV connector other "
        "than CPU offloading, DCP/PCP > 1, HiSparse, another KV record, ratio-1 caches that do not "
        f"pair up, or {GEOMETRY_ENV}=per-ratio"
    )


@functools.cache
def flashinfer_takes_runtime_swa_pages() -> bool:
    """Whether every installed kernel on the sliding-window cache takes
    128-row pages, as its own envelope declares: FlashInfer's SM120 decode and
    prefill take run-time page sizes from 0.7.2.post1 on; 0.7.0.post1
    instantiates 64 rows only.  An unknown envelope keeps 64-row pages."""
    return envelope.accepts_rows(envelope.SWA, DRAFTER_SWA_ROWS) is True


def drafter_swa_rows() -> tuple[int, str]:
    """Rows of a drafter's sliding-window pages before planning, and why; 128
    is a candidate that :mod:`.drafter_pages` plans unless the setting forces it."""
    forced = settings.value(settings.DSV41_DRAFTER_SWA_ROWS)
    if forced == PAGE_ROWS:
        return PAGE_ROWS, f"{DRAFTER_SWA_ENV}={PAGE_ROWS}"
    if not flashinfer_takes_runtime_swa_pages():
        return PAGE_ROWS, "the installed FlashInfer decodes 64-row primary pages only"
    if forced == DRAFTER_SWA_ROWS:
        return DRAFTER_SWA_ROWS, f"{DRAFTER_SWA_ENV}={DRAFTER_SWA_ROWS}"
    return DRAFTER_SWA_ROWS, (
        "the installed FlashInfer takes run-time page sizes; kept where planning the "
        "engine's drafter layers both ways finds that 128-row pages, all in one KV-cache "
        "group, hold more KV tokens per GiB than 64-row pages, else 64"
    )
