"""DeepGEMM's SM120 paged MQA logits envelopes (FP8 and FP4 indexer caches): the
host check compiled into its extension and the kernels' static assertions."""

from __future__ import annotations

import re

from . import installed
from .installed import compiled_strings, declared_at, ints, read_text, search_text, shown
from .model import (
    CACHES,
    DEEPGEMM_LOGITS_FP4,
    DEEPGEMM_LOGITS_FP8,
    TITLES,
    Declaration,
    KernelEnvelope,
    Unreadable,
    Values,
    unknown_envelope,
)

HOST_CHECK = rb"\(arch_major == 12 and \((?:block_kv == \d+(?: or )?)+\)\)"
HEADS_CHECK = rb"num_heads == 16 or num_heads == 32 or num_heads == 64"


def deep_gemm_envelopes() -> dict[str, KernelEnvelope]:
    kernels = (DEEPGEMM_LOGITS_FP8, DEEPGEMM_LOGITS_FP4)
    root = installed.deep_gemm_dir()
    if root is None:
        return {k: unknown_envelope(k, "no DeepGEMM package is installed") for k in kernels}
    try:
        extensions = sorted(root.glob("_C*.so"))
        if not extensions:
            raise Unreadable(f"DeepGEMM's compiled extension not found in {shown(root)}")
        extension = extensions[0]
        what = "DeepGEMM's paged MQA logits host check (arch_major == 12 and (block_kv == ...))"
        condition = compiled_strings(extension, HOST_CHECK, what)[0]
        arch12 = re.search(HOST_CHECK.decode(), condition)
        host_rows = ints(arch12.group(0)[len("(arch_major == 12") :]) if arch12 else frozenset()
        host = Declaration(shown(extension), None, condition)
        heads_what = "DeepGEMM's SM120 head-count check (num_heads == 16 or 32 or 64)"
        heads_text = compiled_strings(extension, HEADS_CHECK, heads_what)[0]
        heads = Values.of(ints(heads_text))
    except Unreadable as exc:
        return {k: unknown_envelope(k, str(exc)) for k in kernels}

    envelopes = {}
    for kernel, name, label, dtypes in (
        (
            DEEPGEMM_LOGITS_FP8,
            "sm120_fp8_paged_mqa_logits.cuh",
            "FP8",
            ("query: float8_e4m3fn", "KV: uint8 rows of FP8 keys, then one float32 scale per row"),
        ),
        (
            DEEPGEMM_LOGITS_FP4,
            "sm120_fp4_paged_mqa_logits.cuh",
            "FP4",
            (
                "query: packed FP4 with int32 UE8M0 scales",
                "KV: uint8 rows of packed FP4 keys, then int32 UE8M0 scales",
            ),
        ),
    ):
        path = root / "include" / "deep_gemm" / "impls" / name
        try:
            text = read_text(path, f"DeepGEMM's SM120 {label} paged MQA logits kernel")
            assertion = search_text(
                text,
                rf'DG_STATIC_ASSERT\(((?:PAGE_KV == \d+(?: or )?)+), "Unsupported {label} page size"\);',
                path,
                f"the {label} kernel's page-size static assertion",
            )
            tile = search_text(
                text,
                r"static constexpr uint32_t BLOCK_KV = PAGE_KV < (\d+) \? PAGE_KV : \1;",
                path,
                f"the {label} kernel's BLOCK_KV choice",
            )
        except Unreadable as exc:
            envelopes[kernel] = unknown_envelope(kernel, str(exc))
            continue
        kernel_rows = ints(assertion.group(1))
        envelopes[kernel] = KernelEnvelope(
            kernel,
            TITLES[kernel],
            CACHES[kernel],
            Values.of(host_rows & kernel_rows),
            heads,
            None,
            dtypes,
            (host, declared_at(text, assertion, path), declared_at(text, tile, path)),
            (
                f"the host check admits {Values.of(host_rows)} on SM12x, the kernel template "
                f"{Values.of(kernel_rows)}; the envelope is both",
                f"a page of fewer than {tile.group(1)} rows gets a compute tile of its own size",
                f"head counts from the extension's check '{heads_text}'",
            ),
        )
    return envelopes
