"""The fixes, in the order :func:`vllm_mla_fixes.register` applies them.

Each module or package here holds one fix, with a DEP-3-style header, and
exposes its record, ``FIX``, a :class:`vllm_mla_fixes.fix.Fix` (``INFO``,
``SETTINGS``, ``probe``, ``apply``, ``diagnose``, ``verify`` and its part of
the command line).  ``ALL_FIXES`` is the one place that names them: nothing
else outside a fix's own folder does.  Modules import vLLM only inside what
they run, so importing this package stays cheap.
"""

from packaging.version import Version

from vllm_mla_fixes import settings
from vllm_mla_fixes.fix import Fix
from vllm_mla_fixes.fixes import dsv41_sm120_geometry, fa4_compile_strides, fp8_ds_mla_reshape

ALL_FIXES: tuple[Fix, ...] = (
    fp8_ds_mla_reshape.FIX,
    fa4_compile_strides.FIX,
    dsv41_sm120_geometry.FIX,
)
FIX_NAMES = tuple(m.INFO.name for m in ALL_FIXES)
FIXES_BY_NAME = {fix.INFO.name: fix for fix in ALL_FIXES}
COVERED_RELEASES = tuple(
    sorted({r for m in ALL_FIXES for r in m.INFO.covered_releases}, key=Version)
)
"""Every vLLM release some fix covers, oldest first: the releases a release of
this package is checked against and ships patched wheels for."""
SELFTEST_RELEASES = tuple(
    sorted(
        {r for m in ALL_FIXES if m.INFO.has_selftest for r in m.INFO.covered_releases}, key=Version
    )
)
"""The releases ``vllm-mla-fixes selftest`` must pass on a GPU runner: those
of the fixes that have a self-test (none: the command does not exist)."""
SELECTION = settings.fix_selection(FIX_NAMES)
"""``VLLM_MLA_FIXES``: which of these fixes the plugin may apply."""
SETTINGS = (SELECTION, *(s for fix in ALL_FIXES for s in fix.SETTINGS), settings.CACHE_DIR)
"""Every setting the package reads, in the order listings show them: the
fix selection, each fix's own settings, then the cache folder."""
