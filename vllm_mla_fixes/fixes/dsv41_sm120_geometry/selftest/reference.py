"""PyTorch reference: read the paged caches as FlashInfer's SM120 kernel does,
and compute the same attention densely from the un-paged latents.

Everything here is written from the layout facts, checked against the
installed sources (paths relative to the package; FlashInfer 0.7.0.post1):

* Record (``KVCacheTraits<ModelType::DSV4>``,
  ``flashinfer/data/include/flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh``):
  per token 448 fp8-e4m3 NoPE bytes then 64 bf16 RoPE values (576 data bytes),
  and an 8-byte footer entry: 7 UE8M0 scales, one per 64 NoPE dims, and a pad
  byte.  V is the whole 512-wide row (NoPE then RoPE), like K.
* Addressing (``common/kv_cache_io.cuh``): ``page = idx / pbs``,
  ``row = idx % pbs``; data at ``page * stride_kv_block + row * 576``; scales
  at ``page * stride_kv_block + pbs * 576 + row * 8``.  ``pbs`` and
  ``stride_kv_block`` come from the tensor (``parse_paged_kv_layout`` in
  ``flashinfer/data/csrc/sparse_mla_sm120_jit_binding.cu``: NHD
  ``[pages, pbs, 1, 584]`` gives ``pbs = shape[1]``, stride ``stride(0)``),
  for the SWA ("primary") and the compressed ("extra") cache alike.
* UE8M0 (``model/scale_convert.cuh``): ``scale = 2 ** (byte - 127)``.
* Masking and softmax (``decode_dsv4_kernel.cuh``): a segment's length is
  clamped to ``[0, width]``; a candidate past the length or with index ``-1``
  is masked; the two segments share one softmax, and the attention sink adds
  ``exp(sink - max)`` to its denominator.
* On SM100 the layers write the window KV and the compressed KV as DeepSeek's
  V4.1 MXFP8 record instead (the layer's ``kv_mxfp8``, vLLM
  ``models/deepseek_v41/attention.py`` ``_use_v41_mxfp8_kv_record``; the
  record in ``common/ops/cache_utils.py``'s header, the SWA writer's Triton
  twin ``_quantize_and_insert_k_mxfp8_kernel`` and the compressor's
  ``_rope_quant_insert_mxfp8_kernel`` in ``fused_compress_quant_cache.py``,
  which rotates the RoPE dims in fp32 and quantises them with the rest): per
  token all 512 dims (RoPE included) as fp8 e4m3, each 32 dims divided by
  the power of two ``2 ** ceil(log2(max(amax, 1e-4) / 448))``, and 16 UE8M0
  bytes (exponent + 127): 528 bytes.  One reader decodes both caches.  From 0.33.0 each token's scales follow
  its own values (record at ``row * 528``); 0.32.0 puts the values at
  ``row * 512`` and the scales at ``pbs * 512 + row * 16``, after all the
  page's values, as in V4's record (:func:`mxfp8_scales_follow_each_row`
  asks the release's writer which).
* Indexer cache (the writer ``indexer_k_norm_rope_store``, vLLM
  ``models/deepseek_v41/common/ops/indexer_k_store.py``; read through the
  block table by DeepGEMM's paged MQA logits): per state 128 fp8-e4m3 bytes at
  ``page + row * 128`` and one fp32 scale at ``page + pbs * 128 + row * 4``.

The kernel also quantizes Q to fp8 before its MMAs; that is arithmetic, not
addressing, and is not reproduced: both the paged and the dense path here use
the bf16 query, so they differ only where the pages hold other bytes than the
latents did.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_mla_fixes import settings

NOPE = 448
ROPE = 64
HEAD = NOPE + ROPE
DATA_BYTES = NOPE + 2 * ROPE  # 576
FOOTER_BYTES = 8
RECORD_BYTES = DATA_BYTES + FOOTER_BYTES  # 584
TILE = 64
NUM_SCALES = NOPE // TILE  # 7
MX_TILE = 32  # dims per UE8M0 scale of the V4.1 MXFP8 record
MX_SCALES = HEAD // MX_TILE  # 16
MX_RECORD_BYTES = HEAD + MX_SCALES  # 528
FP8_MAX = 448.0
INDEX_DIM = 128
INDEX_ROPE = 64
INDEX_RECORD = INDEX_DIM + 4  # 132


# --------------------------------------------------------------------------
# Rounding: the writers run under the Triton interpreter here, whose float
# conversions are not IEEE round-to-nearest-even (fp32 -> bf16 truncates;
# fp32 -> fp8 rounds half up within the mantissa).  To apply the quantisation
# "the same way", the dense reference rounds with the interpreter's own
# conversion routine when the interpreter is active, and with PyTorch's
# round-to-nearest-even otherwise (what the GPU does).
# --------------------------------------------------------------------------


def _interpreter_converter() -> (
    tuple[Callable[[torch.Tensor, object], torch.Tensor], ModuleType] | None
):  # (convert, triton.language)
    if settings.environment_variable("TRITON_INTERPRET") != "1":
        return None
    try:
        import numpy as np
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime.interpreter import _convert_float
    except ImportError:
        return None

    def convert(x: torch.Tensor, dst: object) -> torch.Tensor:  # dst: a triton.language dtype
        src = x.detach().to(torch.float32).contiguous().cpu().numpy()
        if dst is tl.bfloat16:
            bits = _convert_float(src, tl.float32, tl.bfloat16, None)
            out = torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy())
            return out.view(torch.bfloat16).reshape(x.shape)
        bits = _convert_float(src, tl.float32, tl.float8e4nv, ir.ROUNDING_MODE.RTNE)
        out = torch.from_numpy(bits.astype(np.uint8).copy())
        return out.view(torch.float8_e4m3fn).reshape(x.shape)

    return convert, tl


@dataclass(frozen=True)
class Rounding:
    """How the writers that filled the caches rounded fp32 values."""

    name: str

    def to_bf16(self, x: torch.Tensor) -> torch.Tensor:
        conv = _interpreter_converter() if self.name == "triton-interpreter" else None
        if conv is None:
            return x.to(torch.bfloat16)
        convert, tl = conv
        return convert(x, tl.bfloat16)

    def to_fp8(self, x: torch.Tensor) -> torch.Tensor:
        conv = _interpreter_converter() if self.name == "triton-interpreter" else None
        if conv is None:
            return x.to(torch.float8_e4m3fn)
        convert, tl = conv
        return convert(x, tl.float8e4nv)


def writer_rounding() -> Rounding:
    if _interpreter_converter() is not None:
        return Rounding("triton-interpreter")
    return Rounding("round-to-nearest-even")


def interpreter_rounding() -> Rounding:
    """Triton's interpreter's own rounding; raises where it is not active."""
    if _interpreter_converter() is None:
        raise RuntimeError(
            "Triton's interpreter is not active: TRITON_INTERPRET=1 must be set before vLLM "
            "is imported"
        )
    return Rounding("triton-interpreter")


# --------------------------------------------------------------------------
# Dense side: what each writer stores for a latent, as dequantised values.
# --------------------------------------------------------------------------


def _ue8m0_exponent(amax: torch.Tensor, divide: bool) -> torch.Tensor:
    """2**e is the power of two the block is divided by (UE8M0 byte e + 127)."""
    amax = torch.clamp(amax, min=1e-4)
    if divide:
        ratio = amax / FP8_MAX
    else:
        ratio = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    return torch.ceil(torch.log2(ratio))


def _quant_dequant_tiles(
    values: torch.Tensor, tile: int, rounding: Rounding, divide: bool
) -> torch.Tensor:
    """[N, D] fp32 -> the fp32 values fp8 e4m3 with one UE8M0 scale per
    ``tile`` dims decodes to."""
    tiles = values.to(torch.float32).reshape(values.shape[0], -1, tile)
    exp = _ue8m0_exponent(tiles.abs().amax(dim=-1), divide)
    scaled = torch.clamp(tiles * torch.exp2(-exp)[..., None], -FP8_MAX, FP8_MAX)
    fp8 = rounding.to_fp8(scaled).to(torch.float32)
    return (fp8 * torch.exp2(exp)[..., None]).reshape(values.shape)


def quant_dequant_nope(nope: torch.Tensor, rounding: Rounding, divide: bool) -> torch.Tensor:
    """[N, 448] fp32 -> fp32 values the V4 record's fp8 part decodes to."""
    return _quant_dequant_tiles(nope, TILE, rounding, divide)


