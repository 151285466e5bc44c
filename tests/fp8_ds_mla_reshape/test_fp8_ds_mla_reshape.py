"""fp8-ds-mla-reshape on real vLLM releases (issue 3).

Reproduces the upstream start-up failures through vLLM 0.25.x's own producers,
planners and model runners, then shows the fix removes them without changing
anything else.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from fix_releases import covered

from vllm_mla_fixes.fixes import fp8_ds_mla_reshape
from vllm_mla_fixes.patching import State
from vllm_mla_fixes.reproductions import fp8_ds_mla as repro

AFFECTED = covered(fp8_ds_mla_reshape.INFO)
NOT_AFFECTED = {"0.24.0": "before the bug", "0.26.0": "fixed upstream"}
RUNNERS = ("v1", "v2")


def _fp8_status(plugin):
    return {s.name: s for s in plugin.status()}["fp8-ds-mla-reshape"]


@pytest.mark.vllm_release(*AFFECTED)
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("path", ["profiling", "engine"])
def test_startup_reproduces_upstream_error_then_fix_removes_it(fresh_plugin, path, runner):
    before = repro.run(path, runner=runner)
    assert before.error == f"RuntimeError: {repro.UPSTREAM_ERRORS[path]}"

    fresh_plugin.register()
    assert _fp8_status(fresh_plugin).state is State.APPLIED
    after = repro.run(path, runner=runner)
    assert after.ok, after.error
    blocks = 32 if path == "profiling" else 96
    assert after.num_blocks == blocks
    for name, shape in after.shapes.items():
        assert shape == ((blocks, 64, 656) if name.endswith(".attn") else (blocks, 64, 132)), name


@pytest.mark.vllm_release(*AFFECTED)
def test_enforce_eager_is_no_workaround():
    """--enforce-eager skips only CUDA-graph profiling; the normal KV-cache
    initialisation (engine-core plan, real block count) fails the same way."""
    outcome = repro.run("engine", num_blocks=96)
    assert outcome.error == f"RuntimeError: {repro.UPSTREAM_ERRORS['engine']}"


def _specs_unfixed_and_fixed(plugin):
    model = repro.load_config()
    config = repro.make_vllm_config(model)
    before = repro.layer_specs(model, config)
    plugin.register()
    after = repro.layer_specs(model, config)
    return before, after


@pytest.mark.vllm_release(*AFFECTED)
def test_only_kv_quant_mode_changes(fresh_plugin):
    from vllm.v1.kv_cache_interface import KVQuantMode

    before, after = _specs_unfixed_and_fixed(fresh_plugin)
    for name in before:
        assert after[name].page_size_bytes == before[name].page_size_bytes, name
        changed = {
            f.name
            for f in dataclasses.fields(before[name])
            if getattr(before[name], f.name) != getattr(after[name], f.name)
        }
        if name.endswith(".attn"):
            assert before[name].kv_quant_mode is KVQuantMode.NONE
            assert after[name].kv_quant_mode is KVQuantMode.FP8_PER_TENSOR
            assert changed == {"kv_quant_mode"}, name
            assert after[name].page_size_bytes == 64 * 656
        else:  # indexer caches carry no cache_dtype_str: untouched
            assert changed == set(), name
            assert after[name].page_size_bytes == 64 * 132


@pytest.mark.vllm_release(*AFFECTED)
def test_specs_survive_pickle_round_trip(fresh_plugin):
    """Workers pickle their specs to the engine core, which checks them for equality."""
    _, after = _specs_unfixed_and_fixed(fresh_plugin)
    for name, spec in after.items():
        clone = pickle.loads(pickle.dumps(spec))
        assert clone == spec and clone.kv_quant_mode is spec.kv_quant_mode, name


@pytest.mark.vllm_release(*AFFECTED)
def test_fp8_ds_mla_views_keep_the_656_byte_layout(fresh_plugin):
    fresh_plugin.register()
    config, _ = repro.profiling_kv_cache_config(repro.load_config())
    views = repro.views_v1_runner(config)
    for name, view in views.items():
        if not name.endswith(".attn"):
            continue
        assert view.dtype is torch.uint8
        assert view.shape == (32, 64, 656) and view.stride() == (64 * 656, 656, 1)
        # the view covers exactly the layer's own allocation
        assert view.untyped_storage().nbytes() == 32 * 64 * 656


@pytest.mark.vllm_release(*AFFECTED)
@pytest.mark.parametrize("model_version", [None, "deepseek_v4"])
def test_sliding_window_mla_conversion_keeps_the_layout_truth(fresh_plugin, model_version):
    """``unify_hybrid_kv_cache_specs`` rebuilds sliding-window MLA specs as
    ``MLAAttentionSpec`` without ``kv_quant_mode``; the fix covers that producer too."""
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import (
        KVQuantMode,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        get_kv_quant_mode,
    )

    def specs():
        common = dict(
            block_size=64,
            num_kv_heads=1,
            head_size=576,
            dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla",
            model_version=model_version,
            kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        )
        mixed = {
            "full": MLAAttentionSpec(**common),
            "swa": SlidingWindowMLASpec(sliding_window=128, **common),
        }
        unify_hybrid_kv_cache_specs(mixed)
        return mixed

    assert specs()["swa"].kv_quant_mode is KVQuantMode.NONE  # upstream drops it
    fresh_plugin.register()
    converted = specs()
    assert type(converted["swa"]) is MLAAttentionSpec
    assert converted["swa"].kv_quant_mode is KVQuantMode.FP8_PER_TENSOR
    assert converted["swa"].page_size_bytes == converted["full"].page_size_bytes


@pytest.mark.vllm_release(*AFFECTED)
@pytest.mark.parametrize("runner", RUNNERS)
def test_reshape_guard_names_layer_spec_page_size_and_shape(fresh_plugin, runner):
    """If spec fields ever disagree again, the error says what and where."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    fresh_plugin.register()
    config, _ = repro.profiling_kv_cache_config(repro.load_config())
    for name, spec in config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs.items():
        if name.endswith(".attn"):
            object.__setattr__(spec, "kv_quant_mode", KVQuantMode.NONE)  # the pre-fix state
    view = repro.views_v1_runner if runner == "v1" else repro.views_model_runner_v2
    with pytest.raises(fp8_ds_mla_reshape.KVCacheLayoutMismatch) as caught:
        view(config)
    message = str(caught.value)
    assert "layer 'model.layers.0.self_attn.attn'" in message
    assert "(32, 64, 576)" in message and "1343488 bytes were allocated" in message
    assert "page_size_bytes=41984" in message and "MLAAttentionSpec(" in message


