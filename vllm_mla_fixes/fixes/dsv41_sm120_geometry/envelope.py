"""Kernel envelopes: what the installed kernels that read or write a DeepSeek-V4.1
KV cache on SM12x accept, each read from the kernel's own declaration.

The bottom layer of the fix: it imports none of the fix's other modules.  Every
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

import ast
import dataclasses
import functools
import importlib.util
import inspect
import mmap
import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from vllm_mla_fixes import patching

COVERED_VLLM = ("0.32.0", "0.33.0", "0.34.0")
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


# ------------------------------------------------------------------- values


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

    def as_json(self) -> dict[str, Any]:
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


# --------------------------------------------------------- installed files


def installed_version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def package_dir(name: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _shown(path: Path) -> str:
    """``path`` relative to the folder of the installed packages, as a
    declaration names it."""
    for parent in path.parents:
        if parent.name in ("site-packages", "dist-packages"):
            return path.relative_to(parent).as_posix()
    return path.as_posix()


def _text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise Unreadable(f"{what}: cannot read {_shown(path)} ({exc.strerror or exc})") from None


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _search(text: str, pattern: str, path: Path, what: str, flags: int = 0) -> re.Match[str]:
    found = re.search(pattern, text, flags)
    if found is None:
        raise Unreadable(f"{what} not found in {_shown(path)}")
    return found


def _declared_at(text: str, found: re.Match[str], path: Path) -> Declaration:
    line = _line_of(text, found.start())
    return Declaration(_shown(path), line, text.splitlines()[line - 1].strip())


def _ints(text: str) -> frozenset[int]:
    return frozenset(int(n) for n in re.findall(r"\d+", text))


def _compiled_strings(path: Path, pattern: bytes, what: str) -> list[str]:
    """Every NUL-terminated string in a compiled file that matches ``pattern``."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found = []
            for match in re.finditer(pattern, data):
                start = data.rfind(b"\0", 0, match.start()) + 1
                end = data.find(b"\0", match.end())
                found.append(data[start:end].decode("utf-8", "replace"))
    except (OSError, ValueError) as exc:
        raise Unreadable(f"{what}: cannot read {_shown(path)} ({exc})") from None
    if not found:
        raise Unreadable(f"{what} not found in {_shown(path)}")
    return found


# --------------------------------------------------------------- FlashInfer


def _flashinfer_dsv4_config() -> tuple[Any, Declaration]:
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
    return config, Declaration(_shown(path), line, text)


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
        raise Unreadable(f"{what}: {signature.strip()} not found in {_shown(path)}")
    end = text.find("\n}\n", start)
    return start, text[start : end if end > 0 else len(text)]


