"""Every ``VLLM_MLA_FIXES*`` environment variable: its name, allowed values,
default and meaning, and the one place that reads and checks it.

Settings are read from the environment where they are used, in every process
vLLM starts (they inherit the operator's environment).  An empty value counts
as unset.  A value that is not allowed counts as unset too -- the default
applies -- and :func:`warn_invalid` logs one warning per variable and process
when the plugin loads; ``vllm-mla-fixes status`` lists every variable that is
set and flags the invalid ones.  Standard library only, and nothing here
raises for a bad value: the plugin's start-up path reads these.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import pwd
import stat
import textwrap
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Generic, TypeVar

PREFIX = "VLLM_MLA_FIXES"

# What a setting's value is once parsed.  Covariant: a setting read only gives
# its value out, so a Setting[int] is a Setting[object] among all the settings.
T = TypeVar("T", covariant=True)


@dataclasses.dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    allowed_values: str | Callable[[], str]  # a callable where the text is known only later
    default: str
    meaning: str
    parse: Callable[[str], T]  # the value in force; raises ValueError(why) when not allowed

    @property
    def allowed(self) -> str:
        return (
            self.allowed_values if isinstance(self.allowed_values, str) else self.allowed_values()
        )


UNKNOWN_LISTED = 5  # a long list is cut: the message stays a line


def _fix_selection(fix_names: tuple[str, ...], raw: str) -> frozenset[str]:
    text = raw.lower()
    if text == "all":
        return frozenset(fix_names)
    if text == "none":
        return frozenset()
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("it names no fix")
    keywords = sorted({n for n in names if n in ("all", "none")})
    unknown = [n for n in names if n not in fix_names and n not in keywords]
    problems = []
    if keywords:
        problems.append(f"{' and '.join(repr(k) for k in keywords)} must stand alone")
    if unknown:
        listed = ", ".join(shown(n) for n in unknown[:UNKNOWN_LISTED])
        more = len(unknown) - UNKNOWN_LISTED
        problems.append(
            f"unknown fix name{'s' if len(unknown) > 1 else ''} {listed}"
            + (f" and {more} more" if more > 0 else "")
        )
    if problems:
        raise ValueError("; ".join(problems))
    return frozenset(names)


def _cache_folder(raw: str) -> Path:
    try:
        path = Path(raw).expanduser()
    except RuntimeError as exc:  # "~user" of no such user
        raise ValueError(str(exc)) from exc
    if not path.is_absolute():
        raise ValueError("a relative path would differ between vLLM's processes")
    _check_writable_folder(path)
    return path


def _check_writable_folder(path: Path) -> None:
    """ValueError unless this process could keep files in ``path``: the
    nearest part of it that exists is a folder it may write in, and the
    names below it fit that file system.  Decided the same whether or not
    the missing folders were created meanwhile; every OSError becomes the
    reason: a cache folder that cannot be used must never stop plugin load."""
    for part in (path, *path.parents):
        try:
            mode = os.stat(part).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there (yet): the part above it decides
        except OSError as exc:  # a name too long, a parent it may not look into
            raise ValueError(f"it cannot be looked up: {_os_reason(exc)}") from None
        if not stat.S_ISDIR(mode):
            raise ValueError(
                "it exists and is not a folder" if part == path else f"{str(part)!r} is a file"
            )
        if not os.access(part, os.W_OK | os.X_OK):
            raise ValueError(f"this user ({_user()}) may not write in {str(part)!r}")
        _check_names_fit(path, part)
        return


def _check_names_fit(path: Path, existing: Path) -> None:
    """The folders still to be created fit the file system ``existing`` is on."""
    try:
        longest_name = os.pathconf(existing, "PC_NAME_MAX")
        longest_path = os.pathconf(existing, "PC_PATH_MAX")
        encoded = os.fsencode(path)
        names = [os.fsencode(name) for name in path.relative_to(existing).parts]
    except (OSError, ValueError) as exc:  # UnicodeEncodeError: no file name holds it
        raise ValueError(f"it cannot be a file name here: {exc}") from None
    if len(encoded) >= longest_path:
        raise ValueError(f"it is {len(encoded)} bytes long; paths here end at {longest_path - 1}")
    if any(len(name) > longest_name for name in names):
        raise ValueError(f"a name in it is longer than the {longest_name} bytes names here may be")


def _os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    return f"{exc.strerror} ({name})" if exc.strerror and name else str(exc)


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid with no passwd entry, as in many containers
        return f"uid {os.getuid()}"


FIXES_VARIABLE = PREFIX


def fix_selection(fix_names: tuple[str, ...]) -> Setting[frozenset[str]]:
    """``VLLM_MLA_FIXES``, the choice among ``fix_names`` (the package's
    fixes, which :mod:`vllm_mla_fixes.fixes` passes: this module imports none)."""
    return Setting(
        name=FIXES_VARIABLE,
        allowed_values=f"all, none, or fix names separated by commas ({', '.join(fix_names)})",
        default="all",
        meaning="which fixes the plugin may apply; each still applies only where the installed "
        "vLLM needs it",
        parse=functools.partial(_fix_selection, fix_names),
    )


CACHE_DIR = Setting(
    name=f"{PREFIX}_CACHE_DIR",
    allowed_values="an absolute path of a folder this user may write in (created when missing)",
    default="$XDG_CACHE_HOME/vllm-mla-fixes/screens, else ~/.cache/vllm-mla-fixes/screens",
    meaning="where the plugin keeps its source-screen verdicts between processes",
    parse=_cache_folder,
)


@dataclasses.dataclass(frozen=True)
class Reading(Generic[T]):
    """One ``VLLM_MLA_FIXES*`` variable that is set."""

    name: str
    raw: str
    setting: Setting[T] | None  # None: no setting has this name
    value: T | None = None  # what is in force; None when invalid or unknown
    problem: str | None = None  # why the value is not allowed
    known: tuple[str, ...] = ()  # for a name no setting has: the names the package reads

    @property
    def valid(self) -> bool:
        return self.setting is not None and self.problem is None

    def describe(self) -> str:
        """One line: the value in force, or what is wrong and what applies instead."""
        value = shown(self.raw)
        if self.setting is None:
            return (
                f"{self.name}={value}: not a setting of vllm-mla-fixes, which reads "
                f"{', '.join(self.known)}"
            )
        if self.problem is None:
            return f"{self.name}={value}"
        return (
            f"{self.name}={value} is not allowed ({self.problem}); allowed: "
            f"{self.setting.allowed}; ignored, so the default applies: {self.setting.default}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "value": self.raw,
            "known": self.setting is not None,
            "valid": self.valid,
            "problem": self.problem,
            "allowed": self.setting.allowed if self.setting else None,
            "default": self.setting.default if self.setting else None,
        }


SHOWN_CHARACTERS = 120


def shown(raw: str) -> str:
    """A value an operator set, as one readable line: repr (no control or
    unencodable characters reach a terminal or a log), cut where it is longer
    than a line."""
    if len(raw) <= SHOWN_CHARACTERS:
        return repr(raw)
    return f"{raw[:SHOWN_CHARACTERS]!r}... ({len(raw)} characters)"


def terminal_line(text: str) -> str:
    """``text`` with each character that does not print (an escape sequence,
    an undecodable byte) written as its escape: a line safe for a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def plain(text: str) -> str:
    """``text`` as it is where every character prints and it fits a line,
    else as :func:`shown` gives it."""
    return text if text.isprintable() and len(text) <= SHOWN_CHARACTERS else shown(text)


