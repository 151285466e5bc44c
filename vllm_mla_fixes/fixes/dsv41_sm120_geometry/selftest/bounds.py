"""How far each self-test comparison may legitimately be off, derived from the formats.

Two kinds of comparison (:mod:`.records`):

* each record a writer stores is decoded and compared, element by element,
  with the dense PyTorch reference computed from the un-paged latents with the
  writers' own quantisation (:mod:`.reference`), each element against its own
  bound (:func:`writer_element_bound`);
* each read is compared with the same computation on exactly the records the
  writers stored for the tokens it should read, after the bytes at the
  addresses the kernel reads were found equal to those records: a reader's
  bound covers its own arithmetic only (0 where it adds none).

A wrong slot, key or page is then found by the byte comparison, exactly; a
wrong page also reads far outside any bound (a zeroed page 0.7 to 1.0, another
request's page 2 and up, stale bytes up to 1e11).

Formats (round-to-nearest; a value rounds to the neighbour of its binade's
spacing, so the relative error of one rounding is at most half a spacing over
the binade's lowest value):

* e4m3 (fp8): 3 stored mantissa bits, unit roundoff ``U_E4M3 = 2**-4``; the
  spacing between neighbours is at most ``E4M3_STEP = 2**-3`` of a value.
* bf16: 7 stored mantissa bits, ``U_BF16 = 2**-8``.
* UE8M0 scales are powers of two: multiplying by one is exact, so an fp8 value
  times its scale dequantises without rounding (and the paged records
  dequantise to exactly the reference's values when their bytes are right).

The probabilistic rounding model (Higham and Mary, 2019) treats each rounding
error as independent, zero-mean and at most ``u`` relative; spread uniformly
over the half-spacing, its mean square is at most ``u**2 / 3`` of the value's
square (at the bottom of a binade; 0.54 of that averaged over one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import kernels as kn
from . import reference as ref

U_E4M3 = 2.0**-4
E4M3_STEP = 2.0**-3
U_BF16 = 2.0**-8

MAX_ABS = "max |got - ref| / max |ref|"
REL_L2 = "||got - ref||_2 / ||ref||_2 per output row"
PER_ELEMENT = "|got - ref| of each element, against that element's own bound"


@dataclass(frozen=True)
class Bound:
    value: float  # the bound; for a per-element one, the coefficient it scales
    measure: str  # how the error is measured
    formula: str  # the derivation in one line, for the report

    @property
    def per_element(self) -> bool:
        return self.measure == PER_ELEMENT


def margin(error: float, bound: float) -> float:
    """error / bound; an exact comparison (bound 0) is 0 when it is exact."""
    if bound > 0:
        return error / bound
    return 0.0 if error == 0 else math.inf


# Same bytes, same arithmetic.  On CPU the dense reference rounds with the
# Triton interpreter's own conversion, so it stores what the interpreted
# writers store, bit for bit; the stand-in readers then evaluate the very
# PyTorch expression the reference evaluates (one thread, the same shapes) on
# those values: nothing can differ.  The indexer K gather is a byte copy.
EXACT = Bound(0.0, MAX_ABS, "exact: same bytes, same arithmetic (or a byte copy)")


# FlashInfer's SM120 sparse MLA (decode and prefill, FlashInfer 0.7.x
# ``kernels/fp8_decode``, ``fp8_prefill``) reads the records exactly (fp8 x
# UE8M0, bf16 RoPE) but rounds: Q's 448 NoPE dims to e4m3 (per-64 power-of-two
# scale, ``compute/q_stage.cuh``), P to e4m3 for the NoPE part of the PV
# product and to bf16 for its RoPE part, and the output to bf16 (split-K
# partials, then the merged row).  First order, per head, with
# p_j = softmax weight, o = sum_j p_j v_j (the sink only adds mass to the
# denominator):
#
#   from Q:  d_o = sum_j p_j ds_j (v_j - o),  ds_j = scale * sum_i q_i d_i k_ji
#   from P:  d_o = sum_j p_j e_j v_j
#
# With the self-test's inputs (q and the latents N(0, 1), scale = 512**-0.5,
# so scale**2 * sum_i q_i**2 k_ji**2 -> 448/512 over the NoPE dims) and
# independent candidates (||o||**2 ~ sum_j p_j**2 ||v_j||**2), each e4m3 term
# contributes (448/512) U_E4M3**2 / 3 to rel-L2**2, the bf16 ones (64/512)
# U_BF16**2 / 3 (P's RoPE part) and 2 U_BF16**2 / 3 (two output roundings):
#
#   rms = sqrt(2 (448/512) U_E4M3**2/3 + (64/512 + 2) U_BF16**2/3) = 0.0478
#
# A row's rel-L2 is the root of a sum over its H heads' independent errors
# (a chi-like norm): its relative spread about the rms is 1/sqrt(2H).  The
# bound is rms * (1 + 1/sqrt(2H)); with the binade-bottom mean square above
# (0.54 of it on average) that is about 2.8 spreads above the expected error.
# That rounding applied to the self-test's inputs (8 heads, 1 to 200
# candidates; tests/dsv41_sm120_geometry/test_selftest_bounds.py) gives a mean of 0.023 and a worst
# row of 0.039 over 200 rows (0.041 over 1,200 rows with 1 to 200 candidates).
def real_attention_bound(heads: int) -> Bound:
    nope, rope, head = ref.NOPE, ref.ROPE, ref.HEAD
    rms = math.sqrt(2 * (nope / head) * U_E4M3**2 / 3 + (rope / head + 2) * U_BF16**2 / 3)
    value = rms * (1 + 1 / math.sqrt(2 * heads))
    return Bound(
        value,
        REL_L2,
        f"sqrt(2*(448/512)*u8^2/3 + (64/512+2)*u16^2/3) * (1 + 1/sqrt(2*{heads} heads)); "
        "u8 = 2^-4 (Q and P through e4m3), u16 = 2^-8 (P's RoPE part, output in bf16)",
    )


# A GPU's writers (the fused CUDA insert, the Triton kernels) evaluate the
# reference's fp32 expressions up to a few ulps (FMA contraction, approximate
# rsqrt and exp2), then round to bf16 and e4m3 as PyTorch does.  Where the two
# fp32 values straddle a rounding midpoint (probability about a few x 2**-23 /
# 2**-3 = 2**-18 per element) the stored element is the other neighbour: one
# step of its own grid, which for an e4m3 element x (3 mantissa bits) is at
# most 2**-3 |x| where x is normal and 2**-9 of its tile's scale where it is
# subnormal (the scale may itself move one power of two, where the tile's amax
# crossed one: twice that), and for a bf16 element (the V4 record's RoPE dims)
# at most 2**-7 |x|.  SM100's MXFP8 records (every dim e4m3, 32 per scale) are
# held to the same steps.  Each element is held to its own step, so one wrong
# element (a wrong key, a wrong token) stands out of a record of right ones.
GPU_WRITER_ROUNDING = Bound(
    E4M3_STEP,
    PER_ELEMENT,
    "one step of the element's own grid: 2^-3 |x| (e4m3) + 2^-9 x 2 x its tile's scale "
    "(e4m3 subnormals, the scale one power of two away), 2^-7 |x| (bf16 RoPE dims)",
)

# DeepGEMM's paged MQA logits read the same fp8 keys exactly (the pages were
# compared byte for byte first) and add only their own arithmetic: e4m3 x e4m3
# products are exact in fp32; the tensor-core accumulation keeps about 14
# bits on SM90 (DeepSeek-V3 report 3.3.2), at worst d x 2**-14 = 2**-7 of
# sum_i |q_i k_i| over d = 128; bf16 weights (SM100's MX inputs) add 2**-8 of
# each head's term, bf16 logits (0.34.0 on SM100) 2**-8 of the logit.  Per
# element s: 2**-7 sum_h |w_h| sum_i |q_hi k_si| + 2**-8 |logit_s|.  This is a
# worst case, so it is loose: a wrong key (another state's) moves its logit
# past it in 74% of draws with the self-test's inputs (median 2.1x the bound;
# 200 draws of 32 heads and 64 keys); what finds a wrong key
# every time is the byte comparison of the pages before it.
DEEPGEMM_LOGITS = Bound(
    2.0**-7,
    PER_ELEMENT,
    "2^-7 sum_h |w_h| sum_i |q_hi k_si| (fp8 MMA accumulation, bf16 weights) "
    "+ 2^-8 |logit| (bf16 logits), per position",
)


def bound_for(kernel: str, kernels: kn.Kernels, heads: int) -> Bound:
    """The bound of one reader's comparison on this run's device and kernels:
    the stand-ins evaluate the reference's own expression on the same bytes
    (exact anywhere), the gather copies bytes (exact)."""
    if kernels.is_real(kernel) and kernel in (kn.ATTENTION_DECODE, kn.ATTENTION_PREFILL):
        return real_attention_bound(heads)
    if kernels.is_real(kernel) and kernel == kn.INDEXER_LOGITS:
        return DEEPGEMM_LOGITS
    return EXACT


def writer_bound(kernels: kn.Kernels) -> Bound:
    """The bound of a writer's stored records against the dense reference:
    exact on CPU, where the reference rounds with Triton's interpreter's own
    conversion; one step of each element's grid on a GPU."""
    return EXACT if kernels.device.kind == "cpu" else GPU_WRITER_ROUNDING


