"""``vllm-mla-fixes selftest`` on CPU, on the real vLLM 0.32.0, 0.33.0 and 0.34.0 (issue 17).

The command runs as an operator runs it (``vllm-mla-fixes selftest --json`` in
a subprocess of the release's environment), twice at once:

* as installed: the fix's default geometry (interleaved split) and its
  fallback (per-ratio) must read back exactly in every serving case, with no
  byte outside their pages changed; the control (the split with untranslated
  ratio-1 writer slots, PR #56509's bug class) must fail every case; upstream's
  own layout, where it starts, reproduces the bug on 0.32.0 and 0.33.0 and reads
  back exactly on 0.34.0 (--block-size 64: every page is one the kernels'
  declarations take); exit status 0;
* with the fix regressed to that bug class (a ``sitecustomize`` takes the
  ratio-1 slot translation out of ``dsv41-sm120-geometry`` before anything
  runs): the default geometry must fail every case, exit status 1.  This run
  is on 0.34.0 only, to keep CI within its budget: the fix's code paths it
  regresses are the same reviewed definitions on 0.32.0 and 0.33.0.

On CPU the writers are vLLM's Triton kernels under the interpreter (the SWA
writer a PyTorch stand-in, shown here to write byte for byte what its Triton
twin writes under the interpreter) and the readers PyTorch stand-ins that
refuse the page sizes the real kernels lack; the JSON says so per row.  Also
here: the facts the stand-in readers are written from, read off the installed
FlashInfer and vLLM sources, and exit status 2 on a release the fix does not
cover.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import fix_releases
import pytest

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41_INFO
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import CASES

DSV41 = fix_releases.covered(DSV41_INFO)
TIMEOUT_S = 1800
REGRESSED_FIX = """\
# The fix as a regression would leave it: the ratio-1 writers keep manager-block slots.
# (The module itself: the package's ``apply`` attribute is its apply function.)
import importlib
fix_apply = importlib.import_module("vllm_mla_fixes.fixes.dsv41_sm120_geometry.apply")
fix_apply.with_kernel_slots = lambda original: original
"""


ROOT = Path(__file__).resolve().parents[2]


def _cpu_env(site: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of an operator's run of this checkout (``site``: a folder
    whose ``sitecustomize`` runs first)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "VLLM_PLUGINS",
            "VLLM_MLA_FIXES",
            "VLLM_LOGGING_STREAM",
            "VLLM_MLA_FIXES_DSV41_GEOMETRY",
        )
    }
    path = os.pathsep.join(str(p) for p in (site, ROOT) if p)
    return {**env, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **extra}


def _selftest(*args: str, site: str | None = None, **env: str) -> subprocess.Popen:
    command = Path(sys.executable).with_name("vllm-mla-fixes")  # this environment's console script
    assert command.exists(), f"{command} is missing: install the package into this environment"
    return subprocess.Popen(
        [str(command), "selftest", "--json", *args],
        env=_cpu_env(site, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    try:
        report = json.loads(out)  # the whole of stdout: exactly one document
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON document:\n{out[-3000:]}\nstderr:\n{err[-6000:]}")
    return proc.returncode, report, err


REGRESSED_ON = "0.34.0"
UPSTREAM_VERDICT = {
    "0.32.0": "bug reproduced",
    "0.33.0": "bug reproduced",
    "0.34.0": "no failure here",
}


def _release() -> str:
    import vllm

    return str(vllm.__version__)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The installed fix and (on 0.34.0) the regressed one, run side by side."""
    installed = _selftest()
    regressed = None
    if request.config.vllm_release == REGRESSED_ON:
        site = tmp_path_factory.mktemp("regressed")
        (site / "sitecustomize.py").write_text(REGRESSED_FIX)
        regressed = _selftest("--geometry", "split", "--no-timing", "--jobs", "1", site=str(site))
    return _finish(installed), regressed and _finish(regressed)


@pytest.fixture(scope="module")
def report(runs):
    return runs[0][1]


def _geometry(report: dict, name: str) -> dict:
    return next(g for g in report["geometries"] if g["name"] == name)


# ------------------------------------------------------------ the verdicts


