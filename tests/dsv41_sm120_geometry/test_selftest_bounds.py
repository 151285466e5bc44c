"""The self-test's derived bounds and its CPU timing line (issue 27).

On CPU: each comparison of a short run of the self-test (the fix's default
geometry, the timeline's first steps: chunked prefill, then a decode beside a
prefix-hit prefill, which run all four readers and all four writers) reports
its error, bound and margin, and stays within its bound, and the kernel
timing says "not timed (no GPU)".  The premises of the
attention bound (FlashInfer rounds Q and P through e4m3) are read off the
installed FlashInfer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41_INFO
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import bounds

DSV41 = fix_releases.covered(DSV41_INFO)

# ------------------------------------------------------------------ bounds


def test_real_attention_bound_is_the_formats_rms_with_the_heads_spread():
    u8, u16 = 2.0**-4, 2.0**-8
    rms = math.sqrt(2 * (448 / 512) * u8**2 / 3 + (64 / 512 + 2) * u16**2 / 3)
    bound = bounds.real_attention_bound(heads=8)
    assert bound.value == pytest.approx(rms * 1.25)
    assert 0.059 < bound.value < 0.061 and bound.measure == bounds.REL_L2
    # a zeroed page reads 0.7 relative L2 on the harness's reader: far outside
    assert 0.7 / bound.value > 10


def _e4m3_in_tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x rounded to e4m3 with one power-of-two scale per ``tile`` values (the
    largest maps to at most 448), as FlashInfer scales Q and P."""
    tiles = x.reshape(*x.shape[:-1], -1, tile)
    amax = tiles.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 448))
    scaled = torch.clamp(tiles * torch.exp2(-exp), -448, 448)
    return (scaled.to(torch.float8_e4m3fn).float() * torch.exp2(exp)).reshape(x.shape)


def _rounded_attention(q, kv, scale):
    """The rounding steps the bound's derivation names, and no others: Q's NoPE
    dims and the NoPE part's P through e4m3 (per-64 scales), the RoPE part's P
    through bf16, the output through bf16 twice (split-K partial, merged row)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import reference as ref

    q_nope = _e4m3_in_tiles(q[:, : ref.NOPE].float(), 64)
    logits = (q_nope @ kv[:, : ref.NOPE].T + q[:, ref.NOPE :].float() @ kv[:, ref.NOPE :].T) * scale
    top = logits.amax(dim=-1).clamp_min(0.0)  # the zero sink logit
    p = torch.exp(logits - top[:, None])
    denom = p.sum(dim=-1) + torch.exp(-top)
    padded = torch.nn.functional.pad(p, (0, -p.shape[1] % 64))
    p_nope = _e4m3_in_tiles(padded, 64)[:, : p.shape[1]]
    p_rope = p.to(torch.bfloat16).float()
    out = torch.cat([p_nope @ kv[:, : ref.NOPE], p_rope @ kv[:, ref.NOPE :]], dim=1)
    return (out / denom[:, None]).to(torch.bfloat16).float().to(torch.bfloat16).float()


def test_the_attention_bound_holds_for_the_rounding_it_is_derived_from():
    """The self-test's inputs (q and latents N(0, 1), the writer's fp8 NoPE, 8
    heads, 1 to 200 candidates) through that rounding stay within the bound;
    the mean shows the rounding was exercised (measured: mean 0.023, worst
    0.039 of 200 rows, bound 0.060)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import reference as ref

    gen = torch.Generator().manual_seed(27)
    bound = bounds.real_attention_bound(heads=8).value
    errors = []
    for candidates in (1, 2, 8, 64, 200):
        for _ in range(40):
            q = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
            latent = torch.randn(candidates, 512, generator=gen).to(torch.bfloat16)
            rounding = ref.Rounding("round-to-nearest-even")
            kv = torch.cat(
                [
                    ref.quant_dequant_nope(latent[:, : ref.NOPE].float(), rounding, divide=True),
                    latent[:, ref.NOPE :].float(),
                ],
                dim=1,
            )
            want = ref.sink_softmax_attention(q, kv, torch.zeros(8), 512**-0.5)
            got = _rounded_attention(q, kv, 512**-0.5)
            errors.append(float((got - want).norm() / want.norm()))
    worst, mean = max(errors), sum(errors) / len(errors)
    print(f"rounding model: mean {mean:.4f}, worst {worst:.4f}, bound {bound:.4f}")
    assert worst <= bound
    assert 0.01 < mean < bound


def test_margin_is_error_over_bound_and_exact_bounds_take_only_zero():
    assert bounds.margin(0.03, 0.06) == pytest.approx(0.5)
    assert bounds.margin(0.0, 0.0) == 0.0
    assert bounds.margin(1e-9, 0.0) == math.inf


# ------------------------------------------------------------------ a CPU run

SHORT_RUN = """
import json, sys
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import prepare_process_env
prepare_process_env()
import vllm
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness, kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.report import Report
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import TIMELINE
device = kn.detect_device()
kernels = kn.Kernels.for_device(device)
result = harness.run_geometry("split", device, kernels, plans=TIMELINE[:4])
report = Report(str(vllm.__version__), device, kernels, [result])
print(json.dumps({"json": report.as_json(), "text": report.text()}))
"""


@pytest.fixture(scope="module")
def short_run():
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", SHORT_RUN],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm_release(DSV41[-1])  # our comparisons' report: once
def test_cpu_run_reports_each_comparisons_error_bound_and_margin(short_run):
    (geometry,) = short_run["json"]["geometries"]
    rows = {row["kernel"]: row for row in geometry["rows"]}
    assert len(rows) == 8, sorted(rows)  # the four readers and the four writers
    for kernel, row in rows.items():
        assert row["compared"] > 0, kernel
        # on CPU every comparison is exact: the same bytes, the same arithmetic
        assert (row["error"], row["bound"], row["margin"]) == (0, 0, 0), (kernel, row)
        assert row["error"] <= row["bound"] and row["bound_derivation"].startswith("exact"), row
    assert rows["attention decode (FlashInfer SM120 sparse MLA)"]["measure"] == bounds.MAX_ABS
    for case in geometry["cases"].values():
        assert case["worst_margin"] in (0, 0.0), case
    text = short_run["text"]
    assert "bound  error/bound" in text
    assert "indexer prefill K gather (cp_gather_indexer_k_quant_cache): 0, of max |got" in text


@pytest.mark.vllm_release(DSV41[-1])  # our comparisons' report: once
def test_cpu_run_says_the_kernels_are_not_timed(short_run):
    timing = short_run["json"]["decode_step_timing"]
    assert timing["timed"] is False and timing["note"] == "not timed (no GPU)"
    assert (timing["baseline"], timing["kernels"]) == (None, {})
    assert ": not timed (no GPU)" in short_run["text"]


# ------------------------------------------------------------------ premises

_PREMISES = {
    "Q's NoPE dims are quantised to e4m3": "On-the-fly Q quantization: BF16 → FP8 E4M3",
    "P is quantised to e4m3 for the NoPE part of PV": "__nv_fp8_e4m3 f00(",
}


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("premise", sorted(_PREMISES))
def test_attention_bound_premises_hold_in_the_installed_flashinfer(premise):
    import flashinfer

    tree = Path(flashinfer.__file__).parent / "data/include/flashinfer/attention/sparse_mla_sm120"
    sources = [p.read_text(encoding="utf-8") for p in tree.rglob("*.cuh")]
    assert any(_PREMISES[premise] in text for text in sources), premise
