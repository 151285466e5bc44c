"""The one mechanism every fix uses: gate, replace, rebind, revert, record.

A fix (:class:`vllm_mla_fixes.fix.Fix`, one module or package in
``vllm_mla_fixes/fixes/``) provides, for this mechanism:

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

import ast
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

if TYPE_CHECKING:
    from vllm_mla_fixes.fix import Fix


@dataclasses.dataclass(frozen=True)
class NotCovered:
    """Releases known to carry a fix's bug that the fix does not cover."""

    specifier: str  # PEP 440 specifier (nightlies included)
    releases: tuple[str, ...]  # the published releases in it, for tables
    why: str  # one line: why the fix leaves them out


@dataclasses.dataclass(frozen=True)
class FixInfo:
    """Facts about one fix; every report, table, test session and release
    artifact reads them from here.

    The release facts are declared once: ``covered_releases`` lists the
    published vLLM releases the fix covers (the project tests, verifies and
    ships patched wheels for each, and nowhere else spells that list); the
    reviewed releases and the newest of them follow from it and ``fixed_in``.
    Adding a vLLM release to a fix is adding it to ``covered_releases``.
    """

    name: str
    summary: str
    upstream: tuple[str, ...]
    affected: str  # PEP 440 specifier of the releases the gate admits for probing
    covered_releases: tuple[str, ...]  # the published releases the fix covers, oldest first
    fixed_in: str | None  # first fixed release, None while upstream is open
    hardware: str
    error: str  # the upstream error text, as operators see it
    not_covered: tuple[NotCovered, ...] = ()
    has_selftest: bool = False  # `vllm-mla-fixes selftest` proves it on a device (nox sessions)

    def admits(self, version: str) -> bool:
        return release_admitted(version, self.affected)

    @property
    def reviewed_releases(self) -> tuple[str, ...]:
        """The releases whose code was reviewed for this fix: every covered one,
        and the release that fixed the bug upstream."""
        fixed = () if self.fixed_in is None else (self.fixed_in,)
        return tuple(sorted({*self.covered_releases, *fixed}, key=Version))

    @property
    def newest_reviewed(self) -> str:
        """The newest release whose code was reviewed for this fix."""
        return self.reviewed_releases[-1]


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


def release_decision(
    info: FixInfo, version: str, newest_reviewed: str | None = None
) -> FixStatus | None:
    """What the release alone decides for a fix, or ``None`` when the release
    is admitted and the probe of its code decides.  ``newest_reviewed``: the
    decision as of that release, when nothing newer had been reviewed
    (``review --against``); by default the fix's own.  One rule for every fix:

    * at or after ``fixed_in``: not-needed;
    * in a ``not_covered`` range: skipped (the bug is there, the fix is not);
    * newer than ``newest_reviewed`` while upstream is open: skipped, not
      reviewed -- nightlies of the next version count as newer, a local build
      tag (``+cu130``) does not;
    * in ``affected``: probe; anywhere else (below the range): not-needed.
    """
    try:
        release = Version(Version(version).public)
    except InvalidVersion:
        return FixStatus(
            info.name,
            State.SKIPPED,
            f"vLLM's version {version!r} is not a PEP 440 version; the release gate cannot place it",
        )
    if info.fixed_in is not None and release >= Version(info.fixed_in):
        return FixStatus(info.name, State.NOT_NEEDED, f"fixed upstream in vLLM {info.fixed_in}")
    for uncovered in info.not_covered:
        if release_admitted(version, uncovered.specifier):
            return FixStatus(
                info.name,
                State.SKIPPED,
                f"bug present in vLLM {version}, not covered here; upgrade to "
                f"{info.covered_releases[0]}+ ({uncovered.why})",
            )
    reviewed = newest_reviewed or info.newest_reviewed
    if info.fixed_in is None and release > Version(reviewed):
        return FixStatus(
            info.name,
            State.SKIPPED,
            f"not reviewed: vLLM {version} is newer than {reviewed}, the newest "
            "release reviewed for this fix, and the bug is open upstream",
        )
    if not info.admits(version):
        return FixStatus(
            info.name,
            State.NOT_NEEDED,
            f"vLLM {version} is not in the releases this fix covers: {range_in_words(info.affected)}",
        )
    return None


