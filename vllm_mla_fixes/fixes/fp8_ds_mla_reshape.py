"""fp8-ds-mla-reshape: sparse-MLA + fp8 KV cache cannot be viewed at start-up.

Upstream:   vllm-project/vllm#48896 (report), #48378 (report), #48379 (fix, merged
            after v0.25.1), #48907 (reshape prefers spec.cache_dtype_str, unmerged)
Affected:   vLLM 0.25.0, 0.25.1 (regression from #42890)
Fixed in:   0.26.0
Hardware:   FLASHMLA_SPARSE (SM90, SM100); any model whose MLA layers store
            ``fp8_ds_mla`` (GLM-5.x GlmMoeDsa, DeepSeek-V3.2 and their MTP layers)

Why it breaks
    ``MLAAttention.get_kv_cache_spec`` builds an ``MLAAttentionSpec`` with
    ``cache_dtype_str="fp8_ds_mla"`` but leaves ``kv_quant_mode`` at ``NONE``.
    The allocator sizes a token at 656 bytes from ``cache_dtype_str``; the
    reshape reads ``kv_quant_mode == NONE`` as "not quantised", asks the
    backend for the ``"auto"`` shape ``(blocks, 64, 576)`` and the view of the
    656-byte pages fails: ``shape '[32, 64, 576]' is invalid for input of size
    1343488``.  CUDA-graph memory profiling hits it first; the normal KV-cache
    initialisation calls the same reshape on the same spec, so
    ``--enforce-eager`` does not avoid it.

How we fix it
    At the root: ``MLAAttentionSpec`` and ``SlidingWindowMLASpec`` derive
    ``kv_quant_mode`` from ``cache_dtype_str == "fp8_ds_mla"`` when a producer
    left it unset -- one hook on the spec classes covers every producer,
    including the sliding-window MLA conversion in ``kv_cache_utils`` that
    rebuilds specs without ``kv_quant_mode``.  Page sizes do not depend on
    ``kv_quant_mode`` for this layout, so no allocation changes.
    Guard: the reshape checks bytes allocated against the shape it was asked
    for and, on a mismatch, raises an error naming the layer, spec, page size
    and shape instead of a bare view error.

Remove when
    The oldest vLLM supported is >= 0.26.0 (the probe already reports
    not-needed there: the producer passes ``kv_quant_mode`` itself).
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_mla_fixes import fix
from vllm_mla_fixes.patching import (
    Definition,
    FixInfo,
    Patch,
    TargetMismatch,
    find_definition,
    vllm_source,
)

if TYPE_CHECKING:
    from vllm_mla_fixes.report import Environment, Finding, ServeLine

_R = TypeVar("_R")

INFO = FixInfo(
    name="fp8-ds-mla-reshape",
    summary="FLASHMLA_SPARSE + fp8 KV (fp8_ds_mla, 656 B/token) crashes at start-up: "
    "the MLA KV spec says 'not quantised' and the reshape asks for 576 B/token",
    upstream=("vllm#48896", "vllm#48378", "vllm#48379", "vllm#48907"),
    affected=">0.24.0,<0.26.0",
    covered_releases=("0.25.0", "0.25.1"),
    fixed_in="0.26.0",
    hardware="SM90, SM100 (FLASHMLA_SPARSE)",
    error="RuntimeError: shape '[32, 64, 576]' is invalid for input of size 1343488",
)

FP8_DS_MLA = "fp8_ds_mla"
FP8_DS_MLA_BYTES_PER_TOKEN = 656
SPEC_MODULE = "vllm.v1.kv_cache_interface"
PRODUCER_MODULE = "vllm.model_executor.layers.attention.mla_attention"
RESHAPE_MODULE = "vllm.v1.worker.gpu.attn_utils"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RESHAPE_FUNCTION = "_reshape_attention_kv_cache"
RESHAPE_PARAMS = (
    "kv_raw_tensor",
    "kv_cache_spec",
    "kv_cache_shape",
    "kv_cache_stride_order",
    "num_blocks",
    "packing",
)

# The definitions the fix wraps or whose code its probe reads, by (module,
# qualified name): fingerprint -> the releases it was reviewed in.  The probe
# decides at runtime; `vllm-mla-fixes review` compares a new release with these.
REVIEWED: dict[tuple[str, str], dict[str, str]] = {
    (SPEC_MODULE, "MLAAttentionSpec.__post_init__"): {"4d74a4cb27f52ed2": "0.25.0, 0.25.1"},
    (SPEC_MODULE, "SlidingWindowMLASpec.__post_init__"): {"0a0ee396ebadda3b": "0.25.0, 0.25.1"},
    (SPEC_MODULE, "get_kv_quant_mode"): {"7b624460ca00057e": "0.25.0, 0.25.1"},
    (PRODUCER_MODULE, "MLAAttention.get_kv_cache_spec"): {"5098a2f6686b3bc5": "0.25.0, 0.25.1"},
    (RESHAPE_MODULE, RESHAPE_FUNCTION): {"0ef5427d42791b16": "0.25.0, 0.25.1"},
    (RESHAPE_MODULE, "_reshape_kv_cache"): {"3f06df28f8760536": "0.25.0, 0.25.1"},
    (RUNNER_MODULE, "GPUModelRunner._reshape_kv_cache_tensors"): {
        "e3314192fb12266c": "0.25.0, 0.25.1"
    },
}


class KVCacheLayoutMismatch(ValueError):
    """Bytes allocated for a layer's KV cache do not fit the shape asked for."""


