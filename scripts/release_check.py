"""Every step of a release except publishing, on a CPU machine.

``nox -s release-check`` runs ``all``; ``.github/workflows/release.yml`` runs
the stages one job at a time (one runner per vLLM release, for disk).

    python scripts/release_check.py build OUT [--tag vX.Y.Z]
        the plugin's sdist and wheel into OUT/plugin/, then ``twine check
        --strict`` and the contents a release must carry (LICENSE, version,
        entry point, py.typed)
    python scripts/release_check.py release VLLM_VERSION OUT
        a fresh environment of that vLLM release from envs/vllm-<release>.txt;
        the plugin wheel from OUT/plugin/ installed as pip installs from an
        index; ``vllm-mla-fixes status --json`` (every fix listed) and
        ``verify``; ``build-wheel`` into OUT/vllm/; that patched wheel installed
        in place of vLLM lists the three fixes too.  The environment is
        deleted afterwards.
    python scripts/release_check.py sums OUT
        OUT/SHA256SUMS (``sha256sum -c`` format) and one line per artifact
    python scripts/release_check.py notes VERSION
        the CHANGELOG.md section of VERSION (the GitHub release's notes)
    python scripts/release_check.py all OUT [VLLM_VERSION ...]
        build, release for each (default: every shipped release), sums
    python scripts/release_check.py releases
        the shipped releases as one JSON list (the release workflow's matrix)

Standard library only, plus ``twine`` for ``build`` and ``packaging`` for the
stages that read the shipped releases; ``uv`` must be on PATH.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "envs"


class ReleaseCheckError(RuntimeError):
    """A release artifact is not what a release must ship; the message says which."""


def shipped_releases() -> tuple[str, ...]:
    """The vLLM releases a release is checked against and ships patched wheels
    for: every release a fix covers, read from the fixes' FixInfo records in
    this checkout (they import packaging, so ``sums`` and ``notes`` do not)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from vllm_mla_fixes.fixes import COVERED_RELEASES

    return COVERED_RELEASES


def shipped_fixes() -> set[str]:
    """The name of every fix in this checkout: ``status`` of each artifact must list them all."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from vllm_mla_fixes.fixes import FIX_NAMES

    return set(FIX_NAMES)


def plugin_version() -> str:
    """``__version__`` of vllm_mla_fixes/__init__.py, read without importing it."""
    tree = ast.parse((ROOT / "vllm_mla_fixes" / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    raise ReleaseCheckError("vllm_mla_fixes/__init__.py assigns no literal __version__")


def _run(*command: str | Path, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in command), flush=True)
    return subprocess.run([str(c) for c in command], check=True, **kwargs)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:  # the release tooling runs on Python 3.11+
        return hashlib.file_digest(f, "sha256").hexdigest()


# -- build ---------------------------------------------------------------------------


def build(out: Path, tag: str | None = None) -> tuple[Path, Path]:
    version = plugin_version()
    if tag is not None:
        if tag != f"v{version}":
            raise ReleaseCheckError(
                f"tag {tag} does not match the package version {version} "
                f"(vllm_mla_fixes/__init__.py); tag v{version} or change __version__"
            )
        changelog_section(version)  # a release has its dated CHANGELOG.md section
    plugin = out / "plugin"
    shutil.rmtree(plugin, ignore_errors=True)
    _run("uv", "build", "--quiet", "--sdist", "--wheel", "--out-dir", plugin, ROOT)
    wheel = plugin / f"vllm_mla_fixes-{version}-py3-none-any.whl"
    sdist = plugin / f"vllm_mla_fixes-{version}.tar.gz"
    for artifact in (wheel, sdist):
        if not artifact.is_file():
            found = sorted(p.name for p in plugin.iterdir())
            raise ReleaseCheckError(f"uv build did not write {artifact.name} (found: {found})")
    # metadata renders and the long description is valid (what PyPI checks on upload)
    _run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist)
    _check_wheel(wheel, version)
    _check_sdist(sdist, version)
    (plugin / ".gitignore").unlink(missing_ok=True)  # uv's marker, not an artifact
    return wheel, sdist


def _check_wheel(wheel: Path, version: str) -> None:
    info = f"vllm_mla_fixes-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(info + "METADATA").decode()
        entry_points = z.read(info + "entry_points.txt").decode()
    wanted = {
        info + "licenses/LICENSE": "the Apache-2.0 license text",
        "vllm_mla_fixes/py.typed": "the typed-package marker",
        "vllm_mla_fixes/__init__.py": "the package",
    }
    missing = [f"{name} ({why})" for name, why in wanted.items() if name not in names]
    if missing:
        raise ReleaseCheckError(f"{wheel.name} lacks {', '.join(missing)}")
    headers = {
        f"Version: {version}",
        "License-Expression: Apache-2.0",
        "License-File: LICENSE",
        "Description-Content-Type: text/markdown",
    }
    lines = set(metadata.split("\n\n", 1)[0].splitlines())
    if not headers <= lines:
        raise ReleaseCheckError(f"{wheel.name} METADATA lacks {sorted(headers - lines)}")
    if "mla_fixes = vllm_mla_fixes:register" not in entry_points:
        raise ReleaseCheckError(f"{wheel.name} does not register the vLLM general plugin")
    print(f"ok: {wheel.name} carries LICENSE, py.typed, version {version} and the plugin entry")


def readme_link_targets() -> list[str]:
    """The files README.md links to by relative path (docs/..., CONTRIBUTING.md, ...)."""
    targets = re.findall(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)", (ROOT / "README.md").read_text())
    return sorted({t for t in targets if not re.match(r"[a-z]+:", t)})


def _check_sdist(sdist: Path, version: str) -> None:
    top = f"vllm_mla_fixes-{version}/"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    missing = [f for f in ("LICENSE", "CHANGELOG.md", "README.md") if top + f not in names]
    if missing:
        raise ReleaseCheckError(f"{sdist.name} lacks {', '.join(missing)}")
    # the README's relative links work in the unpacked sdist too
    unlinked = [t for t in readme_link_targets() if top + t not in names]
    if unlinked:
        raise ReleaseCheckError(
            f"{sdist.name} lacks {', '.join(unlinked)}, which README.md links to (MANIFEST.in)"
        )
    print(f"ok: {sdist.name} carries LICENSE, CHANGELOG.md, README.md and every file it links to")


# -- one vLLM release ----------------------------------------------------------------


def _operator_env() -> dict[str, str]:
    """What `vllm serve` would see on a CPU machine: no plugin selection, no
    checkout on the path."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES", "VLLM_LOGGING_STREAM", "PYTHONPATH")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _status(venv: Path, cwd: Path) -> dict:
    printed = _run(
        venv / "bin" / "vllm-mla-fixes",
        "status",
        "--json",
        env=_operator_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    ).stdout
    return json.loads(printed)


