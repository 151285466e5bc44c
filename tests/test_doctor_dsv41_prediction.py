"""``doctor`` predicts DeepSeek-V4.1's SM12x geometry where no GPU is visible (issue 18, item 3).

The prediction parses the line with the installed release's ``vllm serve``
parser, builds a real ``VllmConfig`` from it and runs the fix's own
``geometry_decision`` and vLLM's planner (``reproductions/dsv41_prediction.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla_fixes import serve_line
from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor as fix_doctor
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream
from vllm_mla_fixes.reproductions import dsv41_prediction as prediction
from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro

pytestmark = pytest.mark.vllm_release("0.32.0", "0.33.0", "0.34.0")

ROOT = Path(__file__).resolve().parent.parent
# The original report (shared reports, 001) describes its line without quoting
# it: DeepSeek-V4.1-Flash, TP8, FLASHINFER_MLA_SPARSE_DSV41, fp8 KV and indexer,
# engram CPU offload, --language-model-only, --block-size 64 (its first error).
REPORT_LINE = [
    "vllm",
    "serve",
    "deepseek-ai/DeepSeek-V4.1-Flash",
    "--tensor-parallel-size",
    "8",
    "--attention-backend",
    "FLASHINFER_MLA_SPARSE_DSV41",
    "--kv-cache-dtype",
    "fp8",
    "--attention-config",
    '{"indexer_kv_dtype": "fp8"}',
    "--engram-config",
    '{"cpu_offload": true}',
    "--language-model-only",
    "--block-size",
    "64",
]
DSPARK = ["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}']


def _geometry_and_reason(vllm_config) -> tuple[str, str]:
    """The decision the fix takes for the engine ``vllm_config`` describes."""
    decision = fix.decide(vllm_config)
    return decision.geometry, decision.reason


def _decision_for(line: list[str]) -> tuple[str, str]:
    """The fix's geometry_decision on the engine config vLLM's parser builds
    from ``line``, once the model's layers have given their specs (where
    upstream's layout works, the 2% rule is planned on them)."""
    with serve_line.cuda_device_type_while_parsing():
        args = serve_line.engine_args(line)
    with repro.sm120_platform():
        block_size = args.block_size or upstream.picked_block_size(
            upstream.declared_kernel_blocks()
        )
    settings = prediction.engine_settings(args)
    with repro.applied((12, 0)), repro.sm120_platform():
        plan = repro.plan_geometry(block_size, settings=settings)
        return _geometry_and_reason(plan.vllm_config)


def test_kv_offloading_backend_alone_enables_nothing_in_vllm():
    """vLLM's VllmConfig turns offloading into a connector only with a size."""
    backend = {"kv_offloading_backend": "native"}
    alone = repro.make_vllm_config(128, settings=repro.EngineSettings(cache_options=backend))
    sized = repro.make_vllm_config(
        128, settings=repro.EngineSettings(cache_options={**backend, "kv_offloading_size": 4.0})
    )
    assert alone.kv_transfer_config is None
    assert sized.kv_transfer_config.kv_connector in (
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
    )
    # 0.32.0/0.33.0: the split; 0.34.0: upstream's --block-size 64 works, the fix steps aside
    plain = _decision_for(REPORT_LINE)[0]
    assert plain in (fix.SPLIT, fix.UPSTREAM)
    assert _decision_for([*REPORT_LINE, "--kv-offloading-backend", "native"])[0] == plain
    # vLLM's own CPU offloading moves whole packed blocks: the split stays;
    # a connector not reviewed with the split sends it to the fallback
    native = [*REPORT_LINE, "--kv-offloading-backend", "native", "--kv-offloading-size", "4"]
    assert _decision_for(native)[0] == plain
    nixl = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    geometry, reason = _decision_for([*REPORT_LINE, "--kv-transfer-config", nixl])
    if plain == fix.SPLIT:
        assert geometry == fix.PER_RATIO and "KV connector" in reason
    else:
        assert geometry == fix.UPSTREAM