@pytest.mark.vllm_release(*DSV41)
def test_selftest_passes_with_the_fix_as_installed(runs):
    (status, report, err), _ = runs
    verdicts = {g["name"]: g["verdict"] for g in report["geometries"]}
    assert (status, report["exit_status"]) == (0, 0), (verdicts, err[-6000:])
    assert verdicts == {
        "split": "pass",
        "fallback": "pass",
        "upstream": UPSTREAM_VERDICT[_release()],
        "control": "caught",
    }


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("geometry", ["split", "fallback"])
def test_fix_geometries_read_back_exactly_in_every_serving_case(report, geometry):
    g = _geometry(report, geometry)
    assert set(g["cases"]) == set(CASES)
    for name, case in g["cases"].items():
        assert case["compared"] > 0 and not case["failed"], (name, case)
        assert case["worst_error"] == 0 and case["foreign_bytes"] == 0, (name, case)
    for row in g["rows"]:
        assert row["verdict"] == "pass", row
        # on CPU every comparison's derived bound is 0 (exact), and it holds
        assert (row["error"], row["bound"], row["margin"]) == (0, 0, 0), row
    assert (
        g["stray_bytes"],
        g["foreign_bytes"],
        g["tiling_problems"],
        g["ratio1_slot_mismatches"],
    ) == (0, 0, [], 0)
    # the serving cases ran: freed blocks came back with stale bytes, which vLLM's zeroer cleared;
    # the offloading connector's regions were copied out and back
    assert g["reused_blocks"] > 0 and g["stale_bytes_zeroed"] > 0 and g["offloaded_bytes"] > 0


@pytest.mark.vllm_release(*DSV41)
def test_control_fails_every_case(report):
    g = _geometry(report, "control")
    assert sorted(n for n, c in g["cases"].items() if c["failed"]) == sorted(CASES)
    caught = {row["kernel"] for row in g["rows"] if row["verdict"] == "caught"}
    assert {
        "attention decode (FlashInfer SM120 sparse MLA)",
        "attention prefill (FlashInfer SM120 sparse MLA)",
        "indexer decode logits + top-k (DeepGEMM paged MQA)",
        "indexer prefill K gather (cp_gather_indexer_k_quant_cache)",
        "compressed KV writer (rope_quant_insert)",
        "indexer K writer (indexer_k_norm_rope_store)",
    } <= caught
    assert g["ratio1_slot_mismatches"] > 0 and g["foreign_bytes"] > 0


@pytest.mark.vllm_release(REGRESSED_ON)
def test_selftest_exits_1_when_the_fix_keeps_manager_block_slots(runs):
    _, (status, report, err) = runs
    g = _geometry(report, "split")
    assert (status, report["exit_status"], g["verdict"]) == (1, 1, "FAIL"), err[-6000:]
    assert sorted(n for n, c in g["cases"].items() if c["failed"]) == sorted(CASES)
    assert g["ratio1_slot_mismatches"] > 0


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.usefixtures("kernels_as_locked")
def test_upstream_runs_where_it_starts_with_what_the_kernels_declare(report):
    """0.32/0.33 start with --block-size 128: 128-state ratio-1 indexer pages, which
    DeepGEMM's SM120 host check refuses (0.32.0: also 32-row SWA pages, which
    FlashInfer 0.7.0.post1 refuses).  0.34.0 starts with 64: 32-state ratio-2
    indexer pages and 32-row SWA pages, which DeepGEMM and FlashInfer 0.7.4
    declare they take, so upstream's layout reads back exactly."""
    g = _geometry(report, "upstream")
    problems = [p for row in g["rows"] for p in row["problems"]]
    if _release() == "0.34.0":
        assert (g["block_size"], g["verdict"], problems) == (64, "no failure here", [])
        for name, case in g["cases"].items():
            assert case["compared"] > 0 and not case["failed"], (name, case)
            assert case["worst_error"] == 0 and case["foreign_bytes"] == 0, (name, case)
        return
    assert (g["block_size"], g["verdict"]) == (128, "bug reproduced")
    assert any("DeepGEMM's paged MQA logits take pages of 32, 64 states" in p for p in problems)
    primary_32 = any("primary page of 32 rows" in p for p in problems)
    assert primary_32 == (_release() == "0.32.0")