def _check_status(report: dict, release: str, version: str, where: str) -> None:
    listed = {fix["name"]: fix["state"] for fix in report["fixes"]}
    if report["vllm"] != release or report["vllm_mla_fixes"] != version:
        raise ReleaseCheckError(
            f"{where}: status reports vLLM {report['vllm']} and vllm-mla-fixes "
            f"{report['vllm_mla_fixes']}, expected {release} and {version}"
        )
    expected = shipped_fixes()
    if set(listed) != expected:
        raise ReleaseCheckError(f"{where}: status lists {sorted(listed)}, not {sorted(expected)}")
    states = ", ".join(f"{name} {state}" for name, state in listed.items())
    print(f"ok: {where}: status lists all {len(expected)} fixes ({states})")


def check_release(release: str, out: Path, env_root: Path | None = None) -> Path:
    """Install, status, verify and build-wheel for one vLLM release; the patched wheel."""
    version = plugin_version()
    lock = LOCKS / f"vllm-{release}.txt"
    if not lock.is_file():
        raise ReleaseCheckError(f"no lock file {lock}; add it with `nox -s lock -- {release}`")
    if not list((out / "plugin").glob(f"vllm_mla_fixes-{version}-*.whl")):
        raise ReleaseCheckError(f"no plugin wheel {version} in {out / 'plugin'}; run `build` first")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"release-check-{release}-", dir=env_root))
    venv = work / "venv"
    try:
        _run("uv", "venv", "--quiet", "--python", "3.11", venv)
        python = venv / "bin" / "python"
        _run("uv", "pip", "sync", "--quiet", "--python", python, lock)
        # as `pip install vllm-mla-fixes` would take it from an index: by name and
        # version, from a directory of distributions
        _run(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            python,
            "--no-index",
            "--find-links",
            out / "plugin",
            f"vllm-mla-fixes=={version}",
        )
        _check_status(_status(venv, work), release, version, f"plugin wheel on vLLM {release}")
        _run(venv / "bin" / "vllm-mla-fixes", "verify", env=_operator_env(), cwd=work, timeout=3600)
        built = _run(
            venv / "bin" / "vllm-mla-fixes",
            "build-wheel",
            "--vllm",
            release,
            "--out",
            out / "vllm",
            env=_operator_env(),
            cwd=work,
            capture_output=True,
            text=True,
            timeout=3600,
        ).stdout
        print(built, end="")
        patched = out / "vllm" / _patched_name(built)
        if not patched.name.startswith(f"vllm-{release}+mlafixes.{version}-"):
            raise ReleaseCheckError(f"{patched.name}: not labelled +mlafixes.{version}")
        # the shipped artifact itself: vLLM replaced by the patched wheel
        _run("uv", "pip", "uninstall", "--quiet", "--python", python, "vllm-mla-fixes")
        _run("uv", "pip", "install", "--quiet", "--python", python, "--no-deps", patched)
        _check_status(_status(venv, work), release, version, f"{patched.name} installed")
        print(f"ok: vLLM {release} checked in {time.monotonic() - started:.0f} s", flush=True)
        return patched
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _patched_name(build_wheel_output: str) -> str:
    match = re.search(r"^sha256\s+[0-9a-f]{64}\s+(\S+\.whl)$", build_wheel_output, re.MULTILINE)
    if match is None:
        raise ReleaseCheckError(f"build-wheel printed no sha256 line:\n{build_wheel_output}")
    return match.group(1)


