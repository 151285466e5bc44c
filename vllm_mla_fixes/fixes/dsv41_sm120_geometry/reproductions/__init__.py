"""The DeepSeek-V4.1 fix's reproductions on the installed vLLM, on CPU.

``failures`` reproduces the start-up and page failures and shows the fix
removes them (``verify``); ``capacity`` measures KV tokens per GiB of each
layout; ``truth_table`` derives every cell of the README's table.
"""

from __future__ import annotations

from collections.abc import Callable


def verify(report: Callable[[str], None]) -> bool:
    """The fix's CPU verifier (``vllm-mla-fixes verify``): the failures
    reproduced and fixed, then the fixed layout read back by the self-test.
    Both run, whatever the first says."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import selftest
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures

    failures_fixed = bool(failures.verify(report))
    layout_read_back = bool(selftest.verify(report))
    return failures_fixed and layout_read_back
