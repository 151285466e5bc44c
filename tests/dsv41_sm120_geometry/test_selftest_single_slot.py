"""One wrong slot, one wrong key, one wrong top-k index: each turns the self-test red (issue 33).

With the bounds of a GPU run (the readers held to the real kernels' bounds:
FlashInfer's 0.060 relative L2 per row, DeepGEMM's per-element logit bound;
the writers' records to one step of each element's grid), the fix's default
geometry replays a prefill and a decode on CPU (a 260-token prompt where the
top-k must choose among more states than it keeps, else a 60-token one), on
vLLM's own code, pretending to be an SM120 host.  Run as is, every comparison
holds.  Then one fault at a time is injected as the isolation tests inject
theirs, by wrapping the self-test's kernel calls:

* one wrong slot: the window-KV writer is given one token's slot moved to the
  neighbouring row of its page;
* one wrong window row: one record in a window page holds another token's
  bytes when the attention reads it;
* one wrong key: one indexer key in a page holds another state's bytes when
  DeepGEMM's paged MQA logits read it;
* one wrong top-k index: the logits put one index outside the top-64 at the top.

Each must fail the geometry, and the check that sees it is named: a writer's
record at the token's own slot against its per-element bound, the page bytes a
reader reads (exact), or the logits' per-element bound and the top-k.  Under the earlier bounds (2^-3 of
a row's largest logit, one e4m3 step of a row's largest value) such single
faults passed a large share of the time.
"""

from __future__ import annotations

import functools

import fix_releases
import pytest
import torch

from vllm_mla_fixes.fixes import dsv41_sm120_geometry
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import bounds as bd
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import kernels as kn
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import reference as ref

# The injections test the self-test's own comparisons, which read no release's
# code; the newest covered release runs them (the faultless run on every covered
# release is tests/dsv41_sm120_geometry/test_selftest.py's).
NEWEST_DSV41 = fix_releases.newest(dsv41_sm120_geometry.INFO)


def _plans(long: bool):
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.timeline import StepPlan

    if not long:
        return (StepPlan("C prefill", (("C", None),), ()), StepPlan("C decode", (("C", 1),), ()))
    return (
        StepPlan("A prefill 1/2", (("A", 200),), ()),
        StepPlan("A prefill 2/2", (("A", 60),), ()),
        StepPlan("A decode", (("A", 1),), ()),
    )


def _gpu_reader_bounds(kernel: str, kernels: kn.Kernels, heads: int) -> bd.Bound:
    """What a GPU with the real readers holds each read to."""
    if kernel in (kn.ATTENTION_DECODE, kn.ATTENTION_PREFILL):
        return bd.real_attention_bound(heads)
    if kernel == kn.INDEXER_LOGITS:
        return bd.DEEPGEMM_LOGITS
    return bd.EXACT


