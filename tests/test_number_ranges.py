"""Every numeric option has a range, checked by the parser (issue 43).

Before, ``smoke --deadline 99999999999`` lost its watchdog to an
``OverflowError`` and ran with no deadline, ``--timeout 99999999999`` failed
as if the server had, and ``selftest --geometry-timeout 2592000`` stopped
with an internal error after a minute of work.  Each numeric option's type
is now :class:`arguments.WholeNumber` or :class:`arguments.Seconds`; a value
outside its range is exit status 2 with one line naming the option and the
range, before any work.  The property runs the real command line
(``cli.main``) in this process: a refusal comes from the parser, so nothing
else runs.
"""

from __future__ import annotations

import argparse
import math

import pytest
from fix_releases import newest_covered, newest_of_earliest_fix
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_mla_fixes import arguments, cli

pytestmark = pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())

# What a command needs besides the option for its line to parse.
REQUIRED = {"smoke": ["http://127.0.0.1:9"], "build-wheel": ["--vllm-wheel", "vllm.whl"]}
BOUNDED = (arguments.WholeNumber, arguments.Seconds)


def _numeric_options() -> dict[tuple[str, str], object]:
    """(command, option) -> its type, for every option that takes a number."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        (command, action.option_strings[-1]): action.type
        for command, subparser in sub.choices.items()
        for action in subparser._actions
        if action.option_strings
        and (isinstance(action.type, BOUNDED) or action.type in (int, float))
    }


NUMERIC = _numeric_options()


def test_every_numeric_option_has_a_range():
    assert {option for _, option in NUMERIC} >= {
        "--max-tokens",
        "--timeout",
        "--deadline",
        "--build-number",
        "--jobs",
        "--geometry-timeout",
    }
    unbounded = {key: kind for key, kind in NUMERIC.items() if kind in (int, float)}
    assert not unbounded, "a numeric option without a range"


def _outside(kind: object) -> st.SearchStrategy[str]:
    """Texts of values outside ``kind``'s range."""
    if isinstance(kind, arguments.WholeNumber):
        numbers = st.integers(max_value=kind.low - 1) | st.integers(min_value=kind.high + 1)
        return numbers.map(str) | st.just("9" * 5000)  # more digits than int() reads
    assert isinstance(kind, arguments.Seconds)
    too_long = st.floats(min_value=kind.high, exclude_min=True, allow_infinity=True)
    not_positive = st.floats(max_value=0.0)
    return (too_long | not_positive | st.just(math.nan)).map(repr) | st.sampled_from(
        ["1e400", "-0", "99999999999", "2592000"]
    )


@st.composite
def _bad_lines(draw: st.DrawFn) -> tuple[str, str, str]:
    command, option = draw(st.sampled_from(sorted(NUMERIC)))
    return command, option, draw(_outside(NUMERIC[command, option]))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_bad_lines())
@example(("smoke", "--deadline", "99999999999"))
@example(("smoke", "--timeout", "99999999999"))
@example(("selftest", "--geometry-timeout", "2592000"))
def test_a_number_outside_its_range_is_refused_by_the_parser(capsys, line):
    command, option, value = line
    status = cli.main([command, *REQUIRED.get(command, []), f"{option}={value}"])
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.out == "" and "Traceback" not in captured.err
    (error,) = captured.err.splitlines()
    assert error.startswith(f"vllm-mla-fixes {command}: error: argument {option}: "), error
    assert "(allowed: " in error, error


@pytest.mark.parametrize(
    ("kind", "edges"),
    [
        (arguments.WholeNumber(1, 256), ("1", "256")),
        (arguments.Seconds(), ("1e-9", str(arguments.MAX_SECONDS))),
    ],
)
def test_the_ends_of_a_range_are_allowed(kind, edges):
    for text in edges:
        assert kind(text) == float(text)
