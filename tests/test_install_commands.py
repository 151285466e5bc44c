"""The install commands of docs/install.md work as written (issue 36).

Section 2 gives one line per covered vLLM release, installing vLLM and the
plugin together.  Each line runs here, in a fresh virtual environment, as the
operator's shell runs it, with ``--dry-run`` added to its install command:
pip and uv then resolve every requirement against the package index and
install nothing (vLLM and torch are gigabytes; every test session runs in a
real install of the same resolution, pinned in envs/).  A git URL installs
the plugin for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla_fixes.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parent.parent
INSTALL_DOC = ROOT / "docs" / "install.md"
CHECKOUT_PLACEHOLDER = "/path/to/vllm-mla-fixes"
COVERED = sorted({r for fix in ALL_FIXES for r in fix.INFO.covered_releases})


def _section_block(heading: str) -> list[str]:
    """The lines of the first ```bash block under ``heading``."""
    text = INSTALL_DOC.read_text()
    section = text[text.index(heading) :]
    block = section[section.index("```bash\n") + len("```bash\n") :]
    return [line for line in block[: block.index("```")].splitlines() if line.strip()]


def install_lines() -> dict[str, str]:
    """Section 2's line for each vLLM release it installs."""
    lines = _section_block("## 2. vLLM and the plugin together")
    found: dict[str, str] = {}
    for line in lines:
        (release,) = re.findall(r"\bvllm==(\S+)", line)
        assert release not in found, f"two lines install vLLM {release}"
        found[release] = line
    return found


def test_every_covered_release_has_an_install_line():
    assert sorted(install_lines()) == COVERED


def _scratch_venv(path: Path) -> dict[str, str]:
    """A fresh environment with pip, and the shell environment that has it active."""
    subprocess.run(["uv", "venv", "-q", "--seed", "-p", sys.executable, str(path)], check=True)
    tools = Path(sys.executable).parent  # uv, as the operator's `pip install uv` gives it
    # nox's uv sessions set UV_PYTHON and UV_PROJECT_ENVIRONMENT to the session's
    # environment, which uv would install into instead of the active one.
    inherited_targets = ("PYTHONPATH", "VIRTUAL_ENV", "UV_PYTHON", "UV_PROJECT_ENVIRONMENT")
    env = {k: v for k, v in os.environ.items() if k not in inherited_targets}
    env.update(
        VIRTUAL_ENV=str(path),
        PATH=os.pathsep.join([str(path / "bin"), str(tools), env.get("PATH", "")]),
    )
    return env


def _resolve(release: str, line: str, workdir: Path) -> str | None:
    """Run ``line`` with ``--dry-run`` in a fresh environment; what is wrong, or None."""
    workdir.mkdir()
    dry = re.sub(
        r"\b(pip install) ", r"\1 --dry-run ", line.replace(CHECKOUT_PLACEHOLDER, str(ROOT))
    )
    env = _scratch_venv(workdir / "venv")
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", dry],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    said = done.stdout + done.stderr
    if done.returncode != 0:
        return f"`{dry}` exited {done.returncode}\n{said[-4000:]}"
    # pip: "Would install ... vllm-0.34.0 ..."; uv: " + vllm==0.34.0"
    if not re.search(rf"\bvllm(?:-|==){re.escape(release)}\b", said):
        return f"`{dry}` would not install vLLM {release}\n{said[-4000:]}"
    if not re.search(r"\bvllm[-_]mla[-_]fixes(?:-\d| @ )", said):
        return f"`{dry}` would not install the plugin\n{said[-4000:]}"
    return None


@pytest.mark.vllm_release(COVERED[-1])
def test_every_install_line_resolves(tmp_path):
    """Every line at once: resolving is waiting on the package index (about 50 s
    a line), so the lines run side by side, in one session; none needs its
    release installed."""
    from concurrent.futures import ThreadPoolExecutor

    lines = install_lines()
    with ThreadPoolExecutor(max_workers=len(lines)) as pool:
        problems = pool.map(
            lambda item: _resolve(item[0], item[1], tmp_path / item[0]), lines.items()
        )
    wrong = [problem for problem in problems if problem]
    assert not wrong, "\n\n".join(wrong)


@pytest.mark.vllm_release("0.34.0")
def test_0_34_pins_a_flashinfer_that_does_not_exist(tmp_path):
    """Why the 0.34.0 line carries its override: vLLM 0.34.0 requires
    flashinfer-python==0.7.3, which the index does not have; 0.7.4 it does."""
    from importlib.metadata import requires

    pins = [r.split(";")[0].replace(" ", "") for r in requires("vllm") or []]
    assert "flashinfer-python==0.7.3" in pins
    line = install_lines()["0.34.0"]
    assert "echo flashinfer-python==0.7.4 > overrides.txt" in line
    assert "--override overrides.txt" in line
    env = _scratch_venv(tmp_path / "venv")

    def resolves(requirement: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["pip", "install", "--dry-run", "--no-deps", requirement],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    missing = resolves("flashinfer-python==0.7.3")
    assert missing.returncode != 0 and "No matching distribution" in missing.stderr
    assert resolves("flashinfer-python==0.7.4").returncode == 0


@pytest.mark.vllm_release("0.25.1")
def test_a_git_url_installs_the_plugin(tmp_path):
    """``pip install "git+<URL>"``: pip clones the repository and builds it."""
    env = _scratch_venv(tmp_path / "venv")
    url = f"git+file://{ROOT}"
    subprocess.run(
        ["pip", "install", "--quiet", "--no-deps", "packaging", url],
        env=env,
        cwd=tmp_path,
        check=True,
        timeout=600,
    )
    import vllm_mla_fixes

    shown = subprocess.run(
        ["python", "-c", "import vllm_mla_fixes; print(vllm_mla_fixes.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown.startswith(str(tmp_path / "venv")), shown  # the installed copy, not this one
    assert (
        vllm_mla_fixes.__version__
        in subprocess.run(
            ["pip", "show", "vllm-mla-fixes"], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
