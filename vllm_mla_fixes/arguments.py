"""Checks of command-line values, run by argparse before a command does any work
(no network access, no vLLM import): each raises ``ArgumentTypeError`` with a
message naming what is wrong and what is expected."""

from __future__ import annotations

import argparse
import math
import urllib.parse

from packaging.version import InvalidVersion, Version


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
    """A server's base URL: http or https, a host, a port in 1-65535."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http:// or https:// URL (e.g. http://localhost:8000)"
        )
    _host_and_port(text, parts)
    return text


def _host_and_port(text: str, parts: urllib.parse.SplitResult) -> None:
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} names no host")
    try:
        port = parts.port  # raises for a port that is not a number in 0-65535
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} has an invalid port (allowed: 1 to 65535)")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def non_negative_int(text: str) -> int:
    number = _integer(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number} is negative (allowed: 0 or more)")
    return number


def positive_int(text: str) -> int:
    number = _integer(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not positive (allowed: 1 or more)")
    return number


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return seconds
