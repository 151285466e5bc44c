"""What the fix made in this process, shared by its parts: the geometry
decisions taken, the backends whose block sizes it declares, the spec
producers it wrapped, and the interleaved caches it bound.  ``apply`` resets
all of it; nothing here imports vLLM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_state: dict[str, Any] = {
    "split_unreviewed": None,
    "decisions": {},
    # The DeepSeek-V4.1 backend classes whose kernel block sizes the fix
    # declares: only their ratio-1 groups are split.
    "backends": (),
    # Compress ratios of the caches the fix's spec producers made (> 1 only):
    # the warm-up adds its 64-state key for these and no other.
    "owned_ratios": set(),
    # Prefixes of the drafter sliding-window caches built with 128-row pages,
    # and of those planning then narrowed to 64 (drafter_pages).
    "drafter_swa_caches": set(),
    "drafter_swa_narrowed": set(),
    # Prefixes of the sliding-window caches built with upstream's 32-row pages
    # because upstream's layout works: the 2% rule (gain) may still move them
    # to the fix's page rows before their first spec.
    "upstream_swa_caches": set(),
    # True while candidate layouts are planned with vLLM's planner: nothing is
    # recorded, logged or planned again from inside such a pass.
    "planning": False,
    # The decision a planning pass lays out (None: the engine's own).
    "planning_decision": None,
    # The last planned choice: (rows, why), for status.
    "drafter_rows": None,
}


def _logger():
    try:
        from vllm.logger import init_logger
    except Exception:  # pragma: no cover - vLLM broken
        import logging

        return logging.getLogger("vllm.mla_fixes")
    return init_logger("vllm.mla_fixes")


_ORIGINAL_PRODUCERS: dict[type, Callable] = {}

GAIN_MEMO = "vllm_mla_fixes_upstream_gain"
"""Attribute set on an engine's upstream-row sliding-window caches once the
2% rule has been planned for it: its :class:`decision.UpstreamGain`."""


def _is_split_ratio1(group: Any) -> bool:
    """A ratio-1 attention group of one of the fix's backends with a kernel
    block size.  Decided from the group's class and spec alone, so groups of
    any other backend (other models, test stand-ins) are never asked anything."""
    backend = group.backend
    return (
        group.kernel_block_size is not None
        and getattr(group.kv_cache_spec, "tokens_per_state", None) == 1
        and isinstance(backend, type)
        and issubclass(backend, _state["backends"])
    )


_INTERLEAVED: dict[tuple[type, Any], tuple[int, int]] = {}
"""(backend class, spec) of the attention groups bound to interleaved pages ->
(unit bytes, bytes from the pair's start to the cache's first kernel page);
copies of those groups (DBO micro-batches, decoder replay) match too."""


def _interleaved_placement(group: Any) -> tuple[int, int] | None:
    """The group's entry in :data:`_INTERLEAVED`, or None.  Groups the fix does
    not own return None before their spec is hashed or their backend touched."""
    if not _INTERLEAVED or not _is_split_ratio1(group):
        return None
    return _INTERLEAVED.get((group.backend, group.kv_cache_spec))


_PAIR_REGIONS: dict[tuple, tuple[int, int, int]] = {}
"""(device, data pointer, shape, strides) of every view of an interleaved
ratio-1 cache, manager and kernel -> (byte offset of its pair region in block
0, pair bytes, block stride bytes).  Keys only: no tensor is kept alive."""


def _view_key(view: Any) -> tuple:
    return (view.device, view.data_ptr(), tuple(view.shape), tuple(view.stride()))
