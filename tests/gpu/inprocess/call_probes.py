"""Probes inside the vLLM process of a GPU test: what the buggy kernels were
actually asked to do, written as JSON lines to ``$VLLM_MLA_FIXES_GPU_CALL_LOG``.

* ``fa4``: every call of FA4's ``_flash_attn_fwd`` (warm-up compiles from
  compile-only specs, and real calls) with its ``total_q`` (query rows) and
  the Split-KV decision of FA4's own ``num_splits_heuristic``; written even
  when the call raises, with the error.  A test then knows whether the run
  reached a Split-KV kernel with a ``total_q`` warm-up never compiled -- the
  one case in which vLLM #49200 can happen.
* ``dsv41``: every eager call of FlashInfer's SM120 sparse-MLA entry
  (``flashinfer_trtllm_batch_decode_sparse_mla_dsv4`` as bound in vLLM's
  DeepSeek-V4.1 FlashInfer module).  After the kernel ran, a PyTorch decode
  reads the same records through the same cache views and indices the kernel
  got (page ``idx // rows``, base ``storage_offset + page * stride(0)``, data
  ``row * 576``, footer ``rows * 576 + row * 8``), so it follows whatever page
  geometry vLLM bound -- packed, per-ratio or strided kernel pages -- as
  FlashInfer does.  Logged: the relative L2 error of FlashInfer's output
  against it, and how many of the records read were never written (vLLM
  allocates KV caches zeroed; a written record has non-zero UE8M0 scales).

Only this module's own code; it wraps the two vLLM names and calls through.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

LOG_ENV = "VLLM_MLA_FIXES_GPU_CALL_LOG"
FA4_MODULE = "vllm.vllm_flash_attn.cute.interface"
DSV41_MODULE = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
DSV41_ENTRY = "flashinfer_trtllm_batch_decode_sparse_mla_dsv4"
# Where vLLM binds DeepGEMM's paged MQA logits for the DeepSeek-V4.1 indexer
# (the generic sparse indexer; 0.33+ also a specialised decode module), and
# the module whose attribute the prefill K gather is called through.
INDEXER_LOGITS_MODULES = (
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.models.deepseek_v41.nvidia.specialized_decode.attention.indexer",
)
INDEXER_GATHER_MODULE = "vllm._custom_ops"

# fp8_ds_mla V4 record: 448 fp8-e4m3 NoPE + 64 bf16 RoPE (576 B of data per
# row), and per row 8 footer bytes after the page's data: 7 UE8M0 scales (one
# per 64 NoPE dims) and a pad byte.
NOPE, ROPE_BYTES, DATA_BYTES, FOOTER_BYTES, SCALES = 448, 128, 576, 8, 7


def emit(record: dict[str, object]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    record = {"pid": os.getpid(), "time": time.time(), **record}
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------- FA4


def instrument_fa4(interface) -> None:
    original_forward = interface._flash_attn_fwd
    original_heuristic = interface.num_splits_heuristic
    state = threading.local()

    def num_splits_heuristic(*args, **kwargs):
        splits = original_heuristic(*args, **kwargs)
        decisions = getattr(state, "decisions", None)
        if decisions is not None:
            decisions.append(splits)
        return splits

    @functools.wraps(original_forward)  # also shares its compile_cache attribute
    def _flash_attn_fwd(q, *args, **kwargs):
        state.decisions = []
        shape = tuple(getattr(q, "shape", ()))
        record = {
            "probe": "fa4",
            "compile_only": bool(kwargs.get("compile_only", False)),
            "total_q": int(shape[0]) if len(shape) == 3 else None,
            "max_seqlen_k": kwargs.get("max_seqlen_k"),
        }
        try:
            return original_forward(q, *args, **kwargs)
        except BaseException as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            raise
        finally:
            decisions, state.decisions = state.decisions, None
            # With head dims 192/128 on SM100 the heuristic runs twice; the
            # last answer is the one the call used.  No answer: num_splits given.
            record["num_splits"] = decisions[-1] if decisions else kwargs.get("num_splits")
            emit(record)

    interface._flash_attn_fwd = _flash_attn_fwd
    interface.num_splits_heuristic = num_splits_heuristic


def new_split_kv_calls(records: list[dict]) -> list[dict]:
    """Real (not compile-only) FA4 calls that took Split-KV with a total_q
    that no compile-only Split-KV call of warm-up had."""
    fa4 = [r for r in records if r.get("probe") == "fa4"]
    warm = {r["total_q"] for r in fa4 if r["compile_only"] and (r["num_splits"] or 1) > 1}
    return [
        r
        for r in fa4
        if not r["compile_only"] and (r["num_splits"] or 1) > 1 and r["total_q"] not in warm
    ]


# ---------------------------------------------------------------- DSV4.1


def _storage_bytes(view):
    import torch

    storage = view.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def read_records(cache, idx):
    """(K=V rows [N, 512] fp32, written [N] bool) of the records at flat
    indices ``idx`` of an NHD ``[pages, rows, 1, 584]`` uint8 cache view,
    addressed through the view's own offset and page stride."""
    import torch

    rows = cache.shape[1]
    flat = _storage_bytes(cache)
    page = torch.div(idx, rows, rounding_mode="floor")
    row = idx % rows
    base = cache.storage_offset() + page * cache.stride(0)
    data = flat[(base + row * DATA_BYTES)[:, None] + torch.arange(DATA_BYTES, device=idx.device)]
    footer = flat[
        (base + rows * DATA_BYTES + row * FOOTER_BYTES)[:, None]
        + torch.arange(SCALES, device=idx.device)
    ]
    scale = torch.exp2(footer.float() - 127.0).repeat_interleave(64, dim=1)
    nope = data[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float() * scale
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1), footer.ne(0).any(dim=1)


