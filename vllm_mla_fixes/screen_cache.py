"""Remember a fix's source screen across processes, keyed by the bytes it read.

A fix's ``source_screen()`` parses vLLM source files (``ast.parse`` of files up
to 250 KB) to decide whether the installed code is the reviewed shape of the
bug.  vLLM loads plugins in every process it starts (API server, engine core,
each worker), so parsing there costs each process ~0.1 s.  The verdict is a
pure function of those files' contents and of this package's code, so it is
stored under a key made of:

* the sha256 of every source file of the modules in the fix's ``REVIEWED``
  table (a test checks that a screen reads no other vLLM file);
* the sha256 of the source of the module that defines the fix's
  ``source_screen`` and of ``patching.py``, and the fix's ``REVIEWED`` table
  as in force in the process (tests change it at runtime).

Hashing the files costs about a millisecond; any change to any of them is a
different key, so a hand-edited vLLM file is screened again.  Only verdicts are
stored (``None`` = the bug's code is there, or the reason it is not); a screen
that raises is never cached.  Any problem with the cache directory (read-only
home, corrupt entry) falls back to running the screen.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_mla_fixes import atomic, settings

if TYPE_CHECKING:
    from vllm_mla_fixes.fix import Fix

CACHE_DIR_ENV = settings.CACHE_DIR.name


def cache_dir() -> Path:
    """The configured folder, else the default; raises OSError where no
    absolute default can be found (no home folder)."""
    configured = settings.value(settings.CACHE_DIR)
    if configured is not None:
        return configured
    # The XDG spec: a relative XDG_CACHE_HOME is invalid and is ignored.
    xdg = settings.environment_variable("XDG_CACHE_HOME") or ""
    base = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~"), ".cache")
    if not base.is_absolute():  # a relative HOME, or none
        raise OSError(
            f"no absolute cache folder ({str(base)!r}: HOME is not absolute); set "
            f"{settings.CACHE_DIR.name} to an absolute folder"
        )
    return base / "vllm-mla-fixes" / "screens"


def source_file(module_name: str) -> Path | None:
    """The ``.py`` file of a module, found without importing it or its parents."""
    top, *parts = module_name.split(".")
    spec = importlib.util.find_spec(top)
    for root in (spec.submodule_search_locations or ()) if spec else ():
        base = Path(root, *parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _digest(paths: Iterable[Path | None], names: Iterable[str], extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for name, path in zip(names, paths):
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() if path is not None else b"<no source>")
        digest.update(b"\0")
    return digest.hexdigest()


def screen_key(
    reviewed: Mapping[tuple[str, str], Mapping[str, str]], screen: Callable[[], str | None]
) -> str:
    """The content key of a source screen on the installed vLLM: the files
    beside ``screen``'s own (it reads their constants, e.g. the DeepSeek-V4.1
    gate reads ``info``), ``patching``, the files of the modules in
    ``reviewed`` and the table itself."""
    from vllm_mla_fixes import patching

    modules = sorted({module for module, _ in reviewed})
    own = [*sorted(Path(inspect.getfile(screen)).parent.glob("*.py")), Path(patching.__file__)]
    return _digest(
        [*own, *(source_file(m) for m in modules)],
        [*(path.name for path in own), *modules],
        extra=repr([(key, sorted(known.items())) for key, known in sorted(reviewed.items())]),
    )


def cached_screen(fix: Fix, screen: Callable[[], str | None]) -> str | None:
    """``screen()``'s verdict, from the cache when the key of ``fix``'s
    declared screen and ``REVIEWED`` table matches."""
    from vllm_mla_fixes import patching

    if (
        patching._source_root is not None
    ):  # screening another tree (review): not the installed files
        return screen()
    try:
        key = screen_key(fix.REVIEWED, fix.source_screen)
        entry = cache_dir() / f"{fix.INFO.name}-{key[:32]}.json"
    except OSError:  # a file cannot be read, or no cache folder: no cache
        return screen()
    try:
        stored = json.loads(entry.read_text(encoding="utf-8"))
        if stored.get("key") == key and set(stored) == {"key", "verdict"}:
            verdict = stored["verdict"]
            if verdict is None or isinstance(verdict, str):
                return verdict
    except (OSError, ValueError, AttributeError):
        pass  # no entry yet, or an unreadable one: screen again
    verdict = screen()
    try:
        _store(entry, {"key": key, "verdict": verdict})
    except OSError as exc:
        _warn_unwritable(entry.parent, exc)
    return verdict


_warned_folders: set[Path] = set()


def _warn_unwritable(folder: Path, exc: OSError) -> None:
    """Once per folder and process, where the operator chose the folder
    (an unusable default is the usual read-only home: the fixes work without it)."""
    if settings.read(settings.CACHE_DIR) is None or folder in _warned_folders:
        return
    _warned_folders.add(folder)
    logging.getLogger("vllm.mla_fixes").warning(
        "vllm-mla-fixes: %s=%r cannot be written (%s: %s); the fixes work without the "
        "cache, each vLLM process screening vLLM's sources itself",
        CACHE_DIR_ENV,
        str(folder),
        type(exc).__name__,
        exc.strerror or exc,
    )


def _store(entry: Path, payload: dict[str, object]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: processes started together never see half a file
    atomic.write_atomic(entry, json.dumps(payload))
