"""Run the harness through the project's fix module (``plugin`` geometry)."""

from __future__ import annotations

import contextlib

from .geometry import fix_module


class FixUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def applied_fix(capability: tuple[int, int] = (12, 0)):
    """The fix applied to the installed vLLM as on an SM12x device, through
    the same ``run_fix`` the plugin's ``register()`` uses; reverted on exit."""
    fix = fix_module()
    if fix is None:
        raise FixUnavailable("vllm_mla_fixes.fixes.dsv41_sm120_geometry does not exist yet")
    import vllm

    from vllm_mla_fixes.patching import State, run_fix

    result = run_fix(fix.for_capability(capability), vllm.__version__)
    if result.status.state is not State.APPLIED:
        status = result.status
        raise FixUnavailable(f"the fix did not apply: {status.label()} ({status.reason})")
    try:
        yield result
    finally:
        result.patch.revert()
