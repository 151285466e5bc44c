"""What the command line and the fixes' own commands share: how a fix adds
to the command line (:class:`Commands`), the error a command raises, the exit
statuses, the program's name and :func:`logs_to_stderr`.

It sits below :mod:`vllm_mla_fixes.fix` and imports nothing of this
package, so a fix's commands never reach up into :mod:`vllm_mla_fixes.cli`,
which imports the fixes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PROG = "vllm-mla-fixes"


class CommandError(Exception):
    """A command cannot do its work; the message says why, in one line."""

    def __init__(self, message: str, exit_status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def exit_codes(*lines: str) -> str:
    """The ``exit status:`` block of a command's ``--help``."""
    return "exit status:\n" + "\n".join(f"  {line}" for line in lines)


def _plain(text: str) -> str:
    """Help is read in a terminal: no reStructuredText literal markup."""
    return text.replace("``", "").replace("`", "")


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    func: Callable[[argparse.Namespace], int],
    summary: str,
    description: str,
    epilog: str,
    usage: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand, made as every command is: its summary, description and epilog."""
    parser = sub.add_parser(
        name,
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}",
        epilog=_plain(epilog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=usage,
    )
    parser.set_defaults(func=func)
    return parser


@dataclasses.dataclass(frozen=True)
class Commands:
    """Where a fix adds to the command line (``Fix.add_commands``): commands
    of its own, listed after the shared ``status``, ``verify`` and ``doctor``,
    and options of ``status``."""

    subcommands: argparse._SubParsersAction[argparse.ArgumentParser]
    status: argparse.ArgumentParser
    # status options that add to its JSON document only: without --json, refused
    status_json_only: list[str] = dataclasses.field(default_factory=list)

    def add(
        self,
        name: str,
        func: Callable[[argparse.Namespace], int],
        summary: str,
        description: str,
        epilog: str,
    ) -> argparse.ArgumentParser:
        """A command made as every command is (:func:`add_command`)."""
        return add_command(self.subcommands, name, func, summary, description, epilog)


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """While vLLM and the plugins load, send everything they write to stderr,
    so stdout carries our output alone (--json is exactly one document).

    vLLM's logger writes to stdout unless VLLM_LOGGING_STREAM says otherwise;
    it is pointed at stderr for this process before vLLM is imported.  Other
    writers (a library's print, C code) are caught by pointing file
    descriptor 1 at stderr until the block ends."""
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
