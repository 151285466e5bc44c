"""FA4 MLA prefill on vLLM 0.25.x, reproduced on CPU through vLLM's own code.

What runs is vLLM's: the kernels are compiled by its CuTe-DSL warm-up API
(``FA4MLAPrefillCompileContext`` -> ``iter_fa4_mla_prefill_compile_requests``
-> ``FlashAttentionCuTeDSLCompileSpec.compile`` -> the vendored FA4
``compile_flash_attn_varlen_func_from_specs``), for the per-rank shape of
Kimi-K2.5 at TP8 (8 heads, d_qk 192, d_v 128, V a view of the 256-wide
``kv_nope``).  For each batch composition, the vendored ``_flash_attn_fwd``
itself picks the kernel (compile key) and the Split-KV buffers, in torch's
FakeTensorMode with ``compile_only=True`` -- FA4's own CPU mode, which counts
132 SMs.  The cached kernel is then called with CPU tensors of exactly those
shapes, relabelled as CUDA tensors through DLPack: TVM-FFI checks every
argument before it touches the driver, so a call either fails an argument
check (the upstream bug) or reaches the launch, which fails for want of a GPU.

What is set up around it, and why:

* ``vllm.vllm_flash_attn`` refuses to import without its CUDA extension; its
  ``cute/`` code needs none, so a bare package object with the real folder as
  its path stands in for that ``__init__`` only.
* ``torch.cuda.get_device_capability`` / ``get_device_properties`` answer for
  a B200 (10.0, 148 SMs): the warm-up plan and the compile path ask them.
* ``FLASH_ATTENTION_ARCH``/``CUTE_DSL_ARCH`` = ``sm_100a`` select and compile
  the SM100 kernels (FA4's documented CPU-compile switches).
* On a non-CUDA platform ``fa_utils`` skips binding
  ``compile_flash_attn_varlen_func_from_specs``; it is bound to the real
  function that the CUDA branch imports.
* ``CUDA_VISIBLE_DEVICES=""`` always, so no launch can reach a device; each
  kernel call runs in a forked child (a second failed launch in one process
  can hang without a driver), killed after a timeout.

Run ``python -m vllm_mla_fixes.reproductions.fa4_compile_strides --help``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import os
import select
import signal
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from vllm_mla_fixes import atomic, children, settings

if TYPE_CHECKING:  # imported at run time by prepare(), after the environment is set
    import torch

NUM_HEADS = 8  # Kimi-K2.5 per rank at TP8
QK_HEAD_DIM = 192  # nope 128 + rope 64
V_HEAD_DIM = 128
KV_NOPE_HEAD_DIM = 256  # k_nope and v side by side; V is the last 128 columns
B200_SMS = 148
WARMUP_LONG_K = 8192  # vLLM's "very_long_k" warm-up probe
CONTEXT_TOKENS = 8200  # a context chunk of a prompt just over 8k tokens
CALL_TIMEOUT_S = 120

UPSTREAM_SIGNATURE = (
    "`__call__(mQ: Tensor([n0, n1, n2], bfloat16), mK: Tensor([n3, n4, n5], bfloat16), "
    "mV: Tensor([n6, n7, n8], bfloat16), mO: Tensor([n9, n10, n11, n12], float32), "
    "mLSE: Tensor([n13, n14, n15], float32), softmax_scale: float32, "
    "mCuSeqlensQ: Tensor([n16], int32), mCuSeqlensK: Tensor([n17], int32), mSeqUsedQ: None, "
    "mSeqUsedK: None, mDynamicCausal: None, mPageTable: None, window_size_left: None, "
    "window_size_right: None, learnable_sink: None, descale_tensors: None, "
    "blocksparse_tensors: None, aux_tensors: None, output_scale: None)`"
)


def upstream_error(expected_stride: int) -> str:
    """The exact text of vLLM #49200's error for a kernel warmed up with a
    stride[0] of ``expected_stride``."""
    return (
        f"ValueError: Mismatched mO.strides[0] on argument #3 when calling: "
        f"{UPSTREAM_SIGNATURE}, expected to be {expected_stride}"
    )


# The warm-up probe that compiles the kernel of the report: q 129, k 8192.
REPORT_PROBE = (129, WARMUP_LONG_K)
REPORT_STRIDE = 129 * NUM_HEADS * V_HEAD_DIM  # 132096


@dataclasses.dataclass(frozen=True)
class Step:
    """The prefill part of one scheduler step, as one context chunk sees it:
    per request, new tokens (query) and context tokens in this chunk."""

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    def label(self) -> str:
        return "+".join(f"{q}/{c}" for q, c in zip(self.q_lens, self.ctx_lens))


def default_steps() -> list[Step]:
    """Batch compositions of a context chunk, for the four context-chunk
    kernels of vLLM's warm-up (q_stage 1/2 x Split-KV or not).  total_q
    crosses the q_stage line (128), the M-block lines (multiples of 256) and
    the points where num_splits changes, down to one split (b*m > 8 M-blocks
    per head at 132 SMs); contexts cross the 64-block line (8065 tokens)."""
    steps = [
        Step((q,), (WARMUP_LONG_K,))
        for q in (
            1,
            2,
            17,
            64,
            127,
            128,
            129,
            130,
            200,
            255,
            256,
            257,
            300,
            384,
            511,
            512,
            513,
            640,
            767,
            768,
            769,
            1000,
            1024,
            1025,
            1280,
            1536,
            1537,
            1792,
            2047,
            2048,
            2049,
            2304,
            2305,
            3000,
            4096,
            8192,
        )
    ]
    for ctx in (4096, 8064, 8065, 8128, 8200, 9000, 10239, 16384, 65536):
        steps += [Step((100,), (ctx,)), Step((300,), (ctx,))]
    # a long prompt's continuation batched with new prompts (no context yet)
    for q_lens in (
        (129, 1),
        (130, 17),
        (300, 64),
        (200, 56, 44),
        (64, 64),
        (1, 127),
        (128, 1),
        (256, 256),
        (500, 12),
        (33, 33, 33, 33),
        (700, 300),
        (129,) * 4,
        (129,) * 8,
        (129,) * 9,
        (1,) * 16,
        (2000, 1000),
    ):
        steps.append(Step(q_lens, (WARMUP_LONG_K,) + (0,) * (len(q_lens) - 1)))
    # several prompts with context in the same chunk (the workspace splits 64K tokens)
    for batch_lens, contexts in (
        ((130, 40), (8192, 4096)),
        ((1, 1), (8192, 8192)),
        ((300, 300), (9000, 8100)),
        ((64,) * 8, (8192,) * 8),
        ((64,) * 9, (7281,) * 9),
    ):
        steps.append(Step(batch_lens, contexts))
    return steps


def full_steps() -> list[Step]:
    """The CI sweep plus more of the same regimes, for a run that compiled the
    whole warm-up plan (causal and non-LSE kernels too)."""
    steps = default_steps()
    steps += [Step((q,), (WARMUP_LONG_K,)) for q in range(2, 8192, 97)]
    for n in (2, 3, 5, 6, 7, 12, 16):
        steps.append(Step((129,) * n, (WARMUP_LONG_K,) + (0,) * (n - 1)))
        steps.append(Step((64,) * n, (min(WARMUP_LONG_K, 65536 // n),) * n))
    for ctx in (20000, 32768):
        steps += [Step((1,), (ctx,)), Step((4000,), (ctx,))]
    return steps


# --------------------------------------------------------------------------
# Setting up vLLM's FA4 on a CPU-only machine


class _B200Properties:
    multi_processor_count = B200_SMS
    major, minor = 10, 0
    name = "B200 (CPU reproduction)"


def expose_fa4_package() -> bool:
    """Make ``vllm.vllm_flash_attn.cute`` importable without the CUDA
    extension; True if a bare package had to stand in for its ``__init__``."""
    import vllm

    try:
        importlib.import_module("vllm.vllm_flash_attn")
    except ImportError:
        pass
    else:
        return False
    folder = os.path.join(os.path.dirname(vllm.__file__), "vllm_flash_attn")
    package = types.ModuleType("vllm.vllm_flash_attn")
    package.__path__ = [folder]
    package.__package__ = package.__name__
    package.__spec__ = importlib.machinery.ModuleSpec(package.__name__, None, is_package=True)
    package.__spec__.submodule_search_locations = package.__path__
    sys.modules[package.__name__] = package
    vllm.vllm_flash_attn = package
    return True


def prepare() -> types.SimpleNamespace:
    """Import vLLM's FA4 CuTe code and warm-up plan on this CPU machine."""
    if settings.environment_variable("CUDA_VISIBLE_DEVICES") != "":
        raise RuntimeError(
            "run with CUDA_VISIBLE_DEVICES='' so that no kernel launch can reach a GPU"
        )
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_100a")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    import torch
    import vllm

    expose_fa4_package()
    torch.cuda.get_device_capability = lambda device=None: (10, 0)
    torch.cuda.get_device_properties = lambda device=None: _B200Properties()

    interface = importlib.import_module("vllm.vllm_flash_attn.cute.interface")
    fa_interface = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")
    fa_utils = importlib.import_module("vllm.v1.attention.backends.fa_utils")
    if getattr(fa_utils, "compile_flash_attn_varlen_func_from_specs", None) is None:
        fa_utils.compile_flash_attn_varlen_func_from_specs = (  # type: ignore[attr-defined]
            fa_interface.compile_flash_attn_varlen_func_from_specs
        )
    warmup = importlib.import_module("vllm.model_executor.warmup.fa4_cutedsl_config")
    return types.SimpleNamespace(torch=torch, vllm=vllm, interface=interface, warmup=warmup)


