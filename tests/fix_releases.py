"""The vLLM releases a test runs on, named by what they are and read from each
fix's FixInfo, where they are declared once: a test never writes a list of
releases of its own (``tests/test_one_release_list.py``).

    @pytest.mark.vllm_release(*covered(DSV41))             # every release the fix covers
    @pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))  # those before upstream changed
    @pytest.mark.vllm_release(newest(FP8), newest(DSV41))  # one session of each fix
    @pytest.mark.vllm_release(newest(FP8), newest_covered())  # a shared test: the ends

A test outside a fix's own folder names no fix that could be deleted: it
picks its sessions with ``newest_covered``, ``covered_by_some_fix`` and
``first_covered_after`` (``FP8`` and ``FA4`` stand for the 0.25 sessions).

Adding a vLLM release to a fix's ``covered_releases`` adds it to every test
marked with ``covered``, and moves the tests marked with ``newest`` to it.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_mla_fixes.fixes import COVERED_RELEASES, FIXES_BY_NAME
from vllm_mla_fixes.patching import FixInfo

FP8 = FIXES_BY_NAME["fp8-ds-mla-reshape"].INFO
FA4 = FIXES_BY_NAME["fa4-compile-strides"].INFO
if "dsv41-sm120-geometry" in FIXES_BY_NAME:  # tests beyond its own folder name it too
    DSV41 = FIXES_BY_NAME["dsv41-sm120-geometry"].INFO


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


def first_covered_after(release: str) -> tuple[str, ...]:
    """The oldest release some fix covers that is newer than ``release``, if any."""
    return tuple(r for r in COVERED_RELEASES if Version(r) > Version(release))[:1]


def newest_covered() -> str:
    """The newest release some fix covers."""
    return COVERED_RELEASES[-1]


def covered_by_some_fix(within: str) -> tuple[str, ...]:
    """The releases some fix covers inside ``within``, a PEP 440 specifier, oldest first."""
    return tuple(SpecifierSet(within).filter(COVERED_RELEASES))
