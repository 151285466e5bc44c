"""The self-test calls DeepGEMM's paged MQA logits as vLLM's own indexer does, per release and arch (issue 27).

On a B200 (SM100) vLLM's indexer passes DeepGEMM MX-scaled inputs: unit
UE8M0x4 Q scales and bf16 weights from ``mqa_logits_mx_inputs``, bf16 logits
(0.34.0), and the varlen rows' request ``indices``; DeepGEMM's SM100 kernel
asserts on a call without them.  Each test replays a prefill and a decode of the
self-test's ``split`` geometry on CPU with vLLM pretending to run on the arch
(``kernel_calls.pretend_gpu``), records at DeepGEMM's own ops what vLLM's
indexer layer passes and what the self-test passes on the same caches and
metadata, and compares names, dtypes, shapes, strides and scale formats.  The
same run checks that the self-test reads the indexer keys' scales in the
format the release's writers store on that arch (fp32, or UE8M0x4 on SM100),
and the GPU tests' indexer probe, which recomputes vLLM's call, runs on each
arch's recorded call.

The window KV: vLLM's main forward (``_prepare_and_attn``) projects the
query and writes the window KV through the layer's ``_fused_qnorm_rope_kv_insert``
(``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``); recorded at that op,
declared with the schema compiled into the release, with the query the
forward computed, the self-test's write must be the same call, into a cache of the record the layer
writes on that arch (the 528-byte V4.1 MXFP8 record on SM100, else the 584-byte
V4 one): the record, the page alignment and the block-stride alignment are the
values the layer's own ``__init__`` statements compute on that arch.

The compressed KV: a kv source's compressor publishes it through
``DeepseekCompressor.insert_cache`` and ``rope_quant_insert``, which launches
the Triton kernel the cache's record width names; recorded at those kernels,
the self-test's write must be the same launch, into a cache of the record and
page alignment the layer's ``__init__`` statements give the compressed cache
on that arch (on SM100 the 528-byte V4.1 MXFP8 record and 512-byte pages,
else the 584-byte V4 record and 576-byte pages).  The index keys: vLLM's
``DeepseekV4Indexer._produce_k`` stores them through
``indexer_k_norm_rope_store``; recorded at its Triton kernel, the self-test's
launch must be the same (issue 33).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING
from unittest import mock

import fix_releases
import kernel_calls as kc
import pytest
import torch

from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41_INFO

if TYPE_CHECKING:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.layout import CacheLayer

DSV41 = fix_releases.covered(DSV41_INFO)
# The fix's target, SM12x, on every covered release; SM100 and SM90, where the
# self-test runs vLLM's other backends and no layout changes, on the newest only
# (about 130 s of CPU per release saved).
ARCH_PARAMS = [
    pytest.param(
        arch, marks=pytest.mark.vllm_release(*(DSV41 if arch.startswith("sm12") else DSV41[-1:]))
    )
    for arch in kc.ARCHS
]
# What the layer's __init__ sets that its compressed cache's spec and
# writer depend on (DeepseekV4Attention.get_kv_cache_spec reads the last two).
COMPRESSED_CACHE_ATTRIBUTES = ("kv_mxfp8", "compressed_bytes_per_token", "kv_page_alignment")


def _record(arch: str):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.reads import IndexerReads
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import StepPlan

    calls: list[kc.Call] = []
    caller = ["builder"]
    original = IndexerReads.read_indexer

    def read_indexer(reads, batch, cache, md, replay):
        imd = md[cache.name]
        if imd.num_decodes and imd.prefill is None:  # a decode-only step
            model = reads.model
            rows = imd.num_decode_tokens
            q = torch.randn(rows, model.index_heads, 128).to(torch.float8_e4m3fn)
            caller[0] = "vllm"
            kc.vllm_indexer_decode(reads.layout, cache, md, q, torch.rand(rows, model.index_heads))
        caller[0] = "selftest"
        try:
            return original(reads, batch, cache, md, replay)
        finally:
            caller[0] = "builder"

    cpu = kn.Kernels.for_device(kn.detect_device())
    sources = {**cpu.sources, kn.INDEXER_LOGITS: "real (DeepGEMM)"}  # the call reaches DeepGEMM
    capability = kc.ARCHS[arch][0]
    device = kn.Device("cuda", torch.device("cpu"), f"pretend {arch}", capability)
    plans = (
        StepPlan("C prefill", (("C", None),), ("indexer-prefill",)),
        StepPlan("C decode", (("C", 1),), ()),
    )
    with (
        mock.patch.object(IndexerReads, "read_indexer", read_indexer),
        kc.pretend_gpu(arch),
        kc.recording(calls, caller),
    ):
        result = harness.run_geometry("split", device, kn.Kernels(device, sources), plans=plans)
    assert result.aborted is None, "\n".join([result.aborted, *result.layout[-1:]])
    return calls, result


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_selftest_calls_paged_mqa_logits_as_vllm_does(arch):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    calls, result = _record(arch)
    logits = [c for c in calls if c.kernel == kc.PAGED_LOGITS]
    ours = [c for c in logits if c.caller == "selftest"]
    theirs = [c for c in logits if c.caller == "vllm"]
    assert theirs, f"vLLM's indexer never reached DeepGEMM on {arch}: {[c.kernel for c in calls]}"
    assert len(ours) >= len(theirs), "the self-test read fewer indexer caches than vLLM"
    # The decode step's calls, cache by cache, in the order both read them.
    problems = [
        p for want, got in zip(theirs, ours[-len(theirs) :]) for p in kc.differences(want, got)
    ]
    assert not problems, f"on {arch}:\n" + "\n".join(dict.fromkeys(problems))

    # The GPU tests' probe (tests/gpu/inprocess/call_probes.py) recomputes
    # vLLM's call on this arch: it must take its form and read its cache as the
    # self-test's reader does.
    with kc.pretend_gpu(arch):  # the release's scale format on this arch
        for call in theirs:
            _check_probe(arch, call.tensors)

    # The keys' scale bytes read back as the writers stored them.
    gather = result.kernels.get(kn.INDEXER_GATHER)
    assert gather is not None and gather.compared, "the indexer prefill gather was not compared"
    assert not gather.problems, gather.problems


def _check_probe(arch: str, t: dict) -> None:
    from gpu.inprocess.call_probes import reference_paged_mqa_logits

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn

    rows = reference_paged_mqa_logits(
        t["q"], t["kv_cache"], t["weights"], t["context_lens"], t["block_table"], t["q_sf"]
    )
    assert rows, f"the probe found no rows in vLLM's call on {arch}"
    standing_in = kn.paged_mqa_logits_stand_in(
        t["q"],
        t["kv_cache"],
        t["weights"].float(),
        t["context_lens"],
        t["block_table"],
        int(t["max_context_len"]),
    )
    for row, length, expected in rows:
        assert torch.isfinite(expected).all(), f"row {row} on {arch}: {expected}"
        torch.testing.assert_close(standing_in[row, :length], expected)


@functools.cache
def _record_writers(arch: str):
    """One prefill and one decode of the split geometry on a pretend ``arch``,
    each step's window-KV and compressed-KV writes made first by vLLM's own
    writers and then by the self-test's, all recorded where the kernels
    stand; (calls, the layer's own cache arguments, the self-test's caches)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import StepPlan
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.writes import Writes

    calls: list[kc.Call] = []
    caller = ["builder"]
    original = Writes.write
    caches: list[CacheLayer] = []

    def write(writes, batch, block_ids):
        caller[0] = "vllm"
        caches[:] = [*writes.layout.by_kind("swa"), *writes.layout.by_kind("compressed")]
        rows, positions, cos_sin = writes.inputs.rows, batch.positions, writes.inputs.cos_sin_dev
        # vLLM's main forward publishes each layer's window KV with the query
        # it projects (DeepseekV4Attention._prepare_and_attn).
        for cache in writes.layout.by_kind("swa"):
            kv = rows(writes.inputs.swa, cache.layer, batch, batch.num_tokens_padded)
            kc.vllm_window_kv_insert(writes.layout, cache, batch.metadata, kv, positions, cos_sin)
        # A kv source's compressor publishes its latent (DeepseekCompressor.insert_cache),
        # and its indexer turns the latent into index keys (DeepseekV4Indexer._produce_k).
        for kind, vllm_writer in (
            ("compressed", kc.vllm_compressed_insert),
            ("indexer", kc.vllm_produce_k),
        ):
            for cache in writes.layout.by_kind(kind):
                latent = rows(writes.inputs.latent, cache.layer, batch, batch.num_tokens_padded)
                vllm_writer(writes.layout, cache, batch.metadata, latent, positions, cos_sin)
        caller[0] = "selftest"
        try:
            return original(writes, batch, block_ids)
        finally:
            caller[0] = "builder"

    cpu = kn.Kernels.for_device(kn.detect_device())
    sources = {**cpu.sources, kn.SWA_WRITER: "real (vLLM CUDA op)"}  # the write reaches the op
    device = kn.Device("cuda", torch.device("cpu"), f"pretend {arch}", kc.ARCHS[arch][0])
    plans = (StepPlan("C prefill", (("C", None),), ()), StepPlan("C decode", (("C", 1),), ()))
    with (
        mock.patch.object(Writes, "write", write),
        kc.pretend_gpu(arch),
        kc.recording(calls, caller),
        kc.recording_writers(calls, caller, stop_for="vllm"),
        kc.recording_compressed_writer(calls, caller),
        kc.recording_indexer_k_writer(calls, caller),
    ):
        result = harness.run_geometry("split", device, kn.Kernels(device, sources), plans=plans)
        layer = _layer_cache_arguments()
    assert result.aborted is None, "\n".join([result.aborted, *result.layout[-1:]])
    return calls, layer, caches


