"""fa4-compile-strides: FA4 MLA prefill kernels warmed up with frozen strides.

Upstream:   vllm-project/vllm#49200 (report); the fix is vllm-project/flash-attention
            caaa4eb (PR #157), first shipped in vLLM 0.26.0.  Workaround
            discussion: gonka-ai/gonka#1707.
Affected:   vLLM 0.25.0, 0.25.1 and main-branch nightlies between the vendored
            "FA4 compile API" (flash-attention 2c839c3, #150) and caaa4eb, e.g.
            0.23.1rc1.dev1133.  Not 0.23.0 or 0.24.0 (no compile-only API there).
Fixed in:   0.26.0
Hardware:   SM100/SM103 (B200, GB200, B300) running MLA prefill through FA4
            (Kimi-K2.5, Mistral-4-Small, DeepSeek-V3-style models).  H100/H200
            run MLA prefill on FA3 and never reach this code.

Why it breaks
    vLLM's start-up warm-up compiles the FA4 kernels from compile-only tensor
    specs (``_CompileOnlyTensorSpec``), whose CuTe fake tensors carry the
    concrete contiguous strides of the warm-up shape.  ``to_cute_tensor`` asks
    them to ``mark_layout_dynamic``, but nvidia-cutlass-dsl 4.5.2's fake tensors
    inherit an empty stub that returns ``None``, so the static strides go into
    the kernel's TVM-FFI argument checks.  The compile key has no shapes or
    strides, so every later call with the same key reuses that kernel.  The
    Split-KV partial output ``out_partial`` of shape (splits, total_q, H, Dv)
    has ``stride[0] = total_q*H*Dv``; the first context chunk of a prompt over
    ~8k tokens whose step has a different ``total_q`` than the warm-up probe
    (q=129) fails:  ``ValueError: Mismatched mO.strides[0] on argument #3 ...
    expected to be 132096``; EngineCore dies, later requests get HTTP 500.

How we fix it
    We wrap ``vllm.vllm_flash_attn.cute.cute_dsl_utils.to_cute_tensor``: real
    tensors go to the original; a compile-only spec becomes a new CuTe fake
    tensor with symbolic shapes and symbolic 64-bit strides (divisibility from
    the call's alignment), stride 1 on the leading dimension, all symbolic when
    ``fully_dynamic`` -- built with ``cute.runtime.make_fake_tensor`` and
    ``cute.sym_int``/``sym_int64`` from the installed cutlass-dsl.  The name is
    rebound in the FA4 modules that imported it.  Kernels compiled before the
    fix are dropped: ``_flash_attn_fwd.compile_cache`` is replaced by an empty
    cache; when the opt-in on-disk cache is on
    (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``) the new cache lives in a
    fresh namespace beside the old one, because the cache's source fingerprint
    cannot see a monkeypatch.  After patching the probe runs again; if it still
    sees a frozen stride, the patch is reverted and the fix reports "skipped"
    (from the import hook below: logs "left untouched").

Gate
    Release range ``>=0.23.1.dev0,<0.26.0`` (admits the nightlies), then a
    functional probe: convert a real ``_CompileOnlyTensorSpec`` with the
    installed ``to_cute_tensor`` and look for a static non-leading stride.  No
    kernel is compiled.  Without vLLM's CUDA flash-attention extension
    (``import vllm.vllm_flash_attn`` fails, e.g. on a CPU-only machine) the
    fix is skipped: "cannot probe here".

    Importing FA4's CuTe code imports cutlass-dsl, whose start-up calls
    ``cuInit`` to detect the GPU (unless ``CUTE_DSL_ARCH`` is set).  A plugin
    must not do that in the API server or engine core: CUDA is not fork-safe,
    and vLLM forks workers unless torch reports CUDA initialised.  So when vLLM has not imported
    ``vllm.vllm_flash_attn.cute.interface`` yet, ``probe`` only checks without
    importing it (FA4 present, compile-only specs in its source) and
    ``apply`` arms an import hook; the functional probe and the patch run
    when vLLM itself imports that module -- in the worker, before warm-up.
    :func:`deferred_outcome` and one log line tell what the hook decided.

Remove when
    The oldest vLLM supported is >= 0.26.0; the probe already reports
    not-needed there (``to_cute_tensor`` builds symbolic fakes itself).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_mla_fixes import fix, patching, settings
from vllm_mla_fixes.patching import CannotProbe, FixInfo, Patch, TargetMismatch

if TYPE_CHECKING:
    from vllm_mla_fixes.report import Environment, Finding, ServeLine

INFO = FixInfo(
    name="fa4-compile-strides",
    summary="SM100 FA4 MLA prefill: kernels compiled at warm-up keep static strides, so the "
    "first Split-KV context chunk (prompt > ~8k tokens) with a new token count "
    "fails the kernel's argument check and EngineCore dies",
    upstream=("vllm#49200", "flash-attention@caaa4eb (vllm-project/flash-attention#157)"),
    affected=">=0.23.1.dev0,<0.26.0",
    covered_releases=("0.25.0", "0.25.1"),
    fixed_in="0.26.0",
    hardware="SM100/SM103 (B200, GB200, B300) with FA4 MLA prefill; H100/H200 use FA3 and are immune",
    error="ValueError: Mismatched mO.strides[0] on argument #3 when calling: `__call__(mQ: "
    "Tensor([n0, n1, n2], bfloat16), ... output_scale: None)`, expected to be 132096",
)

FA_PACKAGE = "vllm.vllm_flash_attn"
UTILS_MODULE = "vllm.vllm_flash_attn.cute.cute_dsl_utils"
INTERFACE_MODULE = "vllm.vllm_flash_attn.cute.interface"
CACHE_MODULE = "vllm.vllm_flash_attn.cute.cache_utils"
TARGET = "to_cute_tensor"
SPEC_CLASS = "_CompileOnlyTensorSpec"
# Suffix of the on-disk cache namespace used once the fix is in: kernels that
# an unpatched process exported under the plain fingerprint are never loaded.
DISK_NAMESPACE_SUFFIX = "-mlafixes-fa4-strides-1"
MARK = "__vllm_mla_fixes__"

# The definitions the fix wraps or builds on, by (module, qualified name):
# fingerprint -> the releases it was reviewed in.  The functional probe decides
# at runtime; `vllm-mla-fixes review` compares a new release with these.
REVIEWED: dict[tuple[str, str], dict[str, str]] = {
    (UTILS_MODULE, TARGET): {"2a98f24d58655d90": "0.25.0, 0.25.1"},
    (INTERFACE_MODULE, SPEC_CLASS): {"9350765e16c193c4": "0.25.0, 0.25.1"},
    (CACHE_MODULE, "JITPersistentCache"): {"de562e9f4962635a": "0.25.0, 0.25.1"},
    (CACHE_MODULE, "JITCache"): {"2f223a2f24bddb51": "0.25.0, 0.25.1"},
    # the forward whose compile cache apply() replaces
    (INTERFACE_MODULE, "_flash_attn_fwd"): {"4d6380cacbdc7e67": "0.25.0, 0.25.1"},
}


def _fa4_package() -> ModuleType:
    """``vllm.vllm_flash_attn`` (no CuTe, no cutlass: cheap, no CUDA init)."""
    try:
        return importlib.import_module(FA_PACKAGE)
    except ImportError as exc:
        raise CannotProbe(
            f"{FA_PACKAGE} does not import here ({exc}); FA4 can only run where vLLM's "
            f"CUDA flash-attention extension loads"
        ) from exc


def _import_fa4() -> tuple[ModuleType, ModuleType]:
    """The FA4 CuTe modules this fix reads and patches."""
    try:
        utils = importlib.import_module(UTILS_MODULE)
        interface = importlib.import_module(INTERFACE_MODULE)
    except ImportError as exc:
        raise CannotProbe(
            f"{FA_PACKAGE} does not import here ({exc}); FA4 can only run where vLLM's "
            f"CUDA flash-attention extension loads"
        ) from exc
    except Exception as exc:  # e.g. a cutlass-dsl that does not match cuda-python
        raise CannotProbe(
            f"FA4's CuTe modules fail to import: {type(exc).__name__}: {exc}"
        ) from exc
    return utils, interface


def frozen_stride_dims(convert: Any, interface: ModuleType) -> list[int]:
    """Convert a 3-D compile-only spec with ``convert`` (a ``to_cute_tensor``)
    and return the non-leading dimensions whose stride came out static.

    The installed spec class builds the input, so this exercises exactly what
    warm-up does.  An empty list means every non-leading stride is symbolic.
    """
    import torch

    spec_cls = getattr(interface, SPEC_CLASS)
    spec = spec_cls((2, 3, 4), torch.float32)
    try:
        converted = convert(spec)
    except Exception as exc:
        raise TargetMismatch(
            f"{TARGET} rejected a compile-only spec: {type(exc).__name__}: {exc}"
        ) from exc
    strides = getattr(converted, "stride", None)
    if not isinstance(strides, tuple) or len(strides) != 3:
        raise TargetMismatch(f"{TARGET}(spec) gave {converted!r}, not a 3-D CuTe tensor")
    if strides[-1] != 1:
        raise TargetMismatch(
            f"{TARGET}(spec) lost the unit stride of the leading dimension: {strides}"
        )
    return [dim for dim in range(2) if isinstance(strides[dim], int)]


def functional_verdict() -> str | None:
    """The functional probe (imports FA4's CuTe code): None if the bug is there."""
    utils, interface = _import_fa4()
    if not hasattr(interface, SPEC_CLASS):
        return (
            "this FA4 build has no compile-only tensor specs: warm-up compiles from real "
            "tensors, whose strides are dynamic"
        )
    convert = getattr(interface, TARGET, None)
    if not callable(convert) or not callable(getattr(utils, TARGET, None)):
        raise TargetMismatch(f"{INTERFACE_MODULE} or {UTILS_MODULE} has no {TARGET}")
    if frozen_stride_dims(convert, interface):
        return None
    return (
        f"{TARGET} already gives compile-only specs symbolic strides (the upstream fix is present)"
    )


def source_screen() -> str | None:
    """Reads FA4's CuTe interface source (no import): None if it has compile-only specs."""
    try:
        _, tree = patching.vllm_source(INTERFACE_MODULE)
    except TargetMismatch:  # the module has no source file
        return "this vLLM build has no FA4 CuTe code (vllm_flash_attn/cute)"
    if patching.find_definition(tree, SPEC_CLASS) is None:
        return (
            "this FA4 build has no compile-only tensor specs: warm-up compiles from real "
            "tensors, whose strides are dynamic"
        )
    return None


def probe() -> str | None:
    """Functional probe when vLLM already imported FA4's interface; otherwise
    the import-free screen (where FA4's CUDA package loads), and the
    functional probe runs in the import hook."""
    if INTERFACE_MODULE in sys.modules:
        return functional_verdict()
    _fa4_package()
    from vllm_mla_fixes.screen_cache import cached_screen  # parsing vLLM costs each process ~0.1 s

    return cached_screen(FIX, source_screen)


def _cute_fake_tensor_api() -> tuple[Any, Any, Any]:
    """``make_fake_tensor``, ``sym_int`` and ``sym_int64`` of the installed cutlass-dsl."""
    import cutlass.cute as cute

    make = getattr(getattr(cute, "runtime", None), "make_fake_tensor", None)
    sym_int = getattr(cute, "sym_int", None)
    sym_int64 = getattr(cute, "sym_int64", None)
    if not (callable(make) and callable(sym_int) and callable(sym_int64)):
        raise TargetMismatch("cutlass.cute lacks runtime.make_fake_tensor, sym_int or sym_int64")
    return make, sym_int, sym_int64


TARGET_PARAMS = ("t", "assumed_align", "leading_dim", "fully_dynamic", "enable_tvm_ffi")


def symbolic_spec_converter(original: Any) -> Any:
    """A ``to_cute_tensor`` that turns compile-only specs into fully symbolic
    fake tensors and hands everything else to ``original``."""
    import inspect

    import torch

    params = tuple(inspect.signature(original).parameters)
    if params != TARGET_PARAMS:  # the fast path below passes them by position
        raise TargetMismatch(f"{TARGET}{params} is not the reviewed signature {TARGET_PARAMS}")
    make_fake, sym_int, sym_int64 = _cute_fake_tensor_api()

    @functools.wraps(original)
    def to_cute_tensor(
        t: Any,  # a torch tensor, or a compile-only spec of flash-attention's
        assumed_align: int = 16,
        leading_dim: int = -1,
        fully_dynamic: bool = False,
        enable_tvm_ffi: bool = True,
    ) -> object:  # a CuTe tensor of the installed cutlass-dsl
        # Runs for every tensor of every FA4 call: real tensors take the cheap
        # isinstance exit (a failing hasattr on a tensor costs ~1 us).
        if isinstance(t, torch.Tensor) or not hasattr(t, "_cute_tensor"):
            return original(t, assumed_align, leading_dim, fully_dynamic, enable_tvm_ffi)
        elem = t._cute_tensor.element_type
        rank = t.ndim
        if fully_dynamic:
            unit_dim = None
        else:
            unit_dim = rank - 1 if leading_dim == -1 else leading_dim
        # Alignment in elements: what the kernel may assume of every
        # non-unit stride (a real tensor gets the same from from_dlpack).
        elems_aligned = max(1, assumed_align * 8 // elem.width) if assumed_align else 1
        layout_strides = []
        for dim in range(rank):
            if dim == unit_dim:
                layout_strides.append(1)
            else:
                layout_strides.append(sym_int64(divisibility=elems_aligned))
        return make_fake(
            elem,
            tuple(sym_int() for _ in range(rank)),
            stride=tuple(layout_strides),
            assumed_align=elems_aligned * elem.width // 8 if assumed_align else None,
        )

    setattr(to_cute_tensor, MARK, INFO.name)
    return to_cute_tensor


def fresh_forward_cache(interface: ModuleType) -> object:
    """An empty forward compile cache of the kind vLLM made, on-disk ones in
    a namespace no unpatched process writes to."""
    cache_utils = importlib.import_module(CACHE_MODULE)
    # Any: classes of the installed flash-attention, absent where None
    current: Any = getattr(interface._flash_attn_fwd, "compile_cache", None)
    persistent: object = getattr(cache_utils, "JITPersistentCache", None)
    in_memory: object = getattr(cache_utils, "JITCache", None)
    if persistent is not None and type(current) is persistent:
        where = current.cache_path  # <cache dir>/<source fingerprint>/fwd
        namespace = where.parent
        if namespace.name.endswith(DISK_NAMESPACE_SUFFIX):
            raise TargetMismatch(f"the forward cache already lives in {namespace}")
        return persistent(namespace.with_name(namespace.name + DISK_NAMESPACE_SUFFIX) / where.name)
    if in_memory is not None and type(current) is in_memory:
        return in_memory()
    raise TargetMismatch(f"unexpected FA4 forward compile cache {type(current).__name__}")


_deferred: dict[str, str] = {}


def deferred_outcome() -> str | None:
    """What the import hook decided in this process: ``None`` while armed (or
    when the fix was applied at once), else ``patched``, ``not needed: ...``
    or ``left untouched: ...``."""
    return _deferred.get("outcome")


def _log(level: int, message: str) -> None:
    try:
        from vllm.logger import init_logger

        logger = init_logger("vllm.mla_fixes")
    except Exception:  # noqa: BLE001
        logger = logging.getLogger("vllm.mla_fixes")
    logger.log(level, "vllm-mla-fixes: %s: %s", INFO.name, message)


def apply(patch: Patch) -> None:
    if INTERFACE_MODULE in sys.modules:
        patch_now(patch)
        return
    _deferred.clear()

    def on_interface_import(_module: ModuleType) -> None:
        try:
            verdict = functional_verdict()
            if verdict is not None:
                _deferred["outcome"] = f"not needed: {verdict}"
                _log(logging.INFO, _deferred["outcome"])
                return
            patch_now(patch)
        except Exception as exc:  # noqa: BLE001 - an import hook must not raise
            patch.revert()
            _deferred["outcome"] = f"left untouched: {type(exc).__name__}: {exc}"
            _log(logging.WARNING, _deferred["outcome"])
            return
        _deferred["outcome"] = "patched"
        _log(
            logging.INFO,
            f"patched {UTILS_MODULE}.{TARGET} and dropped the FA4 forward "
            f"kernels compiled before (probe: static strides)",
        )

    patch.when_imported(INTERFACE_MODULE, on_interface_import)


def patch_now(patch: Patch) -> None:
    """Wrap ``to_cute_tensor``, drop old kernels, re-probe; raises on any surprise."""
    utils, interface = _import_fa4()
    original = getattr(utils, TARGET)
    if getattr(original, MARK, None) == INFO.name:
        return  # already wrapped in this process
    if getattr(interface, TARGET) is not original:
        raise TargetMismatch(f"{INTERFACE_MODULE}.{TARGET} is not {UTILS_MODULE}.{TARGET}")
    replacement = symbolic_spec_converter(original)
    new_cache = fresh_forward_cache(interface)
    patch.replace_function(utils, TARGET, replacement)
    patch.replace(interface._flash_attn_fwd, "compile_cache", new_cache)
    if getattr(interface, TARGET) is not replacement:
        raise RuntimeError(f"{INTERFACE_MODULE}.{TARGET} was not rebound")
    still_frozen = frozen_stride_dims(interface.to_cute_tensor, interface)
    if still_frozen:
        raise RuntimeError(
            f"after patching, {TARGET} still freezes the strides of dims {still_frozen}"
        )


# -- doctor ------------------------------------------------------------------------

CUTLASS_PIN_AFFECTED = "4.5.2"  # what 0.25.0/0.25.1 pin
DISK_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def diagnose(env: Environment, serve: ServeLine | None) -> list[Finding]:
    """``vllm-mla-fixes doctor``'s findings for this fix on a release its probe
    decides (``env``: a :class:`~vllm_mla_fixes.report.Environment`, ``serve``:
    a :class:`~vllm_mla_fixes.report.ServeLine` or None)."""
    from vllm_mla_fixes.report import Finding as F

    name = INFO.name
    vllm_version = env.packages.get("vllm")
    cutlass = env.packages.get("nvidia-cutlass-dsl")
    quack = env.packages.get("quack-kernels")
    findings = []
    sm = env.capability[0] if env.capability else None
    facts = (
        f"vLLM {vllm_version}, nvidia-cutlass-dsl {cutlass or '-'}, quack-kernels {quack or '-'}, "
        f"GPU {f'SM{env.capability[0]}{env.capability[1]}' if env.capability else 'not visible'}"
    )
    if sm is not None and sm != 10:
        findings.append(
            F(
                "ok",
                name,
                f"{facts}: this GPU does not run FA4's Split-KV MLA prefill "
                "(H100/H200 use FA3 for MLA prefill); the bug needs SM100/SM103",
            )
        )
        return findings
    findings.append(
        F(
            "info",
            name,
            f"{facts}: on SM100/SM103 the first MLA prompt over ~8k tokens "
            f"that reaches a second prefill chunk can kill EngineCore: {INFO.error}",
        )
    )
    if cutlass and cutlass != CUTLASS_PIN_AFFECTED:
        findings.append(
            F(
                "info",
                name,
                f"nvidia-cutlass-dsl {cutlass} is not vLLM "
                f"{vllm_version}'s pin ({CUTLASS_PIN_AFFECTED}); the fix's probe decides at "
                "start-up and leaves vLLM alone if FA4 behaves differently",
            )
        )
    if settings.environment_variable(DISK_CACHE_ENV) == "1":
        findings.append(
            F(
                "info",
                name,
                f"{DISK_CACHE_ENV}=1: FA4 kernels compiled before the fix stay "
                "on disk under the plain source-fingerprint folder; the fix compiles into a "
                f"fresh '<fingerprint>{DISK_NAMESPACE_SUFFIX}' folder and never loads them; "
                "expect one compile per kernel on the first patched start-up",
            )
        )
    avoided = _avoided_by_the_line(serve)
    if avoided is not None and avoided.level == "ok":  # the failure cannot happen at all
        return [*findings, avoided]
    if avoided is not None:
        findings.append(avoided)
    return [*findings, _diagnose_fix_state(as_sm100_node(env), workaround=avoided is not None)]


def _avoided_by_the_line(serve: ServeLine | None) -> Finding | None:
    """Why the line itself cannot meet the failure ("ok"), or the workaround
    it carries ("info"); None where neither."""
    from vllm_mla_fixes.report import MLA_ARCHITECTURES
    from vllm_mla_fixes.report import Finding as F

    name = INFO.name
    if settings.environment_variable("VLLM_BATCH_INVARIANT") == "1":
        return F(
            "ok",
            name,
            "VLLM_BATCH_INVARIANT=1 forces num_splits=1: no Split-KV, "
            "this failure cannot happen (at batch-invariant mode's cost)",
        )
    if serve is None:
        return None
    archs = set(serve.architectures)
    is_mla = bool(archs & MLA_ARCHITECTURES) or "kv_lora_rank" in serve.model_config
    if serve.model_config and not is_mla:
        return F("ok", name, "not an MLA model: this failure is specific to MLA prefill")
    backend = str(serve.attention_config.get("mla_prefill_backend") or "").upper()
    if backend and backend != "FLASH_ATTN":
        return F(
            "ok",
            name,
            f"mla_prefill_backend={backend}: MLA prefill does not use "
            "FA4, so this failure cannot happen",
        )
    if serve.kernel_config.get("enable_cutedsl_warmup") is False:
        return F(
            "info",
            name,
            "enable_cutedsl_warmup=false (the workaround) avoids the "
            "crash; cost: each FA4 kernel JIT-compiles on first use, a stall of "
            "~15-25 s in the serving path; with the fix applied, drop it to get "
            "the warm-up back",
        )
    return None


# The serve flags doctor suggests when the fix is not applied; tests check them
# with each affected release's own config classes.
WORKAROUND_FLAGS = (
    '--attention-config \'{"mla_prefill_backend": "TRTLLM_RAGGED"}\'',
    "--kernel-config '{\"enable_cutedsl_warmup\": false}'",
)

SM100_NODE = "an SM100/SM103 serving node"
CANNOT_PROBE = "cannot probe here"


def as_sm100_node(env: Environment) -> Environment:
    """``env`` as an SM100/SM103 node that serves the line sees this fix, where
    no GPU is visible here: there vLLM's CUDA flash-attention extension loads,
    so the plugin's probe is the source screen (the functional probe runs in
    each worker when vLLM imports FA4), which reads no GPU."""
    from vllm_mla_fixes.report import as_serving_node
    from vllm_mla_fixes.screen_cache import cached_screen

    skipped = env.fix_state(INFO.name) == "skipped"
    if env.capability is not None or not (
        skipped and env.fix_reason(INFO.name).startswith(CANNOT_PROBE)
    ):
        return env
    try:
        reason = cached_screen(FIX, source_screen)
    except (CannotProbe, TargetMismatch) as exc:
        return as_serving_node(env, INFO.name, SM100_NODE, "skipped", str(exc))
    if reason is not None:
        return as_serving_node(env, INFO.name, SM100_NODE, "not-needed", reason)
    return as_serving_node(
        env, INFO.name, SM100_NODE, "applied", "its source screen finds FA4's compile-only specs"
    )


def _diagnose_fix_state(env: Environment, workaround: bool) -> Finding:
    from vllm_mla_fixes.report import Finding as F
    from vllm_mla_fixes.report import fix_verdict

    name = INFO.name
    state, reason = env.fix_state(name), env.fix_reason(name)
    if state == "applied":
        node = env.fix_states[name].get("serving_node")
        where = f"on {node} the plugin arms the fix ({reason})" if node else "the fix is armed here"
        return F(
            "ok",
            name,
            f"{where}: it checks and patches FA4 in each worker "
            "when vLLM imports it, before warm-up; the worker log says "
            f"'vllm-mla-fixes: {name}: patched'",
        )
    if workaround:
        return F(
            "ok",
            name,
            f"the fix is not applied ({state or 'not evaluated'}: {reason}); the line's "
            "enable_cutedsl_warmup=false avoids the crash without it",
        )
    if state == "skipped" and reason.startswith(CANNOT_PROBE):  # a GPU is visible here
        return F(
            "warn",
            name,
            f"the fix cannot check FA4 on this GPU (skipped: {reason}); vLLM cannot run FA4 "
            "without that extension either",
        )
    verdict = fix_verdict(env, name)
    if verdict.level == "error":
        verdict.advice += (
            f"; or work around it: {WORKAROUND_FLAGS[0]} (no FA4), or "
            f"{WORKAROUND_FLAGS[1]} (a JIT stall on each kernel's first use), "
            f"or upgrade to vLLM {INFO.fixed_in}"
        )
    return verdict


def verify(report: Callable[[str], None]) -> bool:
    from vllm_mla_fixes.reproductions import fa4_compile_strides

    return fa4_compile_strides.verify(report)


FIX = fix.plain_fix(
    INFO=INFO,
    REVIEWED=REVIEWED,
    probe=probe,
    apply=apply,
    source_screen=source_screen,
    diagnose=diagnose,
    verify=verify,
)
