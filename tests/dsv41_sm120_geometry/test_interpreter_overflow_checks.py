"""The CPU self-test skips the overflow checks Triton's interpreter computes and drops (issue 34).

Triton's interpreter computes an overflow check for every integer add,
subtract and multiply (``sanitize_overflow``), then asserts nothing unless
``debug`` is on, as a GPU build compiles no assert without debug.
``selftest.env.prepare_process_env`` turns the check off where ``debug`` is
off: about a fifth of a CPU self-test's time.  On each release's Triton: the
check asserts only with ``debug``; without it, a kernel that overflows gives
the same results with the check and without; with ``debug`` nothing is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch
from fix_releases import covered

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import skip_discarded_overflow_checks

pytestmark = pytest.mark.vllm_release(*covered(DSV41))

triton = pytest.importorskip("triton")
if TYPE_CHECKING:  # what mypy reads the kernel's tl.constexpr annotation by
    import triton.language as tl
else:
    tl = triton.language
interpreter = pytest.importorskip("triton.runtime.interpreter")

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


@triton.jit
def _sum_and_product_int32(x_ptr, y_ptr, sum_ptr, product_ptr, n: tl.constexpr):
    offsets = tl.arange(0, n)
    x = tl.load(x_ptr + offsets)
    y = tl.load(y_ptr + offsets)
    tl.store(sum_ptr + offsets, x + y)
    tl.store(product_ptr + offsets, x * y)


def _run() -> tuple[list[int], list[int]]:
    """Sums and products of int32 pairs, two of which overflow."""
    x = torch.tensor([INT32_MAX, 5, INT32_MIN, 7], dtype=torch.int32)
    y = torch.tensor([1, 6, -1, 8], dtype=torch.int32)
    sums, products = torch.empty_like(x), torch.empty_like(x)
    _sum_and_product_int32[(1,)](x, y, sums, products, n=4)
    return sums.tolist(), products.tolist()


@contextlib.contextmanager
def _options(**changes: bool) -> Iterator[Any]:  # Triton's interpreter builder
    builder = interpreter.interpreter_builder
    saved = builder.options
    builder.options = dataclasses.replace(saved, **changes)
    try:
        yield builder
    finally:
        builder.options = saved


def test_the_kernel_runs_in_the_interpreter_and_the_tests_skip_the_checks():
    assert type(_sum_and_product_int32).__name__ == "InterpretedFunction"
    assert interpreter.interpreter_builder.options.sanitize_overflow is False  # conftest's call


def test_with_debug_the_check_asserts():
    with _options(debug=True, sanitize_overflow=True), pytest.raises(BaseException) as raised:
        _run()
    assert "int32 overflow detected" in str(raised.value) + str(raised.value.__cause__)


def test_without_debug_results_are_the_same_with_and_without_the_check():
    with _options(debug=False, sanitize_overflow=True):
        checked = _run()
    with _options(debug=False, sanitize_overflow=True) as builder:
        assert skip_discarded_overflow_checks()
        assert builder.options.sanitize_overflow is False
        unchecked = _run()
    assert checked == unchecked == ([INT32_MIN, 11, INT32_MAX, 15], [INT32_MAX, 30, INT32_MIN, 56])


def test_with_debug_nothing_is_skipped():
    with _options(debug=True, sanitize_overflow=True) as builder:
        assert not skip_discarded_overflow_checks()
        assert builder.options.sanitize_overflow is True
