"""Run the harness through the project's fix module (``plugin`` geometry)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix

if TYPE_CHECKING:
    from vllm_mla_fixes.patching import AppliedFix


class FixUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def applied_fix(capability: tuple[int, int] = (12, 0)) -> Iterator[AppliedFix]:
    """The fix applied to the installed vLLM as on an SM12x device, through
    the same ``run_fix`` the plugin's ``register()`` uses; reverted on exit."""
    import vllm

    from vllm_mla_fixes.patching import State, run_fix

    result = run_fix(fix.for_capability(capability), vllm.__version__)
    if result.status.state is not State.APPLIED:
        status = result.status
        raise FixUnavailable(f"the fix did not apply: {status.label()} ({status.reason})")
    patch = result.patch
    assert patch is not None, "run_fix returns every applied fix with its patch"
    try:
        yield result
    finally:
        patch.revert()


@contextlib.contextmanager
def untranslated_ratio1_slots() -> Iterator[None]:
    """Inside :func:`applied_fix`: the fix's split with its ratio-1 slot
    translation taken out (vLLM's own ``AttentionGroup._with_kernel_block_table``
    back in place), so the ratio-1 writers keep manager-block slots -- the
    control that shows the harness sees the bug class."""
    from vllm.v1.worker.utils import AttentionGroup

    translating = AttentionGroup.__dict__["_with_kernel_block_table"]
    upstream = getattr(translating, "__wrapped__", None)
    if upstream is None:
        raise FixUnavailable("the fix does not translate ratio-1 slots here")
    AttentionGroup._with_kernel_block_table = upstream
    try:
        yield
    finally:
        AttentionGroup._with_kernel_block_table = translating
