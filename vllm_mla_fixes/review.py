"""``vllm-mla-fixes review --vllm X``: what a vLLM release means for each fix,
read from its wheel without installing it.

For each fix: the release gate's decision (:func:`patching.release_decision`,
the rule ``status`` applies), every definition in the fix's ``REVIEWED``
registry -- its fingerprint in the release against the reviewed ones (match,
changed, missing), with a unified diff of each changed one against the newest
reviewed release's source -- and the fix's import-free ``source_screen()`` run
on the release's code.  The wheels come from the package index, checked
against its published sha256 (:func:`wheel.download_verified`, cached under
``~/.cache/vllm-mla-fixes/wheels``); only the reviewed modules' ``.py``
files are unpacked.

Exit status: 0 nothing to review, 1 something changed or the release needs a
review (a fix the release is in scope of: admitted by its gate, or newer than
its newest reviewed release while the bug is open), 2 the review could not run
(bad arguments, no such release, network).  Changes in fixes whose gate rules
the release out (below the range, fixed upstream) are listed, not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from vllm_mla_fixes import patching, wheel
from vllm_mla_fixes.fix import Fix
from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import CannotProbe, State, TargetMismatch

EXIT_UNCHANGED, EXIT_NEEDS_REVIEW, EXIT_CANNOT_REVIEW = 0, 1, 2


class ReviewError(RuntimeError):
    """The review cannot run; the message says why (one line)."""


# -- wheels ---------------------------------------------------------------------------


def newest_release(index_url: str = wheel.DEFAULT_INDEX) -> str:
    """The newest final vLLM release on the index that has a wheel (yanked files ignored)."""
    try:
        files = wheel._index_files(index_url)
    except wheel.WheelBuildError as exc:
        raise ReviewError(str(exc)) from exc
    versions = set()
    for entry in files:
        name = entry.get("filename")
        if not isinstance(name, str) or not name.endswith(".whl") or entry.get("yanked"):
            continue  # no file name, not a wheel's, or withdrawn
        try:
            version = parse_wheel_filename(name)[1]
        except InvalidWheelFilename:
            continue
        if not version.is_prerelease and not version.local:
            versions.add(version)
    if not versions:
        raise ReviewError(f"the index at {index_url} lists no vLLM wheel")
    return str(max(versions))


def fetch(release: str, index_url: str, log: Callable[[str], None]) -> Path:
    log(f"fetching vLLM {release} from {index_url} (sha256 checked, cached in {wheel.CACHE})")
    try:
        return wheel.download_verified(release, index_url)
    except wheel.WheelBuildError as exc:
        raise ReviewError(str(exc)) from exc
    except OSError as exc:  # the download itself (the index read reports its own)
        raise ReviewError(f"cannot download vLLM {release} from {index_url}: {exc}") from exc


def reviewed_modules() -> set[str]:
    """Every vLLM module a fix's registry names (its source screen reads no other)."""
    return {module for fix in ALL_FIXES for module, _ in fix.REVIEWED}


@contextlib.contextmanager
def unpacked_sources(wheel_file: Path, modules: Iterable[str]) -> Iterator[Path]:
    """A temporary folder holding the source files of ``modules`` from the
    wheel (unpacking all ~3,500 of vLLM's would take seconds)."""
    wanted = {
        f"{'/'.join(m.split('.'))}{tail}" for m in modules for tail in (".py", "/__init__.py")
    }
    with tempfile.TemporaryDirectory(prefix="vllm-review-") as folder:
        try:
            with zipfile.ZipFile(wheel_file) as archive:
                members = [n for n in archive.namelist() if n in wanted]
                archive.extractall(folder, members)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ReviewError(f"cannot read {wheel_file}: {exc}") from exc
        if not members:
            raise ReviewError(f"{wheel_file.name} holds none of the reviewed vLLM modules")
        yield Path(folder)


# -- one fix --------------------------------------------------------------------------


def _releases(entry: str) -> list[str]:
    return [r.strip() for r in entry.split(",") if r.strip()]


@dataclasses.dataclass
class DefinitionCheck:
    module: str
    qualname: str
    found: str | None  # fingerprint in the reviewed release; None: the definition is gone
    reference: dict[str, str]  # the reviewed fingerprints compared with -> their releases
    reference_release: str | None  # the release a diff is taken against
    diff: str = ""
    note: str = ""

    @property
    def state(self) -> str:
        if self.found is None:
            return "missing"
        if self.found in self.reference:
            return "match"
        return "changed" if self.reference else "unreviewed"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclasses.dataclass