def writer_element_bound(got: torch.Tensor, want: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Per element of decoded records ``got`` [N, D] (their bytes ``raw``),
    against ``want``: one step of the element's own grid (see above)."""
    size = torch.maximum(got.abs(), want.abs())
    width = raw.shape[1]
    if width == ref.INDEX_RECORD:  # one scale per key
        scale = ref.index_key_scales(raw[:, ref.INDEX_DIM :], ref.index_scales_are_ue8m0x4())
        return E4M3_STEP * size + 2.0**-9 * 2 * scale.abs().expand_as(got)
    per_dim = _tile_scales(raw)
    bound = E4M3_STEP * size + 2.0**-9 * 2 * per_dim
    if width == ref.RECORD_BYTES:  # the bf16 RoPE dims
        bound[:, ref.NOPE :] = 2.0**-7 * size[:, ref.NOPE :]
    return bound


def _tile_scales(raw: torch.Tensor) -> torch.Tensor:
    """Each element's UE8M0 scale [N, 512] from a KV record's scale bytes."""
    if raw.shape[1] == ref.RECORD_BYTES:
        exponents = raw[:, ref.DATA_BYTES : ref.DATA_BYTES + ref.NUM_SCALES].float()
        scales = torch.exp2(exponents - 127.0).repeat_interleave(ref.TILE, dim=1)
        return torch.nn.functional.pad(scales, (0, ref.ROPE))
    exponents = raw[:, ref.HEAD :].float()
    return torch.exp2(exponents - 127.0).repeat_interleave(ref.MX_TILE, dim=1)


def logits_element_bound(
    q_fp8: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """DeepGEMM's own arithmetic on each logit (see above): q [H, 128],
    weights [H], keys [N, 128], the reference logits [N] -> [N]."""
    magnitude = (keys.abs() @ q_fp8.float().abs().T) @ weights.float().abs()
    return DEEPGEMM_LOGITS.value * magnitude + 2.0**-8 * logits.abs()


def worst_element(
    got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor
) -> tuple[float, float]:
    """(|got - want|, its bound) of the element furthest past its bound (the
    largest difference where every bound is 0); a non-finite value is worst."""
    diff = torch.nan_to_num((got.float() - want.float()).abs(), nan=math.inf)
    if not diff.numel():
        return 0.0, 0.0
    if not bool((bound > 0).any()):
        at = int(diff.argmax())
    else:
        ratio = torch.where(bound > 0, diff / bound, torch.where(diff > 0, math.inf, 0.0))
        at = int(ratio.argmax())
    return float(diff.flatten()[at]), float(bound.flatten()[at])


# Bytes written outside a cache's own pages, bytes left unzeroed, stray bytes,
# ratio-1 slots off the kernel table: integer facts, exact.
WRITER_BOUND = Bound(0.0, "bytes written outside the writer's own pages", "exact: a byte count")


def topk_outsiders(picked: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, k: int) -> int:
    """How many of the kernel's top-k indices ``picked`` are outside every top-k
    of the dense scores ``want`` that the logits' own bounds allow: two logits
    swap places only when their bounds together cover the gap between them, so
    a picked index passes if its reference score is within its bound plus the
    k-th's of the k-th score."""
    order = torch.topk(want, k).indices
    kth = order[-1]
    floor = want[kth] - bound[kth]
    return int((want[picked] + bound[picked] < floor).sum())
