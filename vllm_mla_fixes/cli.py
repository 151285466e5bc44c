"""``vllm-mla-fixes status | verify | doctor | selftest | smoke | build-wheel | review``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

import vllm_mla_fixes
from vllm_mla_fixes.fixes import ALL_FIXES, FIX_NAMES


def _check_selection() -> str | None:
    _, unknown = vllm_mla_fixes.selected_fixes()
    if unknown:
        return (
            f"error: {vllm_mla_fixes.ENV_VAR} names unknown fix(es): {', '.join(unknown)}. "
            f"Known fixes: {', '.join(FIX_NAMES)}; or use 'all' / 'none'."
        )
    return None


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """While vLLM and the plugins load, send everything they write to stderr,
    so stdout carries our output alone (``--json`` is exactly one document).

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


def cmd_status(args: argparse.Namespace) -> int:
    problem = _check_selection()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if vllm_mla_fixes.installed_vllm_version() is None:
        print(
            "error: vLLM is not installed in this environment, so no fix can apply. "
            "Install vllm-mla-fixes into the environment that runs `vllm serve`.",
            file=sys.stderr,
        )
        return 1
    with logs_to_stderr():
        import vllm.plugins  # vLLM's own loader: honours VLLM_PLUGINS as `vllm serve` would

        vllm.plugins.load_general_plugins()
        statuses = vllm_mla_fixes.status()
    rows = [
        {
            "name": entry.name,
            "state": entry.state.value,
            "reason": entry.reason,
            "upstream": list(module.INFO.upstream),
            "affected": list(module.INFO.affected_releases),
            "fixed_in": module.INFO.fixed_in or "open",
        }
        for module, entry in zip(ALL_FIXES, statuses)
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "vllm": vllm_mla_fixes.installed_vllm_version(),
                    "vllm_mla_fixes": vllm_mla_fixes.__version__,
                    "fixes": rows,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"vLLM {vllm_mla_fixes.installed_vllm_version()}, vllm-mla-fixes {vllm_mla_fixes.__version__}"
    )
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"  {r['name']:<{width}}  {r['state']}: {r['reason']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import verify

    _cpu_triton_for_selftest()
    return verify.run()


def _cpu_triton_for_selftest() -> None:
    """Without a GPU, the DeepSeek-V4.1 self-test runs vLLM's Triton kernels in
    Triton's interpreter, which must be chosen before vLLM is imported."""
    try:
        import torch
    except ModuleNotFoundError:
        return  # the command itself says what is missing
    if not torch.cuda.is_available():
        from vllm_mla_fixes.selftest.env import prepare_process_env

        prepare_process_env()


def cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import doctor

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    try:
        with logs_to_stderr():
            env, serve, findings = doctor.diagnose(serve_args)
    except doctor.DoctorInputError as exc:
        return doctor.input_error(str(exc), as_json=args.json)
    return doctor.report(env, serve, findings, as_json=args.json)


def cmd_selftest(args: argparse.Namespace) -> int:
    from vllm_mla_fixes.selftest.verdicts import EXIT_CANNOT_RUN

    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        print(
            "selftest: cannot run: PyTorch is not installed in this environment "
            f"({sys.executable}); run it where vLLM is installed",
            file=sys.stderr,
        )
        return EXIT_CANNOT_RUN
    _cpu_triton_for_selftest()
    if vllm_mla_fixes.installed_vllm_version() is None:
        print(
            f"selftest: cannot run: vLLM is not installed in this environment ({sys.executable})",
            file=sys.stderr,
        )
        return EXIT_CANNOT_RUN
    from vllm_mla_fixes.selftest import run_selftest

    with logs_to_stderr():
        report = run_selftest(
            tuple(args.geometry or ()) or None, jobs=args.jobs, timing=not args.no_timing
        )
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(report.text())
    return report.exit_status


