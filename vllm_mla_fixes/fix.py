"""What every fix provides: :class:`Fix`, the one way the rest of the package
reaches a fix.

A fix is one module or package under ``vllm_mla_fixes/fixes/``, listed once
in ``vllm_mla_fixes.fixes.ALL_FIXES`` (typed as ``tuple[Fix, ...]``, so mypy
checks each module against this protocol).  The plugin, ``status``,
``doctor``, ``verify``, the command line and the test sessions read a fix
only through these members; none of them names a fix, so removing a fix is
removing its folder, its tests and its line in ``ALL_FIXES``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm_mla_fixes.cli import Commands
    from vllm_mla_fixes.patching import FixInfo, Patch
    from vllm_mla_fixes.report import Environment, Finding, ServeLine
    from vllm_mla_fixes.settings import Setting


class Fix(Protocol):
    """One fix.  Importing it must stay cheap: vLLM is imported only inside
    ``probe``, ``apply`` and what the commands call.

    Two members are optional, read with ``getattr``: ``status_in_process``
    (a fix that decides per engine after ``register()`` says what it chose)
    and ``DOCTOR_JSON_KEY`` (the top-level key of ``doctor --json`` under
    which its findings' facts go)."""

    @property
    def INFO(self) -> FixInfo:
        """The fix's facts: name, upstream, covered releases, hardware, error."""

    @property
    def SETTINGS(self) -> tuple[Setting, ...]:
        """Its own ``VLLM_MLA_FIXES_*`` settings (the shared ones excluded)."""

    @property
    def REVIEWED(self) -> Mapping[tuple[str, str], Mapping[str, str]]:
        """The vLLM definitions it wraps or reads, by (module, qualified name):
        fingerprint -> the releases it was reviewed in (``review``)."""

    def probe(self) -> str | None:
        """None where the installed vLLM carries the bug, else why it does not
        need the fix (run only after the release gate admitted the release)."""

    def apply(self, patch: Patch) -> None:
        """Install the fix's replacements through ``patch``."""

    def source_screen(self) -> str | None:
        """The probe's part that reads vLLM's source only: None while the
        code is the reviewed shape of the bug (``review``)."""

    def diagnose(self, env: Environment, serve: ServeLine | None) -> list[Finding]:
        """``doctor``'s findings for this fix, on a release it covers."""

    def prepare_verify(self) -> None:
        """Set up this process for :meth:`verify`, before any fix's verifier
        imports vLLM (``vllm-mla-fixes verify``)."""

    def verify(self, report: Callable[[str], None]) -> bool:
        """Reproduce the failure on the installed vLLM on CPU, then show the
        fix removes it; ``report`` takes one line at a time."""

    def add_commands(self, commands: Commands) -> None:
        """Add the fix's own subcommands, and options of shared ones."""

    def kernel_disagreements(self) -> list[str]:
        """Where vLLM's statement about a kernel the fix concerns and the
        kernel's own declaration in the installed build differ (``status``)."""

    def status_json(self, args: argparse.Namespace) -> dict[str, Any]:
        """The keys the fix adds to ``status --json``, after ``exit_status``."""


# -- the members of a fix without commands, status keys, kernel statements or set-up of its
# own: such a fix imports these under the protocol's names.


def no_preparation() -> None:
    """``prepare_verify``: its reproduction runs in the process as it is."""


def no_commands(commands: Commands) -> None:
    """``add_commands``: no commands or options of its own."""


def no_disagreements() -> list[str]:
    """``kernel_disagreements``: it states nothing about a kernel's envelope."""
    return []


def no_status_keys(args: argparse.Namespace) -> dict[str, Any]:
    """``status_json``: no keys of its own."""
    return {}
