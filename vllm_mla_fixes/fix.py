"""What every fix provides: :class:`Fix`, the one way the rest of the package
reaches a fix.

A fix is one module or package under ``vllm_mla_fixes/fixes/`` that exposes
one record, ``FIX = Fix(...)``, listed once in
``vllm_mla_fixes.fixes.ALL_FIXES``.  The plugin, ``status``, ``doctor``,
``verify``, the command line and the test sessions read a fix only through
the record's members; none of them names a fix, so removing a fix is removing
its folder, its tests and its line in ``ALL_FIXES``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_mla_fixes.commands import Commands
    from vllm_mla_fixes.patching import FixInfo, FixStatus, Patch
    from vllm_mla_fixes.report import Environment, Finding, ServeLine
    from vllm_mla_fixes.settings import Setting


@dataclasses.dataclass(frozen=True)
class Fix:
    """One fix; every member is required (a fix without a part of its own
    gives the matching ``no_*`` helper below).

    Building the record must stay cheap: vLLM is imported only inside
    ``probe``, ``apply`` and what the commands call, and a member that needs
    the fix's command, doctor or reproduction modules imports them when it is
    called, so a vLLM process that loads the plugin never loads them."""

    INFO: FixInfo
    """The fix's facts: name, upstream, covered releases, hardware, error."""
    SETTINGS: tuple[Setting[object], ...]
    """Its own ``VLLM_MLA_FIXES_*`` settings (the shared ones excluded)."""
    REVIEWED: Mapping[tuple[str, str], Mapping[str, str]]
    """The vLLM definitions it wraps or reads, by (module, qualified name):
    fingerprint -> the releases it was reviewed in (``review``).  The source
    screen's cache keys on these, the screen's own folder and patching."""
    DOCTOR_JSON_KEY: str | None
    """The top-level key of ``doctor --json`` under which its findings'
    facts go; None where they have none."""
    probe: Callable[[], str | None]
    """None where the installed vLLM carries the bug, else why it does not
    need the fix (run only after the release gate admitted the release)."""
    apply: Callable[[Patch], None]
    """Install the fix's replacements through the given ``Patch``."""
    source_screen: Callable[[], str | None]
    """The probe's part that reads vLLM's source only: None while the code
    is the reviewed shape of the bug (``review``)."""
    status_in_process: Callable[[FixStatus], FixStatus]
    """The status of the applied fix in this process (a fix that decides
    per engine after ``register()`` says what it chose)."""
    diagnose: Callable[[Environment, ServeLine | None], list[Finding]]
    """``doctor``'s findings for this fix, on a release it covers."""
    prepare_verify: Callable[[], None]
    """Set up this process for :attr:`verify`, before any fix's verifier
    imports vLLM (``vllm-mla-fixes verify``)."""
    verify: Callable[[Callable[[str], None]], bool]
    """Reproduce the failure on the installed vLLM on CPU, then show the fix
    removes it; the argument takes one line at a time."""
    add_commands: Callable[[Commands], None]
    """Add the fix's own subcommands, and options of shared ones."""
    kernel_disagreements: Callable[[], list[str]]
    """Where vLLM's statement about a kernel the fix concerns and the
    kernel's own declaration in the installed build differ (``status``)."""
    status_json: Callable[[argparse.Namespace], dict[str, object]]
    """The keys the fix adds to ``status --json``, after ``exit_status``."""


# -- the members of a fix without commands, status keys, kernel statements, set-up or
# per-engine status of its own.


def no_preparation() -> None:
    """``prepare_verify``: its reproduction runs in the process as it is."""


def no_commands(commands: Commands) -> None:
    """``add_commands``: no commands or options of its own."""


def no_disagreements() -> list[str]:
    """``kernel_disagreements``: it states nothing about a kernel's envelope."""
    return []


def no_status_keys(args: argparse.Namespace) -> dict[str, object]:
    """``status_json``: no keys of its own."""
    return {}


def status_as_applied(applied: FixStatus) -> FixStatus:
    """``status_in_process``: what it decided at ``register()`` stands."""
    return applied


def plain_fix(
    *,
    INFO: FixInfo,
    REVIEWED: Mapping[tuple[str, str], Mapping[str, str]],
    probe: Callable[[], str | None],
    apply: Callable[[Patch], None],
    source_screen: Callable[[], str | None],
    diagnose: Callable[[Environment, ServeLine | None], list[Finding]],
    verify: Callable[[Callable[[str], None]], bool],
) -> Fix:
    """The record of a fix with no settings, set-up, commands, kernel
    statements, status keys or per-engine status of its own."""
    return Fix(
        INFO=INFO,
        SETTINGS=(),
        REVIEWED=REVIEWED,
        DOCTOR_JSON_KEY=None,
        probe=probe,
        apply=apply,
        source_screen=source_screen,
        status_in_process=status_as_applied,
        diagnose=diagnose,
        prepare_verify=no_preparation,
        verify=verify,
        add_commands=no_commands,
        kernel_disagreements=no_disagreements,
        status_json=no_status_keys,
    )
