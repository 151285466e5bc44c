"""doctor reads the line vLLM reads (issue 43): every spelling of the same
settings that ``vllm serve``'s own parser accepts gives doctor the same
ServeLine (the same verdict: ``test_doctor_consistency.py``'s spelling cases).

Spellings: dashes or underscores, abbreviations vLLM's parser takes, short
forms (``-tp``, ``-ac``), ``--flag=value``, ``--group.key value``, the
settings moved into a ``--config`` YAML file (the model too), the program
as a path to ``vllm``, the options in any order.  All in this process:
vLLM's parser and ``doctor.serve_of``, as ``doctor`` calls them."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import pytest
from doctor_runs import serve_of
from fix_releases import newest_covered, newest_of_earliest_fix
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# the fp8 fix's newest session and the newest covered one (the two parsers the issue tried)
pytestmark = pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())

MODEL = str(
    Path(__file__).resolve().parent.parent / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
)
EXAMPLES = 30

# setting -> (long flag, short flag or None, values); a dict value is a config option.
OPTIONS: dict[str, tuple[str, str | None, list[object]]] = {
    "kv_cache_dtype": ("--kv-cache-dtype", None, ["fp8", "auto"]),
    "block_size": ("--block-size", None, [64, 128]),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp", [2, 8]),
    "moe_backend": ("--moe-backend", None, ["triton", "marlin"]),
    "enforce_eager": ("--enforce-eager", None, [True]),
    "enable_prefix_caching": ("--enable-prefix-caching", None, [True, False]),
    "attention_config": ("--attention-config", "-ac", [{"indexer_kv_dtype": "mxfp4"}]),
    "kernel_config": ("--kernel-config", None, [{"enable_cutedsl_warmup": False}]),
}
PROGRAMS: tuple[list[str], ...] = (
    ["vllm", "serve"],
    ["/usr/local/bin/vllm", "serve"],
    ["serve"],
    [],
)


def _flag_and_value(name: str, value: object) -> tuple[str, str | None]:
    """The canonical flag of ``name=value``, and its value (None for a switch)."""
    flag = OPTIONS[name][0]
    if value is True and name in ("enforce_eager", "enable_prefix_caching"):
        return flag, None
    if value is False and name == "enable_prefix_caching":
        return "--no-enable-prefix-caching", None
    return flag, json.dumps(value) if isinstance(value, dict) else str(value)


def canonical(chosen: dict[str, object]) -> list[str]:
    line = ["vllm", "serve", MODEL]
    for name in OPTIONS:
        if name in chosen:
            flag, value = _flag_and_value(name, chosen[name])
            line += [flag] if value is None else [flag, value]
    return line


@pytest.fixture(scope="module")
def long_flags() -> list[str]:
    from vllm_mla_fixes import serve_line

    with serve_line.cuda_device_type_while_parsing():
        parser = serve_line.serve_parser()
    subparsers = next(
        a
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction) and a.dest == "subparser"
    )
    serve = subparsers.choices["serve"]
    return [s for s in serve._option_string_actions if s.startswith("--")]


def _shortest_prefix(flag: str, flags: list[str]) -> int:
    """The length of the shortest abbreviation of ``flag`` argparse takes:
    no other option starts with it."""
    others = [f for f in flags if f != flag]
    unique = (n for n in range(3, len(flag)) if not any(o.startswith(flag[:n]) for o in others))
    return next(unique, len(flag))


@st.composite
def spelled(draw, chosen: dict[str, object], flags: list[str], folder: Path):
    """One spelling of ``canonical(chosen)``: its argv, with a YAML file where it uses one."""
    yaml_lines, chunks = [], []
    for name, value in chosen.items():
        flag, text = _flag_and_value(name, value)
        form = draw(
            st.sampled_from(["yaml", "canonical", "underscore", "abbrev", "short", "dotted"])
        )
        if form == "yaml":
            key = draw(st.sampled_from([flag[2:], flag[2:].replace("-", "_")]))
            yaml_lines.append(f"{key}: {json.dumps(value) if text is not None else 'true'}")
            continue
        if form == "dotted" and isinstance(value, dict):
            ((key, item),) = value.items()
            dotted = f"{flag}.{key}"
            item_text = json.dumps(item) if not isinstance(item, str) else item
            chunks.append(draw(st.sampled_from([[dotted, item_text], [f"{dotted}={item_text}"]])))
            continue
        short = OPTIONS[name][1]
        if form == "short" and short and flag == OPTIONS[name][0]:
            spelling = short
        elif form == "underscore":
            spelling = "--" + flag[2:].replace("-", "_")
        elif form == "abbrev":
            shortest = _shortest_prefix(flag, flags)
            spelling = flag[: draw(st.integers(shortest, len(flag)))]
        else:
            spelling = flag
        if text is None:
            chunks.append([spelling])
        elif spelling.startswith("--") and draw(st.booleans()):
            chunks.append([f"{spelling}={text}"])
        else:
            chunks.append([spelling, text])
    chunks = draw(st.permutations(chunks))
    model = draw(st.sampled_from(["positional", "--model", "--model=", "yaml"]))
    if model == "yaml":
        yaml_lines.append(f"model: {MODEL}")
    elif model == "--model":
        chunks.insert(draw(st.integers(0, len(chunks))), ["--model", MODEL])
    elif model == "--model=":
        chunks.append([f"--model={MODEL}"])
    if yaml_lines:
        path = folder / f"line{next(COUNTER)}.yaml"
        path.write_text("\n".join(yaml_lines) + "\n")
        chunks.insert(draw(st.integers(0, len(chunks))), ["--config", str(path)])
    head = [MODEL] if model == "positional" else []
    program = draw(st.sampled_from(PROGRAMS))
    return [*program, *head, *itertools.chain.from_iterable(chunks)]


COUNTER = itertools.count()
SETTINGS = st.fixed_dictionaries(
    {}, optional={name: st.sampled_from(values) for name, (_, _, values) in OPTIONS.items()}
)


@functools.cache
def _canonical_fields(chosen: str) -> dict:
    return _fields(canonical(json.loads(chosen)))


def _fields(line: list[str]) -> dict:
    fields = serve_of(line).reported()
    del fields["raw"]  # the line as given, the one field that is its spelling
    return fields


def test_every_spelling_vllm_accepts_gives_the_same_serve_line(
    long_flags, tmp_path_factory, record_property
):
    folder = tmp_path_factory.mktemp("yaml")
    seen: list[list[str]] = []
    started = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data(), chosen=SETTINGS)
    def check(data, chosen):
        line = data.draw(spelled(chosen, long_flags, folder))
        seen.append(line)
        assert _fields(line) == _canonical_fields(json.dumps(chosen)), line

    check()
    record_property("generated_examples", len(seen))
    print(f"{len(seen)} spellings in {time.monotonic() - started:.1f} s")


def test_the_issue_spellings_read_as_the_canonical_ones(tmp_path):
    """Each line the issue found read otherwise than vLLM reads it."""
    moe, ac = tmp_path / "moe.yaml", tmp_path / "ac.yaml"
    moe.write_text("moe-backend: triton\n")
    ac.write_text("attention-config: {indexer_kv_dtype: mxfp4}\n")
    mxfp4 = '{"indexer_kv_dtype":"mxfp4"}'
    cases = {
        ("--attention-config", mxfp4): [
            ["-ac", mxfp4],
            ["--attention-config.indexer_kv_dtype", "mxfp4"],
            ["--attention_config", mxfp4],
            ["--config", str(ac)],
        ],
        ("--moe-backend", "triton"): [
            ["--moe_backend", "triton"],
            ["--moe-back", "triton"],
            ["--config", str(moe)],
        ],
        ("--kv-cache-dtype", "fp8"): [["--kv_cache_dtype", "fp8"]],
    }
    for flags, spellings in cases.items():
        expected = _fields(["vllm", "serve", MODEL, *flags])
        for spelling in spellings:
            assert _fields(["vllm", "serve", MODEL, *spelling]) == expected, spelling
    model_in_yaml = tmp_path / "model.yaml"
    model_in_yaml.write_text(f"model: {MODEL}\n")
    assert _fields(["/usr/local/bin/vllm", "serve", "--config", str(model_in_yaml)]) == _fields(
        ["vllm", "serve", MODEL]
    )
