"""What the installed vLLM's own parser and config classes make of a ``vllm serve`` line.

``doctor`` checks the operator's line here before it judges it: ``vllm serve``'s
parser (the ``serve`` subparser as ``ServeSubcommand`` builds it, on vLLM's
``FlexibleArgumentParser``), then each of
vLLM's config classes that can be built without the model's files, from the
options the line sets, then its engine arguments.  What they reject is
reported in their own words: the line that ``vllm serve`` prints before it
exits, the config class's validation message with the flag it came from, or
what the engine arguments raise.

Only this module imports vLLM's argument parsers: they cost seconds, so
nothing here runs at import time.  ``doctor`` parses the line once
(:func:`parse`); what reads further builds on that namespace
(:func:`engine_args`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# vLLM's config classes that can be built from the line's options alone (no
# model files, no device); ModelConfig, SchedulerConfig, SpeculativeConfig and
# VllmConfig need the model's config and are built only at start-up.
MODEL_FREE_CONFIGS = (
    "CacheConfig",
    "ParallelConfig",
    "KernelConfig",
    "AttentionConfig",
    "LoadConfig",
    "CompilationConfig",
    "ObservabilityConfig",
    "StructuredOutputsConfig",
    "LoRAConfig",
)


class Rejected(Exception):
    """vLLM rejects the line; the message is vLLM's own."""


@contextlib.contextmanager
def cuda_device_type_while_parsing() -> Iterator[str]:
    """Where no GPU is visible, vLLM's platform is unspecified and its parser
    cannot build its default device config ("Failed to infer device type").
    The line is meant for a CUDA node: the platform reports device type
    ``cuda`` while the line is parsed, and nothing else about it changes."""
    import vllm.platforms as platforms

    current = platforms.current_platform
    if not current.is_unspecified():
        yield f"platform {type(current).__name__}"
        return
    current.device_type = "cuda"  # instance attribute over the class's ""
    try:
        yield f"no GPU visible: {type(current).__name__} reported device type cuda while parsing"
    finally:
        del current.device_type


def line_arguments(argv: list[str]) -> list[str]:
    """A serve line's arguments, without its leading program and ``serve``.
    The program is ``vllm``, or a path to it (``/usr/local/bin/vllm serve``):
    a path whose last part is ``vllm`` counts as the program only where
    ``serve`` follows, so a model folder named ``vllm`` stays the model."""
    argv = list(argv)
    if argv[:1] == ["vllm"] or (argv[1:2] == ["serve"] and os.path.basename(argv[0]) == "vllm"):
        argv = argv[1:]
    return argv[1:] if argv[:1] == ["serve"] else argv


def as_serve_argv(argv: list[str]) -> list[str]:
    """``[vllm] [serve] ARGS`` as ``serve ARGS``, the form vLLM's top-level parser takes."""
    return ["serve", *line_arguments(argv)]


# ``ServeSubcommand.subparser_init`` in every covered release: the ``serve``
# subparser with its usage line, then ``make_arg_parser`` adds every option.
# The calls it may make for the fast path to build the same parser.
SERVE_SUBPARSER_CALLS = frozenset({"add_parser", "make_arg_parser", "format"})
SERVE_USAGE = "vllm serve [model_tag] [options]"


def serve_options_module() -> str | None:
    """The module ``vllm serve`` takes ``make_arg_parser`` from (it moved
    between releases), read from the installed ``vllm/entrypoints/cli/serve.py``;
    None where that file does not build its subparser as the covered releases
    do, so the caller imports the CLI module itself."""
    import ast

    import vllm

    source = Path(vllm.__file__).parent / "entrypoints" / "cli" / "serve.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    modules = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and any(alias.name == "make_arg_parser" and alias.asname is None for alias in node.names)
    ]
    inits = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "subparser_init"
    ]
    if len(modules) != 1 or len(inits) != 1:
        return None
    called = {
        call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        for call in ast.walk(inits[0])
        if isinstance(call, ast.Call)
    }
    return modules[0] if called <= SERVE_SUBPARSER_CALLS else None


def serve_parser() -> argparse.ArgumentParser:
    """``vllm``'s top-level parser with the ``serve`` subparser, as
    ``ServeSubcommand.subparser_init`` builds it.  The CLI module
    ``vllm.entrypoints.cli.serve`` also imports the API server, its launchers
    and the engine's process managers, seconds that parsing does not need, so
    ``make_arg_parser`` is imported from where that module takes it."""
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    options_module = serve_options_module()
    if options_module is None:
        from vllm.entrypoints.cli.serve import ServeSubcommand

        ServeSubcommand().subparser_init(subparsers)
        return parser
    make_arg_parser = importlib.import_module(options_module).make_arg_parser
    make_arg_parser(subparsers.add_parser("serve", usage=SERVE_USAGE))
    return parser


