"""Kernel envelopes: what the installed kernels that read or write a DeepSeek-V4.1
KV cache on SM12x accept, each read from the kernel's own declaration.

The bottom layer of the fix: it imports none of the fix's other modules.
Its modules: ``model`` (what an envelope is), ``installed`` (reading the
installed files), ``flashinfer``, ``deep_gemm`` and ``vllm_kernels`` (one per
source of declarations), ``statements`` (vLLM's claims and the
disagreements); this module assembles the table.  Every
envelope is read at run time from the installed packages, without a GPU and
without initialising CUDA, and cached for the process:

* FlashInfer's SM120 sparse-MLA decode: its config function
  (``flashinfer.mla.supported_sparse_mla_sm120_configs()["dsv4"]``);
* its extra (compressed) cache and its prefill kernels: the C++ declarations
  FlashInfer ships and compiles (0.7.0.post1: ``sparse_mla_sm120_prefill.cu``'s
  DeepSeek-V4 dispatch; 0.7.2.post1 and later: ``runtime_page`` /
  ``main_page_supported`` in ``attention_plan.h`` as ``attention_resolve.cu``
  applies them to both caches);
* DeepGEMM's SM120 paged MQA logits (FP8 and FP4), as vLLM imports it (an
  installed ``deep_gemm`` package first, else ``vllm.third_party.deep_gemm``):
  the host check compiled into its extension, read from the extension's bytes,
  and the kernels' static assertions, read from their ``.cuh`` text;
* the indexer's K gather, its top-k and the three cache writers: the compiled
  op schemas and the Python launchers, which take the page rows from the cache
  at run time.

A release this module was not reviewed against, or a declaration it cannot
read, gives an *unknown* envelope that names what could not be read; unknown
never accepts anything (:meth:`KernelEnvelope.accepts_rows` returns None).

:func:`vllm_statements` reads what vLLM itself says about these kernels on SM12x
(``get_paged_mqa_page_sizes()``, the backends' declared kernel block sizes),
from vLLM's source without importing it, and :func:`disagreements` lists every
statement a kernel's own declaration contradicts, naming both sources.  vLLM's
statements are never used as an envelope.
"""

from __future__ import annotations

from . import installed
from .installed import deep_gemm_dir, installed_version, package_dir, shown
from .model import (
    ANY,
    CACHES,
    COMPRESSED,
    COMPRESSED_WRITER,
    DEEPGEMM_LOGITS_FP4,
    DEEPGEMM_LOGITS_FP8,
    FLASHINFER_DECODE,
    FLASHINFER_DECODE_EXTRA,
    FLASHINFER_PREFILL,
    FLASHINFER_PREFILL_EXTRA,
    INDEXER,
    INDEXER_GATHER,
    INDEXER_TOP_K,
    INDEXER_WRITER,
    KERNELS,
    REVIEWED_FLASHINFER,
    SM120,
    SWA,
    SWA_WRITER,
    TITLES,
    Declaration,
    KernelEnvelope,
    Unreadable,
    Values,
    unknown_envelope,
)
from .statements import Disagreement, Statement, disagreements, vllm_statements
from .table import (
    accepts_rows,
    content_key,
    declaration_files,
    envelopes_for_cache,
    kernel_envelopes,
    rejecting_kernels,
)


def report() -> dict[str, object]:
    """The envelopes, vLLM's statements and their disagreements, for JSON."""
    deep_gemm = deep_gemm_dir()
    return {
        "vllm": installed_version("vllm"),
        "flashinfer": installed_version("flashinfer-python"),
        "deep_gemm": None if deep_gemm is None else shown(deep_gemm),
        "envelopes": {k: e.as_json() for k, e in kernel_envelopes().items()},
        "vllm_statements": [
            {
                "name": s.name,
                "claim": s.claim,
                "source": None if s.source is None else str(s.source),
                "unknown": s.unknown,
            }
            for s in vllm_statements()
        ],
        "disagreements": [str(d) for d in disagreements()],
    }


__all__ = [
    "ANY",
    "CACHES",
    "COMPRESSED",
    "COMPRESSED_WRITER",
    "DEEPGEMM_LOGITS_FP4",
    "DEEPGEMM_LOGITS_FP8",
    "FLASHINFER_DECODE",
    "FLASHINFER_DECODE_EXTRA",
    "FLASHINFER_PREFILL",
    "FLASHINFER_PREFILL_EXTRA",
    "INDEXER",
    "INDEXER_GATHER",
    "INDEXER_TOP_K",
    "INDEXER_WRITER",
    "KERNELS",
    "REVIEWED_FLASHINFER",
    "SM120",
    "SWA",
    "SWA_WRITER",
    "TITLES",
    "Declaration",
    "Disagreement",
    "KernelEnvelope",
    "Statement",
    "Unreadable",
    "Values",
    "accepts_rows",
    "content_key",
    "declaration_files",
    "deep_gemm_dir",
    "disagreements",
    "envelopes_for_cache",
    "installed",
    "installed_version",
    "kernel_envelopes",
    "package_dir",
    "rejecting_kernels",
    "report",
    "unknown_envelope",
    "vllm_statements",
]
