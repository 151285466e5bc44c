"""Issue 43, item 6: doctor's KV tokens per GiB for each geometry are the
capacity benchmark's on the same line.

doctor plans the line's layouts from descriptions of the model's caches
(``decision.fix_specs``, the figure the 2% rule also compares); the benchmark
builds the model's real layers with the fix applied and asks vLLM's own spec
collection, planner and start-up token figure.  Both must print one number.

The figures are vLLM's pool capacity, not bytes of data: every block id of
the shared pool costs the widest group's block, whichever group holds it.
Both geometries store the same bytes per token, so which one holds more
depends on the model's layout.  On DeepSeek-V4.1-Flash the split holds more
(the docs' 0.88x at 8k); on the six-layer test model, whose six
sliding-window layers each get their own group, the split's 138,240-B block
(sized by the four ratio-1/ratio-2 caches sharing it) carries one 37,440-B
sliding-window page, and the per-ratio's 46,080-B block wastes far less.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from doctor_runs import predict_line
from fix_releases import covered

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor as fix_doctor
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

pytestmark = [
    pytest.mark.vllm_release(*covered(DSV41)),
    pytest.mark.usefixtures("kernels_as_locked"),
]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
BLOCK_SIZE = 128  # the line; every covered release's split and per-ratio plan it
MODELS = {
    "tiny_deepseek_v41": (
        json.loads((TINY / "config.json").read_text())["text_config"],
        4096,
    ),
    "DeepSeek-V4.1-Flash": (dict(repro.DSV41_FLASH), capacity.MAX_MODEL_LENS[0]),
}


def _doctor_figure(model: dict, max_model_len: int, geometry: str | None) -> tuple[str, int]:
    """The geometry doctor names for the line and the KV tokens per GiB it
    prints for it, read from its capacity finding."""
    line = ["vllm", "serve", str(TINY), "--block-size", str(BLOCK_SIZE)]
    line += ["--max-model-len", str(max_model_len)]
    with capacity.forced_geometry(geometry):
        predicted = predict_line(line, {"text_config": model})
        messages = [f.message for f in fix_doctor.prediction_findings(predicted)]
    decided = predicted.decision.geometry.value
    figure = next(m for m in messages if m.startswith("KV tokens per GiB per rank at "))
    found = re.search(rf"the fix's {decided} layout ([\d,]+)", figure)
    assert found, figure
    return decided, int(found.group(1).replace(",", ""))


def _benchmark_figure(model: dict, max_model_len: int, geometry: str | None) -> tuple[str, int]:
    with repro.sm120_platform(), capacity.forced_geometry(geometry):
        (row,) = capacity.measure("line", BLOCK_SIZE, (max_model_len,), model=model)
    return row.geometry, row.tokens


@pytest.mark.parametrize("name", list(MODELS))
def test_doctor_prints_the_capacity_benchmarks_tokens_per_gib_for_each_geometry(name):
    model, max_model_len = MODELS[name]
    figures = {}
    for geometry in (None, fix.PER_RATIO):
        printed = _doctor_figure(model, max_model_len, geometry)
        measured = _benchmark_figure(model, max_model_len, geometry)
        assert printed == measured, (name, geometry)
        figures[printed[0]] = printed[1]
    assert set(figures) == {fix.SPLIT, fix.PER_RATIO}
    # which geometry holds more is the layout's (see the module's docstring)
    if name == "DeepSeek-V4.1-Flash":
        assert figures[fix.PER_RATIO] < figures[fix.SPLIT]
    else:
        assert figures[fix.PER_RATIO] > figures[fix.SPLIT]