def _said(stderr: str) -> str:
    """The error ``vllm serve`` prints before exiting, without argparse's usage
    line and pydantic's documentation link."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if "error:" in line), None)
    if start is None:
        return lines[-1] if lines else ""
    return "; ".join(
        line for line in lines[start:] if not line.startswith("For further information")
    )


def parse(argv: list[str]) -> argparse.Namespace:
    """The namespace ``vllm serve`` builds from ``argv``; :class:`Rejected`
    with its message where its parser stops.  ``vllm serve MODEL`` means
    ``--model MODEL``, as in ``ServeSubcommand.cmd``."""
    parser = serve_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(as_serve_argv(argv))
    except SystemExit as exc:  # argparse's parser.error(): usage and message on stderr
        message = _said(said.getvalue()) or f"vllm serve exits with status {exc.code}"
        raise Rejected(message) from None
    except Exception as exc:  # e.g. an unreadable --config file, a YAML error in it
        raise Rejected(f"{type(exc).__name__}: {exc}") from exc
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return args


def model_given(argv: list[str], args: argparse.Namespace) -> bool:
    """Whether the line names a model (``vllm serve`` otherwise serves vLLM's
    default): as its first argument, with ``--model``, or in its ``--config``
    YAML (``model: ...``, which the parser reads as ``--model``)."""
    return (
        bool(getattr(args, "model_tag", None))
        or any(arg == "--model" or arg.startswith("--model=") for arg in argv)
        or getattr(args, "model", None) != default_model()
    )


@functools.cache
def bare_line() -> dict[str, Any]:
    """What ``vllm serve`` with no arguments gets."""
    return vars(serve_parser().parse_args(["serve"]))


def default_model() -> str | None:
    """The model ``vllm serve`` serves when the line names none."""
    return bare_line().get("model")


def options_set(args: argparse.Namespace) -> dict[str, Any]:
    """The options whose value differs from what ``vllm serve`` alone gets."""
    baseline = bare_line()
    missing = object()
    return {
        name: value
        for name, value in vars(args).items()
        if name not in ("model", "model_tag") and baseline.get(name, missing) != value
    }


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _validation_message(exc: Exception, class_name: str, given: dict[str, Any]) -> str:
    """A pydantic ValidationError as 'FLAG VALUE: message' per error, else str(exc)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return f"{class_name}: {type(exc).__name__}: {exc}"
    parts = []
    for error in errors():
        field = str(error["loc"][0]) if error.get("loc") else None
        if field in given:
            parts.append(f"{_flag(field)} {given[field]}: {error['msg']} ({class_name})")
        else:
            parts.append(f"{class_name}: {error['msg']}")
    return "; ".join(parts)


def check_configs(args: argparse.Namespace) -> list[str]:
    """Build each model-free config class of vLLM from the options the line
    sets; :class:`Rejected` with the class's own message when one refuses.
    Returns the names of the classes built."""
    import vllm.config

    options = options_set(args)
    built = []
    for class_name in MODEL_FREE_CONFIGS:
        config_class = getattr(vllm.config, class_name, None)
        if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
            continue
        fields = {f.name for f in dataclasses.fields(config_class) if f.init}
        given = {name: value for name, value in options.items() if name in fields}
        if not given:
            continue
        try:
            config_class(**given)
        except Exception as exc:  # pydantic's ValidationError is a ValueError
            raise Rejected(_validation_message(exc, class_name, given)) from exc
        built.append(class_name)
    return built


def check_engine_args(args: argparse.Namespace) -> None:
    """``AsyncEngineArgs.from_cli_args``, as ``vllm serve`` calls it next:
    :class:`Rejected` with what it raises (e.g. with HF_HUB_OFFLINE=1, a
    model missing from the hub cache)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        AsyncEngineArgs.from_cli_args(args)
    except Exception as exc:  # vllm serve stops on whatever it raises
        raise Rejected(f"{type(exc).__name__}: {exc}") from exc


def names_local_model(model: str | None) -> bool:
    """Whether vLLM reads the model from this machine's files: a path that
    exists, or one no hub repository id can be (vLLM then says it is missing)."""
    if not model:
        return False
    return model.startswith(("/", ".", "~")) or os.path.exists(model)


def check_engine_config(args: argparse.Namespace) -> None:
    """``create_engine_config()``, as ``vllm serve`` calls it before the
    engine starts: the model's config read by the release's own reader
    (transformers' AutoConfig through vLLM's), its heads against the
    tensor-parallel size, the speculative method.  :class:`Rejected` with
    what it raises.  Only for a model on this machine: a hub model would be
    fetched.  The environment is restored after it (vLLM sets variables)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    saved = dict(os.environ)
    try:
        AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:  # vllm serve stops on whatever it raises
        raise Rejected(_raised(exc)) from exc
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _raised(exc: Exception) -> str:
    """What vLLM raised, in its words: a pydantic ValidationError as its
    class and each error's message (without pydantic's input dump and link)."""
    errors = getattr(exc, "errors", None)
    title = getattr(exc, "title", None)
    if not (callable(errors) and title):
        return f"{type(exc).__name__}: {exc}"
    said = []
    for error in errors():
        where = ".".join(str(part) for part in error.get("loc", ()))
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        said.append(f"{title}: {where + ': ' if where else ''}{message}")
    return "; ".join(said)


def engine_args(args: argparse.Namespace) -> Any:  # an AsyncEngineArgs
    """``AsyncEngineArgs`` from the namespace ``vllm serve``'s parser built
    (:func:`parse`), as ``vllm serve`` builds them next; from a copy, since
    vLLM's config classes change the objects they are given."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(copy.deepcopy(args))