@pytest.mark.vllm_release(*DSV41)
def test_rows_say_which_kernels_are_stand_ins_on_cpu(report):
    assert report["device"]["kind"] == "cpu"
    sources = report["kernels"]
    interpreted = {kn.TOPK_GATHER}  # dspark-long-prefill's gather: vLLM's Triton kernel
    for kernel, source in sources.items():
        if "writer (" in kernel or "zeroing" in kernel or kernel in interpreted:
            continue
        assert source.startswith("stand-in"), (kernel, source)
    assert sources["compressed KV writer (rope_quant_insert)"].startswith("real (Triton")
    assert sources[kn.TOPK_GATHER] == "real (Triton, interpreted on CPU)"


@pytest.mark.vllm_release(*DSV41)
def test_split_layout_interleaves_64_row_ratio1_pages(report):
    """Ratio-1 caches: 64-row kernel pages 46,080 B apart (a 37,440-B compressed
    page and an 8,640-B indexer page), 3 per 138,240-B block; every other page
    keeps its rows in its manager page: 64, and the drafter layer's
    sliding-window pages 128 where FlashInfer takes run-time page sizes."""
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
        flashinfer_takes_runtime_swa_pages,
    )

    drafter_rows = fix.DRAFTER_SWA_ROWS if flashinfer_takes_runtime_swa_pages() else 64
    g = _geometry(report, "split")
    for line in g["layout"]:
        name = line.split(":")[0]
        rows = drafter_rows if name == "model.layers.3.self_attn.swa_cache" else 64
        assert f"rows/page {rows} " in line, line
        if name in ("model.layers.1.self_attn", "model.layers.1.self_attn.indexer.k_cache"):
            assert "manager block 128, kernel block 64 (stride 3)" in line, line
            assert line.endswith("page stride 46080"), line
        else:
            assert "kernel block" not in line and line.endswith("page stride 138240"), line
    assert "geometry interleaved-split (default on SM12x" in g["status"]
    assert (
        "geometry per-ratio (KV connector NixlConnector is configured"
        in _geometry(report, "fallback")["status"]
    )


@pytest.mark.vllm_release(*DSV41)
def test_every_geometry_that_reads_back_launches_the_same_timed_work(report):
    """The kernel timing compares equal work: the timed step launches the same
    backbone layers' kernels over the same rows in every layout (the fix's
    drafter layer is left out: upstream's layout has none)."""
    work = {
        g["name"]: g["timed_work"]
        for g in report["geometries"]
        if g["verdict"] in ("pass", "no failure here")
    }
    attention, logits = work["split"].values()
    assert (attention["layers"], logits["layers"]) == ([0, 1, 2], [0, 1])
    assert attention["rows"] == 3 * 4 and logits["rows"] == 2 * 4  # padded to 4 requests
    assert set(work) >= {"split", "fallback"}
    assert all(w == work["split"] for w in work.values()), work


@pytest.mark.vllm_release(*DSV41)
def test_selftest_times_the_slot_translation_beside_vllms_mapping(report):
    assert report["decode_step_timing"]["note"] == "not timed (no GPU)"
    timing = {t["tokens"]: t for t in report["slot_translation_us"]}
    assert set(timing) == {64, 8192}
    for t in timing.values():
        assert (
            t["per_step_both_ratio1_groups"] > 0
            and t["vllm_map_to_kernel_block_table_one_group"] > 0
        )


@pytest.mark.vllm_release("0.26.0")
def test_selftest_cannot_run_where_the_fix_does_not_apply():
    status, report, _ = _finish(_selftest())
    assert (status, report["exit_status"]) == (2, 2)
    assert "dsv41-sm120-geometry is not-needed on vLLM 0.26.0" in report["cannot_run"]


# ------------------------------------------------------------ layout facts

_SM120 = "include/flashinfer/attention/sparse_mla_sm120/"

