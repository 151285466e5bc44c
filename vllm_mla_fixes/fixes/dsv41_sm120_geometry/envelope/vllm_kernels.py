"""vLLM's own kernels on a DeepSeek-V4.1 cache: the indexer's K gather and top-k
and the three cache writers, from their compiled op schemas and Python
launchers (all take the page rows from the cache at run time)."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_mla_fixes import patching

from . import installed
from .installed import compiled_strings, module_path, shown
from .model import (
    ANY,
    CACHES,
    COMPRESSED_WRITER,
    INDEXER_GATHER,
    INDEXER_TOP_K,
    INDEXER_WRITER,
    SWA_WRITER,
    TITLES,
    Declaration,
    KernelEnvelope,
    Unreadable,
    Values,
    unknown_envelope,
)


def _vllm_extension(vllm_dir: Path, schema: bytes, what: str) -> tuple[Path, str]:
    for path in sorted(vllm_dir.glob("_C*.so")):
        try:
            return path, compiled_strings(path, schema, what)[0]
        except Unreadable:
            continue
    raise Unreadable(f"{what} not found in vLLM's compiled extensions ({shown(vllm_dir)}/_C*.so)")


def _python_declaration(module: str, function: str, pattern: str, what: str) -> Declaration:
    """The line of ``function`` in vLLM's ``module`` (read, not imported) that
    matches ``pattern``."""
    try:
        text, tree = patching.vllm_source(module)
    except (patching.CannotProbe, patching.TargetMismatch) as exc:
        raise Unreadable(f"{what}: {exc}") from None
    node = patching.find_definition(tree, function)
    if node is None:
        raise Unreadable(f"{what}: {module}.{function} does not exist")
    lines = text.splitlines()
    for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        if re.search(pattern, lines[number - 1]):
            path = module_path(module)
            return Declaration(path, number, lines[number - 1].strip())
    raise Unreadable(f"{what}: {module}.{function} has no line matching {pattern!r}")


def _runtime_envelope(
    kernel: str,
    sources: tuple[Declaration, ...],
    dtypes: tuple[str, ...],
    note: str,
    topk: Values | None = None,
) -> KernelEnvelope:
    return KernelEnvelope(
        kernel, TITLES[kernel], CACHES[kernel], ANY, None, topk, dtypes, sources, (note,)
    )


def vllm_kernel_envelopes() -> dict[str, KernelEnvelope]:
    vllm_dir = installed.package_dir("vllm")
    readers = {
        INDEXER_GATHER: _gather_envelope,
        INDEXER_TOP_K: _top_k_envelope,
        SWA_WRITER: _swa_writer_envelope,
        COMPRESSED_WRITER: _compressed_writer_envelope,
        INDEXER_WRITER: _indexer_writer_envelope,
    }
    envelopes = {}
    for kernel, reader in readers.items():
        try:
            if vllm_dir is None:
                raise Unreadable("the vllm package folder was not found")
            envelopes[kernel] = reader(vllm_dir)
        except Unreadable as exc:
            envelopes[kernel] = unknown_envelope(kernel, str(exc))
    return envelopes


def _gather_envelope(vllm_dir: Path) -> KernelEnvelope:
    path, schema = _vllm_extension(
        vllm_dir,
        rb"cp_gather_indexer_k_quant_cache\(Tensor kv_cache, [^)]*\) -> \(\)",
        "the schema of cp_gather_indexer_k_quant_cache",
    )
    return _runtime_envelope(
        INDEXER_GATHER,
        (Declaration(shown(path), None, schema),),
        ("KV: uint8 indexer rows", "out: FP8 keys and float32 scales"),
        "takes no page size: the rows are the cache's size(1) at run time",
    )


def _top_k_envelope(vllm_dir: Path) -> KernelEnvelope:
    what = "the compiled persistent_topk kernels"
    path = None
    instantiated: set[int] = set()
    for candidate in sorted(vllm_dir.glob("_C*.so")):
        try:
            names = compiled_strings(candidate, rb"persistent_topk_kernelILi\d+E", what)
        except Unreadable:
            continue
        path = candidate
        instantiated = {
            int(m) for name in names for m in re.findall(r"persistent_topk_kernelILi(\d+)E", name)
        }
        break
    if path is None:
        raise Unreadable(f"{what} not found in vLLM's compiled extensions")
    _, schema = _vllm_extension(
        vllm_dir,
        rb"top_k_per_row_decode\(Tensor logits, [^)]*int topK\) -> \(\)",
        "the schema of top_k_per_row_decode",
    )
    return _runtime_envelope(
        INDEXER_TOP_K,
        (Declaration(shown(path), None, schema),),
        ("logits: float32 or bfloat16", "out: int32 indices"),
        f"reads the logits, not a cache page; persistent_topk is compiled for top-k "
        f"{Values.of(instantiated)}, top_k_per_row takes any top-k at run time",
        topk=ANY,
    )


def _swa_writer_envelope(vllm_dir: Path) -> KernelEnvelope:
    path, schema = _vllm_extension(
        vllm_dir,
        rb"fused_deepseek_v4_kv_rope_insert\(Tensor kv, [^)]*int cache_block_size[^)]*\) -> \(\)",
        "the schema of fused_deepseek_v4_kv_rope_insert",
    )
    return _runtime_envelope(
        SWA_WRITER,
        (Declaration(shown(path), None, schema),),
        ("kv: bfloat16 [tokens, 512]", "KV: uint8 packed record"),
        "the page rows are its run-time cache_block_size argument",
    )


def _compressed_writer_envelope(vllm_dir: Path) -> KernelEnvelope:
    module = "vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache"
    what = "rope_quant_insert's page rows"
    rows = _python_declaration(
        module, "rope_quant_insert", r"CACHE_BLOCK=kv_cache\.shape\[1\]", what
    )
    return _runtime_envelope(
        COMPRESSED_WRITER,
        (rows,),
        ("latent: bfloat16 [tokens, 512]", "KV: uint8 584/528/288-B records, bfloat16 or FP8 rows"),
        "the page rows are the cache's shape[1] at run time",
    )


def _indexer_writer_envelope(vllm_dir: Path) -> KernelEnvelope:
    module = "vllm.models.deepseek_v41.common.ops.indexer_k_store"
    what = "indexer_k_norm_rope_store's page rows"
    rows = _python_declaration(module, "indexer_k_norm_rope_store", r"k_cache\.shape\[1\],$", what)
    return _runtime_envelope(
        INDEXER_WRITER,
        (rows,),
        ("k: bfloat16 [tokens, 128]", "KV: uint8 FP8 (+float32 scale) or MXFP4 rows"),
        "the page rows are the cache's shape[1] at run time",
    )