def _layer_cache_arguments() -> dict:
    """What ``DeepseekV4Attention.__init__`` of the installed release gives its
    caches on this (pretended) arch under ``--kv-cache-dtype fp8``: its own
    statements that set ``kv_mxfp8``, the record widths and the page
    alignment, run on a bare object in the module's namespace (the compressed
    cache's record and alignment), then the ``DeepseekV4SWACache(...)`` call's
    packing arguments evaluated on it."""
    import ast
    import inspect
    import textwrap
    from types import SimpleNamespace

    from vllm.models.deepseek_v41 import attention as v41

    tree = ast.parse(textwrap.dedent(inspect.getsource(v41.DeepseekV4Attention.__init__)))
    wanted = ("kv_mxfp8", "swa_bytes_per_token", "compressed_bytes_per_token", "kv_page_alignment")
    statements = {
        node.targets[0].attr: node
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Attribute)
        and isinstance(node.targets[0].value, ast.Name)
        and node.targets[0].value.id == "self"
        and node.targets[0].attr in wanted
    }
    assert set(statements) == set(wanted), (
        f"__init__ no longer sets {set(wanted) - set(statements)}"
    )
    self = SimpleNamespace(kv_cache_dtype="fp8_ds_mla")
    namespace = dict(vars(v41))
    body: list[ast.stmt] = sorted(statements.values(), key=lambda node: node.lineno)
    exec(
        compile(ast.Module(body=body, type_ignores=[]), "<__init__>", "exec"),
        namespace,
        {"self": self},
    )
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DeepseekV4SWACache"
    ]
    assert len(calls) == 1, f"{len(calls)} DeepseekV4SWACache calls in __init__"
    arguments = {
        keyword.arg: eval(
            compile(ast.Expression(keyword.value), "<__init__>", "eval"), namespace, {"self": self}
        )
        for keyword in calls[0].keywords
        if keyword.arg and keyword.arg.startswith("packed_")
    }
    compressed = {name: getattr(self, name) for name in COMPRESSED_CACHE_ATTRIBUTES}
    return {**compressed, **arguments}