# Each fact the stand-in attention reader relies on, with where the installed
# FlashInfer states it: one alternative per source layout (0.7.0.post1 for vLLM
# 0.32.0, 0.7.2.post1 for 0.33.0, 0.7.4 for 0.34.0).  Paths relative to flashinfer/data.
_FLASHINFER_FACTS = {
    "V4 record: 448 fp8 NoPE + 64 bf16 RoPE; 7 scales of 64 dims; V is the whole row": [
        {
            _SM120 + "model/kv_cache_traits.cuh": [
                "static constexpr int D_NOPE = 448;",
                "static constexpr int D_ROPE = 64;",
                "static constexpr int NUM_SCALES = 7;",
                "static constexpr bool V_HAS_ROPE = true;",
            ]
        },
        {
            _SM120 + "model/dsv4_geometry.cuh": [
                "static constexpr int D_NOPE = 448;",
                "static constexpr int D_ROPE = 64;",
                "static constexpr bool V_HAS_ROPE = true;",
            ],
            _SM120 + "model/kv_cache_traits.cuh": ["Scales::count(D_NOPE);  // 7 = 448/64"],
        },
    ],
    "data at page + row * 576, footer at page + pbs * 576 + row * 8, page = idx / pbs": [
        {
            _SM120 + "common/kv_cache_io.cuh": [
                "DSV4: IO_STRIDE = D_NOPE + D_ROPE*2 = 576",
                "int block_idx = idx / pbs;",
                "(size_t)block_idx * stride_kv_block + (size_t)pbs * IO::IO_STRIDE",
            ]
        },
        {
            _SM120 + "common/kv_cache_io.cuh": [
                "DSV4: IO_STRIDE = D_NOPE + D_ROPE*2 = 576",
                "(size_t)(idx / pbs) * kv_stride_bytes + (size_t)(idx % pbs) * IO::IO_STRIDE",
                "(size_t)pbs * IO::IO_STRIDE +",
            ]
        },
    ],
    "UE8M0 byte e decodes to 2 ** (e - 127)": [
        {_SM120 + "model/scale_convert.cuh": ["static_cast<uint32_t>(v) << 23;"]},
    ],
    "the sink adds exp(sink - max) to the softmax denominator": [
        {_SM120 + "decode_dsv4_kernel.cuh": ["total_sum += exp2f(sink_log2 - gmax)"]},
        {_SM120 + "execution/merge.cuh": ["total_sum += exp2f(sink_log2 - gmax)"]},
    ],
    "NHD pages: rows = shape[1], page stride = stride(0), footer rows packed at 584": [
        {
            "csrc/sparse_mla_sm120_jit_binding.cu": [
                "return {static_cast<int>(kv.size(1)), static_cast<size_t>(kv.stride(0)) "
                "* elem_bytes,",
                "TVM_FFI_ICHECK_EQ(kv_layout.stride_kv_row, bpt)",
            ]
        },
        {
            "csrc/sparse_mla_sm120/attention_validation.h": [
                "axis = kv.size(1) == 1 ? 2 : 1;",
                "const int64_t page_stride = kv.stride(0);",
                "footer-scale rows must stay tightly packed",
            ]
        },
    ],
}


def _holds(root: Path, alternative: dict[str, list[str]]) -> bool:
    for rel, needles in alternative.items():
        path = root / rel
        if not path.is_file() or not all(n in path.read_text(encoding="utf-8") for n in needles):
            return False
    return True


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("fact", sorted(_FLASHINFER_FACTS))
def test_reader_layout_facts_hold_in_the_installed_flashinfer(fact):
    """The facts the stand-in attention reader is written from, read off the
    installed FlashInfer's kernel sources (without importing FlashInfer)."""
    spec = importlib.util.find_spec("flashinfer")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))) / "data"
    assert any(_holds(root, alt) for alt in _FLASHINFER_FACTS[fact]), fact


@pytest.mark.vllm_release(*DSV41)
def test_writer_layout_facts_hold_in_the_installed_vllm():
    """The writers address pages the way the stand-in readers assume."""
    from vllm.models.deepseek_v41.common.ops import fused_compress_quant_cache, indexer_k_store

    writer = inspect.getsource(fused_compress_quant_cache._rope_quant_insert_kernel.fn)
    assert "page = cache + (slot // CACHE_BLOCK).to(tl.int64) * CACHE_STRIDE" in writer
    assert "scales = page + CACHE_BLOCK * 576 + (slot % CACHE_BLOCK) * 8" in writer
    index = inspect.getsource(indexer_k_store._indexer_k_norm_rope_quant_store_kernel.fn)
    assert "+ kv_cache_block_size * TOKEN_STRIDE" in index


