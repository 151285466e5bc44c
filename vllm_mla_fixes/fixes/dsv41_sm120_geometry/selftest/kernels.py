"""The kernels the self-test runs on the pages: real on the device that has them, else stand-ins.

Writers are what vLLM's DeepSeek-V4.1 layers call: the main forward's
sliding-window insert, the layer's own ``_fused_qnorm_rope_kv_insert``
(``torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``, CUDA only;
its KV half is bit for bit ``fused_deepseek_v4_kv_rope_insert``, as vLLM's
``forward_kv`` says, whose Triton twin is ``quantize_and_insert_k_cache`` after
the same RoPE; on CPU :func:`insert_v4_records_stand_in` writes the bytes the
interpreted twin writes), ``rope_quant_insert`` for the compressed KV cache
(what vLLM's ``DeepseekCompressor.insert_cache`` calls; it launches the
Triton kernel the cache's record width names) and ``indexer_k_norm_rope_store``
for the indexer keys (Triton; interpreted on CPU).  On SM100 the releases
write both the SWA and the compressed KV as V4.1 MXFP8 records (528 bytes, the
layer's ``kv_mxfp8``; the layout holds them there, and on CPU
:func:`insert_mxfp8_records_stand_in` writes what the SWA record's Triton twin
writes) and the indexer keys' scales as UE8M0x4.

Readers are reached through vLLM's own entry points:

* attention: ``DeepseekV4FlashInferSM120Attention._forward_decode`` and
  ``_forward_prefill`` (vLLM's index computation and its call of
  ``flashinfer_trtllm_batch_decode_sparse_mla_dsv4``).  On SM12x that is
  FlashInfer's SM120 sparse-MLA kernel; elsewhere the module's reference to it
  is pointed at :func:`sparse_mla_stand_in` for the run: FlashInfer's own
  page-size envelope, then a PyTorch read of the pages as the kernel addresses
  them;
* indexer decode: ``vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits`` (DeepGEMM)
  with the indexer metadata builder's block table, context lengths and
  schedule, on the view ``sparse_attn_indexer`` passes it; on CPU
  :func:`paged_mqa_logits_stand_in`, which takes the pages DeepGEMM's own SM120
  declaration takes (the fix's ``envelope``);
* indexer prefill: ``vllm._custom_ops.cp_gather_indexer_k_quant_cache`` with
  the builder's prefill chunks; on CPU :func:`gather_indexer_k_stand_in`.

Each kernel reports whether it ran for real or as a stand-in; a stand-in row
is never reported as a real kernel's pass.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from . import reference as ref

ATTENTION_DECODE = "attention decode (FlashInfer SM120 sparse MLA)"
ATTENTION_PREFILL = "attention prefill (FlashInfer SM120 sparse MLA)"
INDEXER_LOGITS = "indexer decode logits + top-k (DeepGEMM paged MQA)"
INDEXER_GATHER = "indexer prefill K gather (cp_gather_indexer_k_quant_cache)"
SWA_WRITER = "SWA writer (fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert)"
COMPRESSED_WRITER = "compressed KV writer (rope_quant_insert)"
INDEXER_WRITER = "indexer K writer (indexer_k_norm_rope_store)"
ZEROER = "new-block zeroing (KVBlockZeroer)"
# The CUDA-only op's Triton twin, interpreted, is one program per token; the
# stand-in computes the same bytes for all tokens at once (tests/dsv41_sm120_geometry/test_selftest.py
# compares the two byte for byte on each release).
SWA_TWIN_STAND_IN = (
    "stand-in: PyTorch, byte for byte its Triton twin quantize_and_insert_k_cache "
    "as Triton's interpreter runs it (CUDA-only op)"
)
READERS = (ATTENTION_DECODE, ATTENTION_PREFILL, INDEXER_LOGITS, INDEXER_GATHER)
# The DSpark long-prefill check's own kernels (selftest --geometry dspark-long-prefill).
INDEXER_TOPK = "indexer top-k within each row's length (top_k_per_row_decode)"
TOPK_GATHER = "top-k slot gather (compute_global_topk_indices_and_lens)"
INDEX_READERS = (INDEXER_TOPK, TOPK_GATHER)
TOPK_STAND_IN = "stand-in: torch.topk within each row's length"
WRITERS = (SWA_WRITER, COMPRESSED_WRITER, INDEXER_WRITER, ZEROER)


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu", "sm12x" or "cuda" (another CUDA GPU)
    torch_device: torch.device
    name: str
    capability: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        if self.capability is None:
            return self.name
        return f"{self.name} (SM{self.capability[0]}{self.capability[1]})"


def detect_device() -> Device:
    """The local CUDA GPU, or the CPU when there is none."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        kind = "sm12x" if major == 12 else "cuda"
        return Device(kind, torch.device("cuda", 0), torch.cuda.get_device_name(0), (major, minor))
    return Device("cpu", torch.device("cpu"), "CPU")