def range_in_words(specifier: str) -> str:
    """A release range as an operator reads it: ``>=0.32.0.dev0,<=0.34.0`` is
    "0.32.0 to 0.34.0 (nightlies of 0.32.0 included)"; a specifier of any other
    shape is returned as it is."""
    bounds: dict[str, Version] = {}
    for clause in SpecifierSet(specifier):
        if clause.operator not in (">=", ">", "<=", "<") or clause.operator[0] in {
            op[0] for op in bounds
        }:
            return specifier
        try:
            bounds[clause.operator] = Version(clause.version)
        except InvalidVersion:
            return specifier
    lower = bounds.get(">=") or bounds.get(">")
    upper = bounds.get("<=") or bounds.get("<")
    if lower is None and upper is None:
        return specifier
    low = "" if lower is None else lower.base_version
    high = "" if upper is None else upper.base_version
    if ">=" in bounds and "<=" in bounds:
        words = f"{low} to {high}"
    elif ">=" in bounds and "<" in bounds:
        words = f"{low} to {high}, {high} excluded"
    elif lower is not None and upper is not None:
        words = f"after {low}, {'up to' if '<=' in bounds else 'before'} {high}"
    elif ">=" in bounds:
        words = f"{low} or later"
    elif ">" in bounds:
        words = f"after {low}"
    else:
        words = f"{high} or earlier" if "<=" in bounds else f"before {high}"
    if lower is not None and lower.is_devrelease and ">=" in bounds:
        words += f" (nightlies of {low} included)"
    return words


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


_source_root: Path | None = None  # set by sources_from(); None: the installed vLLM


@contextlib.contextmanager
def sources_from(root: Path) -> Iterator[None]:
    """Inside this block, :func:`vllm_source` (and everything built on it)
    reads the packages under ``root`` -- e.g. a vLLM wheel's unpacked
    ``vllm/`` -- instead of the installed ones."""
    global _source_root
    previous, _source_root = _source_root, Path(root)
    vllm_source.cache_clear()
    try:
        yield
    finally:
        _source_root = previous
        vllm_source.cache_clear()


def sources_root() -> Path | None:
    """The folder :func:`sources_from` reads instead of the installed
    packages, or None."""
    return _source_root