def _run(monkeypatch, long: bool = False):
    """The split geometry with a GPU's bounds, its writers and readers run on CPU."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import harness
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import simulated_sm120_host

    monkeypatch.setattr(bd, "bound_for", _gpu_reader_bounds)
    sources = kn.Kernels.for_device(kn.detect_device()).sources
    device = kn.Device("sm12x", torch.device("cpu"), "pretend SM120", (12, 0))
    kernels = kn.Kernels(device, dict(sources))
    with simulated_sm120_host():
        result = harness.run_geometry("split", device, kernels, plans=_plans(long))
    assert result.aborted is None, "\n".join([result.aborted, *result.layout[-1:]])
    return result


def _problems(result, kernel: str) -> str:
    tally = result.kernels.get(kernel)
    return "\n".join(tally.problems) if tally else ""


def _once(wrapper):
    """``wrapper(original, self, *args, **kwargs)`` on the first call only."""
    calls: list[None] = []  # one entry per call

    def install(original):
        @functools.wraps(original)
        def call(self, *args, **kwargs):
            calls.append(None)
            if len(calls) == 1:
                return wrapper(original, self, *args, **kwargs)
            return original(self, *args, **kwargs)

        return call

    return install


@pytest.mark.vllm_release(NEWEST_DSV41)
def test_the_faultless_run_holds_under_a_gpus_bounds(monkeypatch):
    result = _run(monkeypatch, long=True)
    assert result.clean, {k: t.problems for k, t in result.kernels.items() if t.problems}
    writer = result.kernels[kn.SWA_WRITER]
    assert writer.compared > 0 and writer.bound == bd.GPU_WRITER_ROUNDING
    assert result.kernels[kn.INDEXER_LOGITS].bound == bd.DEEPGEMM_LOGITS


@pytest.mark.vllm_release(NEWEST_DSV41)
def test_one_wrong_slot_fails(monkeypatch):
    def moved(original, self, view, kv, positions, cos_sin, slots, block_size, *rest):
        slots = slots.clone()
        token = int(torch.nonzero(slots >= 0)[4])  # the fifth token written
        slot = int(slots[token])
        slots[token] = slot + 1 if (slot + 1) % block_size else slot - 1
        return original(self, view, kv, positions, cos_sin, slots, block_size, *rest)

    monkeypatch.setattr(kn.Kernels, "write_swa", _once(moved)(kn.Kernels.write_swa))
    result = _run(monkeypatch)
    assert not result.clean
    # the record at the token's own slot is not its record
    assert f"{kn.SWA_WRITER} off by" in _problems(result, kn.SWA_WRITER)


@pytest.mark.vllm_release(NEWEST_DSV41)
def test_one_wrong_window_row_fails(monkeypatch):
    """The attention reads 60 window rows for the decode: one holds another
    token's record (a stray write's, or a misaddressed page)."""
    stand_in = kn.sparse_mla_stand_in
    calls: list[None] = []  # one entry per call

    def misread(**kwargs):
        calls.append(None)
        if len(calls) == 1:
            # the last query row's window: its first row gets its second's record
            cache, indices = kwargs["swa_kv_cache"], kwargs["sparse_indices"][-1].flatten()
            rows, width = int(cache.shape[1]), int(cache.shape[-1])
            assert width == ref.RECORD_BYTES and int(indices[1]) >= 0
            flat = ref.storage_bytes(cache)
            starts = [
                cache.storage_offset()
                + int(slot) // rows * cache.stride(0)
                + int(slot) % rows * ref.DATA_BYTES
                for slot in (indices[0], indices[1])
            ]
            flat[starts[0] : starts[0] + ref.DATA_BYTES] = flat[
                starts[1] : starts[1] + ref.DATA_BYTES
            ].clone()
        return stand_in(**kwargs)

    monkeypatch.setattr(kn, "sparse_mla_stand_in", misread)
    result = _run(monkeypatch)
    assert calls and not result.clean
    assert "(page bytes)" in _problems(result, kn.ATTENTION_PREFILL)


@pytest.mark.vllm_release(NEWEST_DSV41)
def test_one_wrong_key_fails(monkeypatch):
    def swapped(original, self, q, kv_view, weights, context_lens, block_table, *rest):
        rows = int(kv_view.shape[1])
        flat = ref.storage_bytes(kv_view)
        table = block_table.to(torch.int64).cpu()

        def values_at(state: int) -> int:
            page = kv_view.storage_offset() + int(table[0, state // rows]) * kv_view.stride(0)
            return page + (state % rows) * ref.INDEX_DIM

        to, source = values_at(3), values_at(70)  # state 3 holds state 70's key
        flat[to : to + ref.INDEX_DIM] = flat[source : source + ref.INDEX_DIM].clone()
        return original(self, q, kv_view, weights, context_lens, block_table, *rest)

    monkeypatch.setattr(kn.Kernels, "paged_logits", _once(swapped)(kn.Kernels.paged_logits))
    result = _run(monkeypatch, long=True)
    assert not result.clean
    problems = _problems(result, kn.INDEXER_LOGITS)
    assert "keys read are not the tokens' own (page bytes)" in problems
    assert f"{kn.INDEXER_LOGITS} off by" in problems  # the logit, past its own bound


@pytest.mark.vllm_release(NEWEST_DSV41)
def test_one_wrong_topk_index_fails(monkeypatch):
    def promoted(original, self, *args):
        logits = original(self, *args).clone()
        valid = torch.isfinite(logits[0])
        outsider = int(torch.nonzero(valid)[torch.argmin(logits[0][valid])])
        logits[0, outsider] = logits[0][valid].max() + 1  # the lowest score, now the top one
        return logits

    monkeypatch.setattr(kn.Kernels, "paged_logits", _once(promoted)(kn.Kernels.paged_logits))
    result = _run(monkeypatch, long=True)
    assert not result.clean
    problems = _problems(result, kn.INDEXER_LOGITS)
    assert "top-64: 1 indices outside the dense top-64" in problems


def test_topk_allows_only_swaps_the_logits_bounds_cover():
    want = torch.tensor([10.0, 9.0, 8.0, 7.0, 1.0])
    tight = torch.zeros(5)
    assert bd.topk_outsiders(torch.tensor([0, 1, 2]), want, tight, 3) == 0
    assert bd.topk_outsiders(torch.tensor([0, 1, 3]), want, tight, 3) == 1
    # 7 and 8 are within their bounds of each other: a swap the kernel may make
    loose = torch.tensor([0.0, 0.0, 0.6, 0.6, 0.0])
    assert bd.topk_outsiders(torch.tensor([0, 1, 3]), want, loose, 3) == 0
    assert bd.topk_outsiders(torch.tensor([0, 1, 4]), want, loose, 3) == 1


def test_per_element_bounds_see_one_element_a_row_bound_would_hide():
    """One wrong element among right ones: the row's largest value would hide
    it (2^-3 of 100 is 12.5), its own bound does not."""
    want = torch.tensor([100.0, 1.0, 1.0, 1.0])
    got = torch.tensor([100.0, 1.0, 3.0, 1.0])  # one element off by 2
    error, limit = bd.worst_element(got, want, bd.E4M3_STEP * torch.maximum(got, want).abs())
    assert error == 2.0 and limit == bd.E4M3_STEP * 3.0 and error > limit
    assert bd.worst_element(want, want, torch.zeros(4)) == (0.0, 0.0)
    assert bd.worst_element(got, want, torch.zeros(4)) == (2.0, 0.0)


def test_the_logit_bound_alone_is_loose_so_pages_are_compared_first():
    """The figure docs/selftest.md quotes: with the self-test's inputs (32
    heads, q N(0, 1) x 64 in e4m3, weights U(0, 1), keys stored with one
    power-of-two scale), another state's key moves its logit past that
    logit's own bound in 74% of 200 draws (median 2.1 times the bound)."""
    gen = torch.Generator().manual_seed(33)
    ratios = []
    for _ in range(200):
        q = (torch.randn(32, 128, generator=gen) * 64).to(torch.float8_e4m3fn)
        weights = torch.rand(32, generator=gen)
        keys = torch.randn(65, 128, generator=gen)
        scale = torch.exp2(torch.ceil(torch.log2(keys.abs().amax(dim=1, keepdim=True) / 448)))
        keys = (keys / scale).to(torch.float8_e4m3fn).float() * scale
        want = ref.index_logits(q, weights, keys[:64])
        bound = bd.logits_element_bound(q, weights, keys[:64], want)
        wrong = keys[:64].clone()
        wrong[7] = keys[64]
        ratios.append(float((ref.index_logits(q, weights, wrong)[7] - want[7]).abs() / bound[7]))
    ratios_t = torch.tensor(ratios)
    caught = float((ratios_t > 1).float().mean())
    print(f"wrong key past its logit bound: {caught:.0%}, median {ratios_t.median():.2f}x")
    assert (round(caught, 2), round(float(ratios_t.median()), 1)) == (0.74, 2.1)
