"""How far each self-test comparison may legitimately be off, derived from the formats.

Every read is compared with a dense PyTorch reference computed from the
un-paged latents with the writers' own quantisation (:mod:`.reference`).  The
bound of a comparison is what the arithmetic between the two sides can
account for; a wrong page is off by far more (a zeroed page reads 0.7 to 1.0,
another request's page 2 and up, stale bytes up to 1e11).

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

from . import kernels as kn
from . import reference as ref

U_E4M3 = 2.0**-4
E4M3_STEP = 2.0**-3
U_BF16 = 2.0**-8

MAX_ABS = "max |got - ref| / max |ref|"
REL_L2 = "||got - ref||_2 / ||ref||_2 per output row"


@dataclass(frozen=True)
class Bound:
    value: float
    measure: str  # how the error is measured
    formula: str  # the derivation in one line, for the report


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
# candidates; tests/test_selftest_bounds.py) gives a mean of 0.023 and a worst
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
# rsqrt and exp2), then round to bf16 and e4m3 as PyTorch does.  Where the two fp32 values straddle a rounding
# midpoint (probability about a few x 2**-23 / 2**-3 = 2**-18 per element)
# the stored element is the other neighbour: one e4m3 step, at most
# E4M3_STEP of the element and so of the largest reference value.  The readers
# that take these pages add no rounding of their own on the compared path
# (byte copy, fp32 sums, e4m3 x e4m3 products exact in fp32), and their fp32
# summation is (d + H) 2**-24 ~ 1e-5 relative: the bound is one e4m3 step.
# (DeepGEMM on SM90: fp8 tensor-core sums keep about 14 bits, DeepSeek-V3
# report 3.3.2; over d = 128 that is 128 * 2**-14 = 2**-7 of sum |q_i k_i| at
# worst, about sqrt(128) * 2**-14 typically, inside the step.)  The flips'
# share of a real attention row's rel-L2 is negligible: a few elements of
# thousands.  SM100's MXFP8 records (every dim e4m3, 32 per scale; the window
# KV and the compressed KV) are held to the same step: where the CUDA
# writer's fp32 RoPE output (the reference rounds it to bf16 first, as the
# Triton twin's input is) or the compressor's fp32 rotation (a few ulps off
# the reference's) sits on the other side of an e4m3 midpoint, or moves a
# tile's amax across a power of two, an element lands one step of its final
# grid away.
GPU_WRITER_ROUNDING = Bound(
    E4M3_STEP,
    MAX_ABS,
    "2^-3 = one e4m3 step (3 mantissa bits) of an element the GPU writer rounded "
    "to the other neighbour; the reader's fp32 sums add ~(d+H)*2^-24",
)


def bound_for(kernel: str, kernels: kn.Kernels, heads: int) -> Bound:
    """The bound of one reader's comparison on this run's device and kernels."""
    if kernels.is_real(kernel) and kernel in (kn.ATTENTION_DECODE, kn.ATTENTION_PREFILL):
        return real_attention_bound(heads)
    if kernels.device.kind == "cpu":
        return EXACT
    return GPU_WRITER_ROUNDING


# Bytes written outside a cache's own pages, bytes left unzeroed, stray bytes,
# ratio-1 slots off the kernel table: integer facts, exact.
WRITER_BOUND = Bound(0.0, "bytes written outside the writer's own pages", "exact: a byte count")


def topk_slack(logit_bound: float) -> float:
    """Two logits are swapped in the kernel's top-k against the reference's
    only when their errors sum past the gap between them: a picked index is
    outside the reference's top-k only if its reference score is below the
    k-th by more than 2 x the logit bound (relative to max |score|)."""
    return 2 * logit_bound