def _definition(module_name: str, qualname: str) -> Definition | None:
    return find_definition(vllm_source(module_name)[1], qualname)


def producer_sets_quant_mode() -> bool:
    """Whether ``MLAAttention.get_kv_cache_spec`` passes ``kv_quant_mode`` itself."""
    method = _definition(PRODUCER_MODULE, "MLAAttention.get_kv_cache_spec")
    if method is None:
        raise TargetMismatch("MLAAttention.get_kv_cache_spec not found")
    spec_calls = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", getattr(n.func, "attr", None)) == "MLAAttentionSpec"
    ]
    if not spec_calls:
        raise TargetMismatch("MLAAttention.get_kv_cache_spec builds no MLAAttentionSpec")
    return all(any(k.arg == "kv_quant_mode" for k in call.keywords) for call in spec_calls)


def reshape_reads_quant_mode() -> bool:
    """Whether a model runner picks the view's layout from ``kv_quant_mode``
    (``NONE`` -> the unquantised ``"auto"`` shape), the consumer of the bug."""
    consumers = (
        _definition(RUNNER_MODULE, "GPUModelRunner._reshape_kv_cache_tensors"),
        _definition(RESHAPE_MODULE, "_reshape_kv_cache"),
    )
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "NONE"
        and getattr(node.value, "id", None) == "KVQuantMode"
        for consumer in consumers
        if consumer is not None
        for node in ast.walk(consumer)
    )


def probe() -> str | None:
    import torch

    try:
        from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec
    except ImportError as exc:
        raise TargetMismatch(f"{SPEC_MODULE} lacks MLAAttentionSpec/KVQuantMode ({exc})") from exc
    spec = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8, cache_dtype_str=FP8_DS_MLA
    )
    if spec.page_size_bytes != 64 * FP8_DS_MLA_BYTES_PER_TOKEN:
        raise TargetMismatch(
            f"an fp8_ds_mla page is {spec.page_size_bytes} bytes, not 64 x {FP8_DS_MLA_BYTES_PER_TOKEN}"
        )
    if spec.kv_quant_mode is not KVQuantMode.NONE:
        return "MLAAttentionSpec already derives kv_quant_mode from fp8_ds_mla"
    from vllm_mla_fixes.screen_cache import cached_screen  # parsing vLLM costs each process ~0.1 s

    return cached_screen(FIX, source_screen)