# -- sums and notes -------------------------------------------------------------------


def write_sums(out: Path) -> Path:
    artifacts = sorted(
        [*(out / "plugin").glob("*.whl"), *(out / "plugin").glob("*.tar.gz")]
    ) + sorted((out / "vllm").glob("*.whl"))
    if not artifacts:
        raise ReleaseCheckError(f"no artifacts under {out}")
    names = [a.name for a in artifacts]
    if len(set(names)) != len(names):
        raise ReleaseCheckError(f"two artifacts share a file name: {names}")
    lines = [f"{_sha256(a)}  {a.name}" for a in artifacts]
    sums = out / "SHA256SUMS"
    sums.write_text("".join(f"{line}\n" for line in lines))
    print(f"\nartifacts ({sums}):")
    for artifact, line in zip(artifacts, lines):
        digest = line.split()[0]
        size = artifact.stat().st_size / 2**20
        print(f"  {artifact.relative_to(out)}  {size:.1f} MiB  sha256 {digest}")
    return sums


def changelog_section(version: str) -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    match = re.search(
        rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## \[|\Z)", text, re.MULTILINE | re.DOTALL
    )
    if match is None:
        raise ReleaseCheckError(
            f"CHANGELOG.md has no section for {version}: rename [Unreleased] to "
            f"[{version}] - <date> before tagging v{version}"
        )
    return match.group(1).strip() + "\n"


# -- command line ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stages = parser.add_subparsers(dest="stage", required=True)
    build_cmd = stages.add_parser("build")
    build_cmd.add_argument("out", type=Path)
    build_cmd.add_argument("--tag", help="the git tag being released; must be v<version>")
    release_cmd = stages.add_parser("release")
    release_cmd.add_argument("vllm", help="one of the shipped releases")
    release_cmd.add_argument("out", type=Path)
    sums_cmd = stages.add_parser("sums")
    sums_cmd.add_argument("out", type=Path)
    notes_cmd = stages.add_parser("notes")
    notes_cmd.add_argument("version")
    all_cmd = stages.add_parser("all")
    all_cmd.add_argument("out", type=Path)
    all_cmd.add_argument("vllm", nargs="*", help="default: every shipped release")
    stages.add_parser("releases")
    args = parser.parse_args(argv)
    shipped: tuple[str, ...] = ()
    if args.stage in ("release", "all", "releases"):
        shipped = shipped_releases()
        asked = [args.vllm] if args.stage == "release" else getattr(args, "vllm", [])
        unknown = sorted(set(asked) - set(shipped))
        if unknown:
            parser.error(f"not a release this project ships for: {unknown} (choose from {shipped})")
    started = time.monotonic()
    try:
        if args.stage == "build":
            build(args.out, args.tag)
        elif args.stage == "release":
            check_release(args.vllm, args.out)
        elif args.stage == "sums":
            write_sums(args.out)
        elif args.stage == "notes":
            print(changelog_section(args.version), end="")
            return 0
        elif args.stage == "releases":
            print(json.dumps(list(shipped)))
            return 0
        else:
            shutil.rmtree(args.out / "vllm", ignore_errors=True)
            build(args.out)
            for release in args.vllm or shipped:
                check_release(release, args.out)
            write_sums(args.out)
    except ReleaseCheckError as exc:
        print(f"release-check: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        output = (exc.stdout or "") + (exc.stderr or "") if exc.stdout or exc.stderr else ""
        print(f"release-check: {exc}\n{output}", file=sys.stderr)
        return 1
    print(f"release-check {args.stage}: ok in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
