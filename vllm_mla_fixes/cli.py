"""vllm-mla-fixes: check and apply, in place, the fixes for known MLA failures of vLLM.

The fixes apply themselves: vLLM loads this package as a plugin in every process
it starts, and each fix changes vLLM only where the installed release needs it.
These commands show what applies, check an environment or a running server,
and build or review vLLM wheels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TextIO

import vllm_mla_fixes
from vllm_mla_fixes import arguments, atomic, settings
from vllm_mla_fixes.commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CommandError,
    Commands,
    add_command,
    exit_codes,
    logs_to_stderr,
)
from vllm_mla_fixes.fixes import ALL_FIXES, SETTINGS

USAGE_EXIT = "2  bad arguments (one line on stderr says which)"


class UsageError(Exception):
    """A command line argparse refuses: ``prog`` is the (sub)command it belongs to."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors end in :func:`main` as one line instead of usage text."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, f"{message} (see {self.prog} --help)")


def _one_line(message: str) -> str:
    """One line, safe for a terminal (an echoed value may hold control characters)."""
    return settings.terminal_line(" ".join(message.split()))


def _fail(prog: str, message: str, exit_status: int, as_json: bool) -> int:
    """One line on stderr; in a JSON mode also the error as the JSON document on stdout."""
    message = _one_line(message)
    print(f"{prog}: error: {message}", file=sys.stderr)
    if as_json:
        try:
            print(json.dumps({"error": message, "exit_status": exit_status}, indent=2))
            sys.stdout.flush()
        except StdoutFailed:  # the line on stderr is all there is
            pass
    return exit_status


class StdoutFailed(Exception):
    """stdout cannot take the output (a full disk, a closed pipe)."""


class _GuardedStdout:
    """sys.stdout, whose failures say they are stdout's (an OSError alone
    could be a wheel's full disk).  After one, what is still buffered goes to
    /dev/null, so the interpreter's exit does not fail again with a traceback."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _failed(self, exc: OSError) -> StdoutFailed:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        return StdoutFailed(f"the output could not be written to stdout ({exc.strerror or exc})")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._failed(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._failed(exc) from exc

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


# -- status ---------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    asked = [o for o in args.json_only if getattr(args, o.lstrip("-").replace("-", "_"))]
    if asked and not args.json:  # before the work, not ignored after it
        raise CommandError(f"{asked[0]} adds to the JSON document: give --json too", EXIT_USAGE)
    if vllm_mla_fixes.installed_vllm_version() is None:
        raise CommandError(
            "vLLM is not installed in this environment, so no fix can apply; install "
            "vllm-mla-fixes into the environment that runs vllm serve"
        )
    with logs_to_stderr():
        import vllm.plugins  # vLLM's own loader: honours VLLM_PLUGINS as vllm serve does

        vllm.plugins.load_general_plugins()
        statuses = vllm_mla_fixes.status()
    readings = settings.readings(SETTINGS)
    exit_status = EXIT_USAGE if any(r.setting and not r.valid for r in readings) else EXIT_OK
    rows = [
        {
            "name": entry.name,
            "state": entry.state.value,
            "reason": entry.reason,
            "upstream": list(module.INFO.upstream),
            "affected": list(module.INFO.covered_releases),
            "fixed_in": module.INFO.fixed_in or "open",
        }
        for module, entry in zip(ALL_FIXES, statuses)
    ]
    if args.json:
        document: dict[str, object] = {
            "vllm": vllm_mla_fixes.installed_vllm_version(),
            "vllm_mla_fixes": vllm_mla_fixes.__version__,
            "fixes": rows,
            "settings": [r.as_json() for r in readings],
            "kernel_disagreements": _kernel_disagreements(),
            "exit_status": exit_status,
        }
        for module in ALL_FIXES:
            document.update(module.status_json(args))
        print(json.dumps(document, indent=2))
        return exit_status
    print(f"vLLM {vllm_mla_fixes.installed_vllm_version()}, {PROG} {vllm_mla_fixes.__version__}")
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(settings.terminal_line(f"  {r['name']:<{width}}  {r['state']}: {r['reason']}"))
    if not readings:
        print(f"settings: none set (every {settings.PREFIX}* variable at its default)")
    else:
        print("settings:")
    for reading in readings:
        mark = "ok  " if reading.valid else "WARN" if reading.setting else "note"
        print(f"  [{mark}] {reading.describe()}")
    for disagreement in _kernel_disagreements():
        print(f"  [note] vLLM and a kernel disagree: {disagreement}")
    return exit_status


def _kernel_disagreements() -> list[str]:
    """Where vLLM's statement about a kernel and the kernel's own declaration
    in the installed build differ, each fix's in turn."""
    return [line for module in ALL_FIXES for line in module.kernel_disagreements()]