def reference_sparse_mla(
    *,
    query,
    swa_kv_cache,
    sparse_indices,
    swa_topk_lens,
    out,
    bmm1_scale,
    sinks,
    compressed_kv_cache=None,
    extra_sparse_indices=None,
    extra_sparse_topk_lens=None,
    **_unused,
):
    """The SM120 DSV4 sparse-MLA decode in PyTorch: one softmax over the SWA
    segment and the compressed segment with the attention sink in the
    denominator; writes ``out`` and returns the number of valid records read
    and how many of them were never written."""
    import torch

    tokens, heads, dim = query.shape[0], query.shape[-2], query.shape[-1]
    keys, masks, unwritten, read = [], [], 0, 0
    segments = [(swa_kv_cache, sparse_indices, swa_topk_lens)]
    if extra_sparse_indices is not None:
        segments.append((compressed_kv_cache, extra_sparse_indices, extra_sparse_topk_lens))
    for cache, indices, lengths in segments:
        idx = indices.reshape(tokens, -1).long()
        width = idx.shape[1]
        valid = (
            torch.arange(width, device=idx.device)[None, :]
            < lengths.long().clamp(0, width)[:, None]
        )
        valid &= idx >= 0
        rows, written = read_records(cache, idx.clamp(min=0).reshape(-1))
        keys.append(rows.view(tokens, width, dim))
        masks.append(valid)
        read += int(valid.sum())
        unwritten += int((valid & ~written.view(tokens, width)).sum())
    kv = torch.cat(keys, dim=1)
    valid = torch.cat(masks, dim=1)
    q = query.reshape(tokens, heads, dim).float()
    logits = torch.einsum("thd,tnd->thn", q, kv) * bmm1_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :].expand(tokens, heads)
    peak = torch.maximum(logits.amax(dim=-1), sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(logits - peak[..., None])
    denominator = weights.sum(dim=-1) + torch.exp(sink - peak)
    result = torch.einsum("thn,tnd->thd", weights, kv) / denominator.clamp_min(1e-30)[..., None]
    out.view(tokens, heads, dim).copy_(result.to(out.dtype))
    return read, unwritten


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in fp32; inf for a non-finite output or a
    non-zero output where zero was wanted; 0 when both are zero."""
    import torch

    got, want = got.float(), want.float()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    norm = float(want.norm())
    if norm > 0:
        return float((got - want).norm()) / norm
    # Both zero is agreement; zero where something non-zero was wanted is not.
    return 0.0 if float(got.norm()) == 0 else float("inf")


def _page_geometry(cache) -> list | None:
    return None if cache is None else [int(cache.shape[1]), int(cache.stride(0))]


def _capturing(tensor) -> bool:
    import torch

    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def instrument_dsv41(module) -> None:
    original = getattr(module, DSV41_ENTRY)
    called_here = set()

    @functools.wraps(original)
    def checked(**kwargs):
        import torch

        # Only the process that runs the model calls FlashInfer: the engine
        # (EngineCore or a worker), whether it was forked or spawned, never the
        # API server.  One record per process; the tests require it.
        if os.getpid() not in called_here:
            called_here.add(os.getpid())
            emit({"probe": "engine", "module": module.__name__, "entry": DSV41_ENTRY})
        if _capturing(kwargs["query"]):
            emit({"probe": "dsv41", "skipped": "CUDA graph capture"})
            return original(**kwargs)
        # The geometry is what the kernel is asked to read: recorded before
        # it runs, so a kernel that rejects it still leaves the record.
        record = {
            "probe": "dsv41",
            "tokens": int(kwargs["query"].shape[0]),
            "swa_page": _page_geometry(kwargs.get("swa_kv_cache")),
            "extra_page": _page_geometry(kwargs.get("compressed_kv_cache"))
            if kwargs.get("extra_sparse_indices") is not None
            else None,
        }
        try:
            result = original(**kwargs)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            emit(record)
            raise
        try:
            if kwargs.get("sparse_indices_are_storage_offsets"):
                raise NotImplementedError("storage-offset indices (not the SM120 entry)")
            expected = torch.empty_like(kwargs["out"])
            record["records_read"], record["unwritten_read"] = reference_sparse_mla(
                **{**kwargs, "out": expected}
            )
            record["rel_error"] = relative_error(kwargs["out"], expected)
        except Exception as exc:  # noqa: BLE001 - the probe reports, the test decides
            record["probe_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        emit(record)
        return result

    setattr(module, DSV41_ENTRY, checked)


# ------------------------------------------------------------- indexer
#
# The DeepSeek-V4.1 indexer reads its own paged fp8 cache ([pages, rows, 132]:
# a page's rows x 128 fp8 values, then rows x 4 bytes of fp32 scale) in two
# places.  Decode: DeepGEMM's paged MQA logits, through the block table.
# Prefill: ``cp_gather_indexer_k_quant_cache`` copies each request's keys out.
# Both are recomputed here from the same view with the self-test's reference
# readers (``vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest``), which address pages as the kernels do.

INDEXER_LOGITS_ENTRY = "fp8_fp4_paged_mqa_logits"
INDEXER_GATHER_ENTRY = "cp_gather_indexer_k_quant_cache"


def _bound_arguments(function, args, kwargs) -> dict:
    import inspect

    bound = inspect.signature(function).bind(*args, **kwargs)
    return dict(bound.arguments)


def referenced_pages(cache, block_table, lengths):
    """The pages request ``b`` reads (its first ``ceil(lengths[b] / rows)``
    block-table entries), copied to the CPU in one piece, and the block table
    renumbered into that copy.  A layer's whole cache is gigabytes on a GPU;
    a request reads a few pages of it."""
    import torch

    rows = int(cache.shape[1])
    table = block_table.long().cpu()
    used = [(int(n) + rows - 1) // rows for n in lengths]
    ids = sorted({int(table[b, j]) for b, count in enumerate(used) for j in range(count)})
    compact = cache.index_select(0, torch.tensor(ids, dtype=torch.long, device=cache.device))
    position = {page: i for i, page in enumerate(ids)}
    renumbered = torch.zeros(len(used), max(used, default=0) or 1, dtype=torch.int32)
    for b, count in enumerate(used):
        for j in range(count):
            renumbered[b, j] = position[int(table[b, j])]
    return compact.cpu(), renumbered


def dequantised_q(q_fp8, q_scale):
    """The indexer's fp8 queries [B, next_n, H, 128] as fp32, times their MX
    scales where the call has them (SM100: int32 [B, next_n, H], four UE8M0
    exponents a head, one per 32 dims; vLLM's fp8 path passes unit scales)."""
    import torch

    q = q_fp8.float().cpu()
    if q_scale is None:
        return q
    exponents = q_scale.contiguous().cpu().view(torch.uint8).reshape(*q_scale.shape, 4)
    scales = torch.exp2(exponents.float() - 127.0)
    blocks = q.reshape(*q.shape[:-1], 4, q.shape[-1] // 4)
    return (blocks * scales[..., None]).reshape(q.shape)


def reference_paged_mqa_logits(q_fp8, kv_cache, weights, context_lens, block_tables, q_scale=None):
    """Per row ``(row, length, logits[length])`` of the indexer's decode scores,
    read through the block table from the bound view (fp8 q, its scale in the
    weights; on SM100 also unit MX q scales, keys' scales UE8M0x4, and varlen
    rows: one context length and one block-table row per query row), on the CPU."""
    import torch

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest import reference as ref

    ue8m0x4 = ref.index_scales_are_ue8m0x4()
    batch, next_n = int(q_fp8.shape[0]), int(q_fp8.shape[1])
    lens = context_lens.reshape(batch, -1).long().cpu()
    if lens.shape[1] != next_n:
        raise NotImplementedError(f"context lens {tuple(context_lens.shape)} for next_n {next_n}")
    pages, table = referenced_pages(kv_cache, block_tables, lens.amax(dim=1).tolist())
    cache = pages[:, :, 0] if pages.dim() == 4 else pages
    rows_per_page = int(cache.shape[1])
    q, weights = dequantised_q(q_fp8, q_scale), weights.float().cpu()
    out = []
    for b in range(batch):
        for n in range(next_n):
            length = int(lens[b, n])
            if length <= 0:
                continue
            s = torch.arange(length)
            flat = table[b, s // rows_per_page].long() * rows_per_page + s % rows_per_page
            keys = ref.read_index_keys(cache, flat, ue8m0x4)
            row = b * next_n + n
            out.append((row, length, ref.index_logits(q[b, n], weights[row], keys)))
    return out


def instrument_indexer_logits(module) -> None:
    original = getattr(module, INDEXER_LOGITS_ENTRY, None)
    if original is None:
        return

    @functools.wraps(original)
    def checked(*args, **kwargs):
        import torch

        call = _bound_arguments(original, args, kwargs)
        q, q_scale = call["q"]
        if _capturing(q):
            emit({"probe": "indexer_logits", "skipped": "CUDA graph capture"})
            return original(*args, **kwargs)
        kv_cache = call["kv_cache"]
        record = {
            "probe": "indexer_logits",
            "module": module.__name__,
            "indexer_page": [int(kv_cache.shape[1]), int(kv_cache.stride(0))],
        }
        try:
            logits = original(*args, **kwargs)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            emit(record)
            raise
        try:
            if q_scale is not None and q_scale.dtype != torch.int32:
                raise NotImplementedError(f"{q_scale.dtype} q scales (an MXFP4 indexer cache)")
            rows = reference_paged_mqa_logits(
                q, kv_cache, call["weights"], call["context_lens"], call["block_tables"], q_scale
            )
            got = torch.cat([logits[row, :length].float().cpu() for row, length, _ in rows])
            want = torch.cat([expected for _, _, expected in rows])
            record["rows"] = len(rows)
            record["rel_error"] = relative_error(got, want) if rows else 0.0
        except Exception as exc:  # noqa: BLE001 - the probe reports, the test decides
            record["probe_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        emit(record)
        return logits

    setattr(module, INDEXER_LOGITS_ENTRY, checked)


def instrument_indexer_gather(module) -> None:
    """``vllm._custom_ops.cp_gather_indexer_k_quant_cache``: the bytes it
    copied must be the bytes the self-test's gather reads from the same view."""
    original = getattr(module, INDEXER_GATHER_ENTRY, None)
    if original is None:
        return

    @functools.wraps(original)
    def checked(*args, **kwargs):
        import torch

        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.kernels import (
            gather_indexer_k_stand_in,
        )

        call = _bound_arguments(original, args, kwargs)
        kv_cache = call["kv_cache"]
        if _capturing(kv_cache):
            emit({"probe": "indexer_gather", "skipped": "CUDA graph capture"})
            return original(*args, **kwargs)
        record: dict[str, object] = {
            "probe": "indexer_gather",
            "indexer_page": [int(kv_cache.shape[1]), int(kv_cache.stride(0))],
        }
        try:
            result = original(*args, **kwargs)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            emit(record)
            raise
        try:
            cu = call["cu_seq_lens"]
            total = int(cu[-1])
            got_k = call["dst_k"][:total].reshape(total, -1).view(torch.uint8).cpu()
            got_scale = call["dst_scale"][:total].reshape(total, -1).view(torch.uint8).cpu()
            want_k = torch.zeros_like(got_k)
            want_scale = torch.zeros(total, 4, dtype=torch.uint8)
            bounds = cu.long().cpu()
            pages, table = referenced_pages(
                kv_cache, call["block_table"], (bounds[1:] - bounds[:-1]).tolist()
            )
            gather_indexer_k_stand_in(pages, want_k, want_scale, table, bounds)
            differ = (got_k != want_k).any(dim=1) | (got_scale != want_scale).any(dim=1)
            record["keys"] = total
            record["keys_differing"] = int(differ.sum())
        except Exception as exc:  # noqa: BLE001 - the probe reports, the test decides
            record["probe_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        emit(record)
        return result

    setattr(module, INDEXER_GATHER_ENTRY, checked)


# ------------------------------------------------------------ installing


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` right after the module ``name`` executed."""

    def __init__(self, hooks: dict):
        self.hooks = hooks
        self.busy: set[str] = set()

    def find_spec(self, name, path, target=None):
        hook = self.hooks.get(name)
        if hook is None or name in self.busy:
            return None
        self.busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            try:
                hook(module)
            except Exception as exc:  # noqa: BLE001 - never break vLLM's import
                emit(
                    {
                        "probe": "install",
                        "module": name,
                        "probe_error": f"{type(exc).__name__}: {exc}",
                    }
                )

        # the loader importlib found, its exec_module wrapped (no stand-in loader)
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    hooks = {
        FA4_MODULE: instrument_fa4,
        DSV41_MODULE: instrument_dsv41,
        **{name: instrument_indexer_logits for name in INDEXER_LOGITS_MODULES},
        INDEXER_GATHER_MODULE: instrument_indexer_gather,
    }
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks))
    emit({"probe": "install", "argv": sys.argv[:3]})


def read_log(path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as log:
            return [json.loads(line) for line in log if line.strip()]
    except FileNotFoundError:
        return []