class FixReview:
    name: str
    gate: str  # the release gate's decision, as status would print it
    in_scope: bool  # the gate leaves the release to the probe, or refuses it as not reviewed
    definitions: list[DefinitionCheck]
    screen: str
    screen_holds: bool

    def findings(self) -> list[str]:
        """What a maintainer must look at (empty when nothing in scope changed)."""
        if not self.in_scope:
            return []
        found = [f"{d.name} {d.state}" for d in self.definitions if d.state != "match"]
        if not self.screen_holds:
            found.append(f"source screen: {self.screen}")
        if not self.gate.startswith("admitted"):  # in scope, yet not admitted: not reviewed
            found.append(self.gate)
        return found


def gate(module: Fix, version: str, against: str | None = None) -> tuple[str, bool]:
    """The release gate's decision for ``version`` and whether the release is in
    the fix's scope.  ``against``: as of that release, nothing newer was reviewed."""
    info = module.INFO
    as_of = None if against is None else min(against, info.newest_reviewed, key=Version)
    decided = patching.release_decision(info, version, newest_reviewed=as_of)
    if decided is None:
        return "admitted: the probe decides", True
    not_reviewed = decided.state is State.SKIPPED and decided.reason.startswith("not reviewed")
    return f"{decided.state.value}: {decided.reason}", not_reviewed


def _reference(known: Mapping[str, str], against: str | None) -> tuple[dict[str, str], str | None]:
    """The reviewed fingerprints to compare with, and the release a diff is taken against."""
    if against is not None:
        return {fp: rel for fp, rel in known.items() if against in _releases(rel)}, against
    releases = [r for rel in known.values() for r in _releases(rel)]
    return dict(known), max(releases, key=Version) if releases else None


# A module of the wheel that cannot be parsed (a syntax error, bytes that are
# not UTF-8) holds no definition the review can find: "missing", and the
# source screen says why.
UNPARSABLE = (TargetMismatch, SyntaxError, ValueError)


def _fingerprint_or_none(module: str, qualname: str) -> str | None:
    try:
        return patching.definition_fingerprint(module, qualname)
    except UNPARSABLE:
        return None


def _screen(module: Fix) -> tuple[str, bool]:
    try:
        reason = module.source_screen()
    except TargetMismatch as exc:
        return f"fails: {exc}", False
    except CannotProbe as exc:
        return f"cannot run: {exc}", False
    except Exception as exc:  # noqa: BLE001 - a screen that crashes is a finding, not a crash
        return f"fails: {type(exc).__name__}: {exc}", False
    if reason is None:
        return "holds: the code passes the probe's source checks", True
    return f"says not needed: {reason}", False


def review_fix(module: Fix, version: str, against: str | None) -> FixReview:
    """Review one fix against the sources :func:`patching.sources_from` points at."""
    decision, in_scope = gate(module, version, against)
    checks = []
    for (mod, qualname), known in module.REVIEWED.items():
        reference, reference_release = _reference(known, against)
        checks.append(
            DefinitionCheck(
                mod, qualname, _fingerprint_or_none(mod, qualname), reference, reference_release
            )
        )
    screen, holds = _screen(module)
    return FixReview(module.INFO.name, decision, in_scope, checks, screen, holds)


def _source_lines(module: str, qualname: str) -> list[str]:
    try:
        return (patching.definition_source(module, qualname).rstrip("\n") + "\n").splitlines(True)
    except UNPARSABLE:  # gone, or unreadable: the diff shows it removed
        return []


