"""The vLLM releases a test runs on, named by what they are and read from each
fix's FixInfo, where they are declared once: a test never writes a list of
releases of its own (``tests/test_one_release_list.py``).

    @pytest.mark.vllm_release(*covered(DSV41))             # every release the fix covers
    @pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))  # those before upstream changed
    @pytest.mark.vllm_release(newest(FP8), newest(DSV41))  # one session of each fix

Adding a vLLM release to a fix's ``covered_releases`` adds it to every test
marked with ``covered``, and moves the tests marked with ``newest`` to it.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from vllm_mla_fixes.fixes import dsv41_sm120_geometry, fa4_compile_strides, fp8_ds_mla_reshape
from vllm_mla_fixes.patching import FixInfo

FP8 = fp8_ds_mla_reshape.INFO
FA4 = fa4_compile_strides.INFO
DSV41 = dsv41_sm120_geometry.INFO


def covered(info: FixInfo, within: str = "") -> tuple[str, ...]:
    """The releases ``info`` covers, oldest first; with ``within``, a PEP 440
    specifier such as ``"<0.34.0"``, only those inside it."""
    return tuple(SpecifierSet(within).filter(info.covered_releases))


def oldest(info: FixInfo) -> str:
    """The oldest release ``info`` covers."""
    return info.covered_releases[0]


def newest(info: FixInfo) -> str:
    """The newest release ``info`` covers."""
    return info.covered_releases[-1]
