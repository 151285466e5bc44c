"""The vLLM releases a test runs on, named by what they are and read from each
fix's FixInfo, where they are declared once: a test never writes a list of
releases of its own (``tests/test_one_release_list.py``).

    @pytest.mark.vllm_release(*covered(DSV41))             # every release the fix covers
    @pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))  # those before upstream changed
    @pytest.mark.vllm_release(newest(DSV41))               # the fix's newest session
    @pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())  # a shared test: the ends

Here ``DSV41`` is the fix's ``INFO``, which a test in the fix's own folder
imports from the fix (``tests/<fix>/`` goes when the fix goes).  This module
and every test outside a fix's folder name no fix: they pick their sessions
through ``ALL_FIXES`` (``newest_of_earliest_fix``, ``newest_covered``,
``covered_by_some_fix``, ``first_covered_after``), so retiring a fix leaves
them importable, on the releases the remaining fixes cover.  A shared test
about one fix takes its sessions from ``covered_by(name)``: none once that
fix is retired, so the test is deselected in every session.

Adding a vLLM release to a fix's ``covered_releases`` adds it to every test
marked with ``covered``, and moves the tests marked with ``newest`` to it.
"""

from __future__ import annotations

from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_mla_fixes.fixes import ALL_FIXES, COVERED_RELEASES
from vllm_mla_fixes.patching import FixInfo

TESTS = Path(__file__).resolve().parent


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


def newest_of_earliest_fix() -> str:
    """The newest release of the fix whose releases end first (0.25.1 today):
    a shared test's session among the oldest releases some fix covers."""
    return min((fix.INFO.covered_releases[-1] for fix in ALL_FIXES), key=Version)


def covered_by(name: str, within: str = "") -> tuple[str, ...]:
    """The releases the fix named ``name`` covers (inside ``within``, as for
    ``covered``); none where no fix in ``ALL_FIXES`` has that name."""
    infos = [fix.INFO for fix in ALL_FIXES if fix.INFO.name == name]
    return covered(infos[0], within) if infos else ()


def fix_test_folder(info: FixInfo) -> Path:
    """``tests/<fix>/``: the tests of the fix alone, named as its module
    (``fp8-ds-mla-reshape`` -> ``fp8_ds_mla_reshape``); they go when it goes."""
    return TESTS / info.name.replace("-", "_")


def fixed_in_by(name: str) -> tuple[str, ...]:
    """The release upstream fixed the bug of the fix named ``name`` in; none
    where it is not fixed upstream, or no fix in ``ALL_FIXES`` has that name."""
    return tuple(
        fix.INFO.fixed_in for fix in ALL_FIXES if fix.INFO.name == name and fix.INFO.fixed_in
    )
