"""What an envelope is: the caches and kernels of a DeepSeek-V4.1 layer on SM12x,
the declared values a kernel accepts, and where each was read.

The bottom of the envelope package: it imports nothing of the project's."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

# The FlashInfer releases whose declarations were read when this module was
# written; another one (e.g. 0.7.3, which 0.34.0 pins but PyPI never had) gives
# unknown FlashInfer envelopes until its declarations are reviewed.
REVIEWED_FLASHINFER = ("0.7.0.post1", "0.7.2.post1", "0.7.4")
SM120 = (12, 0)

# The caches of a DeepSeek-V4.1 layer on SM12x.
SWA = "swa"
COMPRESSED = "compressed"
INDEXER = "indexer"

# The kernels.
FLASHINFER_DECODE = "flashinfer-sm120-decode"
FLASHINFER_DECODE_EXTRA = "flashinfer-sm120-decode-extra"
FLASHINFER_PREFILL = "flashinfer-sm120-prefill"
FLASHINFER_PREFILL_EXTRA = "flashinfer-sm120-prefill-extra"
DEEPGEMM_LOGITS_FP8 = "deepgemm-paged-mqa-logits-fp8"
DEEPGEMM_LOGITS_FP4 = "deepgemm-paged-mqa-logits-fp4"
INDEXER_GATHER = "indexer-k-gather"
INDEXER_TOP_K = "indexer-top-k"
SWA_WRITER = "swa-writer"
COMPRESSED_WRITER = "compressed-writer"
INDEXER_WRITER = "indexer-writer"

TITLES = {
    FLASHINFER_DECODE: "FlashInfer SM120 sparse-MLA decode, primary (sliding-window) cache",
    FLASHINFER_DECODE_EXTRA: "FlashInfer SM120 sparse-MLA decode, extra (compressed) cache",
    FLASHINFER_PREFILL: "FlashInfer SM120 sparse-MLA prefill, primary (sliding-window) cache",
    FLASHINFER_PREFILL_EXTRA: "FlashInfer SM120 sparse-MLA prefill, extra (compressed) cache",
    DEEPGEMM_LOGITS_FP8: "DeepGEMM SM120 paged MQA logits, FP8 indexer cache",
    DEEPGEMM_LOGITS_FP4: "DeepGEMM SM120 paged MQA logits, MXFP4 indexer cache",
    INDEXER_GATHER: "indexer prefill K gather (cp_gather_indexer_k_quant_cache)",
    INDEXER_TOP_K: "indexer top-k (persistent_topk / top_k_per_row)",
    SWA_WRITER: "sliding-window writer (fused_deepseek_v4_kv_rope_insert)",
    COMPRESSED_WRITER: "compressed KV writer (rope_quant_insert)",
    INDEXER_WRITER: "indexer K writer (indexer_k_norm_rope_store)",
}
CACHES = {
    FLASHINFER_DECODE: (SWA,),
    FLASHINFER_DECODE_EXTRA: (COMPRESSED,),
    FLASHINFER_PREFILL: (SWA,),
    FLASHINFER_PREFILL_EXTRA: (COMPRESSED,),
    DEEPGEMM_LOGITS_FP8: (INDEXER,),
    DEEPGEMM_LOGITS_FP4: (INDEXER,),
    INDEXER_GATHER: (INDEXER,),
    INDEXER_TOP_K: (),
    SWA_WRITER: (SWA,),
    COMPRESSED_WRITER: (COMPRESSED,),
    INDEXER_WRITER: (INDEXER,),
}
KERNELS = tuple(TITLES)


@dataclasses.dataclass(frozen=True)
class Values:
    """A declared set of integers: exactly ``exact``, or every integer from
    ``least`` up to ``most`` (no upper bound when ``most`` is None)."""

    exact: frozenset[int] | None = None
    least: int = 1
    most: int | None = None

    @classmethod
    def of(cls, values: Iterable[int]) -> Values:
        return cls(exact=frozenset(values))

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        if self.exact is not None:
            return value in self.exact
        return value >= self.least and (self.most is None or value <= self.most)

    def __str__(self) -> str:
        if self.exact is not None:
            return ", ".join(str(v) for v in sorted(self.exact)) or "none"
        if self.most is not None:
            return f"{self.least}-{self.most}"
        return "any positive" if self.least == 1 else f"any >= {self.least}"

    def as_json(self) -> list[int] | dict[str, int | None]:
        if self.exact is not None:
            return sorted(self.exact)
        return {"least": self.least, "most": self.most}


ANY = Values()


@dataclasses.dataclass(frozen=True)
class Declaration:
    """Where an envelope was read: a path relative to the installed packages'
    folder, the 1-based line for text files (None for a compiled file), and the
    declaration's text as read."""

    path: str
    line: int | None
    text: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else f"{self.path} (compiled)"
        return f"{where}: {self.text}"


@dataclasses.dataclass(frozen=True)
class KernelEnvelope:
    """What one kernel accepts, as the installed build declares it.

    ``rows``: page rows (tokens for the sliding-window cache, states for the
    compressed and indexer caches); ``heads`` and ``topk`` where the kernel
    declares them (None: it has no such parameter or does not declare it).
    ``unknown`` names the declaration that could not be read; then every
    field above is None and nothing is accepted."""

    kernel: str
    title: str
    caches: tuple[str, ...]
    rows: Values | None
    heads: Values | None
    topk: Values | None
    dtypes: tuple[str, ...]
    sources: tuple[Declaration, ...]
    notes: tuple[str, ...] = ()
    unknown: str | None = None

    @property
    def known(self) -> bool:
        return self.unknown is None

    def accepts_rows(self, rows: int) -> bool | None:
        """Whether the kernel takes pages of ``rows`` rows; None when unknown."""
        if self.rows is None:
            return None
        return rows in self.rows

    def describe(self) -> str:
        if self.unknown is not None:
            return f"{self.title}: unknown ({self.unknown})"
        parts = [f"page rows {self.rows}"]
        if self.heads is not None:
            parts.append(f"heads {self.heads}")
        if self.topk is not None:
            parts.append(f"top-k {self.topk}")
        return f"{self.title}: " + "; ".join(parts)

    def as_json(self) -> dict[str, object]:
        return {
            "kernel": self.kernel,
            "title": self.title,
            "caches": list(self.caches),
            "rows": None if self.rows is None else self.rows.as_json(),
            "heads": None if self.heads is None else self.heads.as_json(),
            "topk": None if self.topk is None else self.topk.as_json(),
            "dtypes": list(self.dtypes),
            "sources": [str(s) for s in self.sources],
            "notes": list(self.notes),
            "unknown": self.unknown,
        }


class Unreadable(Exception):
    """A declaration could not be read; the message names it."""


def unknown_envelope(kernel: str, reason: str) -> KernelEnvelope:
    return KernelEnvelope(
        kernel, TITLES[kernel], CACHES[kernel], None, None, None, (), (), (), reason
    )