class _KeyLog(dict[object, Any]):
    """The FA4 forward cache's dict (compile key -> CuTe kernel), noting every
    key vLLM looks up."""

    looked_up: list[object]

    def __contains__(self, key: object) -> bool:
        self.looked_up.append(key)
        return super().__contains__(key)


def forward_cache(env: types.SimpleNamespace) -> _KeyLog:
    """The dict behind ``_flash_attn_fwd.compile_cache`` (the current one:
    the fix replaces the cache object), with lookups noted."""
    cache = env.interface._flash_attn_fwd.compile_cache
    if not isinstance(cache.cache, _KeyLog):
        log = _KeyLog(cache.cache)
        log.looked_up = []
        cache.cache = log
    return cache.cache


# --------------------------------------------------------------------------
# Compiling through vLLM's warm-up


def warmup_requests(env: types.SimpleNamespace) -> list[Any]:  # vLLM's compile requests
    """vLLM's FA4 MLA-prefill warm-up plan for this shape, in its order."""
    ctx = env.warmup.FA4MLAPrefillCompileContext(
        dtype=env.torch.bfloat16,
        num_heads=NUM_HEADS,
        qk_head_dim=QK_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        kv_nope_head_dim=KV_NOPE_HEAD_DIM,
        requires_v_padding=False,
        scale=QK_HEAD_DIM**-0.5,
        num_splits=0,
        fa_version=4,
    )
    return list(env.warmup.iter_fa4_mla_prefill_compile_requests(ctx))


