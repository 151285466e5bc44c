"""``doctor`` predicts DeepSeek-V4.1's SM12x geometry where no GPU is visible
(issue 18, item 3; issue 37: the engine's own decision, on the operator's config).

The prediction parses the line with the installed release's ``vllm serve``
parser, builds a real ``VllmConfig`` from it and the model's config.json, and
runs the fix's own ``decide`` -- the function every engine process calls
(``fixes/dsv41_sm120_geometry/prediction.py``), in doctor's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from doctor_runs import predict_line
from fix_releases import covered

from vllm_mla_fixes import serve_line
from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import doctor as fix_doctor
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import engine, prediction, upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.doctor import SPLIT_ERROR_0_34
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import engine_report

pytestmark = [
    pytest.mark.vllm_release(*covered(DSV41)),
    pytest.mark.usefixtures("kernels_as_locked"),
]

ROOT = Path(__file__).resolve().parents[2]
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


def _engine(line: list[str], model: dict | None = None, max_model_len: int = 8192):
    """An engine started for ``line`` as a worker builds it on SM120: vLLM's
    parser, then the model's layers (``model``'s topology, DSpark's drafter
    layers where the line drafts with it), vLLM's spec collection and
    planner, with the fix applied.  Returns its config and the decision the
    engine's process recorded."""
    with serve_line.cuda_device_type_while_parsing():
        args = serve_line.engine_args(serve_line.parse(line))
    with repro.sm120_platform():
        block_size = args.block_size or upstream.picked_block_size(
            upstream.declared_kernel_blocks()
        )
    settings = prediction.engine_settings(args)
    model = model or repro.DSV41_FLASH
    drafters: tuple[int, ...] = ()
    if (args.speculative_config or {}).get("method") == "dspark":
        drafters = (0,) * int(model.get("n_mtp_layers") or 3)
    with repro.applied((12, 0)), repro.sm120_platform():
        plan = repro.plan_geometry(
            block_size,
            model=model,
            settings=settings,
            drafter_ratios=drafters,
            max_model_len=max_model_len,
        )
        config = plan.vllm_config
        return engine.engine_config(config), STATE.decision_for(config)


def _decision_for(line: list[str]) -> tuple[str, str]:
    decision = _engine(line)[1]
    return decision.geometry, decision.reason


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
    """Red before issue 18's change (vLLM 0.34.0, the tree at 63bf8e1): doctor
    built its own settings and said "gets the per-ratio geometry (KV offloading
    is configured ...)" for this line."""
    line = [*REPORT_LINE, "--kv-offloading-backend", "native"]
    messages = " | ".join(f.message for f in fix_doctor.prediction_findings(predict_line(line)))
    if _decision_for(line)[0] == fix.UPSTREAM:  # 0.34.0: --block-size 64 works upstream
        assert "upstream's --block-size 64 layout starts" in messages
    else:
        assert f"gets the {fix.SPLIT} geometry" in messages
    assert "KV offloading is configured" not in messages
    assert "--kv-offloading-backend native without --kv-offloading-size enables nothing" in (
        messages
    )
    plain = fix_doctor.prediction_findings(predict_line(REPORT_LINE))
    assert not any("--kv-offloading-backend" in f.message for f in plain)


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_report_line_gets_the_engines_decision_off_the_gpu_node(dspark):
    line = [*REPORT_LINE, "--max-model-len", "8192", *(DSPARK if dspark else [])]
    predicted = predict_line(line)
    engine_config, decision = _engine(line)
    assert predicted.decision == decision
    assert predicted.engine_report() == engine_report(engine_config, decision)
    assert predicted.settings.speculative_method == ("dspark" if dspark else None)
    assert predicted.decision.fix_tokens and predicted.decision.max_model_len == 8192
    # TP8 of DeepSeek-V4.1-Flash's 64 heads: 8 heads per rank, window 128, top-k 512
    shapes = {(s.heads, s.topk, s.page, s.extra_page) for s in predicted.shapes}
    window_page = fix.UPSTREAM_SWA_BLOCK if decision.geometry == fix.UPSTREAM else 64
    expected = {(8, 128, window_page, None), (8, 512, 64, 64)}
    if decision.applies and decision.drafter_swa_rows != 64:
        expected.add((8, 128, decision.drafter_swa_rows, None))  # the drafter's pages
    assert shapes == expected
    assert all(s.decode_kernel for s in predicted.shapes)


def test_reported_shapes_are_named_with_their_reports():
    """16 heads with top-k 512 (TP4) and 64 heads with top-k 1152 (TP1)."""
    line = [*REPORT_LINE, "--max-model-len", "8192"]
    decision = predict_line(line).decision
    shapes = (
        prediction.flashinfer_shapes(16, 128, 512, decision)[0]
        + prediction.flashinfer_shapes(64, 128, 1152, decision)[0]
    )
    reported = {(s.heads, s.topk): s.reported for s in shapes if s.reported}
    assert set(reported) == {(16, 512), (64, 1152)}
    assert "flashinfer#5135" in reported[(16, 512)] and "vllm#56837" in reported[(64, 1152)]
    # the locked FlashInfer of 0.32.0-0.34.0 (0.7.0.post1, 0.7.2.post1, 0.7.4) has both
    assert all(s.decode_kernel for s in shapes)


