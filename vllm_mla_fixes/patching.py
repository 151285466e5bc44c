"""The one mechanism every fix uses: gate, replace, rebind, revert, record.

A fix module (see ``vllm_mla_fixes/fixes/``) provides:

* ``INFO``: a :class:`FixInfo` record -- the single source of the fix's facts,
  read by ``status``, ``doctor`` and the README table;
* ``probe() -> str | None``: runs only after the release gate admitted the
  installed vLLM; inspects the exact target (a functional probe or a source
  fingerprint) and returns ``None`` when the installed code carries the bug, or
  the reason it does not need the fix.  It raises :class:`CannotProbe` when the
  target cannot be inspected here (the fix is then skipped, vLLM untouched);
* ``apply(patch: Patch)``: installs the replacements through ``patch``.

:func:`run_fix` evaluates one fix and returns its :class:`FixStatus`; any
exception leaves vLLM as it was (every replacement made so far is reverted).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.abc
import importlib.util
import inspect
import sys
import textwrap
from collections.abc import Callable
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


@dataclasses.dataclass(frozen=True)
class FixInfo:
    """Facts about one fix; every report and table reads them from here."""

    name: str
    summary: str
    upstream: tuple[str, ...]
    affected: str  # PEP 440 specifier of the releases the gate admits for probing
    affected_releases: tuple[str, ...]  # the published releases known to carry the bug
    fixed_in: str | None  # first fixed release, None while upstream is open
    hardware: str
    error: str  # the upstream error text, as operators see it
    workarounds: tuple[str, ...]

    def admits(self, version: str) -> bool:
        return release_admitted(version, self.affected)


class State(str, enum.Enum):
    APPLIED = "applied"
    NOT_NEEDED = "not-needed"
    DISABLED = "disabled"
    SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True)
class FixStatus:
    name: str
    state: State
    reason: str

    def label(self) -> str:
        return f"skipped: {self.reason}" if self.state is State.SKIPPED else self.state.value


class CannotProbe(Exception):
    """The fix's target cannot be inspected in this process (e.g. no CUDA extension)."""


class TargetMismatch(Exception):
    """The target's code is not the code the fix was written against."""


def release_admitted(version: str, specifier: str) -> bool:
    """Whether ``version`` lies in ``specifier``; dev/rc nightlies count.

    A local segment (``+g1234abc``, ``+cu130``) is ignored, as PEP 440 says for
    ordered comparisons.  An unparseable version is never admitted.
    """
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(specifier, prereleases=True).contains(parsed, prereleases=True)


def source_fingerprint(obj: Any) -> str:
    """A short hash of ``obj``'s source, indentation-normalised."""
    source = textwrap.dedent(inspect.getsource(obj))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def require_fingerprint(obj: Any, known: dict[str, str], what: str) -> None:
    """Raise :class:`TargetMismatch` unless ``obj``'s source is one of ``known``.

    ``known`` maps fingerprints to the releases they were taken from.
    """
    try:
        found = source_fingerprint(obj)
    except (OSError, TypeError) as exc:
        raise TargetMismatch(f"source of {what} unavailable ({exc})") from exc
    if found not in known:
        raise TargetMismatch(
            f"{what} has fingerprint {found}, not one of the reviewed versions "
            f"({', '.join(sorted(set(known.values())))})"
        )


class Patch:
    """Records every change a fix makes, so it can be undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, owner: Any, attr: str, new: Any) -> Any:
        """Set ``owner.attr = new`` and return the previous value."""
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, old))
        return old

    def replace_function(self, module: ModuleType, name: str, new: Callable) -> Callable:
        """Replace a module-level function and rebind it wherever vLLM
        modules imported it by name (``from module import name``).  Modules
        imported later read the replaced attribute themselves."""
        old = self.replace(module, name, new)
        for other in list(sys.modules.values()):
            if other is module or not isinstance(other, ModuleType):
                continue
            if not (getattr(other, "__name__", None) or "").startswith("vllm."):
                continue
            if other.__dict__.get(name) is old:
                self.replace(other, name, new)
        return old

    def when_imported(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        """Run ``callback(module)`` now if ``module_name`` is imported, else
        right after vLLM imports it -- so a fix on a heavy module costs
        nothing at plugin load.  ``callback`` must not raise."""
        module = sys.modules.get(module_name)
        if module is not None:
            callback(module)
            return
        hook = _AfterImport(module_name, callback)
        sys.meta_path.insert(0, hook)
        self._undo.append(hook.remove)

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()

    @property
    def empty(self) -> bool:
        return not self._undo


class _AfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that lets the normal finders locate one module and
    runs a callback once that module has executed."""

    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.callback = callback

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        self.remove()  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module
        callback = self.callback

        def exec_then_patch(module: ModuleType) -> None:
            run_module(module)
            callback(module)

        spec.loader.exec_module = exec_then_patch
        return spec


@dataclasses.dataclass
class AppliedFix:
    status: FixStatus
    patch: Patch | None = None


def run_fix(module: ModuleType, vllm_version: str) -> AppliedFix:
    """Gate, probe and apply one fix module; never raises."""
    info: FixInfo = module.INFO
    if not info.admits(vllm_version):
        return AppliedFix(FixStatus(info.name, State.NOT_NEEDED,
                                    f"vLLM {vllm_version} is outside {info.affected}"))
    try:
        reason = module.probe()
    except CannotProbe as exc:
        return AppliedFix(FixStatus(info.name, State.SKIPPED, f"cannot probe here: {exc}"))
    except TargetMismatch as exc:
        return AppliedFix(FixStatus(info.name, State.SKIPPED, f"unexpected target: {exc}"))
    except Exception as exc:  # any surprise: leave vLLM alone
        return AppliedFix(FixStatus(info.name, State.SKIPPED,
                                    f"probe failed: {type(exc).__name__}: {exc}"))
    if reason is not None:
        return AppliedFix(FixStatus(info.name, State.NOT_NEEDED, reason))
    patch = Patch()
    try:
        module.apply(patch)
    except Exception as exc:
        patch.revert()
        return AppliedFix(FixStatus(info.name, State.SKIPPED,
                                    f"apply failed, vLLM left untouched: {type(exc).__name__}: {exc}"))
    return AppliedFix(FixStatus(info.name, State.APPLIED,
                                f"vLLM {vllm_version}, upstream {', '.join(info.upstream)}"), patch)