def _flashinfer_0_7_0(root: Path, config: Any, source: Declaration) -> dict[str, KernelEnvelope]:
    """FlashInfer 0.7.0.post1: 64-row pages compiled in, prefill's extra page
    from a fixed set."""
    envelopes = {}
    heads, topk, dtypes = _config_heads(config), _config_topk(config), _config_dtypes(config)
    envelopes[FLASHINFER_DECODE] = KernelEnvelope(
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

    decode = root / "data" / "csrc" / "sparse_mla_sm120_decode_dsv4.cu"
    text = _text(decode, "the DeepSeek-V4 decode launcher")
    what = "the extra page of the DeepSeek-V4 decode launcher"
    start, body = _function_body(text, "bool launch_sparse_mla_decode_dsv4(", decode, what)
    taken = re.search(r"int extra_topk, int pbs_extra", body)
    if taken is None or re.search(r"pbs_extra\s*[!=<>]=?\s*\d", body):
        raise Unreadable(f"{what}: no run-time pbs_extra argument in {_shown(decode)}")
    at = _line_of(text, start + taken.start())
    envelopes[FLASHINFER_DECODE_EXTRA] = KernelEnvelope(
        FLASHINFER_DECODE_EXTRA,
        TITLES[FLASHINFER_DECODE_EXTRA],
        CACHES[FLASHINFER_DECODE_EXTRA],
        ANY,
        heads,
        topk,
        dtypes,
        (Declaration(_shown(decode), at, text.splitlines()[at - 1].strip()), source),
        ("the extra page size is a run-time argument the launcher does not check",),
    )

    prefill = root / "data" / "csrc" / "sparse_mla_sm120_prefill.cu"
    text = _text(prefill, "the DeepSeek-V4 prefill dispatch")
    what = "the DeepSeek-V4 single-cache prefill dispatch"
    start, single = _function_body(text, "inline bool dispatch_dsv4_single(", prefill, what)
    primary = re.search(r"if \(page_block_size != (\d+)\) return false;", single)
    if primary is None:
        raise Unreadable(f"{what}: no page_block_size check in {_shown(prefill)}")
    prefill_heads = sorted(_ints(" ".join(re.findall(r"case (\d+):", single))))
    if not prefill_heads:
        raise Unreadable(f"{what}: no head-count cases in {_shown(prefill)}")
    primary_at = _line_of(text, start + primary.start())
    what = "the DeepSeek-V4 dual-cache prefill dispatch"
    dual_start, dual = _function_body(text, "inline bool dispatch_dsv4_dual(", prefill, what)
    dual_primary = re.search(r"if \(page_block_size != (\d+)\) return false;", dual)
    extras = re.findall(r"extra_page_block_size == (\d+)", dual)
    if dual_primary is None or dual_primary.group(1) != primary.group(1) or not extras:
        raise Unreadable(f"{what}: page checks not found in {_shown(prefill)}")
    extra_at = _line_of(text, dual_start + dual.find("extra_page_block_size =="))
    prefill_source = Declaration(
        _shown(prefill), primary_at, text.splitlines()[primary_at - 1].strip()
    )
    notes = ("top-k is a run-time argument (topk <= 256 computes in BF16, larger in FP8)",)
    envelopes[FLASHINFER_PREFILL] = KernelEnvelope(
        FLASHINFER_PREFILL,
        TITLES[FLASHINFER_PREFILL],
        CACHES[FLASHINFER_PREFILL],
        Values.of({int(primary.group(1))}),
        Values.of(prefill_heads),
        ANY,
        dtypes,
        (prefill_source,),
        notes,
    )
    envelopes[FLASHINFER_PREFILL_EXTRA] = KernelEnvelope(
        FLASHINFER_PREFILL_EXTRA,
        TITLES[FLASHINFER_PREFILL_EXTRA],
        CACHES[FLASHINFER_PREFILL_EXTRA],
        Values.of(_ints(" ".join(extras))),
        Values.of(prefill_heads),
        ANY,
        dtypes,
        (Declaration(_shown(prefill), extra_at, text.splitlines()[extra_at - 1].strip()),),
        notes,
    )
    return envelopes


def _flashinfer_runtime_pages(
    root: Path, config: Any, source: Declaration
) -> dict[str, KernelEnvelope]:
    """FlashInfer 0.7.2.post1 and later: one resolver checks both caches of
    decode and prefill against ``main_page_supported``."""
    plan = root / "data" / "include" / "flashinfer" / "attention" / "sparse_mla_sm120"
    plan = plan / "execution" / "attention_plan.h"
    text = _text(plan, "FlashInfer's SM120 page rule")
    runtime = _search(
        text, r"constexpr bool runtime_page\(ModelType model\) \{[^}]*\}", plan, "runtime_page()"
    )
    if not re.search(r"ModelType::DSV4\b", runtime.group(0)):
        raise Unreadable(f"runtime_page() in {_shown(plan)} does not list ModelType::DSV4")
    rule = _search(
        text,
        r"return runtime_page\(model\) \? page > 0 : page == FixedPageSize;",
        plan,
        "main_page_supported()",
    )
    rule_source = _declared_at(text, rule, plan)
    runtime_source = _declared_at(text, runtime, plan)

    resolve = root / "data" / "csrc" / "sparse_mla_sm120" / "attention_resolve.cu"
    resolved = _text(resolve, "FlashInfer's SM120 attention resolver")
    main = _search(
        resolved, r"main_page_supported\(mt, m\.page_size\)", resolve, "the main page check"
    )
    extra = _search(
        resolved,
        r"main_page_supported\(mt, m\.extra_page_size\)",
        resolve,
        "the extra page check",
    )
    main_source = _declared_at(resolved, main, resolve)
    extra_source = _declared_at(resolved, extra, resolve)

    # Prefill instantiates fixed head counts: HEAD(n) under each `if constexpr`
    # whose multi-group (mg) arm names ModelType::DSV4.
    visit = _search(
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
            prefill_heads |= _ints(heads)
    if not prefill_heads:
        raise Unreadable(f"visit_prefill_heads() in {_shown(plan)} lists no DSV4 head counts")
    heads_source = _declared_at(text, visit, plan)

    decode_heads, decode_topk = _config_heads(config), _config_topk(config)
    dtypes = _config_dtypes(config)
    rows_note = "any positive page size (runtime_page includes ModelType::DSV4)"
    common = (rule_source, runtime_source)

    def envelope(kernel: str, heads: Values, topk: Values, own: Declaration, *more):
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


def _flashinfer_envelopes() -> dict[str, KernelEnvelope]:
    kernels = (
        FLASHINFER_DECODE,
        FLASHINFER_DECODE_EXTRA,
        FLASHINFER_PREFILL,
        FLASHINFER_PREFILL_EXTRA,
    )
    found = installed_version("flashinfer-python")
    if found is None:
        return {k: unknown_envelope(k, "flashinfer-python is not installed") for k in kernels}
    if found not in REVIEWED_FLASHINFER:
        reason = (
            f"FlashInfer {found}'s SM120 declarations were not reviewed "
            f"(reviewed: {', '.join(REVIEWED_FLASHINFER)})"
        )
        return {k: unknown_envelope(k, reason) for k in kernels}
    try:
        root = package_dir("flashinfer")
        if root is None:
            raise Unreadable("the flashinfer package folder was not found")
        config, source = _flashinfer_dsv4_config()
        if (root / "data" / "csrc" / "sparse_mla_sm120_prefill.cu").is_file():
            return _flashinfer_0_7_0(root, config, source)
        return _flashinfer_runtime_pages(root, config, source)
    except Unreadable as exc:
        return {k: unknown_envelope(k, str(exc)) for k in kernels}


# ------------------------------------------------------------------ DeepGEMM


def deep_gemm_dir() -> Path | None:
    """The DeepGEMM vLLM imports: an installed ``deep_gemm`` package first,
    else the copy vendored in ``vllm.third_party`` (vllm.utils.deep_gemm's order)."""
    external = package_dir("deep_gemm")
    if external is not None:
        return external
    vllm_dir = package_dir("vllm")
    vendored = None if vllm_dir is None else vllm_dir / "third_party" / "deep_gemm"
    return vendored if vendored is not None and vendored.is_dir() else None


HOST_CHECK = rb"\(arch_major == 12 and \((?:block_kv == \d+(?: or )?)+\)\)"
HEADS_CHECK = rb"num_heads == 16 or num_heads == 32 or num_heads == 64"


def _deep_gemm_envelopes() -> dict[str, KernelEnvelope]:
    kernels = (DEEPGEMM_LOGITS_FP8, DEEPGEMM_LOGITS_FP4)
    root = deep_gemm_dir()
    if root is None:
        return {k: unknown_envelope(k, "no DeepGEMM package is installed") for k in kernels}
    try:
        extensions = sorted(root.glob("_C*.so"))
        if not extensions:
            raise Unreadable(f"DeepGEMM's compiled extension not found in {_shown(root)}")
        extension = extensions[0]
        what = "DeepGEMM's paged MQA logits host check (arch_major == 12 and (block_kv == ...))"
        condition = _compiled_strings(extension, HOST_CHECK, what)[0]
        arch12 = re.search(HOST_CHECK.decode(), condition)
        host_rows = _ints(arch12.group(0)[len("(arch_major == 12") :]) if arch12 else frozenset()
        host = Declaration(_shown(extension), None, condition)
        heads_what = "DeepGEMM's SM120 head-count check (num_heads == 16 or 32 or 64)"
        heads_text = _compiled_strings(extension, HEADS_CHECK, heads_what)[0]
        heads = Values.of(_ints(heads_text))
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
            text = _text(path, f"DeepGEMM's SM120 {label} paged MQA logits kernel")
            assertion = _search(
                text,
                rf'DG_STATIC_ASSERT\(((?:PAGE_KV == \d+(?: or )?)+), "Unsupported {label} page size"\);',
                path,
                f"the {label} kernel's page-size static assertion",
            )
            tile = _search(
                text,
                r"static constexpr uint32_t BLOCK_KV = PAGE_KV < (\d+) \? PAGE_KV : \1;",
                path,
                f"the {label} kernel's BLOCK_KV choice",
            )
        except Unreadable as exc:
            envelopes[kernel] = unknown_envelope(kernel, str(exc))
            continue
        kernel_rows = _ints(assertion.group(1))
        envelopes[kernel] = KernelEnvelope(
            kernel,
            TITLES[kernel],
            CACHES[kernel],
            Values.of(host_rows & kernel_rows),
            heads,
            None,
            dtypes,
            (host, _declared_at(text, assertion, path), _declared_at(text, tile, path)),
            (
                f"the host check admits {Values.of(host_rows)} on SM12x, the kernel template "
                f"{Values.of(kernel_rows)}; the envelope is both",
                f"a page of fewer than {tile.group(1)} rows gets a compute tile of its own size",
                f"head counts from the extension's check '{heads_text}'",
            ),
        )
    return envelopes


# ------------------------------------------------- gather, top-k, writers


def _vllm_extension(vllm_dir: Path, schema: bytes, what: str) -> tuple[Path, str]:
    for path in sorted(vllm_dir.glob("_C*.so")):
        try:
            return path, _compiled_strings(path, schema, what)[0]
        except Unreadable:
            continue
    raise Unreadable(f"{what} not found in vLLM's compiled extensions ({_shown(vllm_dir)}/_C*.so)")


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
            path = _module_path(module)
            return Declaration(path, number, lines[number - 1].strip())
    raise Unreadable(f"{what}: {module}.{function} has no line matching {pattern!r}")


def _module_path(module: str) -> str:
    root = package_dir(module.split(".")[0])
    parts = module.split(".")[1:]
    base = Path(root, *parts) if root is not None else Path(*module.split("."))
    return _shown(
        base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    )


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


def _vllm_kernel_envelopes() -> dict[str, KernelEnvelope]:
    vllm_dir = package_dir("vllm")
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
        (Declaration(_shown(path), None, schema),),
        ("KV: uint8 indexer rows", "out: FP8 keys and float32 scales"),
        "takes no page size: the rows are the cache's size(1) at run time",
    )


def _top_k_envelope(vllm_dir: Path) -> KernelEnvelope:
    what = "the compiled persistent_topk kernels"
    path = None
    instantiated: set[int] = set()
    for candidate in sorted(vllm_dir.glob("_C*.so")):
        try:
            names = _compiled_strings(candidate, rb"persistent_topk_kernelILi\d+E", what)
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
        (Declaration(_shown(path), None, schema),),
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
        (Declaration(_shown(path), None, schema),),
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


# --------------------------------------------------------------- the table


@functools.cache
def kernel_envelopes() -> dict[str, KernelEnvelope]:
    """Every kernel that reads or writes a DeepSeek-V4.1 cache on SM12x, with
    what the installed build declares it accepts (read once per process)."""
    found = installed_version("vllm")
    if found not in COVERED_VLLM:
        reason = f"vLLM {found or 'is not installed'}" + (
            f" is not a covered release ({', '.join(COVERED_VLLM)})" if found else ""
        )
        return {k: unknown_envelope(k, reason) for k in KERNELS}
    envelopes = {**_flashinfer_envelopes(), **_deep_gemm_envelopes(), **_vllm_kernel_envelopes()}
    return {k: envelopes[k] for k in KERNELS}


def envelopes_for_cache(cache: str) -> list[KernelEnvelope]:
    """The envelopes of every kernel that reads or writes ``cache``."""
    return [e for e in kernel_envelopes().values() if cache in e.caches]


def accepts_rows(cache: str, rows: int) -> bool | None:
    """Whether every kernel on ``cache`` takes pages of ``rows`` rows: False
    when one rejects them, None when none rejects and one is unknown."""
    verdicts = [e.accepts_rows(rows) for e in envelopes_for_cache(cache)]
    if False in verdicts:
        return False
    return None if None in verdicts else True


def rejecting_kernels(cache: str, rows: int) -> list[KernelEnvelope]:
    """The kernels on ``cache`` whose declaration rejects ``rows``-row pages."""
    return [e for e in envelopes_for_cache(cache) if e.accepts_rows(rows) is False]


# ------------------------------------------------------- vLLM's statements


@dataclasses.dataclass(frozen=True)
class Statement:
    """What vLLM's own code says about a kernel on SM12x, read from its source.

    ``pages``: the page rows the statement implies, per (cache, compress
    ratio); ``exhaustive``: the statement lists every size the kernel takes
    (so a size the kernel takes beyond it is a disagreement too)."""

    name: str
    claim: str
    kernels: tuple[str, ...]
    cache: str
    pages: dict[tuple[str, int], frozenset[int]]
    exhaustive: bool
    source: Declaration | None
    unknown: str | None = None


@dataclasses.dataclass(frozen=True)
class Disagreement:
    statement: Statement
    envelope: KernelEnvelope
    cache: str
    compress_ratio: int
    rows: frozenset[int]
    detail: str

    def __str__(self) -> str:
        kernel_source = "; ".join(str(s) for s in self.envelope.sources[:1])
        return f"{self.detail} (vLLM: {self.statement.source}; kernel: {kernel_source})"


class _NotEvaluable(Exception):
    pass


class _NoReturn(Exception):
    pass


def _evaluate(node: ast.AST, capability: tuple[int, int]) -> Any:
    """A vLLM expression as it evaluates on a ``capability`` CUDA device; only
    constants, lists, conditionals and ``current_platform``'s capability
    queries (vLLM's interface: a family is every <major>.x)."""
    here = capability[0] * 10 + capability[1]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(e, capability) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.IfExp):
        chosen = node.body if _evaluate(node.test, capability) else node.orelse
        return _evaluate(chosen, capability)
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(v, capability) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, capability)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "current_platform"
    ):
        query = node.func.attr
        args = [_evaluate(a, capability) for a in node.args]
        if query == "is_device_capability_family" and len(args) == 1:
            return here // 10 == args[0] // 10
        if query == "has_device_capability" and len(args) == 1:
            return here >= args[0]
        if query == "is_cuda" and not args:
            return True
        if query in ("is_rocm", "is_xpu", "is_cpu", "is_tpu") and not args:
            return False
    raise _NotEvaluable(ast.unparse(node))


