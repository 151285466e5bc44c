"""What the fix keeps in a process, per engine: :class:`FixState`.

Decisions are kept per engine, keyed by the engine's
:class:`~.engine.EngineConfig`: a second engine in the same process (another
``--block-size``, another model, DSpark on or off) gets its own decision,
exactly what a fresh process would give it, whatever order the engines come
in.  The key holds everything :func:`~.decision.decide` reads of the engine,
so the kept answer is only an optimisation: forgetting it changes nothing.

The rest is bookkeeping of what the fix built, never consulted to decide:
the layers it gave page rows (for the start-up page check), the layers whose
specs it split, the interleaved groups and their views (for slot
translation, zeroing and copies), and the live specs that did not match the
model's described ones (named by ``status`` and the log).  Layers are held
weakly, and nothing is set on vLLM's objects.  ``apply`` starts a new state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any, cast

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import Decision, decide_for
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig, engine_config
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import Geometry


def logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
    except Exception:  # pragma: no cover - vLLM broken
        return logging.getLogger("vllm.mla_fixes")
    return cast(logging.Logger, init_logger("vllm.mla_fixes"))


@dataclasses.dataclass(frozen=True)
class InterleavedPlacement:
    unit: int  # bytes of one interleave unit
    lead: int  # bytes from the pair's start to this cache's first kernel page


@dataclasses.dataclass(frozen=True)
class PairRegion:
    start: int  # byte offset of the pair region in block 0
    size: int  # bytes of the pair region (two units)
    block_stride: int  # bytes from one block's pair region to the next


class FixState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Forget everything (``apply`` starts each patch with a clear state)."""
        self.decisions: dict[EngineConfig, Decision] = {}
        # The DeepSeek-V4.1 backend classes whose kernel block sizes the fix declares.
        self.backends: tuple[type, ...] = ()
        # Layers the fix gave page rows to (rows each must be bound with).
        self.page_rows: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        # Layers whose ratio-1 specs the split changed.
        self.split_layers: weakref.WeakSet[object] = weakref.WeakSet()
        # (backend class, spec) of attention groups bound to interleaved pages.
        self.interleaved: dict[tuple[type, object], InterleavedPlacement] = {}
        # (device, data pointer, shape, strides) of every interleaved view.
        self.pair_regions: dict[tuple[object, ...], PairRegion] = {}
        # Live specs that differ from the model's described ones, per engine.
        self.spec_mismatches: dict[EngineConfig, tuple[str, ...]] = {}

    def decision_for(self, vllm_config: object) -> Decision:
        """The decision of the engine ``vllm_config`` belongs to; decided (and
        logged once) the first time that engine is seen."""
        engine = engine_config(vllm_config)
        with self._lock:
            known = self.decisions.get(engine)
        if known is not None:
            return known
        decision = decide_for(engine, vllm_config)
        with self._lock:
            if engine in self.decisions:
                return self.decisions[engine]
            self.decisions[engine] = decision
        logger().info(
            "vllm-mla-fixes (%s): DeepSeek-V4.1 KV geometry %s (%s)",
            INFO.name,
            decision.geometry.value,
            decision.reason,
        )
        for line in decision.evidence:
            logger().warning("vllm-mla-fixes (%s): %s", INFO.name, line)
        return decision

    def note_mismatch(self, engine: EngineConfig, line: str) -> None:
        with self._lock:
            known = self.spec_mismatches.get(engine, ())
            if line in known:
                return
            self.spec_mismatches[engine] = (*known, line)
        logger().warning(
            "vllm-mla-fixes (%s): a live KV-cache spec differs from the one the decision "
            "planned with (%s); the layout is unchanged, its capacity figures may be off",
            INFO.name,
            line,
        )

    def stepped_aside_everywhere(self) -> bool:
        """Every engine decided in this process kept upstream's layout."""
        return bool(self.decisions) and all(
            d.geometry is Geometry.UPSTREAM for d in self.decisions.values()
        )


STATE = FixState()


def is_split_ratio1(group: Any) -> bool:
    """A ratio-1 attention group of one of the fix's backends with a kernel
    block size.  Decided from the group's class and spec alone, so groups of
    any other backend (other models, test stand-ins) are never asked anything."""
    backend = group.backend
    return (
        group.kernel_block_size is not None
        and getattr(group.kv_cache_spec, "tokens_per_state", None) == 1
        and isinstance(backend, type)
        and issubclass(backend, STATE.backends)
    )


def interleaved_placement(group: Any) -> InterleavedPlacement | None:
    """The group's interleaved placement, or None.  Groups the fix does not
    own return None before their spec is hashed or their backend touched."""
    if not STATE.interleaved or not is_split_ratio1(group):
        return None
    return STATE.interleaved.get((group.backend, group.kv_cache_spec))


def view_key(view: Any) -> tuple[object, ...]:
    """What identifies a view of an interleaved cache (no tensor is kept alive)."""
    return (view.device, view.data_ptr(), tuple(view.shape), tuple(view.stride()))
