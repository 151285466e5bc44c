"""vLLM's FA4 MLA prefill on a CPU-only machine: set up, compiled through
vLLM's own warm-up, each step planned by vLLM and its kernel called.

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

The reproduction that drives it (the report's kernel unpatched, the fix,
the sweep) is :mod:`vllm_mla_fixes.reproductions.fa4_compile_strides`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.machinery
import json
import os
import select
import signal
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from vllm_mla_fixes import settings

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

# The warm-up probe that compiles the kernel of the report: q 129, k 8192.
REPORT_PROBE = (129, WARMUP_LONG_K)


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