def _returned(body: list[ast.stmt], capability: tuple[int, int]) -> Any:
    for statement in body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # docstring
        if isinstance(statement, ast.Return) and statement.value is not None:
            return _evaluate(statement.value, capability)
        if isinstance(statement, ast.If):
            branch = statement.body if _evaluate(statement.test, capability) else statement.orelse
            try:
                return _returned(branch, capability)
            except _NoReturn:
                continue
        raise _NotEvaluable(ast.unparse(statement))
    raise _NoReturn


def _answer_on(module: str, qualname: str, capability: tuple[int, int]) -> tuple[Any, Declaration]:
    """What vLLM's ``module.qualname`` returns on a ``capability`` device,
    evaluated from its source (vLLM is not imported)."""
    text, tree = patching.vllm_source(module)
    node = patching.find_definition(tree, qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise patching.TargetMismatch(f"{module}.{qualname} does not exist")
    answer = _returned(node.body, capability)
    return answer, Declaration(
        _module_path(module),
        node.lineno,
        f"def {qualname}(...) -> {answer!r} on SM{capability[0]}{capability[1]}",
    )


RATIOS = (1, 2)  # DeepSeek-V4.1's compress ratios of its compressed and indexer caches
STATEMENTS = (
    (
        "get_paged_mqa_page_sizes()",
        "vllm.utils.deep_gemm",
        "get_paged_mqa_page_sizes",
        (DEEPGEMM_LOGITS_FP8, DEEPGEMM_LOGITS_FP4),
        INDEXER,
        True,
    ),
    (
        "DEEPSEEK_V41_INDEXER kernel block sizes",
        "vllm.v1.attention.backends.mla.indexer",
        "DeepseekV41IndexerBackend.get_supported_kernel_block_sizes",
        (DEEPGEMM_LOGITS_FP8, DEEPGEMM_LOGITS_FP4, INDEXER_GATHER),
        INDEXER,
        False,
    ),
    (
        "FLASHINFER_MLA_SPARSE_DSV41 kernel block sizes",
        "vllm.models.deepseek_v41.nvidia.flashinfer_sparse",
        "DeepseekV4FlashInferMLASparseBackend.get_supported_kernel_block_sizes",
        (FLASHINFER_DECODE_EXTRA, FLASHINFER_PREFILL_EXTRA),
        COMPRESSED,
        False,
    ),
)


@functools.cache
def vllm_statements(capability: tuple[int, int] = SM120) -> tuple[Statement, ...]:
    """vLLM's own claims about the kernels on a ``capability`` device.

    ``get_paged_mqa_page_sizes()`` names page sizes (states) directly; the
    backends' kernel block sizes count tokens, so they imply pages of
    ``block // ratio`` states for each compress ratio."""
    statements = []
    for name, module, qualname, kernels, cache, exhaustive in STATEMENTS:
        try:
            answer, source = _answer_on(module, qualname, capability)
            sizes = [int(s) for s in answer]
        except (patching.CannotProbe, patching.TargetMismatch, _NotEvaluable, _NoReturn) as exc:
            statements.append(
                Statement(
                    name, "", kernels, cache, {}, exhaustive, None, f"{module}.{qualname}: {exc}"
                )
            )
            continue
        except (TypeError, ValueError):
            statements.append(
                Statement(
                    name,
                    "",
                    kernels,
                    cache,
                    {},
                    exhaustive,
                    None,
                    f"{module}.{qualname} returns {answer!r}",
                )
            )
            continue
        if exhaustive:
            pages = {(cache, r): frozenset(sizes) for r in RATIOS}
            claim = f"{name} = {tuple(sizes)}: the page sizes the kernels take"
        else:
            pages = {(cache, r): frozenset(b // r for b in sizes if b % r == 0) for r in RATIOS}
            claim = f"{name} = {sizes} tokens: " + ", ".join(
                f"ratio-{r} {cache} pages of {', '.join(map(str, sorted(pages[cache, r])))}"
                for r in RATIOS
            )
        statements.append(Statement(name, claim, kernels, cache, pages, exhaustive, source))
    return tuple(statements)


def disagreements(capability: tuple[int, int] = SM120) -> list[Disagreement]:
    """Every vLLM statement a kernel's own declaration contradicts: a page
    the statement implies and the kernel rejects, or, for a statement that
    lists the sizes a kernel takes, a size the kernel takes and the statement
    leaves out.  Unknown envelopes and unreadable statements contradict
    nothing (each reports itself as unknown)."""
    envelopes = kernel_envelopes()
    found = []
    for statement in vllm_statements(capability):
        if statement.unknown is not None:
            continue
        for kernel in statement.kernels:
            envelope = envelopes[kernel]
            if envelope.rows is None:
                continue
            for (cache, ratio), rows in sorted(statement.pages.items()):
                rejected = frozenset(r for r in rows if r not in envelope.rows)
                if rejected:
                    found.append(
                        Disagreement(
                            statement,
                            envelope,
                            cache,
                            ratio,
                            rejected,
                            f"{statement.name} on SM{capability[0]}{capability[1]} gives "
                            f"ratio-{ratio} {cache} pages of {_listed(rejected)} rows; "
                            f"{envelope.title} takes {envelope.rows}",
                        )
                    )
            claimed = frozenset().union(*statement.pages.values())
            if statement.exhaustive and envelope.rows.exact is not None:
                omitted = envelope.rows.exact - claimed
                if omitted:
                    found.append(
                        Disagreement(
                            statement,
                            envelope,
                            statement.cache,
                            0,
                            omitted,
                            f"{statement.name} on SM{capability[0]}{capability[1]} says "
                            f"{envelope.title} takes pages of {_listed(claimed)} only; "
                            f"its declaration takes {envelope.rows}",
                        )
                    )
    return found


def _listed(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in sorted(values))


def report() -> dict[str, Any]:
    """The envelopes, vLLM's statements and their disagreements, for JSON."""
    deep_gemm = deep_gemm_dir()
    return {
        "vllm": installed_version("vllm"),
        "flashinfer": installed_version("flashinfer-python"),
        "deep_gemm": None if deep_gemm is None else _shown(deep_gemm),
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
