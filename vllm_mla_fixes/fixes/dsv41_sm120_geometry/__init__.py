"""dsv41-sm120-geometry: DeepSeek-V4.1 on SM120/SM121 cannot start, or reads the wrong pages.

Upstream:   vllm-project/vllm#59203 (report), #56702 (closed report), #56509 and
            #57292 (open candidate fixes; #56509 starts but every output is
            U+FFFD), flashinfer-ai/flashinfer#5323 (report), #5174 (extra page
            32) and #5244/#5121 (extra page 128) -- all open
Affected:   vLLM 0.32.0, 0.33.0 and 0.34.0 (``INFO``); 0.30.0/0.31.0 carry it
            but are not covered
Fixed in:   open
Hardware:   SM120 (RTX PRO 6000 Blackwell) and SM121 (GB10), where
            FLASHINFER_MLA_SPARSE_DSV41 is the only DeepSeek-V4.1 backend

Why it breaks
    Every compressed-KV and indexer-K cache takes the global ``--block-size``
    B (a page holds B / compress-ratio states) and the sliding-window cache
    is hard-wired to 32-token blocks.  FlashInfer's SM120 sparse-MLA kernels
    and DeepGEMM's SM120 paged-MQA logits declare which page rows they take
    (``envelope`` reads each declaration from the installed files).  On
    0.32/0.33 no B works: 64 stops at start-up ("No common block size for 64
    (FLASHINFER_MLA_SPARSE_DSV41: [128])."), 128 starts and hands the kernels
    pages they refuse.  0.34.0 declares 64-token kernel blocks on SM12x:
    --block-size 64 (and an unset one) works, 128 stops ("... cannot be split
    into").  #56509 splits 128-token blocks but leaves the ratio-1 writers on
    manager slots: writes land in other layers' pages.

How we fix it
    Every page FlashInfer or the indexer reads holds 64 states, the
    sliding-window cache gets 64-token blocks, and both backends declare
    their kernel block size per spec.  Two geometries deliver that:

    interleaved-split (default)
        128-token blocks; the ratio-1 compressed/indexer pair is split into
        64-state kernel pages that interleave (one compressed page, then one
        indexer page, per unit), bound as strided views; the ratio-1 writers
        get kernel-block slots translated elementwise into persistent buffers;
        block zeroing and prefix-cache copies see each block's pair region.
        A DSpark drafter's sliding-window pages hold 128 rows where the
        installed FlashInfer takes run-time pages and planning finds they
        hold more.
    per-ratio (fallback)
        ``64 x ratio``-token blocks per cache, nothing split: for speculative
        methods with their own KV writers, KV connectors other than CPU
        offloading, DCP/PCP > 1, HiSparse, other KV records, ratio-1 caches
        that do not pair up, unreviewed split targets, or the setting.

One decision per engine
    :func:`decide` is a pure function of the engine's configuration (serve
    line, the model's config including a drafter's, parallel layout) and the
    installed kernels' declarations; it plans candidate layouts with vLLM's
    own planner on the full model's specs built from its config
    (``model_specs``), never on the layers a rank holds.  Where upstream's
    own layout works it steps aside unless its layout holds at least
    ``GAIN_TO_APPLY`` times the KV tokens.  Every process, pipeline rank and
    node, ``doctor``, the truth table and the capacity benchmark call it;
    ``fix_state.STATE`` keeps each engine's answer keyed by its
    ``EngineConfig``.  The engine core holds every worker to the decision.

Remove when
    vLLM chooses 64-state pages on SM12x itself (the probe reports not-needed
    once the targets change), or the kernels accept every page upstream's
    layout produces and vLLM's backends say so.

Layout (imports point down this list)
    __init__     ``FIX``, the record the package reaches the fix through; its
                 command, doctor and reproduction members import those
                 modules when called, so loading the plugin loads none of them
    cli          ``selftest``, ``status --truth-table``, the set-up ``verify`` needs
    reproductions, selftest   the CPU reproductions (``verify``) and the self-test
    apply        installs the wrappers through ``Patch``
    checks       start-up page check; the engine core's agreement check
    views, slots interleaved views, zeroing, copies; ratio-1 writer slots
    specs        spec producers, per-spec kernel blocks, sliding-window rows
    doctor, prediction, status   what ``doctor`` and ``status`` say
    fix_state    per-engine decisions and bookkeeping
    decision     :func:`decide` and :class:`Decision`
    planning, model_specs        vLLM's planner on the full model's specs
    engine       :class:`EngineConfig`, read from a ``VllmConfig``
    upstream, envelope, gate     upstream's layout, kernel envelopes, review
    info, settings, vocabulary   ``INFO``, constants, the fix's settings, enums
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_mla_fixes.fix import Fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import (
    REVIEWED,
    SPLIT_TARGETS,
    probe,
    source_screen,
    split_unreviewed,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    ATTENTION_MODULE,
    DOCTOR_JSON_KEY,
    DRAFTER_SWA_ENV,
    DRAFTER_SWA_ROWS,
    FLASHINFER_BACKEND,
    FLASHINFER_MODULE,
    GAIN_TO_APPLY,
    GEOMETRY_ENV,
    INDEXER_BACKEND,
    INDEXER_MODULE,
    INFO,
    PAGE_ROWS,
    PER_RATIO,
    SPLIT,
    SPLIT_MANAGER_BLOCK,
    UPSTREAM,
    UPSTREAM_SWA_BLOCK,
    WORKER_UTILS_MODULE,
    PageGeometryError,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.settings import SETTINGS
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import CacheKind, Geometry

if TYPE_CHECKING:
    from vllm_mla_fixes.commands import Commands
    from vllm_mla_fixes.patching import FixStatus, Patch
    from vllm_mla_fixes.report import Environment, Finding, ServeLine

# The members below import their module when called: apply's wrappers (and the
# decision and kernel envelopes under them) only where the probe found the bug,
# the commands, doctor and reproductions only where a command runs them.


def install_wrappers(patch: Patch) -> None:
    """``apply`` (named apart from the ``apply`` module it calls)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.apply import apply

    apply(patch)