def _same_calls(arch: str, calls: list, prefix: str, writer: str) -> list:
    """vLLM's recorded calls of the kernels named ``prefix...``, after
    asserting that vLLM made some and that the self-test made the same ones
    with the same arguments; ``writer`` names vLLM's side in the messages."""
    recorded = [c for c in calls if c.kernel.startswith(prefix)]
    theirs = [c for c in recorded if c.caller == "vllm"]
    ours = [c for c in recorded if c.caller == "selftest"]
    assert theirs, f"{writer} wrote nothing on {arch}"
    assert [c.kernel for c in ours] == [c.kernel for c in theirs], (
        f"on {arch} the self-test calls {[c.kernel for c in ours]}, "
        f"{writer} {[c.kernel for c in theirs]}"
    )
    problems = [p for want, got in zip(theirs, ours) for p in kc.differences(want, got)]
    assert not problems, f"on {arch}:\n" + "\n".join(dict.fromkeys(problems))
    return theirs


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_selftest_writes_the_window_kv_through_the_main_forwards_writer(arch):
    calls, layer, caches = _record_writers(arch)
    swa_caches = [cache for cache in caches if cache.kind == "swa"]
    _same_calls(arch, calls, "_C.", "vLLM's main forward (the window KV)")
    assert swa_caches, "the self-test wrote no window KV"
    for cache in swa_caches:
        module = cache.module
        held = {
            name: getattr(module, name, None)
            for name in layer
            if name.startswith("packed_")  # the release's own arguments
        }
        want = {name: value for name, value in layer.items() if name.startswith("packed_")}
        assert held == want, f"on {arch} the layer's SWA cache gets {want}, the self-test's {held}"
        assert cache.module.kv_cache.shape[-1] == layer["packed_bytes_per_token"]
        assert cache.spec.alignment == layer["packed_page_alignment"]


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_selftest_writes_the_compressed_kv_as_the_compressor_does(arch):
    """vLLM's compressor publishes a kv source's latent through
    ``rope_quant_insert``, which launches the Triton kernel the cache's record
    width names (584: V4, 528: V4.1 MXFP8); recorded at those kernels, the
    self-test's write is the same launch (kernel, argument dtypes, shapes,
    strides, constexprs), into caches of the record and page alignment the
    layer's own ``__init__`` statements give the compressed cache on that arch."""
    calls, layer, caches = _record_writers(arch)
    theirs = _same_calls(arch, calls, kc.COMPRESSED_LAUNCH, "vLLM's compressor (the compressed KV)")
    width = layer["compressed_bytes_per_token"]
    written = {c.kernel: c.args["cache"].shape[-1] for c in theirs}
    assert set(written.values()) == {width}, (
        f"on {arch} the compressed KV is written as {written} (kernel: record bytes); "
        f"the layer's __init__ gives its compressed cache {width}-byte records"
    )
    compressed = [cache for cache in caches if cache.kind == "compressed"]
    assert compressed, "the self-test has no compressed cache"
    want = {name: layer[name] for name in COMPRESSED_CACHE_ATTRIBUTES}
    for cache in compressed:
        held = {name: getattr(cache.module, name) for name in COMPRESSED_CACHE_ATTRIBUTES}
        assert held == want, f"on {arch} the layer sets {want}, the self-test's {held}"
        assert cache.spec.state_content_bytes == width, (arch, cache.spec)
        assert cache.spec.alignment == layer["kv_page_alignment"], (arch, cache.spec)
        assert cache.bound.shape[-1] == width, (arch, tuple(cache.bound.shape))


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_selftest_writes_the_indexer_keys_as_the_indexer_does(arch):
    """vLLM's indexer turns a kv source's compressor latent into its index
    keys through ``DeepseekV4Indexer._produce_k`` (``k_norm(wk(latent))``,
    ``indexer_k_norm_rope_store`` with the layer's norm weight and epsilon, its
    cache, the metadata's slots, the compress ratio, the FP8 cache); recorded
    at the Triton kernel that store launches, the self-test's write is the
    same launch (kernel, argument dtypes, shapes, strides, constexprs, grid)."""
    calls, _, _ = _record_writers(arch)
    _same_calls(arch, calls, kc.INDEXER_K_LAUNCH, "vLLM's indexer (the index keys)")


