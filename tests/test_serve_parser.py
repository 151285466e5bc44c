"""doctor parses a line with the parser ``vllm serve`` builds, without importing
vLLM's CLI module (issue 36: that module also imports the API server).

On every release: ``serve_line`` finds ``make_arg_parser`` where the installed
``vllm/entrypoints/cli/serve.py`` imports it from, and the parser it builds has
the same options, defaults and actions as the one ``ServeSubcommand`` builds,
and parses lines to the same namespace.
"""

from __future__ import annotations

import argparse

import pytest

from vllm_mla_fixes import serve_line


def _serve_options(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    return {
        action.dest: (
            type(action).__name__,
            repr(action.option_strings),
            repr(action.nargs),
            repr(action.default),
            repr(action.const),
            repr(action.choices),
            getattr(action.type, "__qualname__", repr(action.type)),
        )
        for action in serve._actions
    }


@pytest.fixture(scope="module")
def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with serve_line.cuda_device_type_while_parsing():
        fast = serve_line.serve_parser()
        vllms = FlexibleArgumentParser(prog="vllm")
        ServeSubcommand().subparser_init(vllms.add_subparsers(dest="subparser"))
    return fast, vllms


def test_make_arg_parser_is_found_in_the_installed_cli_module():
    assert serve_line.serve_options_module() in {
        "vllm.entrypoints.openai.cli_args",
        "vllm.entrypoints.launchers.cli_args",
        "vllm.entrypoints.common.cli_args",
    }


def test_the_parser_has_vllm_serves_options(parsers):
    fast, vllms = parsers
    assert _serve_options(fast) == _serve_options(vllms)


@pytest.mark.parametrize(
    "line",
    [
        ["serve", "some/model", "--port", "8001", "--block-size", "64"],
        ["serve", "--model", "m", "--host", "0.0.0.0", "--kv-cache-dtype", "fp8", "-tp", "2"],
        ["serve", "m", "--no-enable-prefix-caching", "--max-model-len", "4096"],
    ],
)
def test_lines_parse_to_the_namespace_vllm_serve_builds(parsers, line):
    fast, vllms = parsers
    with serve_line.cuda_device_type_while_parsing():
        assert vars(fast.parse_args(line)) == vars(vllms.parse_args(line))


def test_an_unknown_option_is_refused_in_vllm_serves_words(parsers):
    with serve_line.cuda_device_type_while_parsing():
        with pytest.raises(serve_line.Rejected, match="unrecognized arguments: --no-such-flag"):
            serve_line.parse(["vllm", "serve", "m", "--no-such-flag"])


def test_where_the_cli_module_is_built_otherwise_its_own_subcommand_builds_the_parser(
    parsers, monkeypatch
):
    monkeypatch.setattr(serve_line, "serve_options_module", lambda: None)
    with serve_line.cuda_device_type_while_parsing():
        fallback = serve_line.serve_parser()
    assert _serve_options(fallback) == _serve_options(parsers[1])