def read(setting: Setting[T], environ: Mapping[str, str] | None = None) -> Reading[T] | None:
    """The variable of ``setting`` checked, or None when it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(setting.name, "")
    if not raw.strip():
        return None
    try:
        return Reading(setting.name, raw, setting, value=setting.parse(raw.strip()))
    except ValueError as exc:
        return Reading(setting.name, raw, setting, problem=str(exc))


def environment_variable(name: str) -> str | None:
    """A variable as this process sees it, None where unset, unchecked: one
    of vLLM or another tool (``VLLM_PLUGINS``, ``HF_HOME``, ...), or a
    setting's raw text.  The package reads the environment only through
    this module."""
    return os.environ.get(name)


def value(setting: Setting[T], environ: Mapping[str, str] | None = None) -> T | None:
    """The value in force, or None for the default (unset, empty, or not allowed)."""
    reading = read(setting, environ)
    return None if reading is None else reading.value


def readings(
    known: Sequence[Setting[object]], environ: Mapping[str, str] | None = None
) -> list[Reading[object]]:
    """Every ``VLLM_MLA_FIXES*`` variable that is set: the ``known`` settings
    in their order, then names none of them has (a misspelling, or a
    variable of the project's test tools)."""
    env = os.environ if environ is None else environ
    names = tuple(s.name for s in known)
    found = [r for s in known if (r := read(s, env)) is not None]
    found += [
        Reading(name, env[name], None, known=names)
        for name in sorted(env)
        if name.startswith(PREFIX) and name not in names and env[name].strip()
    ]
    return found


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_invalid(log: logging.Logger, known: Sequence[Setting[object]]) -> None:
    """Log one warning for each invalid setting of ``known``, once per value and process."""
    for reading in readings(known):
        if reading.setting is None or reading.problem is None:
            continue
        with _warned_lock:
            if (reading.name, reading.raw) in _warned:
                continue
            _warned.add((reading.name, reading.raw))
        log.warning("vllm-mla-fixes: %s", reading.describe())


def forget_warnings() -> None:
    """Warn again, as a freshly started process would (the plugin's revert_all)."""
    with _warned_lock:
        _warned.clear()


def help_text(known: Sequence[Setting[object]]) -> str:
    """The ``known`` settings as ``--help`` shows them."""
    lines = ["environment variables (an invalid value is ignored with one warning):"]
    for s in known:
        lines.append(f"  {s.name}")
        for text in (s.meaning, f"allowed: {s.allowed}", f"default: {s.default}"):
            lines += textwrap.wrap(
                text,
                80,
                initial_indent=" " * 6,
                subsequent_indent=" " * 8,
                break_on_hyphens=False,
                break_long_words=False,
            )
    return "\n".join(lines)