@dataclass(frozen=True)
class Launch:
    """One reader kernel launch as it was made: the kernel's own callable (the
    real kernel, or its stand-in) and its arguments, so that it can be made
    again alone (the timing) or on other pages (:mod:`.pairing`)."""

    kernel: Callable[..., object]
    args: tuple[Any, ...] = ()  # tensors and numbers as the kernel takes them
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> object:
        return self.kernel(*self.args, **self.kwargs)


class Kernels:
    """The writers and readers of one device, each real or stand-in
    (:attr:`sources` says which, and why a stand-in)."""

    def __init__(self, device: Device, sources: dict[str, str]):
        self.device = device
        self.sources = sources
        self.attention_calls = 0
        # Called after each attention call with the call's arguments (the
        # output filled): lets the GPU tests' probe read the same pages.
        self.attention_observer: Callable[..., object] | None = None
        self._recorders: list[list[Launch]] = []  # see recording()

    @classmethod
    def for_device(cls, device: Device) -> Kernels:
        if device.kind == "cpu":
            interpreted = "real (Triton, interpreted on CPU)"
            stand_in = "stand-in: PyTorch reader (no GPU)"
            return cls(
                device,
                {
                    COMPRESSED_WRITER: interpreted,
                    INDEXER_WRITER: interpreted,
                    ZEROER: interpreted,
                    SWA_WRITER: SWA_TWIN_STAND_IN,
                    ATTENTION_DECODE: stand_in,
                    ATTENTION_PREFILL: stand_in,
                    INDEXER_LOGITS: stand_in,
                    INDEXER_GATHER: stand_in,
                    INDEXER_TOPK: f"{TOPK_STAND_IN} (no GPU)",
                    TOPK_GATHER: interpreted,
                },
            )
        import vllm._custom_ops  # noqa: F401  (loads vLLM's CUDA ops into torch.ops)

        def op(namespace: str, name: str) -> str:
            found = hasattr(getattr(torch.ops, namespace), name)
            return (
                "real (vLLM CUDA op)"
                if found
                else f"stand-in: torch.ops.{namespace}.{name} missing"
            )

        sources = {
            COMPRESSED_WRITER: "real (Triton)",
            INDEXER_WRITER: "real (Triton)",
            ZEROER: "real (Triton)",
            SWA_WRITER: op("_C", "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert"),
            INDEXER_GATHER: op("_C_cache_ops", "cp_gather_indexer_k_quant_cache"),
            INDEXER_TOPK: op("_C", "top_k_per_row_decode"),
            TOPK_GATHER: "real (Triton)",
        }
        if sources[INDEXER_TOPK].startswith("stand-in"):
            sources[INDEXER_TOPK] += f"; {TOPK_STAND_IN} instead"
        if sources[SWA_WRITER].startswith("stand-in"):
            sources[SWA_WRITER] += "; its Triton twin writes instead"
        if device.kind == "sm12x":
            from vllm.utils.flashinfer import has_flashinfer_sparse_mla_sm120

            attention = (
                "real (FlashInfer)"
                if has_flashinfer_sparse_mla_sm120()
                else "stand-in: PyTorch reader (FlashInfer has no SM120 sparse-MLA API here)"
            )
        else:
            attention = "stand-in: PyTorch reader (FlashInfer's SM120 kernel needs SM12x)"
        sources[ATTENTION_DECODE] = sources[ATTENTION_PREFILL] = attention
        from vllm.utils.deep_gemm import is_deep_gemm_supported

        sources[INDEXER_LOGITS] = (
            "real (DeepGEMM)"
            if is_deep_gemm_supported()
            else "stand-in: PyTorch reader (vLLM finds DeepGEMM unusable here: "
            "is_deep_gemm_supported() is False)"
        )
        return cls(device, sources)

    def is_real(self, kernel: str) -> bool:
        return self.sources[kernel].startswith("real")

    @contextlib.contextmanager
    def recording(self, into: list[Launch]) -> Iterator[list[Launch]]:
        """Each reader launch made meanwhile is also appended to ``into`` (and
        to the lists of any enclosing ``recording``)."""
        self._recorders.append(into)
        try:
            yield into
        finally:
            self._recorders.pop()  # nested blocks end innermost first

    def _launch(self, kernel: Callable[..., object], *args: object, **kwargs: object) -> object:
        launch = Launch(kernel, args, kwargs)
        for recorder in self._recorders:
            recorder.append(launch)
        return launch()

    # ------------------------------------------------------------ writers

    def write_swa(
        self,
        view: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        slots: torch.Tensor,
        block_size: int,
        layer: Any = None,  # vLLM's attention module of the layer
        swa_metadata: object = None,  # vLLM's sliding-window metadata of the layer
    ) -> None:
        """``kv``: [T, 512] bf16 as the layer hands it (RoPE not yet applied).
        On a GPU, the main forward's writer: ``layer``'s own
        ``_fused_qnorm_rope_kv_insert`` with ``swa_metadata``, whose Q half
        runs on a throwaway query."""
        if self.is_real(SWA_WRITER):
            assert layer is not None and swa_metadata is not None
            layer.rotary_emb = SimpleNamespace(cos_sin_cache=cos_sin)
            query = kv.new_zeros(kv.shape[0], layer.n_local_heads, kv.shape[1])
            layer._fused_qnorm_rope_kv_insert(
                query, kv, positions, {layer.swa_cache_layer.prefix: swa_metadata}
            )
            return
        rotated = ref.rope_swa_rows(
            kv,
            cos_sin[positions.clamp(0, cos_sin.shape[0] - 1)],
            ref.Rounding("round-to-nearest-even"),
        )
        # The cache's row width names its record, as for vLLM's own readers.
        mxfp8 = view.shape[-1] == ref.MX_RECORD_BYTES
        if self.sources[SWA_WRITER] == SWA_TWIN_STAND_IN:
            stand_in = insert_mxfp8_records_stand_in if mxfp8 else insert_v4_records_stand_in
            stand_in(rotated, view.view(view.shape[0], -1), slots, block_size=block_size)
            return
        from vllm.models.deepseek_v41.common.ops.cache_utils import quantize_and_insert_k_cache

        quantize_and_insert_k_cache(
            rotated,
            view.view(view.shape[0], -1),
            slots,
            block_size=block_size,
            **({"bytes_per_token": ref.MX_RECORD_BYTES} if mxfp8 else {}),
        )

    @staticmethod
    def write_compressed(
        view: torch.Tensor,
        latent: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        slots: torch.Tensor,
        ratio: int,
    ) -> None:
        from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import (
            rope_quant_insert,
        )

        rope_quant_insert(latent, positions, cos_sin, view, slots, ratio)

    @staticmethod
    def write_indexer(
        view: torch.Tensor,
        k_pre: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        slots: torch.Tensor,
        ratio: int,
    ) -> None:
        from vllm.models.deepseek_v41.common.ops import indexer_k_norm_rope_store

        indexer_k_norm_rope_store(k_pre, positions, cos_sin, weight, eps, view, slots, ratio, False)

    # ------------------------------------------------------------ attention

    @contextlib.contextmanager
    def attention_entry(self) -> Iterator[None]:
        """For the run, vLLM's SM120 attention module calls FlashInfer's
        kernel (SM12x) or the stand-in, counting the calls."""
        from vllm.models.deepseek_v41.nvidia import flashinfer_sparse as module

        name = "flashinfer_trtllm_batch_decode_sparse_mla_dsv4"
        upstream = getattr(module, name)
        target = upstream if self.is_real(ATTENTION_DECODE) else sparse_mla_stand_in

        def counted(**kwargs: object) -> object:
            self.attention_calls += 1
            result = self._launch(target, **kwargs)
            if self.attention_observer is not None:
                self.attention_observer(**kwargs)
            return result

        setattr(module, name, counted)
        try:
            yield
        finally:
            setattr(module, name, upstream)

    # ------------------------------------------------------------ indexer

    def paged_logits(
        self,
        q_fp8: torch.Tensor,
        kv_view: torch.Tensor,
        weights: torch.Tensor,
        context_lens: torch.Tensor,
        block_table: torch.Tensor,
        schedule: torch.Tensor,
        max_len: int,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Indexer decode logits [rows, max_len] as ``sparse_attn_indexer``
        asks DeepGEMM for them on this device: fp8 Q with its scale folded
        into the weights; on SM100 (0.33.0 on) also the unit MX Q scales and
        weights that vLLM's ``mqa_logits_mx_inputs`` makes, the logits dtype
        the release's DeepSeek config resolves, and the varlen rows' request
        ``indices`` the metadata builder made (tests/dsv41_sm120_geometry/test_selftest_kernel_calls.py
        compares this call with vLLM's own, per release and arch)."""
        if not self.is_real(INDEXER_LOGITS):
            return self._launch(
                paged_mqa_logits_stand_in,
                q_fp8,
                kv_view,
                weights,
                context_lens,
                block_table,
                max_len,
            )
        from vllm.utils import deep_gemm

        func = deep_gemm.fp8_fp4_paged_mqa_logits
        params = inspect.signature(func).parameters
        logits_dtype = indexer_logits_dtype()
        q_scale = None
        mx_inputs = getattr(deep_gemm, "mqa_logits_mx_inputs", None)  # 0.33.0 on
        if mx_inputs is not None:
            dtype_arg = (
                (logits_dtype,) if "logits_dtype" in inspect.signature(mx_inputs).parameters else ()
            )
            q_scale, weights = mx_inputs(q_fp8, None, weights, *dtype_arg)
        extra: dict[str, object] = {}
        if "clean_logits" in params:  # 0.32.0
            extra["clean_logits"] = False
        if "logits_dtype" in params:
            extra["logits_dtype"] = logits_dtype
        if indices is not None:
            extra["indices"] = indices
        return self._launch(
            func,
            (q_fp8, q_scale),
            kv_view,
            weights,
            context_lens,
            block_table,
            schedule,
            max_len,
            **extra,
        )

    def topk_within_lengths(
        self, logits: torch.Tensor, lengths: torch.Tensor, topk: int
    ) -> torch.Tensor:
        """Each row's ``topk`` best columns below its length, -1 after, as
        vLLM's decode indexer selects them (one query row per token)."""
        rows = int(logits.shape[0])
        out = torch.full((rows, topk), -1, dtype=torch.int32, device=logits.device)
        if not self.is_real(INDEXER_TOPK):
            self._launch(topk_within_lengths_stand_in, logits, lengths, out)
            return out
        from vllm import _custom_ops as ops

        self._launch(
            ops.top_k_per_row_decode,
            logits,
            1,
            lengths.to(torch.int32).contiguous(),
            out,
            rows,
            logits.stride(0),
            logits.stride(1),
            topk,
        )
        return out

    def gather_k(
        self, cache: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor, *where: torch.Tensor
    ) -> None:
        """The indexer's K gather into ``keys`` and ``scales``; ``where`` is the
        block table and the cumulative row counts, as the op takes them."""
        if not self.is_real(INDEXER_GATHER):
            on_cpu = keys.cpu(), scales.cpu()
            gather_indexer_k_stand_in(cache.cpu(), *on_cpu, *(t.cpu() for t in where))
            keys.copy_(on_cpu[0])
            scales.copy_(on_cpu[1])
            return
        from vllm import _custom_ops as ops

        ops.cp_gather_indexer_k_quant_cache(cache, keys, scales, *where)


# --------------------------------------------------------------- stand-ins


def flashinfer_page_problem(
    page_rows: int, extra_rows: int | None, num_heads: int, topk: int
) -> str | None:
    """Why FlashInfer's SM120 sparse-MLA kernels would refuse these pages, from
    the installed FlashInfer's own declarations (the fix's ``envelope``).  A
    call goes to the decode or the prefill kernels, so a page must be taken by
    both; an unknown envelope takes nothing."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope

    declared = envelope.kernel_envelopes()
    pages = [(envelope.FLASHINFER_DECODE, envelope.FLASHINFER_PREFILL, page_rows, "primary")]
    if extra_rows is not None:
        pages.append(
            (
                envelope.FLASHINFER_DECODE_EXTRA,
                envelope.FLASHINFER_PREFILL_EXTRA,
                extra_rows,
                "extra (compressed)",
            )
        )
    for *kernels, rows, which in pages:
        for kernel in kernels:
            e = declared[kernel]
            if e.unknown is not None:
                return f"{e.title}: envelope unknown ({e.unknown})"
            if not e.accepts_rows(rows):
                return f"{which} page of {rows} rows: {e.title} takes {e.rows} ({e.sources[0]})"
            if e.heads is not None and num_heads not in e.heads:
                return f"{num_heads} heads: {e.title} takes {e.heads}"
            if e.topk is not None and topk not in e.topk:
                return f"top-k {topk}: {e.title} takes {e.topk}"
    return None


def sparse_mla_stand_in(
    *,
    query: torch.Tensor,
    swa_kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor,
    sparse_indices: torch.Tensor,
    compressed_kv_cache: torch.Tensor | None,
    out: torch.Tensor,
    bmm1_scale: float | torch.Tensor,
    sinks: torch.Tensor,
    kv_layout: str,
    swa_topk_lens: torch.Tensor,
    extra_sparse_indices: torch.Tensor | None = None,
    extra_sparse_topk_lens: torch.Tensor | None = None,
    **_ignored: object,
) -> None:
    """FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` as vLLM calls it on
    SM120, in PyTorch: refuse page sizes FlashInfer has no kernel for, then read
    the pages exactly where the kernel reads them."""
    if kv_layout != "NHD":
        raise ValueError(f"stand-in reads NHD caches, got {kv_layout}")
    problem = flashinfer_page_problem(
        int(swa_kv_cache.shape[1]),
        int(compressed_kv_cache.shape[1]) if compressed_kv_cache is not None else None,
        int(query.shape[1]),
        int(sparse_indices.shape[-1]),
    )
    if problem is not None:
        raise ValueError(f"FlashInfer refuses this page geometry: {problem}")
    decoded = ref.sm120_sparse_decode(
        query.float().cpu(),
        swa_kv_cache.cpu(),
        sparse_indices.cpu(),
        swa_topk_lens.cpu(),
        None if compressed_kv_cache is None else compressed_kv_cache.cpu(),
        None if extra_sparse_indices is None else extra_sparse_indices.cpu(),
        None if extra_sparse_topk_lens is None else extra_sparse_topk_lens.cpu(),
        sinks.float().cpu()[: query.shape[1]],
        float(bmm1_scale),
    )
    out.copy_(decoded.to(out.dtype))


def paged_mqa_logits_stand_in(
    q_fp8: torch.Tensor,
    kv_view: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """DeepGEMM's paged MQA logits in PyTorch: ``logits[t, s] = k_scale[s] *
    sum_h w[t, h] * relu(q[t, h] . k[s])`` for request-local compressed
    position ``s`` read through the block table, -inf past the context;
    computed on the CPU, returned on the device of ``q_fp8``."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope

    device = q_fp8.device
    q_fp8, kv_view, weights = q_fp8.cpu(), kv_view.cpu(), weights.cpu()
    context_lens, block_table = context_lens.cpu(), block_table.cpu()

    declared = envelope.kernel_envelopes()[envelope.DEEPGEMM_LOGITS_FP8]
    rows = int(kv_view.shape[1])
    if declared.unknown is not None:
        raise ValueError(f"DeepGEMM's paged MQA logits: envelope unknown ({declared.unknown})")
    if not declared.accepts_rows(rows):
        raise ValueError(
            f"DeepGEMM's paged MQA logits take pages of {declared.rows} states on SM12x "
            f"({declared.sources[0]}), the indexer cache has {rows}"
        )
    batch, next_n = q_fp8.shape[:2]
    out = torch.full((batch * next_n, max_len), float("-inf"))
    cache = kv_view[:, :, 0] if kv_view.dim() == 4 else kv_view
    # Rows of one block-table row read a prefix of the same keys: read them once.
    longest: dict[tuple[int, ...], int] = {}
    for b in range(batch):
        table_row = tuple(block_table[b].tolist())
        longest[table_row] = max(longest.get(table_row, 0), int(context_lens[b].max()))
    keys_of = {}
    for table_row, length in longest.items():
        s = torch.arange(max(length, 0))
        flat = torch.tensor(table_row, dtype=torch.int64)[s // rows] * rows + s % rows
        keys_of[table_row] = ref.read_index_keys(cache, flat, ref.index_scales_are_ue8m0x4())
    for b in range(batch):
        keys = keys_of[tuple(block_table[b].tolist())]
        for n in range(next_n):
            length = int(context_lens[b, n])
            if length <= 0:
                continue
            out[b * next_n + n, :length] = ref.index_logits(
                q_fp8[b, n], weights[b * next_n + n], keys[:length]
            )
    return out.to(device)


def topk_within_lengths_stand_in(
    logits: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor
) -> None:
    """``top_k_per_row_decode`` in PyTorch: columns at or past a row's length
    are never picked; lanes past it hold -1."""
    width = int(logits.shape[1])
    lengths = lengths.flatten().to(logits.device)
    past = torch.arange(width, device=logits.device)[None, :] >= lengths[:, None]
    lanes = min(out.shape[1], width)
    picked = logits.float().masked_fill(past, float("-inf")).topk(lanes, dim=1).indices
    in_row = torch.arange(lanes, device=logits.device)[None, :] < lengths[:, None]
    out[:, :lanes] = torch.where(in_row, picked, -1).to(out.dtype)


def indexer_logits_dtype() -> torch.dtype:
    """The indexer logits dtype a default ``vllm serve`` of DeepSeek-V4.1
    resolves on this device: the release's own config hook decides (0.34.0:
    bf16 where the MQA logits kernels reduce in bf16, i.e. SM100, else fp32);
    releases without the setting emit fp32."""
    from vllm.config import AttentionConfig
    from vllm.model_executor.models import config as model_configs
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    resolve = getattr(model_configs, "_set_deepseek_indexer_logits_dtype", None)
    attention = AttentionConfig()
    if resolve is None or not hasattr(attention, "indexer_logits_dtype"):
        return torch.float32
    resolve(SimpleNamespace(attention_config=attention))
    return STR_DTYPE_TO_TORCH_DTYPE[attention.indexer_logits_dtype]


def gather_indexer_k_stand_in(
    pages: torch.Tensor,
    keys_out: torch.Tensor,
    scales_out: torch.Tensor,
    tables: torch.Tensor,
    row_starts: torch.Tensor,
) -> None:
    """``cp_gather_indexer_k_quant_cache``: request b's compressed states in
    rows ``row_starts[b]..row_starts[b+1]`` of ``keys_out`` (fp8 values) and
    ``scales_out`` (fp32 scale bytes), read through its row of ``tables``."""
    rows = int(pages.shape[1])
    cu = row_starts.tolist()
    flat = ref.storage_bytes(pages)
    for b in range(len(cu) - 1):
        s = torch.arange(cu[b + 1] - cu[b])
        page = tables[b, s // rows].to(torch.int64)
        base = pages.storage_offset() + page * pages.stride(0)
        values = ref.gather_bytes(flat, base + (s % rows) * ref.INDEX_DIM, ref.INDEX_DIM)
        scales = ref.gather_bytes(flat, base + rows * ref.INDEX_DIM + (s % rows) * 4, 4)
        keys_out[cu[b] : cu[b + 1]].view(torch.uint8).copy_(values)
        scales_out[cu[b] : cu[b + 1]].copy_(scales)


def _written_tokens(
    k: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(token indices, their slots, their rows of ``k``) of the tokens a
    ``quantize_and_insert_k_cache`` stand-in writes, or None when none is."""
    slots = slot_mapping.to(torch.int64).cpu()
    if bool((slots < -1).any()):
        # The kernel skips -1 only; it would write below the page.
        raise ValueError(f"slot {int(slots.min())}: a negative slot other than -1")
    tokens = torch.nonzero(slots != -1).flatten()
    if not tokens.numel():
        return None
    return tokens, slots[tokens], k[: slot_mapping.shape[0]].cpu()[tokens]


def insert_v4_records_stand_in(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
) -> None:
    """``quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size)``
    (V4 records) as its Triton kernel computes it under Triton's interpreter,
    for all tokens at once instead of one interpreted program per token.

    Token ``t`` with a slot other than -1: page ``slot // block_size``
    (``k_cache.stride(0)`` bytes apart), row ``slot % block_size``; at
    ``row * 576`` its 448 NoPE dims as fp8, each tile of 64 divided by
    ``2 ** ceil(log2(max(amax, 1e-4) / 448))``, then its 64 RoPE dims' bf16
    bytes; at ``block_size * 576 + row * 8`` the 7 exponents + 127 and a zero
    byte.  Records are written in token order, so where two overlap the later
    token's bytes stay, as under the interpreter, which runs the programs in order.
    """
    written = _written_tokens(k, slot_mapping)
    if written is None:
        return
    tokens, slots, rows = written
    tiles = rows[:, : ref.NOPE].float().reshape(-1, ref.NUM_SCALES, ref.TILE)
    exponent = torch.ceil(torch.log2(tiles.abs().amax(dim=-1).clamp_min(1e-4) / ref.FP8_MAX))
    scaled = torch.clamp(tiles / torch.exp2(exponent)[..., None], -ref.FP8_MAX, ref.FP8_MAX)
    fp8 = ref.interpreter_rounding().to_fp8(scaled).view(torch.uint8).reshape(-1, ref.NOPE)
    data = torch.cat([fp8, rows[:, ref.NOPE :].contiguous().view(torch.uint8)], dim=1)
    scales = torch.zeros(len(tokens), ref.FOOTER_BYTES, dtype=torch.uint8)
    scales[:, : ref.NUM_SCALES] = torch.clamp(exponent + 127.0, 0.0, 255.0).to(torch.uint8)
    page = k_cache.storage_offset() + (slots // block_size) * k_cache.stride(0)
    row = slots % block_size
    data_at = (page + row * ref.DATA_BYTES)[:, None] + torch.arange(ref.DATA_BYTES)
    scales_at = (page + block_size * ref.DATA_BYTES + row * ref.FOOTER_BYTES)[
        :, None
    ] + torch.arange(ref.FOOTER_BYTES)
    flat = ref.storage_bytes(k_cache)
    data, scales = data.to(flat.device), scales.to(flat.device)
    for t in range(len(tokens)):
        flat[data_at[t]] = data[t]
        flat[scales_at[t]] = scales[t]


def insert_mxfp8_records_stand_in(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
) -> None:
    """``quantize_and_insert_k_cache(..., bytes_per_token=528)`` (V4.1 MXFP8
    records, the SM100 window KV) as its Triton kernel computes it under
    Triton's interpreter, all tokens at once.

    Token ``t`` with a slot other than -1: page ``slot // block_size``; its
    512 dims as fp8, each tile of 32 multiplied by
    ``2 ** -ceil(log2(max(amax, 1e-4) * (1 / 448)))``, and the 16 exponents
    + 127, where the release's layout puts them
    (:func:`.reference.mxfp8_addresses`).  Later tokens' records overwrite
    earlier ones on the same slot.
    """
    written = _written_tokens(k, slot_mapping)
    if written is None:
        return
    tokens, slots, rows = written
    tiles = rows.float().reshape(-1, ref.MX_SCALES, ref.MX_TILE)
    reciprocal = torch.tensor(1.0 / ref.FP8_MAX, dtype=torch.float32)
    exponent = torch.ceil(torch.log2(tiles.abs().amax(dim=-1).clamp_min(1e-4) * reciprocal))
    scaled = torch.clamp(tiles * torch.exp2(-exponent)[..., None], -ref.FP8_MAX, ref.FP8_MAX)
    fp8 = ref.interpreter_rounding().to_fp8(scaled).view(torch.uint8).reshape(-1, ref.HEAD)
    scales = torch.clamp(exponent + 127.0, 0.0, 255.0).to(torch.uint8)
    page = k_cache.storage_offset() + (slots // block_size) * k_cache.stride(0)
    values_at, scales_at = ref.mxfp8_addresses(page, slots % block_size, block_size)
    values_at = values_at[:, None] + torch.arange(ref.HEAD)
    scales_at = scales_at[:, None] + torch.arange(ref.MX_SCALES)
    flat = ref.storage_bytes(k_cache)
    fp8, scales = fp8.to(flat.device), scales.to(flat.device)
    for t in range(len(tokens)):
        flat[values_at[t]] = fp8[t]
        flat[scales_at[t]] = scales[t]