# ------------------------------------------------------------ faster paths


def _v4_rows(count: int, gen):
    """bf16 rows [count, 512] whose 64-dim tiles span the UE8M0 exponents the
    writer meets: tiny tiles (below its 1e-4 floor), zero tiles, unit-scale and
    huge tiles, and rows of mixed signs."""
    import torch

    rows = torch.randn(count, 512, generator=gen)
    tile_scale = 2.0 ** torch.randint(-30, 60, (count, 8, 1), generator=gen).float()
    rows = (rows.reshape(count, 8, 64) * tile_scale).reshape(count, 512)
    rows[0, :64] = 0.0
    rows[1, 64:128] = 3e-5
    rows[2, :448] = 448.0
    rows[3, :448] = -(2.0**-133)  # subnormal in fp32, bf16-representable
    return rows.to(torch.bfloat16)


def _swa_records(mxfp8: bool):
    """(record bytes the release names, the self-test's stand-in writer of it)."""
    from vllm.models.deepseek_v41.common.ops import cache_utils

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels

    if mxfp8:
        return cache_utils.V41_BYTES_PER_TOKEN, kernels.insert_mxfp8_records_stand_in
    return cache_utils.V4_BYTES_PER_TOKEN, kernels.insert_v4_records_stand_in


def _swa_pages(rows, slots, write, record: int, **kwargs):
    """Writes ``rows`` at ``slots`` into 5 pages of 16 records with padding,
    in a view that starts inside its allocation; (allocation, view)."""
    import torch

    block_size, pages = 16, 5
    page_bytes = block_size * record + 200  # aligned pages leave padding after the records
    storage = torch.full((300 + pages * page_bytes + 100,), 0xA5, dtype=torch.uint8)
    view = storage[300 : 300 + pages * page_bytes].view(pages, page_bytes)
    write(rows, view, slots, block_size=block_size, **kwargs)
    return storage, view


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("mxfp8", [False, True], ids=["v4-record", "v41-mxfp8-record"])
def test_swa_stand_in_writes_the_bytes_the_interpreted_triton_twin_writes(mxfp8):
    """On CPU the self-test's SWA writer is the stand-in for the twin's
    one-program-per-token interpretation, for the V4 record and SM100's V4.1
    MXFP8 one (``bytes_per_token``): both write the same bytes -- pages with
    padding, a view that starts inside its allocation, -1 slots skipped, rows
    past the slot count unread, and two tokens on one slot (the later wins)."""
    import torch
    from vllm.models.deepseek_v41.common.ops.cache_utils import quantize_and_insert_k_cache

    record, stand_in = _swa_records(mxfp8)
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([3, -1, 17, 0, 79, 40, 41, 17, 63, -1, 5, 33], dtype=torch.int64)
    rows = _v4_rows(slots.numel() + 2, gen)
    twin, _ = _swa_pages(rows, slots, quantize_and_insert_k_cache, record, bytes_per_token=record)
    ours, _ = _swa_pages(rows, slots, stand_in, record)
    differ = torch.nonzero(twin != ours).flatten()
    assert differ.numel() == 0, f"{differ.numel()} bytes differ, first at {differ[:8].tolist()}"
    assert int((twin != 0xA5).sum()) > 9 * (record - 4)  # the writes happened


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("mxfp8", [False, True], ids=["v4-record", "v41-mxfp8-record"])
def test_swa_records_read_back_as_the_dense_reference(mxfp8):
    """The stand-in reader decodes what vLLM's Triton writer (interpreted)
    stored, record by record, to exactly the dense reference's rows; and
    vLLM's own Triton gather (``dequantize_and_gather_k_cache_triton``, which
    tells the records apart by width) reads the same values from those pages."""
    import torch
    from vllm.models.deepseek_v41.common.ops.cache_utils import (
        dequantize_and_gather_k_cache_triton,
        quantize_and_insert_k_cache,
    )

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import reference as ref

    record, _ = _swa_records(mxfp8)
    gen = torch.Generator().manual_seed(9)
    slots = torch.tensor([3, 17, 0, 79, 40, 41, 63, 5, 33, 18], dtype=torch.int64)
    rows = _v4_rows(slots.numel(), gen)
    _, view = _swa_pages(rows, slots, quantize_and_insert_k_cache, record, bytes_per_token=record)
    pages = view[:, : 16 * record].view(view.shape[0], 16, 1, record)
    pages = torch.as_strided(pages, pages.shape, (view.stride(0), record, record, 1))
    got = ref.read_kv_rows(pages, slots)
    want = ref.dense_swa_rows(rows, ref.interpreter_rounding(), mxfp8)
    assert torch.equal(got, want), float((got - want).abs().max())

    # vLLM's reader of both records, one request holding slots 0..23 of pages 0, 1.
    gathered = torch.zeros(1, 24, 512, dtype=torch.bfloat16)
    dequantize_and_gather_k_cache_triton(
        gathered,
        pages[:, :, 0],
        torch.tensor([24], dtype=torch.int32),
        None,
        torch.tensor([[0, 1]], dtype=torch.int32),
        16,
        0,
    )
    held = [i for i, slot in enumerate(slots.tolist()) if slot < 24]
    local = slots[held]
    torch.testing.assert_close(gathered[0, local].float(), want[held].to(torch.bfloat16).float())


