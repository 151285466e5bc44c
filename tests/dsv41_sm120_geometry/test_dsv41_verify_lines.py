"""``vllm-mla-fixes verify`` tells the installed release's story (issue 44, defect 5).

On 0.34.0 verify's header once said "--block-size 64 fails 'No common block
size', 128 hands FlashInfer 32-token SWA pages" (0.32/0.33's story) above rows
that showed 64 working; its ``--block-size 128, fixed`` row repeated the
geometry note on 0.32.0 and carried the 64 line's step-aside note on 0.34.0;
and the FA4 reproduction cut a message mid-word ("CUDA driver version is i)").

Here the DSV41 verifier runs on each covered release (seconds, once vLLM's
model code is imported) and every line is held to the rows it recorded.
"""

from __future__ import annotations

import re
from pathlib import Path

import fix_releases
import pytest

from vllm_mla_fixes.fixes import dsv41_sm120_geometry
from vllm_mla_fixes.reproductions import fa4_compile_strides

DSV41 = fix_releases.covered(dsv41_sm120_geometry.INFO)


@pytest.mark.vllm_release(*DSV41)
def test_verify_says_what_upstream_did_on_this_release_and_each_rows_own_decision():
    import vllm

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures

    lines: list[str] = []
    assert failures.verify(lines.append) is True, "\n".join(lines)
    story = next(line for line in lines if line.startswith("upstream on vLLM "))
    assert story.startswith(f"upstream on vLLM {vllm.__version__}: "), story
    for block_size in (64, 128):
        row = next(line for line in lines if line.startswith(f"--block-size {block_size}, upst"))
        failed = ": ValueError: " in row
        kernels = lines[lines.index(row) + 1] if not failed else ""
        works = kernels == "  kernels: every page inside the installed kernels' own envelopes"
        claims = {
            "fails at start-up": failed,
            "works": works,
            "starts, but a kernel rejects its pages": not failed and " rejects " in kernels,
        }
        for outcome, happened in claims.items():
            assert (f"--block-size {block_size} {outcome}" in story) == happened, (story, row)
    # the fix's header names no release's failure: the rows above do
    assert "No common block size" not in dsv41_sm120_geometry.INFO.summary
    for line in lines:
        fixed = re.match(r"--block-size (\d+), fixed \(([a-z-]+)\)", line)
        if not fixed:
            continue
        note = lines[lines.index(line) + 1]
        # one note, of this row's own decision
        assert re.findall(r"geometry ([a-z-]+) \(", note) == [fixed[2]], (line, note)


def test_a_long_error_is_cut_at_a_word_not_inside_one():
    error = (
        "RuntimeError: cudaErrorInsufficientDriver (35) at launch: CUDA driver version is "
        "insufficient for CUDA runtime version"
    )
    fixed = {"phase": "fixed", "outcome": "reached-launch", "error": error}
    result = {
        "compiles": [],
        "calls": [{**fixed, "total_q": q} for q in (130, 300)],
        "fix": "applied",
    }
    lines: list[str] = []
    fa4_compile_strides.summarize(result, lines.append)
    fixed_lines = [line for line in lines if line.startswith("fixed ")]
    assert len(fixed_lines) == 2
    for line in fixed_lines:
        shown = line.split("for want of a GPU: ", 1)[1]
        assert shown.endswith(" ...)"), line
        shown = shown.removesuffix(" ...)")
        assert error.startswith(shown) and error[len(shown)] == " ", line


MEASUREMENTS = Path(__file__).resolve().parents[2] / "docs" / "measurements.md"


@pytest.mark.vllm_release(*DSV41)
def test_measurements_md_says_what_upstreams_layout_does_here():
    """docs/measurements.md once said upstream's --block-size 64 layout fails 6
    of 10 self-test cases on 0.34.0, on 32-state ratio-2 indexer pages that
    DeepGEMM rejects; the self-test and the truth table say every page is
    inside the envelopes.  The self-test's upstream row is the block size vLLM
    picks; its verdict there must be what the installed kernels' own
    declarations say of that layout, fresh."""
    import vllm

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures

    release = str(vllm.__version__)
    with failures.sm120_platform():
        size = upstream.picked_block_size(upstream.declared_kernel_blocks())
        works = upstream.upstream_layout(size).works
    rows = [
        line
        for line in MEASUREMENTS.read_text().splitlines()
        if line.strip().startswith(f"| upstream, `--block-size` {size} (") and release in line
    ]
    assert len(rows) == 1, rows
    verdict = rows[0].split("|")[2].strip()
    assert verdict == ("no failure here" if works else "bug reproduced"), rows[0]
    if works:
        assert rows[0].rstrip(" |").endswith("0 of 10"), rows[0]
