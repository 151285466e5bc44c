"""Compare vLLM's own test outcomes with the fix off and on (``upstream-tests-*`` nox session).

    python compare_outcomes.py fix-off.json fix-on.json docs/testing.md

The table in docs/testing.md between ``<!-- upstream-test-differences -->`` and
``<!-- end of upstream-test-differences -->`` lists every difference the fix
intends: test id, outcome with the fix off, outcome with it on, and why.  Exit
0 when the runs differ in exactly those tests, as listed; 1 otherwise, printing
each unlisted difference and each listed one that did not happen.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

START = "<!-- upstream-test-differences -->"
END = "<!-- end of upstream-test-differences -->"


def intended_differences(document: str) -> dict[str, tuple[str, str]]:
    """test id -> (outcome fix off, outcome fix on), from the document's table."""
    start, end = document.index(START), document.index(END)
    listed = {}
    for line in document[start:end].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue  # the header, its rule, prose
        listed[cells[0].strip("`")] = (cells[1], cells[2])
    return listed


def differences(off: dict[str, str], on: dict[str, str]) -> dict[str, tuple[str, str]]:
    """test id -> (outcome fix off, outcome fix on) where they differ ("absent"
    where a test ran in one run only)."""
    return {
        test: (off.get(test, "absent"), on.get(test, "absent"))
        for test in sorted(off.keys() | on.keys())
        if off.get(test) != on.get(test)
    }


def main(off_path: str, on_path: str, document_path: str) -> int:
    off = json.loads(Path(off_path).read_text())
    on = json.loads(Path(on_path).read_text())
    found = differences(off, on)
    listed = intended_differences(Path(document_path).read_text())
    for name, run in (("fix off", off), ("fix on", on)):
        counts = Counter(run.values())
        print(
            f"{name}: {len(run)} tests: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        )
    unlisted = {test: pair for test, pair in found.items() if listed.get(test) != pair}
    missing = {test: pair for test, pair in listed.items() if found.get(test) != pair}
    for test, (was, now) in found.items():
        mark = "listed" if test not in unlisted else "NOT LISTED"
        print(f"  {mark}: {test}: {was} -> {now}")
    for test, (was, now) in missing.items():
        print(f"  LISTED BUT NOT SEEN: {test}: {was} -> {now} (runs: {found.get(test)})")
    if unlisted or missing:
        print(
            f"{len(unlisted)} unlisted difference(s), {len(missing)} listed difference(s) not "
            f"seen: the fix changes vLLM's own tests in ways {document_path} does not state"
        )
        return 1
    print(f"{len(found)} difference(s), each listed in {document_path} with its reason")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