def cmd_smoke(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import smoke

    result = smoke.run(
        args.url,
        model=args.model,
        max_tokens=args.max_tokens,
        api_key=args.api_key,
        timeout=args.timeout,
    )
    print(json.dumps(result.as_json(), indent=2) if args.json else result.text())
    return 0 if result.ok else 1


def cmd_build_wheel(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import wheel

    return wheel.run(args.vllm_wheel, args.vllm, args.out, args.build_number, args.index_url)


def cmd_review(args: argparse.Namespace) -> int:
    from vllm_mla_fixes import review

    return review.run(args.vllm, args.vllm_wheel, args.against, args.index_url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-mla-fixes", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="which fixes apply in this environment")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    verify = sub.add_parser(
        "verify", help="reproduce each failure of the installed vLLM on CPU, then fix it"
    )
    verify.set_defaults(func=cmd_verify)
    from vllm_mla_fixes.doctor import HELP_EPILOG as DOCTOR_EPILOG

    doctor = sub.add_parser(
        "doctor",
        help="check this environment and, after --, a `vllm serve` line",
        usage="vllm-mla-fixes doctor [--json] [-- <vllm serve args>]",
        epilog=DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON document (below)")
    doctor.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: the vllm serve line to check"
    )
    doctor.set_defaults(func=cmd_doctor)
    selftest = sub.add_parser(
        "selftest",
        help="DeepSeek-V4.1 on SM12x: run the writers and readers vLLM uses on this "
        "device over the fixed KV layout, against a dense reference; exit 1 on a mismatch, "
        "2 when it cannot run",
    )
    selftest.add_argument("--json", action="store_true", help="print only the JSON report")
    selftest.add_argument(
        "--geometry",
        action="append",
        choices=("split", "fallback", "upstream", "control"),
        help="run only this geometry (repeatable; default: all four)",
    )
    selftest.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="geometries run in parallel processes (CPU only; default: cores)",
    )
    selftest.add_argument(
        "--no-timing", action="store_true", help="skip timing the per-step slot translation"
    )
    selftest.set_defaults(func=cmd_selftest)
    smoke_cmd = sub.add_parser(
        "smoke",
        help="check a running server: /health, /v1/models, then chats and completions "
        "(streamed and not) must be non-empty text without U+FFFD; exit 1 otherwise",
    )
    smoke_cmd.add_argument("url", help="the server's base URL, e.g. http://localhost:8000")
    smoke_cmd.add_argument("--model", help="the served model name (default: the first listed)")
    smoke_cmd.add_argument("--max-tokens", type=int, default=32)
    smoke_cmd.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="bearer token (default: $VLLM_API_KEY)",
    )
    smoke_cmd.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    smoke_cmd.add_argument("--json", action="store_true", help="print only the JSON report")
    smoke_cmd.set_defaults(func=cmd_smoke)
    build = sub.add_parser("build-wheel", help="write a vLLM wheel that carries these fixes")
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--vllm-wheel", metavar="PATH", help="an upstream vLLM wheel file")
    source.add_argument(
        "--vllm", metavar="VERSION", help="download this vLLM release (sha256 checked)"
    )
    build.add_argument("--out", default="dist", help="output directory (default: dist)")
    build.add_argument(
        "--build-number",
        type=int,
        default=None,
        help="append .buildN to the version (+mlafixes.<plugin version>.buildN), for a "
        "rebuild of the same vLLM and plugin versions (default: none)",
    )
    build.add_argument(
        "--index-url",
        default="https://pypi.org/simple",
        help="PEP 691 package index to download from",
    )
    build.set_defaults(func=cmd_build_wheel)
    review = sub.add_parser(
        "review",
        help="what a vLLM release's code means for each fix, read "
        "from its wheel (not installed); exit 1 when something needs review",
    )
    release = review.add_mutually_exclusive_group(required=True)
    release.add_argument("--vllm", metavar="VERSION", help="a release on the index, or 'latest'")
    release.add_argument("--vllm-wheel", metavar="PATH", help="a vLLM wheel file (e.g. a nightly)")
    review.add_argument(
        "--against",
        metavar="VERSION",
        help="compare with the fingerprints reviewed in this release only",
    )
    review.add_argument(
        "--index-url", default="https://pypi.org/simple", help="PEP 691 package index"
    )
    review.set_defaults(func=cmd_review)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as exc:  # an optional package a command needs
        print(
            f"vllm-mla-fixes {args.command}: needs the Python package {exc.name!r}, which is not "
            f"installed in this environment ({sys.executable})",
            file=sys.stderr,
        )
    except OSError as exc:  # a path the user gave, a full disk, no network
        print(f"vllm-mla-fixes {args.command}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
