"""The documentation's commands run, and its links lead somewhere.

A shell block whose fence reads ```` ```bash tested ```` (README.md, CONTRIBUTING.md,
docs/) holds commands an operator can run on a machine without a GPU; each of
its lines runs here, as the operator would run it: in a shell, from an empty
folder, with this environment's ``vllm-mla-fixes`` first on PATH.  A line must
exit 0 and print no traceback; a ``doctor`` line may also end READY WITH
WARNINGS (a documented line must never be one that WILL FAIL).

Other blocks are illustrations (they need a GPU, the network, or your own
serve line) and are run, where they can be, by the tests that own them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla_fixes.doctor import EXIT_STATUS, READY, READY_WITH_WARNINGS

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", ROOT / "CHANGELOG.md"]
    + [ROOT / "tests" / "README.md"]
    + list((ROOT / "docs").rglob("*.md"))
)
TESTED_FENCE = re.compile(r"^```(?:bash|sh)\s+tested\s*$")

# Files only, plus ~2 minutes of CPU for the commands: once, in the newest release's session.
pytestmark = pytest.mark.vllm_release("0.34.0")


def commands_in_tested_blocks(text: str) -> list[str]:
    """The logical lines of every ```` ```bash tested ```` block (backslash continuations joined)."""
    commands, block, inside = [], [], False
    for line in text.splitlines():
        if not inside:
            inside = bool(TESTED_FENCE.match(line))
            continue
        if line.startswith("```"):
            inside = False
            continue
        block.append(line)
        if not line.endswith("\\"):
            command = " ".join(part.rstrip("\\").strip() for part in block).strip()
            if command and not command.startswith("#"):
                commands.append(command)
            block = []
    return commands


def _documented_commands() -> list[tuple[str, str]]:
    found = {}
    for document in DOCUMENTS:
        for command in commands_in_tested_blocks(document.read_text()):
            found.setdefault(command, document.relative_to(ROOT).as_posix())
    return [(where, command) for command, where in found.items()]


COMMANDS = _documented_commands()


def test_the_marker_is_found_where_commands_are_documented():
    where = {document for document, _ in COMMANDS}
    assert {"README.md", "docs/fixes/dsv41-sm120-geometry.md"} <= where
    sample = (
        "x\n```bash tested\nvllm-mla-fixes doctor -- vllm serve m \\\n    --block-size 64\n```\n"
    )
    assert commands_in_tested_blocks(sample) == [
        "vllm-mla-fixes doctor -- vllm serve m --block-size 64"
    ]


@pytest.mark.parametrize(("document", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_documented_command_runs(document, command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = proc.stdout + proc.stderr
    doctor = " doctor" in command
    allowed = {EXIT_STATUS[READY], EXIT_STATUS[READY_WITH_WARNINGS]} if doctor else {0}
    assert proc.returncode in allowed, (
        f"{document}: `{command}` exited {proc.returncode}\n{output[-4000:]}"
    )
    assert "Traceback (most recent call last)" not in output, (
        f"{document}: `{command}`\n{output[-4000:]}"
    )


# -- links ---------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(document: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for document in DOCUMENTS:
        for target in LINK.findall(document.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            resolved = (document.parent / path).resolve() if path else document
            if not resolved.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_no_anchor_of_its_own():
    """PyPI renders the README without heading anchors: an in-page link would be dead there."""
    readme = (ROOT / "README.md").read_text()
    assert not [t for t in LINK.findall(readme) if t.startswith("#")]


def test_the_first_screen_of_the_readme():
    """What a newcomer needs is within the README's first 60 lines."""
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for fix in ("fp8-ds-mla-reshape", "fa4-compile-strides", "dsv41-sm120-geometry"):
        assert fix in first
    assert "No fix has been run on a GPU by this project" in first  # the hardware caveat
    # install from a checkout or a git URL: there is nothing on PyPI, no public repository
    assert "pip install /path/to/vllm-mla-fixes" in first and 'pip install "git+<URL' in first
    assert "There is no PyPI release and no public repository yet" in first
    assert "Nothing changes: run `vllm serve` with the same flags" in first
    # the harness is the developers', with what it needs
    assert "nox -t verify" in first and "nox -s lint && nox" in first
    harness = first[first.index("## For developers") :]
    assert "an operator needs neither" in harness
    assert all(need in harness for need in ("Python 3.11", "27 GB of disk", "half an hour"))