def add_diffs(
    reviews: list[FixReview],
    version: str,
    new_root: Path,
    index_url: str,
    log: Callable[[str], None],
) -> None:
    """Diff each changed or missing definition of an in-scope fix against its
    reference release's source (that wheel is fetched once)."""
    wanted = [
        d
        for r in reviews
        if r.in_scope
        for d in r.definitions
        if d.state in ("changed", "missing") and d.reference_release is not None
    ]
    releases = {d.reference_release for d in wanted if d.reference_release is not None}
    for release in sorted(releases, key=Version):
        group = [d for d in wanted if d.reference_release == release]
        with (
            unpacked_sources(fetch(release, index_url, log), {d.module for d in group}) as old_root,
            patching.sources_from(old_root),
        ):
            old = {d.name: _source_lines(d.module, d.qualname) for d in group}
            for d in group:  # the registry must describe the release it names
                reviewed = _fingerprint_or_none(d.module, d.qualname)
                if reviewed not in d.reference:
                    d.note = (
                        f"registry error: {release}'s wheel has fingerprint {reviewed}, "
                        f"not one the registry lists for {release}"
                    )
        with patching.sources_from(new_root):
            for d in group:
                d.diff = "".join(
                    difflib.unified_diff(
                        old[d.name],
                        _source_lines(d.module, d.qualname),
                        f"{release}/{d.name}",
                        f"{version}/{d.name}",
                    )
                )


# -- the command ----------------------------------------------------------------------


def report(
    reviews: list[FixReview], version: str, wheel_name: str, against: str | None
) -> list[str]:
    lines = [
        f"vLLM {version} ({wheel_name}), compared with the fixes' reviewed definitions"
        + (f" as of {against}" if against else "")
    ]
    for r in reviews:
        scope = "in scope" if r.in_scope else "out of scope: listed, not counted"
        lines += ["", f"{r.name}: {r.gate}  [{scope}]", "  reviewed definitions:"]
        for d in r.definitions:
            reviewed = ", ".join(f"{fp} ({rel})" for fp, rel in d.reference.items()) or "none"
            lines.append(f"    {d.state:<10} {d.name}  {d.found or '-'}  reviewed: {reviewed}")
        lines.append(f"  source screen{' (the fix as it is now)' if against else ''}: {r.screen}")
        for d in r.definitions:
            if d.note:
                lines.append(f"  {d.name}: {d.note}")
            if d.diff:
                lines += [
                    f"  diff of {d.name} against {d.reference_release}:",
                    *(f"    {line}" for line in d.diff.rstrip("\n").split("\n")),
                ]
    findings = [f"{r.name}: {f}" for r in reviews for f in r.findings()]
    lines.append("")
    if findings:
        lines += [
            f"NEEDS REVIEW: {len(findings)} finding(s) for vLLM {version}:",
            *(f"  - {f}" for f in findings),
        ]
    else:
        lines.append(
            f"nothing to review: every fix in scope of vLLM {version} finds its reviewed code"
        )
    return lines


def run(
    release: str | None,
    wheel_path: str | None,
    against: str | None,
    index_url: str,
    print_: Callable[[str], None] = print,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> int:
    try:
        reviewed = {
            r
            for m in ALL_FIXES
            for known in m.REVIEWED.values()
            for rel in known.values()
            for r in _releases(rel)
        }
        if against is not None and against not in reviewed:
            raise ReviewError(
                f"--against {against}: no fix has definitions reviewed in that "
                f"release (reviewed: {', '.join(sorted(reviewed, key=Version))})"
            )
        if wheel_path:
            source = Path(wheel_path)
            if not source.is_file():
                raise ReviewError(f"no such wheel: {source}")
            try:
                name, parsed, _, _ = parse_wheel_filename(source.name)
            except InvalidWheelFilename as exc:
                raise ReviewError(f"{source.name} is not a wheel file name: {exc}") from exc
            if name != "vllm":
                raise ReviewError(f"{source.name} is not a vLLM wheel")
            version = str(parsed)
        elif release is None:
            raise ReviewError("give --vllm VERSION or --vllm-wheel PATH")
        else:
            version = newest_release(index_url) if release == "latest" else release
            try:
                Version(version)
            except InvalidVersion as exc:
                raise ReviewError(
                    f"--vllm {version!r} is not a release number (e.g. 0.34.0) or 'latest'"
                ) from exc
            source = fetch(version, index_url, log)
        with unpacked_sources(source, reviewed_modules()) as root:
            with patching.sources_from(root):
                reviews = [review_fix(m, version, against) for m in ALL_FIXES]
            add_diffs(reviews, version, root, index_url, log)
    except ReviewError as exc:
        print(f"vllm-mla-fixes review: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_REVIEW
    for line in report(reviews, version, source.name, against):
        print_(line)
    return EXIT_NEEDS_REVIEW if any(r.findings() for r in reviews) else EXIT_UNCHANGED
