"""CONTRIBUTING.md's table "Every place a new fix touches" is what the suite
enforces (issue 45): each place it lists exists for every fix, each test it
names exists, and every shared test that reads each fix of ``ALL_FIXES`` is
either named there or checks only the fix's own module (``FIX_ITSELF``).
A new test that asks something of every fix thus lands in the table, or here
with the reason it asks nothing outside the fix."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fix_releases import fix_test_folder

from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import FixInfo

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
OPTIONAL = "*where it has one*"
# Names a shared test reads to visit each fix, directly or through its tables.
EVERY_FIX = frozenset(
    {"ALL_FIXES", "FIXES_BY_NAME", "FIX_NAMES", "COVERED_RELEASES", "expected_decisions"}
)
FIX_ITSELF = {
    # the fix's record: its INFO, settings, gate, review and screen, read from its module;
    # or the mechanism, on a fix the test makes (test_foundation's own fix)
    "tests/test_foundation.py::test_fingerprint_mismatch_skips_with_one_warning_and_leaves_vllm_untouched",
    "tests/test_foundation.py::test_loading_the_plugin_again_says_nothing_twice",
    "tests/test_foundation.py::test_unknown_name_warns_in_plugin_and_fails_in_cli",
    "tests/test_build_wheel.py::test_patched_wheel_installs_and_applies_the_025_fixes",
    "tests/test_cli_contract.py::test_status_json_stdout_is_exactly_the_document",
    "tests/test_doctor_inputs.py::test_an_unreadable_config_will_fail_and_json_says_so",
    "tests/test_foundation.py::test_release_gate_decisions",
    "tests/test_foundation.py::test_covered_releases_pass_their_own_gate",
    "tests/test_foundation.py::test_selection_variable",
    "tests/test_gate_rule.py::test_every_fix_declares_a_consistent_release_record",
    "tests/test_gate_rule.py::test_unparseable_version_is_skipped_not_called_unaffected",
    "tests/test_gate_rule.py::test_run_fix_decides_by_release_before_probing",
    "tests/test_printed_values.py::test_the_remedy_doctor_prints_gets_the_fix_applied",
    "tests/test_properties.py::test_no_setting_turns_a_fix_off_and_each_invalid_one_warns_once",
    "tests/test_release.py::test_plugin_from_a_package_index_lists_all_three_fixes",
    "tests/test_review.py::test_gate_rule_and_scope",
    "tests/test_screen_cache.py::test_a_screen_reads_only_the_modules_its_key_covers",
    "tests/test_screen_cache.py::test_a_changed_module_beside_the_screen_changes_its_key",
    "tests/test_screen_cache.py::test_cached_verdict_is_the_screened_one_and_parses_nothing",
}


def places_table() -> list[tuple[str, str, list[str]]]:
    """(place, what goes there, the tests named) for each row of the table."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("### Every place a new fix touches\n", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue  # prose, the header or its rule
        place = cells[0].split("`")[1]
        rows.append((place, cells[1], re.findall(r"`(tests/[\w/]+\.py(?:::\w+)?)`", cells[2])))
    return rows


def paths_for(place: str, info: FixInfo) -> list[Path]:
    """The files or folders ``place`` stands for, for one fix."""
    folder = fix_test_folder(info).name
    named = place.replace("<fix>", folder).replace("<name>", info.name)
    if "<release>" in named:
        return [ROOT / named.replace("<release>", r) for r in info.covered_releases]
    return [ROOT / named]


def exists(path: Path) -> bool:
    return path.exists() or path.with_suffix(".py").is_file()  # a fix's module or package


def shared_tests_reading_every_fix() -> set[str]:
    """``file::test`` for each test of a shared test module (not a fix's own
    folder) that reads the fixes' list, or a module-level table made from it."""
    found = set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        derived = set(EVERY_FIX)
        for node in tree.body:  # module-level helpers and tables built from the list, in order
            read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("test_"):
                if read & derived:
                    derived.add(node.name)
            elif isinstance(node, ast.Assign) and read & derived:
                derived |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for test in ast.walk(tree):
            if isinstance(test, ast.FunctionDef) and test.name.startswith("test_"):
                read = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
                read |= {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
                if read & derived:
                    found.add(f"{path.relative_to(ROOT)}::{test.name}")
    return found


def test_every_place_exists_for_every_fix():
    rows = places_table()
    assert len(rows) >= 10, rows
    missing = [
        f"{place} for {fix.INFO.name}: {path.relative_to(ROOT)}"
        for place, what, _ in rows
        if OPTIONAL not in what
        for fix in ALL_FIXES
        for path in paths_for(place, fix.INFO)
        if not exists(path)
    ]
    assert not missing, missing


def test_the_places_this_test_checks_name_every_fix():
    """A file place whose only check is this test names each fix (tests/README.md's row)."""
    for place, _, tests in places_table():
        path = ROOT / place
        if tests == ["tests/test_contributing_places.py"] and path.is_file():
            text = path.read_text(encoding="utf-8")
            assert all(fix.INFO.name in text for fix in ALL_FIXES), place


def test_every_test_the_table_names_exists():
    for _, _, tests in places_table():
        for test in tests:
            file, _, name = test.partition("::")
            assert (ROOT / file).is_file(), test
            if name:
                assert f"def {name}(" in (ROOT / file).read_text(encoding="utf-8"), test


def test_every_shared_test_that_reads_each_fix_is_in_the_table_or_checks_the_fix_itself():
    named = [t for _, _, tests in places_table() for t in tests]
    covered = {
        t for t in shared_tests_reading_every_fix() if t in named or t.split("::")[0] in named
    }
    unaccounted = shared_tests_reading_every_fix() - covered - FIX_ITSELF
    assert not unaccounted, (
        "tests that read every fix, neither in CONTRIBUTING.md's table of places nor in "
        f"FIX_ITSELF: {sorted(unaccounted)}"
    )
    stale = FIX_ITSELF - shared_tests_reading_every_fix()
    assert not stale, f"FIX_ITSELF names tests that no longer read every fix: {sorted(stale)}"
