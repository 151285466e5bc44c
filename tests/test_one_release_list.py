"""Each fix's vLLM releases are spelled once, in its FixInfo (issue 34).

The noxfile, the release script and workflow, the CLI, the envelope table and
the tests' ``vllm_release`` markers read a fix's ``covered_releases``; adding
a vLLM release is one edit there, plus the lock file ``nox -s lock`` writes.
This test scans the checkout's Python, TOML and YAML files for a list of two
or more vLLM releases written out anywhere else: a tuple, list or set, the
arguments of one call (a marker), or one string of comma-separated releases.
Allowed: the ``FixInfo(...)`` records themselves and the ``REVIEWED``
fingerprint tables (review records: fingerprint -> the releases it was seen
in).  Prose (Markdown), the changelog, lock files and measured results under
``benchmarks/results`` are not code and are not scanned; a dict keyed by
release (one literal expectation per release) is not a list.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
# vLLM's releases since 0.10 have a two-digit minor version; the kernel
# packages whose versions this project names (FlashInfer 0.7.x, DeepGEMM)
# have not, so their version lists are not taken for vLLM's.
VLLM_RELEASE = re.compile(r"0\.\d{2,}\.\d+")
RELEASE_LIST_TEXT = re.compile(rf"\s*{VLLM_RELEASE.pattern}(\s*,\s*{VLLM_RELEASE.pattern})+\s*")
SCANNED_SUFFIXES = {".py", ".toml", ".yml", ".yaml"}
NOT_SCANNED = {
    Path("benchmarks/results"),  # measured output, kept as it was printed
    Path("envs"),  # the lock files
}
NOT_SCANNED_NAMES = {
    ".git",
    ".nox",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
}


def _is_release(value: object) -> bool:
    return isinstance(value, str) and VLLM_RELEASE.fullmatch(value) is not None


def _is_release_list(values: list[object]) -> bool:
    """Two or more vLLM releases, and no other string: a command line naming
    two releases, or sample versions with nightlies among them, is no list of
    releases."""
    strings = [v for v in values if isinstance(v, str)]
    return len(strings) >= 2 and all(_is_release(v) for v in strings)


def _scanned_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.iterdir()):
        relative = path.relative_to(ROOT)
        if path.is_dir():
            skip = path.name in NOT_SCANNED_NAMES or path.name.endswith(".egg-info")
            if not skip and relative not in NOT_SCANNED and not (path / "pyvenv.cfg").exists():
                yield from _scanned_files(path)
        elif path.suffix in SCANNED_SUFFIXES:
            yield path


def _allowed_subtrees(tree: ast.AST) -> set[int]:
    """The nodes under a ``FixInfo(...)`` call or a ``REVIEWED = ...`` table."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            roots: list[ast.AST] = [node] if name == "FixInfo" else []
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            reviewed = any(getattr(t, "id", None) == "REVIEWED" for t in targets)
            roots = [node.value] if reviewed and node.value is not None else []
        else:
            continue
        allowed.update(id(inner) for root in roots for inner in ast.walk(root))
    return allowed


def release_lists_in_python(source: str) -> list[tuple[int, str]]:
    """(line, the list as written) for each list of two or more vLLM releases."""
    tree = ast.parse(source)
    allowed = _allowed_subtrees(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items: list[ast.expr] = list(node.elts)
        elif isinstance(node, ast.Call):
            items = list(node.args)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if RELEASE_LIST_TEXT.fullmatch(node.value):
                found.append((node.lineno, repr(node.value)))
            continue
        else:
            continue
        if _is_release_list([i.value for i in items if isinstance(i, ast.Constant)]):
            found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return found


def release_lists_in_data(data: object) -> list[str]:
    """Each list of two or more vLLM releases in parsed TOML or YAML."""
    found = []
    if isinstance(data, dict):
        for value in data.values():
            found += release_lists_in_data(value)
    elif isinstance(data, list):
        if _is_release_list(data):
            found.append(str(data))
        for item in data:
            found += release_lists_in_data(item)
    elif isinstance(data, str) and RELEASE_LIST_TEXT.fullmatch(data):
        found.append(repr(data))
    return found


def release_lists_in_file(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return [f"line {line}: {code}" for line, code in release_lists_in_python(text)]
    if path.suffix == ".toml":
        return release_lists_in_data(tomllib.loads(text))
    return [hit for document in yaml.safe_load_all(text) for hit in release_lists_in_data(document)]


def test_no_file_spells_a_release_list_of_its_own():
    spelled = {
        str(path.relative_to(ROOT)): hits
        for path in _scanned_files(ROOT)
        if (hits := release_lists_in_file(path))
    }
    assert spelled == {}, (
        "a list of vLLM releases written out beside the fixes' FixInfo records; read the "
        "fix's covered_releases instead (tests: tests/fix_releases.py)"
    )


@pytest.mark.parametrize(
    "source",
    [
        'pytestmark = pytest.mark.vllm_release("0.32.0", "0.33.0", "0.34.0")',
        'DSV41 = ("0.32.0", "0.33.0", "0.34.0")',
        'VERIFY = ["0.25.1", "0.32.0"]',
        'assert installed in {"0.25.0", "0.25.1"}',
        'SHIPPED = "0.25.0, 0.25.1, 0.32.0"',
        'cases = [(v, b) for v in ("0.32.0", "0.33.0") for b in (64, 128)]',
    ],
)
def test_the_scan_finds_a_release_list_written_out(source):
    assert len(release_lists_in_python(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        # the records themselves
        'INFO = FixInfo(name="x", covered_releases=("0.32.0", "0.33.0"))',
        'REVIEWED = {("m", "f"): {"80626492cbc4d6b0": "0.32.0, 0.33.0, 0.34.0"}}',
        # one release, a dict keyed by release, kernel versions, prose naming two releases
        'pytestmark = pytest.mark.vllm_release("0.34.0")',
        'EXPECTED = {"0.32.0": "fails", "0.33.0": "fails", "0.34.0": "starts"}',
        'FLASHINFER = ("0.7.0.post1", "0.7.2.post1", "0.7.4")',
        'REASON = "bug present in vLLM 0.31.0, not covered here; upgrade to 0.32.0+"',
    ],
)
def test_the_scan_leaves_records_single_releases_and_prose_alone(source):
    assert release_lists_in_python(source) == []


def test_the_scan_reads_workflow_and_toml_lists():
    workflow = yaml.safe_load('jobs:\n  check:\n    matrix:\n      release: ["0.25.0", "0.34.0"]\n')
    assert release_lists_in_data(workflow) == ["['0.25.0', '0.34.0']"]
    assert release_lists_in_data(tomllib.loads('releases = ["0.32.0", "0.33.0"]\n')) != []
    assert release_lists_in_data({"release": "0.34.0", "include": [{"release": "0.25.1"}]}) == []


# What noxfile.py and scripts/release_check.py do in a Python that has packaging
# but neither vLLM nor torch (nox's own, the release-check session's).
WITHOUT_VLLM = """
import importlib.abc, sys
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, NoVllm())
import json
from vllm_mla_fixes.fixes import COVERED_RELEASES, SELFTEST_RELEASES
print(json.dumps([COVERED_RELEASES, SELFTEST_RELEASES]))
"""


def test_the_release_lists_are_read_without_vllm():
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    every_fix, with_selftest = json.loads(proc.stdout)
    assert every_fix and set(with_selftest) <= set(every_fix)
