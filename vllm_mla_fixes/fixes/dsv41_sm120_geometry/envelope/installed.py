"""Finding and reading the installed packages' files, without importing them
and without a GPU: package folders, source text and the strings compiled into
extensions.  A declaration that cannot be read raises :class:`Unreadable`."""

from __future__ import annotations

import importlib.util
import mmap
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .model import Declaration, Unreadable


def installed_version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def package_dir(name: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def shown(path: Path) -> str:
    """``path`` relative to the folder of the installed packages, as a
    declaration names it."""
    for parent in path.parents:
        if parent.name in ("site-packages", "dist-packages"):
            return path.relative_to(parent).as_posix()
    return path.as_posix()


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise Unreadable(f"{what}: cannot read {shown(path)} ({exc.strerror or exc})") from None


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def search_text(text: str, pattern: str, path: Path, what: str, flags: int = 0) -> re.Match[str]:
    found = re.search(pattern, text, flags)
    if found is None:
        raise Unreadable(f"{what} not found in {shown(path)}")
    return found


def declared_at(text: str, found: re.Match[str], path: Path) -> Declaration:
    line = line_of(text, found.start())
    return Declaration(shown(path), line, text.splitlines()[line - 1].strip())


def ints(text: str) -> frozenset[int]:
    return frozenset(int(n) for n in re.findall(r"\d+", text))


def compiled_strings(path: Path, pattern: bytes, what: str) -> list[str]:
    """Every NUL-terminated string in a compiled file that matches ``pattern``."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found = []
            for match in re.finditer(pattern, data):
                start = data.rfind(b"\0", 0, match.start()) + 1
                end = data.find(b"\0", match.end())
                found.append(data[start:end].decode("utf-8", "replace"))
    except (OSError, ValueError) as exc:
        raise Unreadable(f"{what}: cannot read {shown(path)} ({exc})") from None
    if not found:
        raise Unreadable(f"{what} not found in {shown(path)}")
    return found


def deep_gemm_dir() -> Path | None:
    """The DeepGEMM vLLM imports: an installed ``deep_gemm`` package first,
    else the copy vendored in ``vllm.third_party`` (vllm.utils.deep_gemm's order)."""
    external = package_dir("deep_gemm")
    if external is not None:
        return external
    vllm_dir = package_dir("vllm")
    vendored = None if vllm_dir is None else vllm_dir / "third_party" / "deep_gemm"
    return vendored if vendored is not None and vendored.is_dir() else None


def module_path(module: str) -> str:
    root = package_dir(module.split(".")[0])
    parts = module.split(".")[1:]
    base = Path(root, *parts) if root is not None else Path(*module.split("."))
    return shown(
        base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    )