def source_screen() -> str | None:
    """The part of the probe that reads vLLM's source only (no import): None
    while producer, consumer and reshape are the reviewed shape of the bug."""
    if producer_sets_quant_mode():
        return "MLAAttention.get_kv_cache_spec passes kv_quant_mode (upstream #48379 present)"
    if not reshape_reads_quant_mode():
        return "the KV-cache reshape takes its layout from the cache dtype, not kv_quant_mode"
    reshape = _definition(RESHAPE_MODULE, RESHAPE_FUNCTION)
    if reshape is None:
        return f"{RESHAPE_MODULE}.{RESHAPE_FUNCTION} does not exist: views come from the spec"
    if isinstance(reshape, ast.ClassDef):
        raise TargetMismatch(
            f"{RESHAPE_MODULE}.{RESHAPE_FUNCTION} is a class, not the reviewed function"
        )
    params = tuple(a.arg for a in reshape.args.args)
    if params != RESHAPE_PARAMS:
        raise TargetMismatch(f"{RESHAPE_FUNCTION}{params} is not the reviewed signature")
    return None


def _derive_quant_mode(original_post_init: Callable[[object], None]) -> Callable[[object], None]:
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    @functools.wraps(original_post_init)
    def post_init_with_quant_mode(self: Any) -> None:  # self: an MLA KV-cache spec of vLLM's
        original_post_init(self)
        if self.kv_quant_mode is KVQuantMode.NONE and self.cache_dtype_str == FP8_DS_MLA:
            object.__setattr__(self, "kv_quant_mode", get_kv_quant_mode(FP8_DS_MLA))

    return post_init_with_quant_mode


def _calling_layer_name() -> str:
    """The ``layer_name`` being reshaped by vLLM's caller (both callers name it so)."""
    frame = sys._getframe(2)
    return str(frame.f_locals.get("layer_name", "<unknown layer>"))


def _with_layout_check(original_reshape: Callable[..., _R]) -> Callable[..., _R]:
    signature = inspect.signature(original_reshape)

    @functools.wraps(original_reshape)
    def reshape_with_layout_check(*args: object, **kwargs: object) -> _R:
        bound = signature.bind(*args, **kwargs)
        raw, spec, shape = (bound.arguments[p] for p in RESHAPE_PARAMS[:3])
        if bound.arguments["packing"] is None and spec.page_size_padded is None:
            wanted = math.prod(shape) * spec.dtype.itemsize
            allocated = raw.numel() * raw.element_size()
            if wanted != allocated:
                raise KVCacheLayoutMismatch(
                    f"vllm-mla-fixes: the KV cache of layer {_calling_layer_name()!r} cannot be "
                    f"viewed as {tuple(shape)} x {spec.dtype} ({wanted} bytes): {allocated} bytes "
                    f"were allocated ({bound.arguments['num_blocks']} blocks, page_size_bytes="
                    f"{spec.page_size_bytes}) for {spec!r}. The spec's layout fields "
                    f"(cache_dtype_str, kv_quant_mode) disagree about the page format; this is a "
                    f"vLLM bug, not a configuration error -- report it with this message. "
                    f"Meanwhile --kv-cache-dtype auto avoids quantised layouts."
                )
        return original_reshape(*args, **kwargs)

    return reshape_with_layout_check


def apply(patch: Patch) -> None:
    from vllm.v1 import kv_cache_interface as kvi

    for spec_class in (kvi.MLAAttentionSpec, kvi.SlidingWindowMLASpec):
        if "__post_init__" not in spec_class.__dict__:
            raise TargetMismatch(f"{spec_class.__name__} defines no __post_init__ of its own")
        patch.replace(
            spec_class, "__post_init__", _derive_quant_mode(spec_class.__dict__["__post_init__"])
        )

    def install_guard(module: ModuleType) -> None:
        original = getattr(module, RESHAPE_FUNCTION, None)
        if original is None or tuple(inspect.signature(original).parameters) != RESHAPE_PARAMS:
            return  # probe checked the source; a different module object is left alone
        patch.replace_function(module, RESHAPE_FUNCTION, _with_layout_check(original))

    patch.when_imported(RESHAPE_MODULE, install_guard)


# -- doctor ------------------------------------------------------------------------