# -- verify, doctor -----------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import verify

    for module in ALL_FIXES:
        module.prepare_verify()
    return verify.run()


def cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import doctor

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    try:
        with logs_to_stderr():
            env, serve, findings = doctor.diagnose(serve_args)
    except doctor.DoctorInputError as exc:
        raise CommandError(str(exc), doctor.EXIT_STATUS[doctor.WILL_FAIL]) from exc
    return doctor.report(env, serve, findings, as_json=args.json)


# -- smoke, build-wheel, review ---------------------------------------------------------


def cmd_smoke(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import smoke

    result = smoke.run(
        args.url,
        model=args.model,
        max_tokens=args.max_tokens,
        api_key=args.api_key,
        timeout=args.timeout,
        deadline=args.deadline,
    )
    print(json.dumps(result.as_json(), indent=2) if args.json else result.text())
    return EXIT_OK if result.ok else EXIT_FAILED


def cmd_build_wheel(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import wheel

    problem = arguments.output_folder_problem(args.out)
    if problem is not None:
        raise CommandError(f"--out {args.out}: {problem}", EXIT_USAGE)
    try:
        wheel.added_file_time()  # SOURCE_DATE_EPOCH, read before the build
    except wheel.WheelBuildError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from exc
    if args.vllm_wheel is not None:
        source = Path(args.vllm_wheel)
        if not source.is_file():
            raise CommandError(f"--vllm-wheel {args.vllm_wheel}: no such file", EXIT_USAGE)
        try:
            wheel.upstream_version(source)
        except wheel.WheelBuildError as exc:
            raise CommandError(f"--vllm-wheel: {exc}", EXIT_USAGE) from exc
    return wheel.run(args.vllm_wheel, args.vllm, args.out, args.build_number, args.index_url)


def cmd_review(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import review

    return review.run(args.vllm, args.vllm_wheel, args.against, args.index_url)


# -- the parser -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # Its commands' parsers are _Parser too (add_subparsers makes them of the
    # parser's class); they are used as the ArgumentParsers they are.
    parser: argparse.ArgumentParser = _Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Run {PROG} COMMAND --help for what a command does, its options and exit status.",
    )
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {vllm_mla_fixes.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The order of these calls is the order of the commands in --help.
    status = _add_status_parser(sub)
    _add_verify_parser(sub)
    _add_doctor_parser(sub)
    commands = Commands(sub, status)
    status.set_defaults(json_only=commands.status_json_only)  # filled by the fixes below
    for module in ALL_FIXES:
        module.add_commands(commands)
    _add_smoke_parser(sub)
    _add_build_wheel_parser(sub)
    _add_review_parser(sub)
    return parser


def _add_status_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    status = add_command(
        sub,
        "status",
        cmd_status,
        "which fixes apply in this environment, and why",
        "Loads the plugins through vLLM's own loader, as vllm serve does (VLLM_PLUGINS\n"
        "applies), then prints each fix's state (applied, not-needed, disabled, skipped)\n"
        f"and reason, and every {settings.PREFIX}* variable that is set.\n\n"
        + settings.help_text(SETTINGS),
        exit_codes(
            "0  the report is printed",
            "1  vLLM is not installed in this environment",
            f"2  bad arguments, or a {settings.PREFIX}* variable has a value that is not",
            "   allowed (the report flags it WARN; the plugin ignores it)",
        ),
    )
    status.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout (logs go to stderr)"
    )
    return status


def _add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_command(
        sub,
        "verify",
        cmd_verify,
        "reproduce each failure of the installed vLLM on CPU, then show the fix removes it",
        "For each fix the installed release needs, runs vLLM's own code with the package's\n"
        "tiny model configs: first unfixed (the failure must appear), then fixed.",
        exit_codes(
            "0  every failure this release has was reproduced and fixed",
            "1  a reproduction or a fix did not behave as expected, or vLLM is not installed",
            USAGE_EXIT,
        ),
    )


def _add_doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from vllm_mla_fixes.doctor import HELP_EPILOG as DOCTOR_EPILOG

    doctor = add_command(
        sub,
        "doctor",
        cmd_doctor,
        "check this environment and, after --, a vllm serve line",
        "Reports the packages, the GPU and the plugin settings, and for the serve line\n"
        "given after -- which known failure it would hit here, whether a fix covers it,\n"
        "and what to do.",
        DOCTOR_EPILOG,
        usage=f"{PROG} doctor [--json] [-- <vllm serve args>]",
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON document (below)")
    doctor.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: the vllm serve line to check"
    )


def _add_smoke_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    smoke_cmd = add_command(
        sub,
        "smoke",
        cmd_smoke,
        "check a running OpenAI-compatible server answers in text",
        "/health must answer 200, the model must be listed by /v1/models, and a chat and a\n"
        "completion of each prompt, streamed and not, must come back as non-empty text\n"
        "without U+FFFD (what a misread KV cache decodes to).",
        exit_codes(
            "0  every check passed",
            "1  a check failed (the report says which request, and why)",
            USAGE_EXIT,
        ),
    )
    smoke_cmd.add_argument(
        "url", type=arguments.server_url, help="the server's base URL, e.g. http://localhost:8000"
    )
    smoke_cmd.add_argument("--model", help="the served model name (default: the first listed)")
    smoke_cmd.add_argument(
        "--max-tokens",
        type=arguments.WholeNumber(1, 1_000_000),
        default=32,
        help="tokens per answer, 1 to 1000000 (default: 32)",
    )
    smoke_cmd.add_argument(
        "--api-key",
        type=arguments.api_key,
        default=settings.environment_variable("VLLM_API_KEY"),
        help="bearer token (default: $VLLM_API_KEY; never printed)",
    )
    smoke_cmd.add_argument(
        "--timeout",
        type=arguments.Seconds(),
        default=120.0,
        help=f"seconds each request may take, at most {arguments.MAX_SECONDS} (default: 120)",
    )
    smoke_cmd.add_argument(
        "--deadline",
        type=arguments.Seconds(),
        default=300.0,
        help=f"seconds the whole check may take, at most {arguments.MAX_SECONDS}; requests past "
        "it are not run (default: 300)",
    )
    smoke_cmd.add_argument(
        "--json", action="store_true", help="print only the JSON report on stdout"
    )


def _add_build_wheel_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    build = add_command(
        sub,
        "build-wheel",
        cmd_build_wheel,
        "write a vLLM wheel that carries these fixes",
        "Copies an upstream vLLM wheel byte for byte, adds this package with its plugin\n"
        "entry point, and names the result vllm-<version>+mlafixes.<plugin version>.\n"
        "The wheel is written under a temporary name and checked (zip, RECORD, version)\n"
        "before it takes its final name: a failed or interrupted build (Ctrl-C, SIGTERM,\n"
        "SIGHUP from a closed terminal) leaves the output folder as it was.",
        exit_codes(
            "0  the wheel is written (its path and sha256 are printed)",
            "1  the build failed: download, sha256, or wheel contents (one line says why)",
            "2  bad arguments (a version, URL, build number or path; checked before any download)",
            "129, 130, 143  interrupted by SIGHUP, Ctrl-C or SIGTERM; nothing was written",
        ),
    )
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--vllm-wheel", metavar="PATH", help="an upstream vLLM wheel file")
    source.add_argument(
        "--vllm",
        metavar="VERSION",
        type=arguments.release,
        help="download this vLLM release from the index (sha256 checked)",
    )
    build.add_argument("--out", default="dist", help="output folder (default: dist)")
    build.add_argument(
        "--build-number",
        type=arguments.WholeNumber(0, 999_999),
        default=None,
        metavar="N",
        help="append .buildN (N: 0 to 999999) to the version, for a rebuild of the same vLLM "
        "and plugin versions (default: none)",
    )
    build.add_argument(
        "--index-url",
        type=arguments.index_url,
        default="https://pypi.org/simple",
        help="PEP 691 package index to download from (default: https://pypi.org/simple)",
    )


def _add_review_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    review = add_command(
        sub,
        "review",
        cmd_review,
        "what a vLLM release's code means for each fix, read from its wheel",
        "For each fix: the release gate's decision, every reviewed definition's\n"
        "fingerprint in the release (match, changed with a diff, missing), and the fix's\n"
        "source screen on the release's code. The wheel is not installed.",
        exit_codes(
            "0  nothing to review",
            "1  something changed, or the release needs a review",
            "2  bad arguments, or the review cannot run (no such release, network)",
            "129, 130, 143  interrupted by SIGHUP, Ctrl-C or SIGTERM",
        ),
    )
    release = review.add_mutually_exclusive_group(required=True)
    release.add_argument(
        "--vllm",
        metavar="VERSION",
        type=arguments.release_or_latest,
        help="a release on the index, or 'latest'",
    )
    release.add_argument("--vllm-wheel", metavar="PATH", help="a vLLM wheel file (e.g. a nightly)")
    review.add_argument(
        "--against",
        metavar="VERSION",
        type=arguments.release,
        help="compare with the fingerprints reviewed in this release only",
    )
    review.add_argument(
        "--index-url",
        type=arguments.index_url,
        default="https://pypi.org/simple",
        help="PEP 691 package index (default: https://pypi.org/simple)",
    )


def _json_mode(argv: list[str]) -> bool:
    """Whether the command line asks for JSON (a --json after -- belongs to the serve line)."""
    before = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in before


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = _json_mode(argv)
    stdout = sys.stdout
    sys.stdout = _GuardedStdout(stdout)
    try:
        try:
            args = build_parser().parse_args(argv)
        except UsageError as exc:
            return _fail(exc.prog, str(exc), EXIT_USAGE, as_json)
        except StdoutFailed as exc:  # --help or --version
            return _fail(PROG, str(exc), EXIT_FAILED, False)
        prog = f"{PROG} {args.command}"
        try:
            return _run(args, prog, as_json)
        finally:
            _flush_or_say(prog)
    finally:
        sys.stdout = stdout


def _flush_or_say(prog: str) -> None:
    try:
        sys.stdout.flush()
    except StdoutFailed as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)


def _run(args: argparse.Namespace, prog: str, as_json: bool) -> int:
    """The command's exit status; every failure as one line (:func:`_fail`)."""
    try:
        # Every command unwinds on SIGINT, SIGTERM and SIGHUP alike: the files
        # it is writing (a cache entry, a wheel, a report) are removed, its
        # children ended (children.supervised passes the signal on to here).
        with atomic.interruptions_unwind():
            run_command: Callable[[argparse.Namespace], int] = args.func  # set by add_command
            return run_command(args)
    except CommandError as exc:
        return _fail(prog, str(exc), exc.exit_status, as_json)
    except StdoutFailed as exc:
        return _fail(prog, str(exc), EXIT_FAILED, False)
    except atomic.Interrupted as exc:
        return _fail(prog, f"{exc}; nothing was left half-written", exc.exit_status, as_json)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted by SIGINT", 130, as_json)
    except ModuleNotFoundError as exc:  # an optional package a command needs
        return _fail(
            prog,
            f"needs the Python package {exc.name!r}, which is not installed in this "
            f"environment ({sys.executable})",
            EXIT_FAILED,
            as_json,
        )
    except OSError as exc:  # a path the user gave, a full disk, no network
        return _fail(prog, str(exc), EXIT_FAILED, as_json)
    except Exception as exc:  # a bug of ours: still one line, never a traceback
        return _fail(
            prog,
            f"internal error of {PROG} {vllm_mla_fixes.__version__} (please report it): "
            f"{type(exc).__name__}: {exc}",
            EXIT_FAILED,
            as_json,
        )


if __name__ == "__main__":
    sys.exit(main())
