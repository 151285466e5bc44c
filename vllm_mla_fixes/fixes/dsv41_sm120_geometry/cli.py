"""The fix's part of the ``vllm-mla-fixes`` command line: the ``selftest``
command, ``status``'s ``--truth-table`` option and its ``status`` output,
and the CPU set-up ``verify`` needs before vLLM is imported.

What it shares with the package's command line comes from
:mod:`vllm_mla_fixes.commands`, below the fixes; the package's ``FIX``
record imports this module only when a command calls it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_mla_fixes.commands import EXIT_USAGE, PROG, CommandError, exit_codes, logs_to_stderr
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import DOCTOR_JSON_KEY, INFO
from vllm_mla_fixes.patching import installed_vllm_version

if TYPE_CHECKING:
    from vllm_mla_fixes.commands import Commands


def _covered_release_installed() -> bool:
    return installed_vllm_version() in INFO.covered_releases


def kernel_disagreements() -> list[str]:
    """Where vLLM's statement about a DeepSeek-V4.1 kernel on SM12x and the
    kernel's own declaration in the installed build differ, with both sources
    (empty outside the releases the fix covers)."""
    if not _covered_release_installed():
        return []
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope

    with logs_to_stderr():
        return [str(d) for d in envelope.disagreements()]


def status_json(args: argparse.Namespace) -> dict[str, object]:
    """The per-engine decisions taken in this process, and on a release the
    fix covers the installed build's truth table."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import engine_reports

    document: dict[str, object] = {DOCTOR_JSON_KEY: engine_reports()}
    if _covered_release_installed():
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import truth_table

        with logs_to_stderr():
            document["dsv41_truth_table"] = truth_table.for_status(args.truth_table)
    return document


def prepare_verify() -> None:
    """Without a GPU, the DeepSeek-V4.1 self-test runs vLLM's Triton kernels in
    Triton's interpreter, which must be chosen before vLLM is imported."""
    try:
        import torch
    except ModuleNotFoundError:
        return  # the command itself says what is missing
    if not torch.cuda.is_available():
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import prepare_process_env

        prepare_process_env()


def cmd_selftest(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import arguments, atomic
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.verdicts import EXIT_CANNOT_RUN

    if args.report is not None:  # before minutes of testing
        problem = arguments.output_file_problem(args.report)
        if problem is not None:
            raise CommandError(f"--report {args.report!r}: {problem}", EXIT_USAGE)

    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        raise CommandError(
            "cannot run: PyTorch is not installed in this environment "
            f"({sys.executable}); run it where vLLM is installed",
            EXIT_CANNOT_RUN,
        ) from None
    prepare_verify()
    if installed_vllm_version() is None:
        raise CommandError(
            f"cannot run: vLLM is not installed in this environment ({sys.executable})",
            EXIT_CANNOT_RUN,
        )
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import run_selftest

    with logs_to_stderr():
        report = run_selftest(
            tuple(args.geometry or ()) or None,
            jobs=args.jobs,
            timing=not args.no_timing,
            geometry_limit_seconds=args.geometry_timeout,
        )
    document = json.dumps(report.as_json(), indent=2)
    print(
        document if args.json else report.text(), flush=True
    )  # first: a failed write loses nothing
    if args.report is not None:
        try:
            atomic.write_atomic(Path(args.report), document + "\n")
        except OSError as exc:  # the results are printed above; only the file is missing
            reason = exc.reason if isinstance(exc, atomic.CannotWrite) else exc.strerror or exc
            print(
                f"{PROG} selftest: error: --report {args.report!r} not written "
                f"({reason}); the report is printed above",
                file=sys.stderr,
            )
            return EXIT_USAGE  # the path given cannot be written: as when checked first
    return report.exit_status


def add_commands(commands: Commands) -> None:
    """``status --truth-table``, and the ``selftest`` command."""
    commands.status.add_argument(
        "--truth-table",
        action="store_true",
        help="with --json: derive the DeepSeek-V4.1 truth table of this install if it is not\n"
        "kept yet (a few minutes on CPU, once per installed vLLM), and include it",
    )
    commands.status_json_only.append("--truth-table")
    _add_selftest_parser(commands)


def _add_selftest_parser(commands: Commands) -> None:
    from vllm_mla_fixes import arguments

    selftest = commands.add(
        "selftest",
        cmd_selftest,
        "DeepSeek-V4.1: prove the fixed KV page layout on this device",
        "Runs the writers and readers vLLM uses on this device over the fixed KV layout\n"
        f"(vLLM {INFO.covered_releases[0]} to {INFO.covered_releases[-1]}) and "
        "compares every read with a dense reference. Without\n"
        "a GPU, vLLM's Triton kernels run in Triton's interpreter.",
        exit_codes(
            "0  pass",
            "1  a mismatch, or a missed control",
            "2  bad arguments, or it cannot run here (the reason is printed)",
        ),
    )
    selftest.add_argument(
        "--json", action="store_true", help="print only the JSON report on stdout"
    )
    selftest.add_argument(
        "--geometry",
        action="append",
        choices=("split", "fallback", "upstream", "control", "dspark-long-prefill"),
        help="run only this geometry (repeatable; default: split, fallback, control, "
        "upstream; dspark-long-prefill checks a long DSpark prefill's top-k indices)",
    )
    selftest.add_argument(
        "--jobs",
        type=arguments.WholeNumber(1, 256),
        default=None,
        help="geometries run in parallel processes, 1 to 256 (CPU only, default: cores; "
        "on a GPU they run one after another, each in a process of its own)",
    )
    selftest.add_argument(
        "--no-timing",
        action="store_true",
        help="skip the timings (the per-step slot translation; on a GPU, the decode-step kernels)",
    )
    selftest.add_argument(
        "--geometry-timeout",
        type=arguments.Seconds(),
        default=None,
        metavar="SECONDS",
        help="stop a geometry's process still running after SECONDS and report it hung "
        "(where geometries run in processes of their own: on a GPU, or with --jobs above 1; "
        "default 1800, room for a first run's JIT build of FlashInfer's SM120 kernels; "
        f"at most {arguments.MAX_SECONDS})",
    )
    selftest.add_argument(
        "--report",
        metavar="FILE",
        help="also write the JSON report to FILE (whole, or not at all; a link to a regular file "
        "is written through, the link kept; a folder, device, FIFO or socket is refused)",
    )