def diagnose(env: Environment, serve: ServeLine | None) -> list[Finding]:
    """``vllm-mla-fixes doctor``'s findings for this fix on a release its probe
    decides (``env``: a :class:`~vllm_mla_fixes.report.Environment`, ``serve``:
    a :class:`~vllm_mla_fixes.report.ServeLine` or None)."""
    from vllm_mla_fixes.report import (
        SPARSE_MLA_ARCHITECTURES,
        Finding,
        covered_failure,
        fix_verdict,
    )

    name = INFO.name
    vllm_version = env.packages.get("vllm")
    if serve is None:
        return [
            Finding(
                "info",
                name,
                f"vLLM {vllm_version} has this bug for sparse-MLA models "
                "(GLM-5.x, DeepSeek-V3.2) with --kv-cache-dtype fp8 on FLASHMLA_SPARSE",
            ),
            fix_verdict(env, name),
        ]
    findings = []
    sparse = (
        bool(set(serve.architectures) & SPARSE_MLA_ARCHITECTURES)
        or "index_topk" in serve.model_config
    )
    if not serve.model_config and not serve.architectures:
        findings.append(
            Finding(
                "info",
                name,
                f"no config.json of {serve.model!r} here, and its name says no architecture: "
                "assuming it may be a sparse-MLA model",
            )
        )
        sparse = True
    sm = env.capability[0] if env.capability else None
    backend = serve.attention_backend or ("FLASHMLA_SPARSE" if sm == 9 else None)
    unaffected = _unaffected_line_finding(serve, sparse, backend)
    if unaffected is not None:
        findings.append(unaffected)
        return findings
    findings.append(
        covered_failure(
            env,
            name,
            f"vLLM {vllm_version} + sparse MLA + --kv-cache-dtype "
            f"{serve.kv_cache_dtype} (stored as {FP8_DS_MLA}, "
            f"{FP8_DS_MLA_BYTES_PER_TOKEN} B/token) on "
            f"{backend or _likely_backend(sm)} fails at start-up: "
            f"{INFO.error}",
        )
    )
    findings += _workaround_flag_findings(env, serve)
    findings.append(fix_verdict(env, name))
    return findings


def _unaffected_line_finding(serve: ServeLine, sparse: bool, backend: str | None) -> Finding | None:
    """Why the line cannot meet this failure (it stores no fp8_ds_mla, or runs
    another backend than FLASHMLA_SPARSE), or None where it can."""
    from vllm_mla_fixes.report import Finding

    if not (sparse and serve.kv_cache_dtype.startswith("fp8")):
        return Finding(
            "ok",
            INFO.name,
            "this line does not store fp8_ds_mla "
            f"(sparse MLA: {sparse}, --kv-cache-dtype {serve.kv_cache_dtype})",
        )
    if backend not in ("FLASHMLA_SPARSE", None):
        return Finding(
            "ok",
            INFO.name,
            f"--attention-backend {backend}: this failure is specific to FLASHMLA_SPARSE",
        )
    return None


def _workaround_flag_findings(env: Environment, serve: ServeLine) -> list[Finding]:
    """Flags of the line users suspect, or try against this crash: what each does here."""
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    findings = []
    if serve.enforce_eager:
        findings.append(
            Finding(
                "info" if env.fix_state(name) == "applied" else "warn",
                name,
                "--enforce-eager does not avoid this crash on 0.25.x: "
                "KV-cache initialisation fails the same way after profiling is skipped",
                "drop --enforce-eager once the fix is applied (it costs CUDA-graph speed)",
            )
        )
    if serve.kv_offloading or serve.prefix_caching:
        findings.append(
            Finding(
                "info",
                name,
                "KV offloading / prefix caching are not a factor: the "
                "reshape fails before either is used; no need to remove them",
            )
        )
    return findings


def _likely_backend(sm: int | None) -> str:
    """The sparse-MLA backend a line without --attention-backend gets, said as
    what doctor knows: the GPU here, or none visible."""
    if sm is None:
        return (
            "FLASHMLA_SPARSE (vLLM's sparse-MLA backend on SM90 and SM100; no GPU is visible here)"
        )
    return "FLASHMLA_SPARSE (likely on this GPU)"


def verify(report: Callable[[str], None]) -> bool:
    from vllm_mla_fixes.reproductions import fp8_ds_mla

    return fp8_ds_mla.verify(report)


FIX = fix.plain_fix(
    INFO=INFO,
    REVIEWED=REVIEWED,
    probe=probe,
    apply=apply,
    source_screen=source_screen,
    diagnose=diagnose,
    verify=verify,
)
