"""The comparison behind ``nox -s upstream-tests-0.34.0`` (no vLLM needed, well under 1 s)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "compare_outcomes", ROOT / "tests" / "upstream" / "compare_outcomes.py"
)
assert _spec is not None and _spec.loader is not None, "tests/upstream/compare_outcomes.py"
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

DOCUMENT_WITH = """
<!-- upstream-test-differences -->
| test | fix off | fix on | why |
|---|---|---|---|
| `tests/a.py::test_x` | passed | failed | the fix declares 128-token kernel blocks for ratio 2 |
<!-- end of upstream-test-differences -->
"""


def _run(tmp_path, off, on, document):
    paths = []
    for name, content in (("off.json", json.dumps(off)), ("on.json", json.dumps(on))):
        (tmp_path / name).write_text(content)
        paths.append(str(tmp_path / name))
    (tmp_path / "testing.md").write_text(document)
    return compare.main(*paths, str(tmp_path / "testing.md"))


def test_the_documented_table_parses_and_lists_no_difference_today():
    assert compare.intended_differences((ROOT / "docs" / "testing.md").read_text()) == {}


def test_only_listed_differences_pass(tmp_path, capsys):
    off = {"tests/a.py::test_x": "passed", "tests/a.py::test_y": "skipped"}
    assert _run(tmp_path, off, dict(off, **{"tests/a.py::test_x": "failed"}), DOCUMENT_WITH) == 0
    # an unlisted difference, and a listed one that did not happen
    assert _run(tmp_path, off, dict(off, **{"tests/a.py::test_y": "failed"}), DOCUMENT_WITH) == 1
    out = capsys.readouterr().out
    assert "NOT LISTED: tests/a.py::test_y: skipped -> failed" in out
    assert "LISTED BUT NOT SEEN: tests/a.py::test_x: passed -> failed" in out
    # a test that ran in one run only is a difference too
    assert (
        _run(tmp_path, off, {"tests/a.py::test_y": "skipped"}, DOCUMENT_WITH.replace("| `", "| x"))
        == 1
    )