# Two small checkpoints of the family besides DeepSeek-V4.1-Flash: other layer
# counts, heads, top-k, sources and windows (their config.json text config).
CHECKPOINTS: dict[str, dict[str, Any]] = {  # name -> its config.json's text config
    "12-layers": {
        "num_hidden_layers": 12,
        "compress_ratios": [0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1],
        "kv_source_layer_ids": [1, 6],
        "index_source_layer_ids": [1, 6],
        "sliding_window": 128,
        "head_dim": 512,
        "index_head_dim": 128,
        "num_attention_heads": 32,
        "index_topk": 256,
        "max_position_embeddings": 32768,
    },
    "24-layers-one-drafter": {
        "num_hidden_layers": 24,
        "compress_ratios": [0, 0] + [2] * 10 + [1] * 12 + [0],
        "kv_source_layer_ids": [2, 7, 12, 18],
        "index_source_layer_ids": [2, 7, 12, 18],
        "sliding_window": 256,
        "head_dim": 512,
        "index_head_dim": 128,
        "num_attention_heads": 16,
        "index_topk": 1024,
        "n_mtp_layers": 1,
        "max_position_embeddings": 65536,
    },
}


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.parametrize("block_size", ["64", "128"])
@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_doctor_decides_what_the_engine_decides_on_other_checkpoints(name, block_size, dspark):
    """doctor --json's ``dsv41`` object for the operator's config.json is the
    object ``status --json`` shows in the engine's process on that config:
    same decision, page rows and capacity."""
    model = CHECKPOINTS[name]
    line = [
        "vllm",
        "serve",
        "/models/checkpoint",
        "--block-size",
        block_size,
        "--max-model-len",
        str(model["max_position_embeddings"]),
        *(DSPARK if dspark else []),
    ]
    predicted = predict_line(line, {"text_config": model})
    engine_config, decision = _engine(line, model, model["max_position_embeddings"])
    assert predicted.model_figures == "from config.json"
    assert predicted.decision == decision
    assert predicted.engine_report() == engine_report(engine_config, decision)
    assert (
        decision.fix_tokens is not None
        and decision.max_model_len == model["max_position_embeddings"]
    )
    if dspark:
        layers = model.get("n_mtp_layers", 3)
        assert predicted.engine.model is not None
        assert predicted.engine.model.drafter_layers == layers


@pytest.mark.vllm_release("0.34.0")
def test_doctor_json_dsv41_object_is_the_engines_status_json_object(monkeypatch, swap_fix):
    """``doctor --json``'s ``dsv41`` for a line and config.json equals the
    ``dsv41`` object ``status --json`` prints in the engine's process on
    that config (here: the engine's layers built in this process, then the
    status command's own JSON)."""
    import contextlib
    import io

    import vllm.plugins

    import vllm_mla_fixes
    from vllm_mla_fixes import cli

    model = CHECKPOINTS["12-layers"]
    line = [
        "vllm",
        "serve",
        "/models/checkpoint",
        "--block-size",
        "128",
        "--max-model-len",
        "32768",
    ]
    # doctor's object adds its comparison with upstream's best working layout
    doctor_object = predict_line(line, {"text_config": model}).engine_report()
    vllm_mla_fixes.revert_all()
    swap_fix(fix.for_capability((12, 0)))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        with repro.sm120_platform():
            vllm.plugins.load_general_plugins()
            with serve_line.cuda_device_type_while_parsing():
                args = serve_line.engine_args(serve_line.parse(line))
            repro.plan_geometry(
                128, model=model, settings=prediction.engine_settings(args), max_model_len=32768
            )
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                cli.main(["status", "--json"])
        status_objects = json.loads(printed.getvalue())["dsv41"]
    finally:
        vllm_mla_fixes.revert_all()
    assert status_objects == [{**doctor_object, "spec_mismatches": []}]


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
    assert report["dsv41"]["vs_upstream"] == 1.066
    assert not any("No common block size" in m for m in messages)
    assert any("the fix's interleaved-split layout 67,209" in m for m in messages)
    (applies,) = [m for m in messages if m.startswith("upstream's --block-size 64 layout starts")]
    assert f"but the fix's {fix.SPLIT} geometry holds at least 1.02x" in applies
    assert "(1.066x, at least the 1.02x" in applies
    # the one warning is vllm#56771's: DSpark on SM12x with long prompts
    (warning,) = [
        f
        for f in report["findings"]
        if f["topic"] == fix.INFO.name and f["level"] in ("warn", "error")
    ]
    assert warning["level"] == "warn" and "vllm#56771" in warning["message"], warning
    assert report["verdict"] == "READY WITH WARNINGS"
    # doctor's quote of 0.34.0's --block-size 128 error is the text vLLM raises
    # (tests/dsv41_sm120_geometry/test_dsv41_release_0_34.py asserts repro.SPLIT_ERROR on the real code)
    assert SPLIT_ERROR_0_34.removeprefix("ValueError: ") in repro.SPLIT_ERROR


@pytest.mark.vllm_release("0.34.0")
def test_doctor_stopped_by_sigterm_leaves_no_process_of_its_group():
    """Issue 35, item 4: doctor decides in its own process (no prediction
    child); stopped by SIGTERM midway, as systemd or Kubernetes stop it,
    nothing of its process group is left after 5 s."""
    import signal
    import time

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    model = ROOT / "vllm_mla_fixes" / "models" / "tiny_deepseek_v41"
    doctor = subprocess.Popen(
        [sys.executable, "-m", "vllm_mla_fixes", "doctor", "--json", "--"]
        + ["vllm", "serve", str(model), "--block-size", "128"],
        env=env,
        start_new_session=True,  # its own group, as a service manager starts it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(8)  # midway: vLLM imported, the line being judged
        os.kill(doctor.pid, signal.SIGTERM)
        doctor.wait(timeout=5)
        time.sleep(1)
        left = subprocess.run(["pgrep", "-g", str(doctor.pid)], capture_output=True, text=True)
        assert left.stdout.split() == []
    finally:
        if doctor.poll() is None:
            os.killpg(doctor.pid, signal.SIGKILL)
            doctor.wait(timeout=5)