def gptj_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (even, odd) pairs of x [N, 2P] by angle rows [N, P]."""
    even = x[..., 0::2].to(torch.float32)
    odd = x[..., 1::2].to(torch.float32)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def rope_swa_rows(kv_bf16: torch.Tensor, angles: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """The sliding-window row the fused insert stores before quantising: the
    layer's kv row [N, 512] with GPT-J RoPE on its last 64 dims at the token's
    position (``angles``: [N, 64], cos then sin), rounded to bf16."""
    rot = gptj_rotate(kv_bf16[:, NOPE:].float(), angles[:, :32], angles[:, 32:])
    return torch.cat([kv_bf16[:, :NOPE], rounding.to_bf16(rot)], dim=1)


def dense_swa_rows(rows_bf16: torch.Tensor, rounding: Rounding, mxfp8: bool) -> torch.Tensor:
    """Sliding-window rows stored by ``quantize_and_insert_k_cache``: the
    input is the already-rotated KV row.  V4 record: NoPE quantised (the
    exponent from ``amax / 448``), RoPE copied; V4.1 MXFP8 record
    (``mxfp8``): all 512 dims quantised per 32 (from ``amax * (1 / 448)``)."""
    if mxfp8:
        return _quant_dequant_tiles(rows_bf16.float(), MX_TILE, rounding, divide=False)
    nope = quant_dequant_nope(rows_bf16[:, :NOPE].float(), rounding, divide=True)
    return torch.cat([nope, rows_bf16[:, NOPE:].float()], dim=1)


def dense_compressed_rows(
    latent_bf16: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    rounding: Rounding,
    mxfp8: bool,
) -> torch.Tensor:
    """Compressed rows stored by ``rope_quant_insert`` for latents [N, 512]
    whose RoPE angles (the group's first position) are rope_cos/sin [N, 32].
    V4 record: NoPE quantised per 64 (the exponent from ``amax * (1 / 448)``),
    the rotated RoPE dims rounded to bf16; V4.1 MXFP8 record (``mxfp8``): the
    rotated RoPE dims stay fp32 and all 512 dims are quantised per 32."""
    rot = gptj_rotate(latent_bf16[:, NOPE:].float(), rope_cos, rope_sin)
    if mxfp8:
        rows = torch.cat([latent_bf16[:, :NOPE].float(), rot], dim=1)
        return _quant_dequant_tiles(rows, MX_TILE, rounding, divide=False)
    nope = quant_dequant_nope(latent_bf16[:, :NOPE].float(), rounding, divide=False)
    return torch.cat([nope, rounding.to_bf16(rot).float()], dim=1)


def dense_index_keys(
    k_pre_bf16: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    rounding: Rounding,
) -> torch.Tensor:
    """Index keys stored by ``indexer_k_norm_rope_store`` (fp8 path), as
    dequantised fp32 [N, 128]: RMSNorm, bf16, RoPE on the last 64 dims, bf16,
    then one UE8M0-style power-of-two scale per key."""
    k = k_pre_bf16.float()
    var = (k * k).sum(dim=-1, keepdim=True) / INDEX_DIM
    k = rounding.to_bf16(k * torch.rsqrt(var + eps) * norm_weight.float()).float()
    nope, rope = k[:, : INDEX_DIM - INDEX_ROPE], k[:, INDEX_DIM - INDEX_ROPE :]
    rot = rounding.to_bf16(gptj_rotate(rope, rope_cos, rope_sin)).float()
    k = torch.cat([nope, rot], dim=1)
    amax = torch.clamp(k.abs().amax(dim=-1, keepdim=True), min=1e-4)
    exp = torch.ceil(torch.log2(amax * torch.tensor(1.0 / FP8_MAX)))
    scaled = torch.clamp(k * torch.exp2(-exp), -FP8_MAX, FP8_MAX)
    return rounding.to_fp8(scaled).float() * torch.exp2(exp)


# --------------------------------------------------------------------------
# Paged side: read bytes exactly where the SM120 kernel reads them.
# --------------------------------------------------------------------------


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``view`` as one flat uint8 tensor."""
    storage = view.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=view.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


class OutOfBounds(RuntimeError):
    pass


def gather_bytes(flat: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
    addr = start[:, None] + torch.arange(width, dtype=torch.int64)[None, :]
    if addr.numel() and (int(addr.min()) < 0 or int(addr.max()) >= flat.numel()):
        raise OutOfBounds(
            f"read at bytes [{int(addr.min())}, {int(addr.max())}] of a "
            f"{flat.numel()}-byte cache allocation"
        )
    return flat[addr]


def page_geometry(view: torch.Tensor, record: int) -> tuple[int, int]:
    """(rows per page, page stride in bytes) of a bound cache view, as
    FlashInfer's binding derives them from an NHD ``[pages, pbs, 1, rec]``
    (or the 3-D ``[pages, pbs, rec]`` vLLM binds)."""
    if view.dim() == 4:
        assert view.shape[2] == 1, tuple(view.shape)
        view = view[:, :, 0]
    assert view.dtype == torch.uint8 and view.dim() == 3, (view.dtype, view.shape)
    assert view.shape[-1] == record and view.stride(-1) == 1, tuple(view.shape)
    # FlashInfer rejects padded rows for the footer-scale model.
    assert view.stride(1) == record, view.stride()
    return int(view.shape[1]), int(view.stride(0))


@functools.cache
def mxfp8_scales_follow_each_row() -> bool:
    """Whether the installed release's V4.1 MXFP8 record keeps each token's
    scales right after its values (0.33.0 on), rather than after all the
    page's values (0.32.0): its own writer, ``quantize_and_insert_k_cache``,
    answers for a one-token write into a two-row page."""
    from vllm.models.deepseek_v41.common.ops.cache_utils import quantize_and_insert_k_cache

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    page = torch.zeros(1, 2 * MX_RECORD_BYTES, dtype=torch.uint8, device=device)
    row = torch.ones(1, HEAD, dtype=torch.bfloat16, device=device)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    quantize_and_insert_k_cache(row, page, slot, block_size=2, bytes_per_token=MX_RECORD_BYTES)
    written = set(torch.nonzero(page[0].cpu()).flatten().tolist())
    if written == set(range(MX_RECORD_BYTES)):
        return True
    if written == set(range(HEAD)) | set(range(2 * HEAD, 2 * HEAD + MX_SCALES)):
        return False
    raise RuntimeError(
        f"the release's MXFP8 writer wrote bytes {sorted(written)[:4]}...{sorted(written)[-4:]} "
        "of a two-row page: neither V4.1 record layout the self-test knows"
    )


def mxfp8_addresses(
    page: torch.Tensor, row: torch.Tensor, pbs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Start of each token's 512 values and of its 16 scales, from its page's
    start and its row in the page (the release's layout)."""
    if mxfp8_scales_follow_each_row():
        values = page + row * MX_RECORD_BYTES
        return values, values + HEAD
    return page + row * HEAD, page + pbs * HEAD + row * MX_SCALES


def index_scales_are_ue8m0x4() -> bool:
    """Whether the installed release's indexer K writers store each key's
    power-of-two scale as four equal UE8M0 bytes instead of an fp32: on SM100,
    whose DeepGEMM MQA logits kernels take only MX scales.  vLLM's own
    ``mqa_logits_use_mx_scales`` decides (0.33.0 on); 0.32.0 always writes fp32."""
    from vllm.utils import deep_gemm

    decide = getattr(deep_gemm, "mqa_logits_use_mx_scales", None)
    return bool(decide is not None and decide())


def index_key_scales(raw: torch.Tensor, ue8m0x4: bool) -> torch.Tensor:
    """The fp32 scales [N, 1] of index keys from their 4 scale bytes [N, 4]."""
    raw = raw.contiguous()
    if ue8m0x4:  # byte = exponent + 127, four times
        return torch.exp2(raw[:, :1].to(torch.float32) - 127.0)
    return raw.view(torch.float32)


def record_bytes(view: torch.Tensor, idx: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The raw record [N, width] at each flat slot of ``idx`` (page ``slot //
    rows``, row ``slot % rows``) in the pages of ``view`` (``view.stride(0)``
    elements apart): its values, then its scales, gathered from where the
    record of ``width`` bytes keeps them (V4, the release's V4.1 MXFP8, the
    indexer's fp8 row); on the CPU."""
    flat = storage_bytes(view)
    idx = idx.to(torch.int64).to(flat.device)
    page = view.element_size() * (view.storage_offset() + (idx // rows) * view.stride(0))
    row = idx % rows
    if width == RECORD_BYTES:
        parts = [(page + row * DATA_BYTES, DATA_BYTES)]
        parts.append((page + rows * DATA_BYTES + row * FOOTER_BYTES, FOOTER_BYTES))
    elif width == MX_RECORD_BYTES:
        values, scales = mxfp8_addresses(page, row, rows)
        parts = [(values, HEAD), (scales, MX_SCALES)]
    elif width == INDEX_RECORD:
        parts = [(page + row * INDEX_DIM, INDEX_DIM), (page + rows * INDEX_DIM + row * 4, 4)]
    else:
        raise ValueError(f"no record of {width} bytes per token")
    return torch.cat([gather_bytes(flat, start, size) for start, size in parts], dim=1).cpu()


def decode_records(raw: torch.Tensor, ue8m0x4: bool = False) -> torch.Tensor:
    """The fp32 values records [N, width] (:func:`record_bytes`) hold: K=V rows
    [N, 512] of the V4 or V4.1 MXFP8 record, or index keys [N, 128] (their
    scales fp32, or UE8M0x4: :func:`index_scales_are_ue8m0x4`)."""
    raw = raw.contiguous()
    width = raw.shape[1]
    if width == RECORD_BYTES:
        nope = raw[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float()
        scales = torch.exp2(raw[:, DATA_BYTES : DATA_BYTES + NUM_SCALES].float() - 127.0)
        rope = raw[:, NOPE:DATA_BYTES].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope * scales.repeat_interleave(TILE, dim=1), rope], dim=1)
    if width == MX_RECORD_BYTES:
        values = raw[:, :HEAD].contiguous().view(torch.float8_e4m3fn).float()
        scales = torch.exp2(raw[:, HEAD:].float() - 127.0)
        return values * scales.repeat_interleave(MX_TILE, dim=1)
    if width == INDEX_RECORD:
        keys = raw[:, :INDEX_DIM].contiguous().view(torch.float8_e4m3fn).float()
        return keys * index_key_scales(raw[:, INDEX_DIM:], ue8m0x4)
    raise ValueError(f"no record of {width} bytes per token")


def read_kv_rows(view: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Dequantised K=V rows [N, 512] at flat slot indices idx [N] (>= 0) of
    whichever record the cache holds (its row width names it, as vLLM's
    readers tell them apart)."""
    width = int(view.shape[-1])
    rows, _ = page_geometry(view, width)
    return decode_records(record_bytes(view, idx, rows, width))


def read_index_keys(view: torch.Tensor, idx: torch.Tensor, ue8m0x4: bool = False) -> torch.Tensor:
    """Dequantised index keys [N, 128] at flat state indices idx [N] (>= 0),
    their scales fp32 or UE8M0x4 (:func:`index_scales_are_ue8m0x4`)."""
    rows, _ = page_geometry(view, INDEX_RECORD)
    return decode_records(record_bytes(view, idx, rows, INDEX_RECORD), ue8m0x4)


def index_logits(q_fp8: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The indexer's score of keys [N, 128] (dequantised) for one query:
    ``sum_h w[h] * relu(q[h] . k)``, q [H, 128] fp8 with its scale folded into
    the weights [H] (the fp8 path of ``sparse_attn_indexer``)."""
    q = q_fp8.float()
    return (torch.relu(keys.float() @ q.T) * weights.float()[None, :]).sum(dim=1)


# --------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------


def sink_softmax_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token: q [H, 512], kv [n, 512] (K = V), sink [H] -> [H, 512].

    Softmax over the n candidates plus a virtual sink logit that only adds
    mass to the denominator."""
    q = q.float()
    if kv.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float32)
    logits = (q @ kv.T) * scale
    m = torch.maximum(logits.amax(dim=-1), sink.float())
    p = torch.exp(logits - m[:, None])
    denom = p.sum(dim=-1) + torch.exp(sink.float() - m)
    return (p @ kv) / denom[:, None]


def segment_indices(indices: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    idx = indices.reshape(-1).to(torch.int64)
    n = min(max(int(length), 0), idx.numel())
    idx = idx[:n]
    return idx[idx >= 0]


def sm120_sparse_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    extra_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode q [T, H, 512] from the paged caches; returns fp32 [T, H, 512].

    The arguments are the ones vLLM passes to
    ``trtllm_batch_decode_sparse_mla_dsv4`` on SM120 (``_forward_decode``):
    primary = SWA cache with ``decode_swa_indices`` / ``decode_swa_lens``,
    extra = compressed cache with the global top-k indices and lengths."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        rows = [read_kv_rows(swa_cache, segment_indices(swa_indices[t], swa_lens[t]))]
        if extra_cache is not None:
            assert extra_indices is not None and extra_lens is not None
            rows.append(read_kv_rows(extra_cache, segment_indices(extra_indices[t], extra_lens[t])))
        out[t] = sink_softmax_attention(q[t], torch.cat(rows), sink, scale)
    return out