@pytest.mark.vllm_release(*AFFECTED)
def test_probe_says_needed_on_affected_release():
    assert fp8_ds_mla_reshape.probe() is None


@pytest.mark.vllm_release(*NOT_AFFECTED)
def test_no_op_on_neighbour_releases(fresh_plugin):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    hooks = (
        MLAAttentionSpec.__dict__["__post_init__"],
        SlidingWindowMLASpec.__dict__["__post_init__"],
    )
    fresh_plugin.register()
    assert _fp8_status(fresh_plugin).state is State.NOT_NEEDED
    assert (
        MLAAttentionSpec.__dict__["__post_init__"],
        SlidingWindowMLASpec.__dict__["__post_init__"],
    ) == hooks
    # The probe, asked directly, reads the real release code the same way.
    reason = fp8_ds_mla_reshape.probe()
    assert reason is not None and ("#48379" in reason or "cache dtype" in reason)


@pytest.mark.vllm_release("0.26.0")
def test_fixed_release_builds_the_same_views_without_the_plugin():
    """0.26.0 (upstream fix) agrees with what the plugin produces on 0.25.x."""
    for path, blocks in (("profiling", 32), ("engine", 96)):
        outcome = repro.run(path, num_blocks=96)
        assert outcome.ok, outcome.error
        assert outcome.shapes["model.layers.0.self_attn.attn"] == (blocks, 64, 656)


@pytest.mark.vllm_release("0.25.1")
def test_verify_command_reports_error_then_fix(capsys):
    from vllm_mla_fixes import verify

    assert verify.run() == 0
    out = capsys.readouterr().out
    assert repro.UPSTREAM_ERRORS["profiling"] in out and repro.UPSTREAM_ERRORS["engine"] in out
    assert "attn (32, 64, 656)" in out and "[fp8-ds-mla-reshape] PASS" in out
