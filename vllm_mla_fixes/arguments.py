"""Checks of command-line values, run before a command does any work (no
network access, no vLLM import): argparse's types raise ``ArgumentTypeError``
with a message naming what is wrong and what is expected; the output-path
checks return that message."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tempfile
import urllib.parse
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_mla_fixes import atomic


def release(text: str) -> str:
    """A vLLM release number (PEP 440), e.g. 0.25.1."""
    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a release number (e.g. 0.25.1)"
        ) from None
    return text


def release_or_latest(text: str) -> str:
    if text == "latest":
        return text
    try:
        return release(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a release number (e.g. 0.34.0) or 'latest'"
        ) from None


def index_url(text: str) -> str:
    """A package index: an http, https or file URL."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https", "file"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http://, https:// or file:// URL of a package index"
        )
    if parts.scheme != "file":
        _host_and_port(text, parts)
    return text


def server_url(text: str) -> str:
    """A server's base URL: http or https, a host, a port in 1-65535.  Its
    password, where it has one, is never shown."""
    from vllm_mla_fixes.smoke import redact_url

    shown = redact_url(text)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not an http:// or https:// URL (e.g. http://localhost:8000)"
        )
    _host_and_port(shown, parts)
    return text


def api_key(text: str) -> str:
    """A bearer token: surrounding white space (a key file's newline) is
    dropped; a character an HTTP header cannot carry is refused, and the key
    is never shown."""
    key = text.strip()
    bad = next((i for i, c in enumerate(key) if not " " < c <= "~"), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"the API key (--api-key or $VLLM_API_KEY, {len(key)} characters) holds a "
            f"character an HTTP header cannot carry at position {bad + 1}; it is not shown"
        )
    return key


def _host_and_port(text: str, parts: urllib.parse.SplitResult) -> None:
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} names no host")
    if not re.fullmatch(r"[\w.~%:-]+", parts.hostname, re.ASCII):  # a space, a quote
        raise argparse.ArgumentTypeError(
            f"{text!r}: {parts.hostname!r} is not a host name or address"
        )
    try:
        port = parts.port  # raises for a port that is not a number in 0-65535
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} has an invalid port (allowed: 1 to 65535)")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # also a number of more digits than int() reads
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None


@dataclasses.dataclass(frozen=True)
class WholeNumber:
    """An option's whole number in ``low`` to ``high``: every count has a range
    a run can use (processes, tokens), checked before any work."""

    low: int
    high: int

    def __call__(self, text: str) -> int:
        allowed = f"allowed: {self.low} to {self.high}"
        huge = re.fullmatch(r"\s*([+-]?)\d{19,}\s*", text)  # beyond every range (and int())
        if huge:
            what = "too small" if huge[1] == "-" else "too large"
            raise argparse.ArgumentTypeError(f"{text.strip()[:20]}... is {what} ({allowed})")
        number = _integer(text)
        if number < self.low:
            what = "negative" if number < 0 and self.low == 0 else "not positive"
            raise argparse.ArgumentTypeError(f"{number} is {what} ({allowed})")
        if number > self.high:
            raise argparse.ArgumentTypeError(f"{text[:40]} is too large ({allowed})")
        return number


# The longest time an option may name: a week, far below what the waits it
# reaches accept (poll() takes at most 2**31-1 ms, about 24.8 days; threading
# about 292 years), so no wait fails with OverflowError part-way.
MAX_SECONDS = 7 * 24 * 3600


@dataclasses.dataclass(frozen=True)
class Seconds:
    """An option's time: more than 0, at most :data:`MAX_SECONDS`."""

    high: float = MAX_SECONDS

    def __call__(self, text: str) -> float:
        try:
            seconds = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
        allowed = (
            f"allowed: more than 0, at most {self.high:g} seconds ({self.high / 86400:g} days)"
        )
        if not (seconds > 0 and math.isfinite(seconds)):
            raise argparse.ArgumentTypeError(
                f"{text[:40]} is not a positive, finite number of seconds ({allowed})"
            )
        if seconds > self.high:
            raise argparse.ArgumentTypeError(f"{text[:40]} seconds is too long ({allowed})")
        return seconds


# Output paths are checked before a command's long work (a self-test runs for
# minutes, a build reads a 400 MB wheel): each returns why a path cannot be
# written, or None.


def output_file_problem(text: str) -> str | None:
    """Why a file cannot be written at ``text`` (a report), or None."""
    if not text.strip():
        return "an empty path names no file"
    if text.endswith(os.sep):  # Path() would drop the slash and write a file
        return f"it ends in {os.sep!r}, which names a folder; give a file name"
    try:
        final = atomic.write_target(Path(text))  # not replaced unless a regular file
        if not final.parent.is_dir():
            return "its folder does not exist"
    except atomic.CannotWrite as exc:
        return exc.reason
    except OSError as exc:  # a name too long, a folder it may not look into
        return exc.strerror or str(exc)
    return _cannot_write_in(final.parent)


def output_folder_problem(text: str) -> str | None:
    """Why files cannot be written into the folder ``text`` (created when
    missing, with its parents), or None."""
    if not text.strip():
        return "an empty path names no folder"
    path = Path(text)
    for part in (path, *path.parents):
        try:
            if not part.exists():
                continue
            if not part.is_dir():
                return "exists and is not a folder" if part == path else f"{str(part)!r} is a file"
        except OSError as exc:
            return exc.strerror or str(exc)
        return _cannot_write_in(part)
    return None


def _cannot_write_in(folder: Path) -> str | None:
    """Why no file can be created in ``folder`` now (a read-only file system,
    no permission), tried with one that is removed at once; or None."""
    try:
        descriptor, name = tempfile.mkstemp(dir=folder, prefix=".vllm-mla-fixes-probe-")
    except OSError as exc:
        return f"cannot write in {str(folder)!r}: {exc.strerror or exc}"
    os.close(descriptor)
    os.unlink(name)
    return None
