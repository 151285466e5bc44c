"""The documentation's commands run, and its links lead somewhere.

A shell block whose fence reads ```` ```bash tested ```` (README.md, CONTRIBUTING.md,
docs/) holds commands an operator can run on a machine without a GPU; each of
its lines runs here, as the operator would run it: in a shell, from an empty
folder, with this environment's ``vllm-mla-fixes`` first on PATH.  A line must
exit 0 and print no traceback; a ``doctor`` line may also end READY WITH
WARNINGS (a documented line must never be one that WILL FAIL).

Every other shell block of README.md and docs/ says, on the line just above
its fence, who runs it or why nothing can run it here (issue 44): ``<!-- run
by tests/<file>.py -->`` (a test that reads that document), or ``<!-- not
run here: <why> -->`` (a GPU, the network, a publication, your own serve
line).  A block with neither fails."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla_fixes.doctor import EXIT_STATUS, READY, READY_WITH_WARNINGS
from vllm_mla_fixes.fixes import FIX_NAMES

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
    found: dict[str, str] = {}  # command -> the first document that shows it
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


# -- every other block says who runs it ------------------------------------------------

SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\b(.*)$")
RUN_BY = re.compile(r"^<!-- run by (tests/[\w/]+\.py) -->$")
NOT_RUN = re.compile(r"^<!-- not run here: (.{12,}) -->$")


def shell_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, fence, the line above it) of every shell block's opening fence."""
    lines = text.splitlines()
    found, inside = [], False
    for number, line in enumerate(lines, 1):
        if inside:
            inside = not line.startswith("```")
            continue
        if line.startswith("```"):
            inside = True
            if SHELL_FENCE.match(line):
                above = next((ln for ln in reversed(lines[: number - 1]) if ln.strip()), "")
                found.append((number, line, above.strip()))
    return found


def unmarked_blocks(document: Path) -> list[str]:
    """The shell blocks of ``document`` that neither run here nor say why not."""
    problems = []
    name = document.relative_to(ROOT).as_posix()
    for number, fence, above in shell_blocks(document.read_text()):
        if TESTED_FENCE.match(fence) or NOT_RUN.match(above):
            continue
        runner = RUN_BY.match(above)
        if runner is None:
            problems.append(f"{name}:{number}: {fence!r} says neither who runs it nor why not")
        else:
            test = ROOT / runner[1]
            if not test.exists() or Path(name).name not in test.read_text():
                problems.append(
                    f"{name}:{number}: {runner[1]} does not exist or never reads {name}"
                )
    return problems


def test_every_shell_block_is_run_or_says_why_not():
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    problems = [problem for document in documents for problem in unmarked_blocks(document)]
    assert not problems, "\n".join(problems)


def test_an_unmarked_block_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nnox -t verify\n```\n\n<!-- not run here: needs a GPU node -->\n```bash\nx\n```\n"
        "<!-- run by tests/nowhere.py -->\n```sh\ny\n```\n```text\nnot a command\n```\n"
    )
    assert unmarked_blocks(page) == [
        "page.md:1: '```bash' says neither who runs it nor why not",
        "page.md:10: tests/nowhere.py does not exist or never reads page.md",
    ]


def _noxfile_env_dir() -> Path:
    """The noxfile's ENV_DIR under this process's environment (its assignments
    alone: nox is not installed in a release's test environment)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    wanted: list[ast.stmt] = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("USER_CACHE", "ENV_DIR")
    ]
    namespace: dict = {"os": os, "Path": Path}
    exec(compile(ast.Module(wanted, []), "noxfile.py", "exec"), namespace)
    return namespace["ENV_DIR"]


def test_the_harness_environments_go_where_the_readme_says(monkeypatch, tmp_path):
    readme = (ROOT / "README.md").read_text()
    words = " ".join(readme.split())
    assert "in a virtual environment" in words and "python3 -m venv .venv" in readme
    for said in ("$XDG_CACHE_HOME/vllm-mla-fixes/envs", "~/.cache/vllm-mla-fixes/envs"):
        assert said in readme
    monkeypatch.delenv("VLLM_MLA_FIXES_ENV_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert _noxfile_env_dir() == Path.home() / ".cache" / "vllm-mla-fixes" / "envs"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # as the plugin's own cache follows it
    assert _noxfile_env_dir() == tmp_path / "vllm-mla-fixes" / "envs"
    monkeypatch.setenv("VLLM_MLA_FIXES_ENV_DIR", str(tmp_path / "mine"))
    assert _noxfile_env_dir() == tmp_path / "mine"


def _git_tags() -> list[str] | None:
    done = subprocess.run(["git", "tag", "--list"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.split() if done.returncode == 0 else None


def test_the_docs_name_no_tag_or_release_that_does_not_exist():
    tags = _git_tags()
    if tags is None:
        pytest.skip("not a git checkout: its tags cannot be read")
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {
        (document.relative_to(ROOT).as_posix(), tag)
        for document in documents
        for tag in re.findall(r"@(v\d+\.\d+\.\d+)", document.read_text())
    }
    assert not [(where, tag) for where, tag in named if tag not in tags], named
    install = INSTALL.read_text()
    published = any(re.fullmatch(r"v\d+\.\d+\.\d+", tag) for tag in tags)
    assert ("No release is published yet" in install) != published


INSTALL = ROOT / "docs" / "install.md"


def test_every_mention_of_the_truth_table_module_says_which_table_it_prints():
    """With no flag the module prints the cells as JSON, not the table the docs show."""
    module = "vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions.truth_table"
    bare = []
    for document in (d for d in DOCUMENTS if d.name != "CHANGELOG.md"):  # history stays as said
        words = " ".join(document.read_text().split())
        for after in words.split(module)[1:]:
            if not after.lstrip("` ").startswith(("--markdown", "--summary")):
                bare.append(f"{document.relative_to(ROOT)}: ...{module}{after[:40]}")
    assert not bare, "\n".join(bare)


def test_the_local_wheel_section_installs_what_its_first_line_leaves_behind():
    """install.md section 4 once built from a wheel file its first line never
    wrote (the download goes to the user cache, the build to dist/)."""
    section = INSTALL.read_text().split("## 4. ", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    wheels = re.findall(r"\S+\.whl", block)
    assert wheels and all(w.startswith("dist/") for w in wheels), wheels


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
    for document in DOCUMENTS:  # a link whose text is a file's name names the file it leads to
        for text, target in re.findall(r"\[`?([\w./-]+\.md)`?\]\(([^)\s#]+)", document.read_text()):
            if Path(text).name != Path(target).name:
                broken.append(f"{document.relative_to(ROOT)}: [{text}]({target}) (another file)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_no_anchor_of_its_own():
    """PyPI renders the README without heading anchors: an in-page link would be dead there."""
    readme = (ROOT / "README.md").read_text()
    assert not [t for t in LINK.findall(readme) if t.startswith("#")]


def test_the_first_screen_of_the_readme():
    """What a newcomer needs is within the README's first 60 lines."""
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for fix in FIX_NAMES:
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