def test_doctor_does_not_report_the_backend_alone_as_offloading():
    """Red before this change (vLLM 0.34.0, the tree at 63bf8e1): doctor built
    its own settings and said "gets the per-ratio geometry (KV offloading is
    configured ...)" for this line.  doctor's findings from the prediction
    (``diagnose`` runs the same prediction in a fresh interpreter)."""
    line = [*REPORT_LINE, "--kv-offloading-backend", "native"]
    messages = " | ".join(
        f.message for f in fix_doctor._prediction_findings(prediction.predict(line))
    )
    if _decision_for(line)[0] == fix.UPSTREAM:  # 0.34.0: --block-size 64 works upstream
        assert "upstream's --block-size 64 layout starts" in messages
    else:
        assert f"gets the {fix.SPLIT} geometry" in messages
    assert "KV offloading is configured" not in messages
    assert "--kv-offloading-backend native without --kv-offloading-size enables nothing" in (
        messages
    )
    plain = fix_doctor._prediction_findings(prediction.predict(REPORT_LINE))
    assert not any("--kv-offloading-backend" in f.message for f in plain)


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_report_line_gets_geometry_and_capacity_off_the_gpu_node(dspark):
    line = [*REPORT_LINE, *(DSPARK if dspark else [])]
    predicted = prediction.predict(line)
    geometry, reason = _decision_for(line)
    assert predicted["geometry"] == geometry
    assert predicted["reason"].startswith(reason)  # then what planning chose for a drafter
    if not dspark and geometry != fix.UPSTREAM:
        assert geometry == fix.SPLIT
    assert predicted["settings"]["speculative_method"] == ("dspark" if dspark else None)
    assert [c["max_model_len"] for c in predicted["capacity"]] == [8192, 131072]
    for figures in predicted["capacity"]:
        assert figures["tokens_per_gib"] > 0
        assert figures["upstream_128"] > 0 and figures["upstream_64"] > 0
        if predicted["geometry"] == fix.SPLIT:
            # upstream's figures are for the same model, DSpark's 3 drafter layers
            # included.  With them the split holds more than block 128 where the
            # drafter's sliding-window pages hold 128 rows (FlashInfer from
            # 0.7.2.post1), 0.993x/0.997x on 0.32.0 (a tenth KV-cache group);
            # more than block 64 either way.
            assert figures["tokens_per_gib"] > figures["upstream_64"]
            if not dspark or fix.flashinfer_takes_runtime_swa_pages():
                assert figures["tokens_per_gib"] > figures["upstream_128"]
    # TP8 of DeepSeek-V4.1-Flash's 64 heads: 8 heads per rank, window 128, top-k 512
    shapes = {(s["heads"], s["topk"], s["page"], s["extra_page"]) for s in predicted["shapes"]}
    window_page = fix.UPSTREAM_SWA_BLOCK if geometry == fix.UPSTREAM else 64
    expected = {(8, 128, window_page, None), (8, 512, 64, 64)}
    if dspark and geometry != fix.UPSTREAM and fix.flashinfer_takes_runtime_swa_pages():
        expected.add((8, 128, fix.DRAFTER_SWA_ROWS, None))  # the drafter's pages
    assert shapes == expected
    assert all(s["decode_kernel"] for s in predicted["shapes"])


def test_reported_shapes_are_named_with_their_reports():
    """16 heads with top-k 512 (TP4) and 64 heads with top-k 1152 (TP1)."""
    shapes = prediction.flashinfer_shapes(16, 128, 512) + prediction.flashinfer_shapes(
        64, 128, 1152
    )
    reported = {(s["heads"], s["topk"]): s["reported"] for s in shapes if s["reported"]}
    assert set(reported) == {(16, 512), (64, 1152)}
    assert "flashinfer#5135" in reported[(16, 512)] and "vllm#56837" in reported[(64, 1152)]
    # the locked FlashInfer of 0.32.0-0.34.0 (0.7.0.post1, 0.7.2.post1, 0.7.4) has both
    assert all(s["decode_kernel"] for s in shapes)


@pytest.mark.vllm_release("0.34.0")
def test_doctor_command_on_the_report_line_with_dspark_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "doctor", "--json", "--", *REPORT_LINE, *DSPARK],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["environment"]["capability"] is None  # no GPU visible
    messages = [f["message"] for f in report["findings"] if f["topic"] == fix.INFO.name]
    geometry, reason = _decision_for([*REPORT_LINE, *DSPARK])
    # 0.34.0 starts --block-size 64 and its pages are inside the envelopes, but
    # with DSpark's three drafter layers the split holds 1.066x its KV tokens
    # (one 128-row group): the 2% rule applies the fix, and doctor says so.
    assert geometry == fix.SPLIT and "(1.066x, at least the 1.02x" in reason, reason
    assert report["dsv41"]["upstream_works"] is True
    assert report["dsv41"]["decision"] == fix.SPLIT
    assert report["dsv41"]["vs_best_working_upstream"] == 1.066
    assert not any("No common block size" in m for m in messages)
    assert any("upstream --block-size 128" in m and "--block-size 64" in m for m in messages)
    (applies,) = [m for m in messages if m.startswith("upstream's --block-size 64 layout starts")]
    assert f"but the fix's {fix.SPLIT} geometry holds at least 1.02x" in applies
    assert "(1.066x, at least the 1.02x" in applies
    assert not any(
        f["level"] in ("warn", "error") for f in report["findings"] if f["topic"] == fix.INFO.name
    ), report["findings"]
    # doctor's quote of 0.34.0's --block-size 128 error is the text vLLM raises
    # (tests/test_dsv41_release_0_34.py asserts repro.SPLIT_ERROR on the real code)
    assert fix.SPLIT_ERROR_0_34.removeprefix("ValueError: ") in repro.SPLIT_ERROR