@functools.cache
def vllm_source(module_name: str) -> tuple[str, ast.Module]:
    """Text and syntax tree of a vLLM module, read from the installed files
    (or from :func:`sources_from`'s folder) without importing it or its parent
    packages (whose ``__init__`` can be heavy, or initialise CUDA)."""
    top, *parts = module_name.split(".")
    if _source_root is not None:
        locations = [str(_source_root / top)]
    else:
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            raise CannotProbe(f"{top} is not importable here")
        locations = spec.submodule_search_locations
    for root in locations:
        base = Path(root, *parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                text = candidate.read_text(encoding="utf-8")
                return text, ast.parse(text, filename=str(candidate))
    raise TargetMismatch(f"{module_name} has no Python source")


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def find_definition(tree: ast.AST, qualname: str) -> Definition | None:
    """The class or function ``qualname`` ("Class.method", "function") in ``tree``."""
    scope: ast.AST = tree
    found: Definition | None = None
    for part in qualname.split("."):
        found = next(
            (
                node
                for node in ast.iter_child_nodes(scope)
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == part
            ),
            None,
        )
        if found is None:
            return None
        scope = found
    return found


def definition_source(module_name: str, qualname: str) -> str:
    text, tree = vllm_source(module_name)
    node = find_definition(tree, qualname)
    if node is None:
        raise TargetMismatch(f"{module_name}.{qualname} does not exist")
    segment = ast.get_source_segment(text, node, padded=True)
    if segment is None:  # only a tree built by hand lacks positions
        raise TargetMismatch(f"{module_name}.{qualname} has no source positions")
    return textwrap.dedent(segment)


def definition_fingerprint(module_name: str, qualname: str) -> str:
    """sha256[:16] of a definition's dedented source, read without importing it."""
    return hashlib.sha256(definition_source(module_name, qualname).encode()).hexdigest()[:16]


def require_fingerprint(module_name: str, qualname: str, known: dict[str, str]) -> None:
    """Raise :class:`TargetMismatch` unless the definition is one of ``known``
    (fingerprint -> the releases it was reviewed in)."""
    found = definition_fingerprint(module_name, qualname)
    if found not in known:
        raise TargetMismatch(
            f"{module_name}.{qualname} has fingerprint {found}, not one of the reviewed "
            f"versions ({', '.join(sorted(set(known.values()))) or 'none'})"
        )


class Patch:
    """Records every change a fix makes, so it can be undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.failed: str | None = None  # why a deferred step failed (the patch is then reverted)

    def replace(self, owner: object, attr: str, new: object) -> Any:
        """Set ``owner.attr = new`` and return the previous value."""
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, old))
        return old

    def replace_function(
        self, module: ModuleType, name: str, new: Callable[..., object]
    ) -> Callable[..., object]:
        """Replace a module-level function and rebind it wherever vLLM
        modules imported it by name (``from module import name``).  Modules
        imported later read the replaced attribute themselves."""
        old: Callable[..., object] = self.replace(module, name, new)
        # Undone last: a vLLM module imported while the patch was in force
        # holds ``new`` by name; on revert it gets ``old`` back too.
        self._undo.insert(0, lambda: _rebind_vllm_modules(name, new, old))
        _rebind_vllm_modules(name, old, new, self, skip=module)
        return old

    def when_imported(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        """Run ``callback(module)`` now if ``module_name`` is imported, else
        right after vLLM imports it -- so a fix on a heavy module costs
        nothing at plugin load.  If a deferred callback raises, vLLM's import
        still succeeds: the whole patch is reverted (half a fix is worse than
        none), ``failed`` says why, and one warning is logged."""
        module = sys.modules.get(module_name)
        if module is not None:
            callback(module)  # raising here fails apply(), which run_fix reverts
            return

        def callback_or_revert(imported: ModuleType) -> None:
            try:
                callback(imported)
            except Exception as exc:
                self.revert()
                self.failed = f"patching {module_name} failed: {type(exc).__name__}: {exc}"
                logging.getLogger("vllm.mla_fixes").warning(
                    "vllm-mla-fixes: %s; the fix is reverted and vLLM left as it was", self.failed
                )

        hook = _AfterImport(module_name, callback_or_revert)
        sys.meta_path.insert(0, hook)
        self._undo.append(hook.remove)

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()


def _rebind_vllm_modules(
    name: str,
    held: Callable[..., object],
    new: Callable[..., Any],
    patch: Patch | None = None,
    skip: ModuleType | None = None,
) -> None:
    """In every imported vLLM module whose ``name`` is ``held``, set it to
    ``new`` (through ``patch``, so that it is undone, where given)."""
    for other in list(sys.modules.values()):
        if other is skip or not isinstance(other, ModuleType):
            continue
        if not (getattr(other, "__name__", None) or "").startswith("vllm."):
            continue
        if other.__dict__.get(name) is held:
            if patch is not None:
                patch.replace(other, name, new)
            else:
                setattr(other, name, new)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that lets the normal finders locate one module and
    runs a callback once that module has executed."""

    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.callback = callback

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
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

        # this one loader instance only; the class keeps its method
        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


@dataclasses.dataclass
class AppliedFix:
    status: FixStatus
    patch: Patch | None = None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (the imported one where vLLM is loaded), or None."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None)  # vLLM's own attribute, not a fix's
    if version:
        return str(version)
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("vllm")
    except PackageNotFoundError:
        return None


def run_fix(fix: Fix, vllm_version: str) -> AppliedFix:
    """Gate, probe and apply one fix; never raises."""
    info = fix.INFO
    decided = release_decision(info, vllm_version)
    if decided is not None:
        return AppliedFix(decided)
    try:
        reason = fix.probe()
    except CannotProbe as exc:
        return AppliedFix(FixStatus(info.name, State.SKIPPED, f"cannot probe here: {exc}"))
    except TargetMismatch as exc:
        return AppliedFix(FixStatus(info.name, State.SKIPPED, f"unexpected target: {exc}"))
    except Exception as exc:  # any surprise: leave vLLM alone
        return AppliedFix(
            FixStatus(info.name, State.SKIPPED, f"probe failed: {type(exc).__name__}: {exc}")
        )
    if reason is not None:
        return AppliedFix(FixStatus(info.name, State.NOT_NEEDED, reason))
    patch = Patch()
    try:
        fix.apply(patch)
    except Exception as exc:
        patch.revert()
        return AppliedFix(
            FixStatus(
                info.name,
                State.SKIPPED,
                f"apply failed, vLLM left untouched: {type(exc).__name__}: {exc}",
            )
        )
    return AppliedFix(
        FixStatus(
            info.name, State.APPLIED, f"vLLM {vllm_version}, upstream {', '.join(info.upstream)}"
        ),
        patch,
    )