def status_in_process(applied: FixStatus) -> FixStatus:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import status

    return status.status_in_process(applied)


def diagnose(env: Environment, serve: ServeLine | None) -> list[Finding]:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor

    return doctor.diagnose(env, serve)


def prepare_verify() -> None:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import cli

    cli.prepare_verify()


def verify(report: Callable[[str], None]) -> bool:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import reproductions

    return reproductions.verify(report)


def add_commands(commands: Commands) -> None:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import cli

    cli.add_commands(commands)


def kernel_disagreements() -> list[str]:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import cli

    return cli.kernel_disagreements()


def status_json(args: argparse.Namespace) -> dict[str, object]:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import cli

    return cli.status_json(args)


FIX = Fix(
    INFO=INFO,
    SETTINGS=SETTINGS,
    REVIEWED=REVIEWED,
    DOCTOR_JSON_KEY=DOCTOR_JSON_KEY,
    probe=probe,
    apply=install_wrappers,
    source_screen=source_screen,
    status_in_process=status_in_process,
    diagnose=diagnose,
    prepare_verify=prepare_verify,
    verify=verify,
    add_commands=add_commands,
    kernel_disagreements=kernel_disagreements,
    status_json=status_json,
)


def for_capability(capability: tuple[int, int]) -> Fix:
    """This fix as seen from a device of ``capability``: its probe reads that
    capability instead of the visible device's (tests, and ``verify`` on CPU)."""
    return dataclasses.replace(FIX, probe=functools.partial(probe, capability))


__all__ = [
    "ATTENTION_MODULE",
    "CacheKind",
    "DOCTOR_JSON_KEY",
    "DRAFTER_SWA_ENV",
    "DRAFTER_SWA_ROWS",
    "FIX",
    "FLASHINFER_BACKEND",
    "FLASHINFER_MODULE",
    "GAIN_TO_APPLY",
    "GEOMETRY_ENV",
    "Geometry",
    "INDEXER_BACKEND",
    "INDEXER_MODULE",
    "INFO",
    "PAGE_ROWS",
    "PER_RATIO",
    "PageGeometryError",
    "REVIEWED",
    "SETTINGS",
    "SPLIT",
    "SPLIT_MANAGER_BLOCK",
    "SPLIT_TARGETS",
    "UPSTREAM",
    "UPSTREAM_SWA_BLOCK",
    "WORKER_UTILS_MODULE",
    "for_capability",
    "probe",
    "source_screen",
    "split_unreviewed",
]