def probe_name(request: Any) -> str:  # one of warmup_requests()
    s = request.compile_spec
    return (
        f"q{s.max_seqlen_q}_k{s.max_seqlen_k}_{'causal' if s.causal else 'full'}"
        f"{'_lse' if s.return_softmax_lse else ''}"
    )


def compile_warmup(env: types.SimpleNamespace, which: str, phase: str) -> list[dict[str, Any]]:
    """Compile warm-up requests: ``report`` (the report's kernel),
    ``context`` (the requests a context chunk uses: full mask, LSE; 6
    requests, 4 kernels) or ``all`` (the whole warm-up plan).  One record
    per request: seconds, new kernels, cache entries after."""
    chosen = []
    for request in warmup_requests(env):
        s = request.compile_spec
        context = not s.causal and s.return_softmax_lse
        if (
            which == "all"
            or (which == "context" and context)
            or (context and (s.max_seqlen_q, s.max_seqlen_k) == REPORT_PROBE)
        ):
            chosen.append(request)
    records = []
    for request in chosen:
        entries = forward_cache(env)
        before = len(entries)
        start = time.perf_counter()
        request.compile()
        seconds = time.perf_counter() - start
        entries = forward_cache(env)
        records.append(
            {
                "phase": phase,
                "probe": probe_name(request),
                "seconds": round(seconds, 2),
                "new_kernels": len(entries) - before,
                "cache_entries": len(entries),
            }
        )
    return records