@pytest.mark.vllm_release(*DSV41)
def test_sm100_window_records_read_back_exactly_on_cpu():
    """On SM100 the window KV and the compressed KV are V4.1 MXFP8 records:
    the self-test lays its caches out for them, its CPU writers store them
    (the SWA one byte for byte vLLM's Triton twin, tests/dsv41_sm120_geometry/test_selftest.py; the
    compressor's Triton kernel itself, interpreted), the readers decode them
    and the dense reference quantises every dim per 32; a prefill and a decode
    of the split geometry then read back exactly, every byte in its pages."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import StepPlan
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.writes import Writes

    cpu = kn.Kernels.for_device(kn.detect_device())
    device = kn.Device("cuda", torch.device("cpu"), "pretend sm100", kc.ARCHS["sm100"][0])
    plans = (
        StepPlan("C prefill", (("C", None),), ("indexer-prefill",)),
        StepPlan("C decode", (("C", 1),), ()),
    )
    records = []
    original = Writes.write

    def write(writes, batch, block_ids):
        records.append(writes.layout.kv_records)
        return original(writes, batch, block_ids)

    with (
        mock.patch.object(Writes, "write", write),
        kc.pretend_gpu("sm100"),
        kc.recording([], ["selftest"]),
    ):
        result = harness.run_geometry("split", device, kn.Kernels(device, cpu.sources), plans=plans)
    assert result.aborted is None, "\n".join([result.aborted, *result.layout[-1:]])
    assert records and all(
        r.mxfp8 and r.swa_bytes_per_token == r.compressed_bytes_per_token == 528 for r in records
    ), records
    assert result.clean, {k: t.problems for k, t in result.kernels.items() if t.problems}
    assert result.kernels[kn.COMPRESSED_WRITER].writes, "no compressed KV was written"
    for kernel in (kn.ATTENTION_PREFILL, kn.ATTENTION_DECODE):
        tally = result.kernels[kernel]
        assert tally.compared and tally.worst == 0.0, (kernel, tally.compared, tally.worst)