@pytest.mark.vllm_release(*DSV41)
@pytest.mark.parametrize("mxfp8", [False, True], ids=["v4-record", "v41-mxfp8-record"])
def test_compressed_records_read_back_as_the_dense_reference(mxfp8):
    """The compressed KV as the release's compressor writes it
    (``rope_quant_insert``, interpreted; the record named by the cache's
    width: 584-B V4, or SM100's 528-B V4.1 MXFP8 with the RoPE dims rotated in
    fp32 and quantised with the rest): the self-test's reader decodes each
    record, in the release's scale placement, to exactly the dense
    reference's row, and the bytes outside the written records stay as they were."""
    import torch
    from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import (
        rope_quant_insert,
    )

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import reference as ref

    record, _ = _swa_records(mxfp8)
    gen = torch.Generator().manual_seed(13)
    ratio, block_size, pages = 2, 16, 5
    slots = torch.tensor([3, 17, 0, 79, 40, 41, 63, 5, 33, 18], dtype=torch.int64)
    # Each token ends its group (position + 1 divisible by the ratio), so each is written.
    positions = 2 * torch.randint(0, 200, (slots.numel(),), generator=gen) + 1
    angles = torch.rand(512, 32, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32)
    latent = _v4_rows(slots.numel(), gen)

    page_bytes = block_size * record + 200  # aligned pages leave padding after the records
    storage = torch.full((300 + pages * page_bytes + 100,), 0xA5, dtype=torch.uint8)
    cache = torch.as_strided(storage[300:], (pages, block_size, record), (page_bytes, record, 1))
    rope_quant_insert(latent, positions, cos_sin, cache, slots, ratio)

    got = ref.read_kv_rows(cache, slots)
    first = positions - 1  # RoPE at the group's first position
    want = ref.dense_compressed_rows(
        latent, cos_sin[first, :32], cos_sin[first, 32:], ref.interpreter_rounding(), mxfp8
    )
    assert torch.equal(got, want), float((got - want).abs().max())
    written = torch.zeros_like(storage, dtype=torch.bool)
    for slot in slots.tolist():
        start = 300 + (slot // block_size) * page_bytes
        row = slot % block_size
        if record == ref.RECORD_BYTES:
            spans = [(row * ref.DATA_BYTES, ref.DATA_BYTES)]
            spans.append((block_size * ref.DATA_BYTES + row * ref.FOOTER_BYTES, ref.FOOTER_BYTES))
        else:
            values, scales = ref.mxfp8_addresses(torch.tensor(0), torch.tensor(row), block_size)
            spans = [(int(values), ref.HEAD), (int(scales), ref.MX_SCALES)]
        for offset, width in spans:
            written[start + offset : start + offset + width] = True
    assert bool((storage[~written] == 0xA5).all()), "bytes outside the written records changed"
