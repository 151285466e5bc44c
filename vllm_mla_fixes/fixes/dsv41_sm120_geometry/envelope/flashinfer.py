"""FlashInfer's SM120 sparse-MLA envelopes (decode and prefill, primary and
extra cache): its ``supported_sparse_mla_sm120_configs()`` and the C++
declarations it compiles."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from . import installed
from .installed import declared_at, ints, line_of, read_text, search_text, shown
from .model import (
    ANY,
    CACHES,
    FLASHINFER_DECODE,
    FLASHINFER_DECODE_EXTRA,
    FLASHINFER_PREFILL,
    FLASHINFER_PREFILL_EXTRA,
    REVIEWED_FLASHINFER,
    TITLES,
    Declaration,
    KernelEnvelope,
    Unreadable,
    Values,
    unknown_envelope,
)


def _flashinfer_dsv4_config() -> tuple[object, Declaration]:
    """FlashInfer's own decode envelope for the DeepSeek-V4 (584-B record)
    family, and where its config function is defined."""
    what = "flashinfer.mla.supported_sparse_mla_sm120_configs()['dsv4']"
    try:
        from flashinfer.mla import supported_sparse_mla_sm120_configs

        config = supported_sparse_mla_sm120_configs()["dsv4"]
        function = inspect.unwrap(supported_sparse_mla_sm120_configs)
        path = Path(inspect.getsourcefile(function) or "")
        line = inspect.getsourcelines(function)[1]
    except Exception as exc:  # noqa: BLE001 - any failure leaves the envelope unknown
        raise Unreadable(f"{what}: {type(exc).__name__}: {exc}") from None
    text = (
        f"dsv4: page_block_size={config.page_block_size}, "
        f"page_block_size_is_runtime={getattr(config, 'page_block_size_is_runtime', False)}, "
        f"page_block_sizes={sorted(getattr(config, 'page_block_sizes', ()) or ())}, "
        f"max_num_heads={config.max_num_heads}, head_counts="
        f"{None if config.head_counts is None else sorted(config.head_counts)}, "
        f"min_topk={config.min_topk}, topk_is_runtime={config.topk_is_runtime}, "
        f"kv_cache_format={config.kv_cache_format}, bytes_per_token={config.bytes_per_token}, "
        f"max_num_tokens={config.max_num_tokens}"
    )
    return config, Declaration(shown(path), line, text)


def _config_rows(config: Any) -> Values:
    if getattr(config, "page_block_size_is_runtime", False):
        return ANY
    return Values.of(getattr(config, "page_block_sizes", None) or {config.page_block_size})


def _config_heads(config: Any) -> Values:
    if config.head_counts is not None:
        return Values.of(config.head_counts)
    return Values(least=1, most=config.max_num_heads)


def _config_topk(config: Any) -> Values:
    return Values(least=config.min_topk) if config.topk_is_runtime else Values.of(config.topks)


def _config_dtypes(config: Any) -> tuple[str, ...]:
    return (
        f"KV: {config.kv_cache_format} packed record, {config.bytes_per_token} B per token",
        "query: bfloat16",
    )


def _function_body(text: str, signature: str, path: Path, what: str) -> tuple[int, str]:
    """Offset and text of a C++ function: from its signature to the next
    top-level closing brace."""
    start = text.find(signature)
    if start < 0:
        raise Unreadable(f"{what}: {signature.strip()} not found in {shown(path)}")
    end = text.find("\n}\n", start)
    return start, text[start : end if end > 0 else len(text)]


def _flashinfer_0_7_0(root: Path, config: Any, source: Declaration) -> dict[str, KernelEnvelope]:
    """FlashInfer 0.7.0.post1: 64-row pages compiled in, prefill's extra page
    from a fixed set."""
    heads, topk, dtypes = _config_heads(config), _config_topk(config), _config_dtypes(config)
    decode = KernelEnvelope(
        FLASHINFER_DECODE,
        TITLES[FLASHINFER_DECODE],
        CACHES[FLASHINFER_DECODE],
        _config_rows(config),
        heads,
        topk,
        dtypes,
        (source,),
        (
            f"decode serves at most {config.max_num_tokens} tokens per call; longer calls go to prefill",
        ),
    )
    return {
        FLASHINFER_DECODE: decode,
        FLASHINFER_DECODE_EXTRA: _flashinfer_0_7_0_decode_extra(root, heads, topk, dtypes, source),
        **_flashinfer_0_7_0_prefill(root, dtypes),
    }


def _flashinfer_0_7_0_decode_extra(
    root: Path, heads: Values, topk: Values, dtypes: tuple[str, ...], source: Declaration
) -> KernelEnvelope:
    """FlashInfer 0.7.0.post1's decode extra cache: any page size, as long as
    its launcher takes the size as an argument and never compares it."""
    decode = root / "data" / "csrc" / "sparse_mla_sm120_decode_dsv4.cu"
    text = read_text(decode, "the DeepSeek-V4 decode launcher")
    what = "the extra page of the DeepSeek-V4 decode launcher"
    start, body = _function_body(text, "bool launch_sparse_mla_decode_dsv4(", decode, what)
    taken = re.search(r"int extra_topk, int pbs_extra", body)
    if taken is None or re.search(r"pbs_extra\s*[!=<>]=?\s*\d", body):
        raise Unreadable(f"{what}: no run-time pbs_extra argument in {shown(decode)}")
    at = line_of(text, start + taken.start())
    return KernelEnvelope(
        FLASHINFER_DECODE_EXTRA,
        TITLES[FLASHINFER_DECODE_EXTRA],
        CACHES[FLASHINFER_DECODE_EXTRA],
        ANY,
        heads,
        topk,
        dtypes,
        (Declaration(shown(decode), at, text.splitlines()[at - 1].strip()), source),
        ("the extra page size is a run-time argument the launcher does not check",),
    )


def _flashinfer_0_7_0_prefill(root: Path, dtypes: tuple[str, ...]) -> dict[str, KernelEnvelope]:
    """FlashInfer 0.7.0.post1's prefill, both caches: the page sizes and head
    counts its single- and dual-cache dispatch functions accept."""
    prefill = root / "data" / "csrc" / "sparse_mla_sm120_prefill.cu"
    text = read_text(prefill, "the DeepSeek-V4 prefill dispatch")
    what = "the DeepSeek-V4 single-cache prefill dispatch"
    start, single = _function_body(text, "inline bool dispatch_dsv4_single(", prefill, what)
    primary = re.search(r"if \(page_block_size != (\d+)\) return false;", single)
    if primary is None:
        raise Unreadable(f"{what}: no page_block_size check in {shown(prefill)}")
    prefill_heads = sorted(ints(" ".join(re.findall(r"case (\d+):", single))))
    if not prefill_heads:
        raise Unreadable(f"{what}: no head-count cases in {shown(prefill)}")
    primary_at = line_of(text, start + primary.start())
    what = "the DeepSeek-V4 dual-cache prefill dispatch"
    dual_start, dual = _function_body(text, "inline bool dispatch_dsv4_dual(", prefill, what)
    dual_primary = re.search(r"if \(page_block_size != (\d+)\) return false;", dual)
    extras = re.findall(r"extra_page_block_size == (\d+)", dual)
    if dual_primary is None or dual_primary.group(1) != primary.group(1) or not extras:
        raise Unreadable(f"{what}: page checks not found in {shown(prefill)}")
    extra_at = line_of(text, dual_start + dual.find("extra_page_block_size =="))
    prefill_source = Declaration(
        shown(prefill), primary_at, text.splitlines()[primary_at - 1].strip()
    )
    notes = ("top-k is a run-time argument (topk <= 256 computes in BF16, larger in FP8)",)
    return {
        FLASHINFER_PREFILL: KernelEnvelope(
            FLASHINFER_PREFILL,
            TITLES[FLASHINFER_PREFILL],
            CACHES[FLASHINFER_PREFILL],
            Values.of({int(primary.group(1))}),
            Values.of(prefill_heads),
            ANY,
            dtypes,
            (prefill_source,),
            notes,
        ),
        FLASHINFER_PREFILL_EXTRA: KernelEnvelope(
            FLASHINFER_PREFILL_EXTRA,
            TITLES[FLASHINFER_PREFILL_EXTRA],
            CACHES[FLASHINFER_PREFILL_EXTRA],
            Values.of(ints(" ".join(extras))),
            Values.of(prefill_heads),
            ANY,
            dtypes,
            (Declaration(shown(prefill), extra_at, text.splitlines()[extra_at - 1].strip()),),
            notes,
        ),
    }


def _flashinfer_runtime_pages(
    root: Path, config: object, source: Declaration
) -> dict[str, KernelEnvelope]:
    """FlashInfer 0.7.2.post1 and later: one resolver checks both caches of
    decode and prefill against ``main_page_supported``."""
    plan = root / "data" / "include" / "flashinfer" / "attention" / "sparse_mla_sm120"
    plan = plan / "execution" / "attention_plan.h"
    text = read_text(plan, "FlashInfer's SM120 page rule")
    common = _runtime_page_rule(text, plan)
    main_source, extra_source = _resolver_page_checks(root)
    prefill_heads, heads_source = _runtime_prefill_heads(text, plan)

    decode_heads, decode_topk = _config_heads(config), _config_topk(config)
    dtypes = _config_dtypes(config)
    rows_note = "any positive page size (runtime_page includes ModelType::DSV4)"

    def envelope(
        kernel: str, heads: Values, topk: Values, own: Declaration, *more: Declaration
    ) -> KernelEnvelope:
        return KernelEnvelope(
            kernel,
            TITLES[kernel],
            CACHES[kernel],
            ANY,
            heads,
            topk,
            dtypes,
            (own, *common, *more),
            (rows_note,),
        )

    return {
        FLASHINFER_DECODE: envelope(
            FLASHINFER_DECODE, decode_heads, decode_topk, source, main_source
        ),
        FLASHINFER_DECODE_EXTRA: envelope(
            FLASHINFER_DECODE_EXTRA, decode_heads, decode_topk, extra_source, source
        ),
        FLASHINFER_PREFILL: envelope(
            FLASHINFER_PREFILL, Values.of(prefill_heads), ANY, main_source, heads_source
        ),
        FLASHINFER_PREFILL_EXTRA: envelope(
            FLASHINFER_PREFILL_EXTRA, Values.of(prefill_heads), ANY, extra_source, heads_source
        ),
    }


def _runtime_page_rule(text: str, plan: Path) -> tuple[Declaration, Declaration]:
    """Where ``plan`` (FlashInfer's attention plan header, read as ``text``)
    lets DSV4 pages be any positive size: the page rule, then ``runtime_page``."""
    runtime = search_text(
        text, r"constexpr bool runtime_page\(ModelType model\) \{[^}]*\}", plan, "runtime_page()"
    )
    if not re.search(r"ModelType::DSV4\b", runtime.group(0)):
        raise Unreadable(f"runtime_page() in {shown(plan)} does not list ModelType::DSV4")
    rule = search_text(
        text,
        r"return runtime_page\(model\) \? page > 0 : page == FixedPageSize;",
        plan,
        "main_page_supported()",
    )
    return declared_at(text, rule, plan), declared_at(text, runtime, plan)


def _resolver_page_checks(root: Path) -> tuple[Declaration, Declaration]:
    """Where FlashInfer's SM120 resolver checks the main page, then the extra
    page, with ``main_page_supported``."""
    resolve = root / "data" / "csrc" / "sparse_mla_sm120" / "attention_resolve.cu"
    resolved = read_text(resolve, "FlashInfer's SM120 attention resolver")
    main = search_text(
        resolved, r"main_page_supported\(mt, m\.page_size\)", resolve, "the main page check"
    )
    extra = search_text(
        resolved,
        r"main_page_supported\(mt, m\.extra_page_size\)",
        resolve,
        "the extra page check",
    )
    return declared_at(resolved, main, resolve), declared_at(resolved, extra, resolve)


def _runtime_prefill_heads(text: str, plan: Path) -> tuple[set[int], Declaration]:
    """The head counts prefill instantiates for DSV4, and where they are listed."""
    # Prefill instantiates fixed head counts: HEAD(n) under each `if constexpr`
    # whose multi-group (mg) arm names ModelType::DSV4.
    visit = search_text(
        text,
        r"PrefillLaunchResult visit_prefill_heads\(int heads, F&& call\) \{(.*?)#undef HEAD",
        plan,
        "visit_prefill_heads()",
        re.S,
    )
    prefill_heads: set[int] = set()
    for condition, heads in re.findall(
        r"if constexpr \((.*?)\) \{\s*((?:HEAD\(\d+\)\s*)+)\}", visit.group(1), re.S
    ):
        if re.search(r"mg && (?:\(inline_scale \|\| )?MT == ModelType::DSV4\b", condition):
            prefill_heads |= ints(heads)
    if not prefill_heads:
        raise Unreadable(f"visit_prefill_heads() in {shown(plan)} lists no DSV4 head counts")
    return prefill_heads, declared_at(text, visit, plan)


def flashinfer_envelopes() -> dict[str, KernelEnvelope]:
    kernels = (
        FLASHINFER_DECODE,
        FLASHINFER_DECODE_EXTRA,
        FLASHINFER_PREFILL,
        FLASHINFER_PREFILL_EXTRA,
    )
    found = installed.installed_version("flashinfer-python")
    if found is None:
        return {k: unknown_envelope(k, "flashinfer-python is not installed") for k in kernels}
    if found not in REVIEWED_FLASHINFER:
        reason = (
            f"FlashInfer {found}'s SM120 declarations were not reviewed "
            f"(reviewed: {', '.join(REVIEWED_FLASHINFER)})"
        )
        return {k: unknown_envelope(k, reason) for k in kernels}
    try:
        root = installed.package_dir("flashinfer")
        if root is None:
            raise Unreadable("the flashinfer package folder was not found")
        config, source = _flashinfer_dsv4_config()
        if (root / "data" / "csrc" / "sparse_mla_sm120_prefill.cu").is_file():
            return _flashinfer_0_7_0(root, config, source)
        return _flashinfer_runtime_pages(root, config, source)
    except Unreadable as exc:
        return {k: unknown_envelope(k, str(exc)) for k in kernels}