# --------------------------------------------------------------------------
# Planning a step with vLLM's FA4 and calling the chosen kernel


@dataclasses.dataclass
class Plan:
    key: object
    hit: bool
    split_out: tuple[int, ...] | None  # out_partial (splits, total_q, H, Dv), fp32
    split_lse: tuple[int, ...] | None  # lse_partial (splits, H, total_q), fp32
    error: str | None = None

    @property
    def num_splits(self) -> int:
        return self.split_out[0] if self.split_out else 1


def plan(env: types.SimpleNamespace, step: Step) -> Plan:
    """Let vLLM's ``_flash_attn_fwd`` pick the kernel and buffers for this
    context chunk (FakeTensorMode, ``compile_only=True``; nothing launches)."""
    torch = env.torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    allocations: list[tuple[tuple[int, ...], object]] = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(
            self,
            func: Any,  # a torch OpOverload
            types: Sequence[type],
            args: Sequence[object] = (),
            kwargs: Mapping[str, object] | None = None,
        ) -> object:  # what the operator returns
            result = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format:
                allocations.append((tuple(result.shape), result.dtype))
            return result

    entries = forward_cache(env)
    entries.looked_up.clear()
    before = len(entries)
    error = None
    total_k = sum(step.ctx_lens)
    with FakeTensorMode():
        q = torch.empty(step.total_q, NUM_HEADS, QK_HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(total_k, NUM_HEADS, QK_HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        kv_nope = torch.empty(
            total_k, NUM_HEADS, KV_NOPE_HEAD_DIM, dtype=torch.bfloat16, device="cuda"
        )
        v = kv_nope[..., KV_NOPE_HEAD_DIM - V_HEAD_DIM :]
        cu_q = torch.empty(len(step.q_lens) + 1, dtype=torch.int32, device="cuda")
        cu_k = torch.empty(len(step.ctx_lens) + 1, dtype=torch.int32, device="cuda")
        with Allocations():
            try:
                env.interface._flash_attn_fwd(
                    q,
                    k,
                    v,
                    cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k,
                    max_seqlen_q=max(step.q_lens),
                    max_seqlen_k=max(step.ctx_lens),
                    softmax_scale=QK_HEAD_DIM**-0.5,
                    causal=False,
                    num_splits=0,
                    return_lse=True,
                    compile_only=True,
                )
            except Exception as exc:  # a cache miss tries to compile from fake torch tensors
                error = f"{type(exc).__name__}: {exc}"[:300]
    entries = forward_cache(env)
    key = entries.looked_up[0] if entries.looked_up else None
    fp32 = [shape for shape, dtype in allocations if dtype == torch.float32]
    split_out = next((s for s in fp32 if len(s) == 4), None)
    split_lse = next((s for s in fp32 if len(s) == 3), None)
    hit = key is not None and error is None and len(entries) == before and key in dict.keys(entries)
    return Plan(key=key, hit=hit, split_out=split_out, split_lse=split_lse, error=error)


def _dlpack_as_cuda(torch: types.ModuleType, tensor: torch.Tensor) -> object:  # a tvm_ffi.Tensor
    """``tensor`` (CPU) as a TVM-FFI tensor whose DLPack device says CUDA:0."""
    import tvm_ffi

    capsule = torch.utils.dlpack.to_dlpack(tensor)
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    dl_tensor = get_pointer(capsule, b"dltensor")
    # DLTensor: void* data; DLDevice {int32 device_type; int32 device_id}; ...
    ctypes.c_int32.from_address(dl_tensor + ctypes.sizeof(ctypes.c_void_p)).value = 2  # kDLCUDA
    return tvm_ffi.from_dlpack(capsule)


def call_arguments(env: types.SimpleNamespace, step: Step, p: Plan) -> list[Any]:
    """The arguments vLLM's ``_flash_attn_fwd`` passes an SM100 forward kernel
    for this context chunk, on CPU memory."""
    torch = env.torch
    total_k = sum(step.ctx_lens)
    q = torch.empty(step.total_q, NUM_HEADS, QK_HEAD_DIM, dtype=torch.bfloat16)
    k = torch.empty(total_k, NUM_HEADS, QK_HEAD_DIM, dtype=torch.bfloat16)
    kv_nope = torch.empty(total_k, NUM_HEADS, KV_NOPE_HEAD_DIM, dtype=torch.bfloat16)
    v = kv_nope[..., KV_NOPE_HEAD_DIM - V_HEAD_DIM :]
    if p.split_out is not None:
        out = torch.empty(p.split_out, dtype=torch.float32)
        lse = torch.empty(p.split_lse, dtype=torch.float32)
    else:
        out = torch.empty(step.total_q, NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16)
        lse = torch.empty(NUM_HEADS, step.total_q, dtype=torch.float32)
    cu_q = torch.tensor([0, *torch.tensor(step.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(step.ctx_lens).cumsum(0).tolist()], dtype=torch.int32)
    tensors = [_dlpack_as_cuda(torch, t) for t in (q, k, v, out, lse)]
    # softmax_scale, cu_seqlens_q/k, then: seqused_q, seqused_k, dynamic_causal,
    # page_table, window left/right, learnable_sink, descale_tensors (SM100),
    # block-sparse tensors, aux_tensors, output_scale -- all None here.
    return [
        *tensors,
        QK_HEAD_DIM**-0.5,
        _dlpack_as_cuda(torch, cu_q),
        _dlpack_as_cuda(torch, cu_k),
    ] + [None] * 11


def classify(exc: BaseException | None) -> tuple[str, str]:
    if exc is None:
        return "returned", ""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ValueError) and "Mismatched" in text:
        return "argument-check-failed", text
    if "cudaError" in text or "CUDA_ERROR" in text:
        return "reached-launch", text
    return "other-error", text


def in_child(
    work: Callable[[], dict[str, object]], timeout: float = CALL_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``work`` in a forked child (fresh launch state, same compiled
    kernels); its JSON-able result, or a timeout/crash record."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        try:
            payload = work()
        except BaseException as exc:  # noqa: BLE001 - report anything
            payload = {"outcome": "harness-error", "error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(payload).encode()
        while data:
            data = data[os.write(write_end, data) :]
        os._exit(0)
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                os.kill(pid, signal.SIGKILL)
                return {"outcome": "timeout", "error": f"no answer within {timeout:.0f} s"}
            ready, _, _ = select.select([read_end], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    if not chunks:
        return {"outcome": "child-crashed", "error": "the child exited without an answer"}
    return cast("dict[str, Any]", json.loads(b"".join(chunks)))


_primed: set[int] = set()


def prime(env: types.SimpleNamespace, kernel: Callable[..., object], step: Step, p: Plan) -> None:
    """Pay a compiled function's one-time set-up (about a second on the first
    call) in this process, so that forked children inherit it: call it once
    with a float32 query, which the first argument check rejects -- nothing
    launches."""
    if id(kernel) in _primed:
        return
    args = call_arguments(env, step, p)
    args[0] = _dlpack_as_cuda(env.torch, env.torch.empty(step.total_q, NUM_HEADS, QK_HEAD_DIM))
    try:
        kernel(*args)
    except ValueError as exc:
        if "argument #0" not in str(exc):
            raise RuntimeError(f"priming call failed unexpectedly: {exc}") from exc
    else:
        raise RuntimeError("priming call with a float32 query was accepted")
    _primed.add(id(kernel))


def run_step(env: types.SimpleNamespace, step: Step, phase: str) -> dict[str, Any]:
    """Plan ``step`` with vLLM, then call the cached kernel in a child."""
    start = time.perf_counter()
    p = plan(env, step)
    planned = time.perf_counter()
    record = {
        "phase": phase,
        "step": step.label(),
        "total_q": step.total_q,
        "num_splits": p.num_splits,
        "kernel_cached": p.hit,
        "plan_s": round(planned - start, 3),
    }
    if not p.hit:
        record.update(outcome="kernel-not-warmed", error=p.error or "cache miss")
        return record
    kernel = forward_cache(env)[p.key]
    prime(env, kernel, step, p)

    def work() -> dict[str, object]:
        try:
            kernel(*call_arguments(env, step, p))
        except Exception as exc:  # noqa: BLE001
            outcome, text = classify(exc)
        else:
            outcome, text = classify(None)
        return {"outcome": outcome, "error": text}

    record.update(in_child(work))
    record["call_s"] = round(time.perf_counter() - planned, 3)
    return record


# --------------------------------------------------------------------------
# The scenario: reproduce, fix, re-run, sweep


def apply_fix(env: types.SimpleNamespace) -> str:
    from vllm_mla_fixes.fixes import fa4_compile_strides
    from vllm_mla_fixes.patching import run_fix

    result = run_fix(fa4_compile_strides.FIX, env.vllm.__version__)
    return result.status.label() if result.status.state.value != "applied" else "applied"


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for dist in ("vllm", "nvidia-cutlass-dsl", "quack-kernels", "torch", "apache-tvm-ffi"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def scenario(
    reproduce: bool = True, sweep: str = "default", log: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """``reproduce``: compile the report's kernel unpatched and call it with
    total_q 129, 130 and 300.  Then apply the fix (through the plugin's
    ``run_fix``), recompile, and call 130 and 300 again.  ``sweep``:
    ``none``, ``default`` (both Split-KV context kernels) or ``full`` (the whole
    warm-up plan) -- plan and call every composition, counting new kernels."""
    env = prepare()
    result: dict[str, Any] = {
        "versions": versions(),
        "planning_sms": "132 SMs",
        "compile_sms": B200_SMS,
        "compiles": [],
        "calls": [],
        "sweep": None,
    }
    if reproduce:
        result["compiles"] += compile_warmup(env, "report", "unpatched")
        log(
            f"unpatched: compiled {result['compiles'][-1]['probe']} in "
            f"{result['compiles'][-1]['seconds']} s"
        )
        for q in (129, 130, 300):
            record = run_step(env, Step((q,), (CONTEXT_TOKENS,)), "unpatched")
            result["calls"].append(record)
            log(
                f"unpatched total_q={q}: {record['outcome']} {whole_words(record.get('error', ''), 160)}"
            )
    status = apply_fix(env)
    result["fix"] = status
    log(f"fix: {status}")
    if status != "applied":
        return result
    result["cache_entries_after_fix"] = len(forward_cache(env))
    if reproduce:
        result["compiles"] += compile_warmup(env, "report", "fixed")
        for q in (130, 300):
            record = run_step(env, Step((q,), (CONTEXT_TOKENS,)), "fixed")
            result["calls"].append(record)
            log(
                f"fixed total_q={q}: {record['outcome']} {whole_words(record.get('error', ''), 160)}"
            )
    if sweep != "none":
        result["compiles"] += compile_warmup(
            env, "context" if sweep == "default" else "all", "fixed"
        )
        steps = default_steps() if sweep == "default" else full_steps()
        before = len(forward_cache(env))
        start = time.perf_counter()
        records = [run_step(env, step, "sweep") for step in steps]
        after = len(forward_cache(env))
        result["sweep"] = {
            "kind": sweep,
            "size": len(steps),
            "reached_launch": sum(r["outcome"] == "reached-launch" for r in records),
            "cache_entries_before": before,
            "cache_entries_after": after,
            "new_kernels": after - before,
            "total_q_range": [min(s.total_q for s in steps), max(s.total_q for s in steps)],
            "num_splits_seen": sorted({r["num_splits"] for r in records}),
            "seconds": round(time.perf_counter() - start, 1),
            "failures": [r for r in records if r["outcome"] != "reached-launch"],
        }
        log(
            f"sweep: {result['sweep']['reached_launch']}/{len(steps)} reached launch, "
            f"new kernels {after - before}"
        )
    return result


def gate(cpu_package: bool = True) -> dict[str, Any]:
    """The fix's gate on this install, without compiling anything: the
    plugin's verdict, the probe's, and -- where the fix applies -- what it
    replaced and whether reverting restores vLLM."""
    from vllm_mla_fixes import installed_vllm_version
    from vllm_mla_fixes.fixes import fa4_compile_strides as fix
    from vllm_mla_fixes.patching import CannotProbe, TargetMismatch, run_fix

    version = installed_vllm_version()
    out: dict[str, Any] = {
        "vllm": version,
        "admitted": fix.INFO.admits(version or "0"),
        "bare_package": expose_fa4_package() if cpu_package else False,
    }
    result = run_fix(fix.FIX, version or "0")  # as the gate above reads a missing vLLM
    out["status"] = result.status.state.value
    out["status_reason"] = result.status.reason
    # what register() costs a process that never runs FA4 (API server, engine core)
    out["register_imported"] = {
        name: name in sys.modules for name in ("cutlass", fix.INTERFACE_MODULE)
    }

    def functional() -> dict[str, object]:
        try:
            reason = fix.functional_verdict()
        except (CannotProbe, TargetMismatch) as exc:
            return {"needed": None, "reason": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001
            return {"needed": None, "reason": f"probe failed: {type(exc).__name__}: {exc}"}
        return {"needed": reason is None, "reason": reason}

    # importing FA4's interface (as vLLM's worker does) fires an armed hook
    out["after_import"] = functional()
    out["deferred_outcome"] = fix.deferred_outcome()
    if result.patch is None or fix.deferred_outcome() != "patched":
        out["functional_probe"] = out["after_import"]
        return out
    utils = importlib.import_module(fix.UTILS_MODULE)
    interface = importlib.import_module(fix.INTERFACE_MODULE)
    cache = interface._flash_attn_fwd.compile_cache
    out["patched"] = {
        name: getattr(sys.modules[name].__dict__.get(fix.TARGET), fix.MARK, None) == fix.INFO.name
        for name in sorted(sys.modules)
        if name.startswith("vllm.") and fix.TARGET in getattr(sys.modules[name], "__dict__", {})
    }
    out["cache"] = {
        "type": type(cache).__name__,
        "entries": len(cache.cache),
        "path": str(getattr(cache, "cache_path", "")) or None,
    }
    result.patch.revert()
    restored = interface._flash_attn_fwd.compile_cache
    out["reverted"] = {
        "cache_restored": restored is not cache,
        "target_restored": getattr(utils.to_cute_tensor, fix.MARK, None) is None
        and interface.to_cute_tensor is utils.to_cute_tensor,
    }
    out["functional_probe"] = functional()  # on the installed, unpatched code
    return out


def _child(args: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run this module in a fresh interpreter; its JSON result, or why none."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        watch = ("--watch-parent", str(os.getpid()))
        try:
            proc = children.run(
                [sys.executable, "-W", "ignore", "-m", __name__, *args, *watch, "--json", out],
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return None, f"no result within {timeout:.0f} s"
        if not os.path.exists(out):
            return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"
        with open(out, encoding="utf-8") as f:
            return json.load(f), ""


def verify(report: Callable[[str], None]) -> bool:
    """``vllm-mla-fixes verify``: check FA4 on this install; where it has the
    bug, reproduce the upstream error on CPU through vLLM's warm-up kernel,
    then show the fix removes it (a child interpreter, 5 CuTe compiles: about
    1.5-2 min on 2 cores)."""
    gate_result, why = _child(["--gate"], timeout=900)
    if gate_result is None:
        report(f"could not inspect vLLM's FA4 here: {why}")
        return False
    probe = gate_result["functional_probe"]
    if probe["needed"] is False:
        report(f"vLLM {gate_result['vllm']}: FA4 does not have this bug: {probe['reason']}")
        return True
    if probe["needed"] is None:
        report(f"vLLM {gate_result['vllm']}: cannot check FA4 here: {probe['reason']}")
        return False
    report(
        "FA4 freezes compile-only strides here; compiling vLLM's FA4 warm-up kernels for an "
        "SM100 target on CPU (8 heads, d_qk 192, d_v 128; ~15 s per kernel)"
    )
    result, why = _child(["--sweep", "default"], timeout=3600)
    if result is None:
        report(f"the CPU reproduction failed: {why}")
        return False
    return summarize(result, report)


def whole_words(text: str, limit: int) -> str:
    """``text``, or its words up to ``limit`` characters and an ellipsis: a
    report line never ends in a cut word."""
    if len(text) <= limit:
        return text
    return text[: limit + 1].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


def summarize(result: dict[str, Any], report: Callable[[str], None]) -> bool:
    """Report lines for a scenario result; whether it shows bug then fix."""
    calls = {(c["phase"], c["total_q"]): c for c in result["calls"]}
    for c in result["compiles"]:
        if c["phase"] == "unpatched":
            report(f"warm-up compile {c['probe']} (unpatched): {c['seconds']} s")
    reproduced = True
    for q in (130, 300):
        c = calls.get(("unpatched", q), {})
        report(f"upstream total_q={q}: {c.get('error') or c.get('outcome')}")
        reproduced &= c.get("error") == upstream_error(REPORT_STRIDE)
    warm_ok = calls.get(("unpatched", 129), {}).get("outcome") == "reached-launch"
    report(
        f"upstream total_q=129 (the warm-up shape): {calls.get(('unpatched', 129), {}).get('outcome')}"
    )
    if result.get("fix") != "applied":
        report(f"fix not applied: {result.get('fix')}")
        return False
    fixed = True
    for q in (130, 300):
        c = calls.get(("fixed", q), {})
        detail = (
            "every argument check passed; the launch then fails for want of a GPU: "
            if c.get("outcome") == "reached-launch"
            else ""
        )
        report(
            f"fixed    total_q={q}: {c.get('outcome')} ({detail}{whole_words(c.get('error', ''), 90)})"
        )
        fixed &= c.get("outcome") == "reached-launch"
    sweep = result.get("sweep")
    if sweep:
        report(
            f"sweep: {sweep['reached_launch']}/{sweep['size']} compositions pass the argument "
            f"checks (total_q {sweep['total_q_range'][0]}-{sweep['total_q_range'][1]}, "
            f"num_splits {sweep['num_splits_seen']}); compile cache {sweep['cache_entries_before']} "
            f"-> {sweep['cache_entries_after']} entries"
        )
        fixed &= sweep["reached_launch"] == sweep["size"] and sweep["new_kernels"] == 0
    return reproduced and warm_ok and fixed


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("none", "default", "full"), default="default")
    parser.add_argument(
        "--no-reproduce", action="store_true", help="skip the unpatched compile and calls"
    )
    parser.add_argument(
        "--gate",
        action="store_true",
        help="only evaluate the fix's gate, apply and revert it (no compiling)",
    )
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--watch-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.watch_parent is not None:  # started by verify: ends with it
        children.watch_parent(args.watch_parent)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.gate:
        result = gate()
        text = json.dumps(result, indent=1, default=str)
        print(text)
        if args.json:
            atomic.write_atomic(Path(args.json), text)
        return 0
    result = scenario(
        reproduce=not args.no_reproduce, sweep=args.sweep, log=lambda line: print(line, flush=True)
    )
    if args.json:
        atomic.write_atomic(Path(args.json), json.dumps(result, indent=1, default=str))
    ok = summarize(result, lambda line: print(line, flush=True)) if not args.no_reproduce else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
