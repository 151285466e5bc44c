"""The fixes, in the order :func:`vllm_mla_fixes.register` applies them.

Each module holds one fix: a DEP-3-style header, ``INFO`` (a
:class:`~vllm_mla_fixes.patching.FixInfo`), ``probe()``, ``apply(patch)`` and
``diagnose(env, serve)`` (``doctor``'s findings; types in :mod:`vllm_mla_fixes.report`).
Modules import vLLM only inside ``probe``/``apply``, so importing this package
stays cheap.
"""

from packaging.version import Version

from vllm_mla_fixes import settings
from vllm_mla_fixes.fixes import dsv41_sm120_geometry, fa4_compile_strides, fp8_ds_mla_reshape

ALL_FIXES = (fp8_ds_mla_reshape, fa4_compile_strides, dsv41_sm120_geometry)
FIX_NAMES = tuple(m.INFO.name for m in ALL_FIXES)
FIXES_BY_NAME = {m.INFO.name: m for m in ALL_FIXES}
COVERED_RELEASES = tuple(
    sorted({r for m in ALL_FIXES for r in m.INFO.covered_releases}, key=Version)
)
"""Every vLLM release some fix covers, oldest first: the releases a release of
this package is checked against and ships patched wheels for."""
settings.declare_fixes(FIX_NAMES)
