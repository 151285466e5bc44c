"""DeepSeek-V4.1 on SM12x: the truth table, derived by the installed release's own code.

Every cell runs vLLM's real start-up, planner and capacity figure on CPU with
the platform answering as SM120/SM121, and holds upstream's bound pages against
the installed kernels' own envelopes.  These tests check that the fix's cheap
run-time prediction of upstream's layout (``upstream.py``) agrees with that
start-up in every cell, that the fix steps aside exactly where upstream's layout
works and where its own layout would gain under 2%, the per-release facts of
issue 25, and that the README and docs tables are this code's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fix_releases import covered, newest

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope, upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import truth_table as table

pytestmark = [
    pytest.mark.vllm_release(*covered(DSV41)),
    pytest.mark.usefixtures("kernels_as_locked"),
]
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"


@pytest.fixture(scope="module")
def cells() -> list[table.Cell]:
    return table.truth_table()


def test_runtime_prediction_agrees_with_vllms_start_up(cells):
    """The fix decides from ``upstream.for_config`` at start-up, without
    planning; in every cell it must say what vLLM's real start-up and the
    envelopes say."""
    for c in cells:
        capability = (int(c.device[2:4]), int(c.device[4:]))
        with repro.sm120_platform(capability):
            declared = upstream.declared_kernel_blocks()
            predicted = upstream.upstream_layout(c.picked_block_size, declared=declared)
            if c.block_size is None:
                assert upstream.picked_block_size(declared) == c.picked_block_size, c
        assert predicted.starts == c.upstream_starts, (c, predicted)
        if c.upstream_starts:
            assert set(predicted.rejected) == set(c.upstream_rejected), (c, predicted)
            assert predicted.works == c.upstream_works


def test_the_fix_applies_wherever_upstream_fails(cells):
    for c in cells:
        if not c.upstream_works:
            assert c.decision != fix.UPSTREAM, c


def test_where_upstream_works_the_fix_applies_exactly_where_it_gains_two_percent(cells):
    """The 2% rule, judged against the fix's own layouts forced on the same
    line: where upstream's layout works, the fix steps aside (and holds
    upstream's figures) where its default geometry gains under GAIN_TO_APPLY
    at a max-model-len, and applies (holding the forced layout's figures)
    where it gains at least that -- with DSpark's three drafter layers, which
    share one 128-row group under the split (1.066x / 1.034x on 0.34.0).  The
    per-ratio fallback never gains that much."""
    working = [c for c in cells if c.upstream_works and c.device == "SM120"]
    applied = []
    for c in working:
        settings = table._settings(c.speculation)
        for geometry in (fix.SPLIT, fix.PER_RATIO):
            with repro.sm120_platform(), capacity.forced_geometry(geometry):
                rows = capacity.measure(
                    "forced", c.picked_block_size, table.MAX_MODEL_LENS, settings
                )
            assert rows[0].geometry == geometry
            for row in rows:
                gain = row.tokens / c.upstream_tokens[row.max_model_len]
                if geometry == fix.PER_RATIO:
                    assert gain < table.GAIN_TO_APPLY, (c, row)
                elif gain >= table.GAIN_TO_APPLY:
                    assert c.fix_tokens[row.max_model_len] == row.tokens, (c, row)
                    applied.append((c.speculation, c.block_size, row.max_model_len))
                else:
                    assert c.fix_tokens[row.max_model_len] == c.upstream_tokens[row.max_model_len]
        if any(a[:2] == (c.speculation, c.block_size) for a in applied):
            assert c.decision == fix.SPLIT and "at least the 1.02x" in c.reason, c
        else:
            assert c.decision == fix.UPSTREAM and "under the 1.02x" in c.reason, c
    if cells[0].vllm == "0.34.0":
        assert {(s, b) for s, b, _ in applied} == {("dspark", 64), ("dspark", None)}, applied


def test_no_default_cell_holds_less_than_the_best_working_upstream(cells):
    for c in cells:
        if c.vs_best_working_upstream is not None:
            assert min(c.vs_best_working_upstream.values()) >= 1.0, c


def test_issue_25_release_facts(cells):
    release = cells[0].vllm
    by_size = {c.block_size: c for c in cells if c.device == "SM120" and c.speculation == "none"}
    if release == "0.34.0":
        assert by_size[64].upstream_works is True
        assert by_size[None].picked_block_size == 64 and by_size[None].upstream_works is True
        assert by_size[128].upstream_starts is False
        assert "cannot be split into" in by_size[128].start_error
    else:
        assert by_size[None].picked_block_size == 128
        for c in cells:
            assert c.upstream_works is False, c
            assert c.start_error or c.upstream_rejected, c
            for rejection in c.upstream_rejected:
                assert rejection.kernel in {e.title for e in envelope.kernel_envelopes().values()}


def test_sm121_cells_are_sm120s(cells):
    """Both are compute capability 12.x: vLLM's family check and the kernels
    treat them alike, so every fact but the device name agrees."""
    key = lambda c: (c.block_size, c.speculation)  # noqa: E731
    sm120 = {key(c): c.as_dict() for c in cells if c.device == "SM120"}
    for c in cells:
        if c.device == "SM121":
            facts = {**c.as_dict(), "device": "SM120"}
            assert facts == sm120[key(c)]


def _section(path: Path, release: str) -> list[str]:
    text = path.read_text()
    begin = f"<!-- truth-table {release} begin -->"
    end = f"<!-- truth-table {release} end -->"
    assert begin in text and end in text, f"{path.name} has no truth-table section for {release}"
    return text.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()


def test_the_readme_and_docs_tables_are_this_codes_output(cells):
    release = cells[0].vllm
    assert _section(ROOT / "README.md", release) == table.summary_markdown(cells).splitlines()
    assert (
        _section(ROOT / "docs" / "dsv41-truth-table.md", release)
        == table.markdown(cells).splitlines()
    )


def _doctor_json(*serve: str, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "doctor", "--json", "--", "vllm", "serve", *serve],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **env},
    )
    return json.loads(done.stdout)


# What doctor must say of the tiny model's --block-size 64 line on SM120, by
# release, stated literally (vLLM's own start-up gives the same: the tests
# above and test_dsv41_release_0_34.py).
REFUSED_64 = repro.BLOCK_SIZE_ERROR  # vLLM's own words, captured from its block size selection
LINE_64 = {
    "0.32.0": (False, REFUSED_64, "interleaved-split"),
    "0.33.0": (False, REFUSED_64, "interleaved-split"),
    "0.34.0": (True, None, "upstream"),
}


def test_doctor_json_carries_the_line_decision(request):
    """--block-size 64: works upstream on 0.34.0 (the fix steps aside: the
    tiny model's split would gain under 2%), does not start on 0.32.0/0.33.0."""
    report = _doctor_json(
        str(MODEL), "--kv-cache-dtype", "fp8", "--block-size", "64", "--max-model-len", "4096"
    )  # the tiny model's own max_position_embeddings (vLLM refuses more)
    facts = report["dsv41"]
    expected = LINE_64[request.config.vllm_release]
    assert (facts["upstream_works"], facts["upstream_start_error"], facts["decision"]) == expected
    assert facts["upstream_rejected"] == []
    assert facts["at_max_model_len"] == 4096 and facts["fix_tokens_per_gib"] > 0
    if expected[0]:
        assert facts["vs_upstream"] is not None and facts["vs_upstream"] < 1.02


@pytest.mark.vllm_release(newest(DSV41))
def test_status_says_why_no_table_is_kept_where_there_is_no_cache_folder(monkeypatch, tmp_path):
    """A relative HOME (issue 43) used to make status call a covered release
    not covered."""
    monkeypatch.chdir(tmp_path)  # what resolves the relative HOME (FlashInfer logs there)
    monkeypatch.delenv("VLLM_MLA_FIXES_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "relative-home")
    source = table.for_status(compute=False)["source"]
    assert isinstance(source, str), source
    assert source.startswith("no cache to keep it in: no absolute cache folder"), source
