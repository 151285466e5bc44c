"""Kernel calls recorded at the kernel boundary, on CPU, as a GPU of one arch would see them.

The self-test (and the GPU tests) must call each kernel as the installed vLLM
release calls it on that arch: same argument names, dtypes, shapes, strides and
scale formats.  Neither side can run the kernels here, so both are run up to
the kernel and the call is recorded there:

* :func:`pretend_gpu` makes the driverless host look like a CUDA GPU of the
  given compute capability for vLLM's decisions (platform CUDA, capability,
  SM count; host buffers unpinned), on top of the self-test's own
  ``simulated_sm120_host``;
* :func:`recording` registers CPU kernels for DeepGEMM's own torch ops
  (``torch.ops.deep_gemm``, loaded from the DeepGEMM vLLM imports) that record
  each call by the names of the op's declared schema and stop it there, and
  records FlashMLA's scheduler-metadata entry point the sparse-SWA metadata
  builder asks for off SM12x;
* :func:`vllm_indexer_decode` runs the release's own DeepSeek-V4.1 indexer
  layer (``SparseAttnIndexer`` built from the release's config, its
  ``forward_cuda`` and ``sparse_attn_indexer``) on the self-test's caches and
  metadata, so the call recorded is the one the server makes;
* :func:`recording_compressed_writer` stands a recorder in the place of each
  Triton kernel the release's ``rope_quant_insert`` launches (the compressed
  KV writer), and :func:`vllm_compressed_insert` runs the release's own
  ``DeepseekCompressor.insert_cache`` on the self-test's caches and metadata;
  :func:`recording_indexer_k_writer` and :func:`vllm_produce_k` do the same
  for the indexer keys (``indexer_k_norm_rope_store``, written by the
  release's ``DeepseekV4Indexer._produce_k``).

Nothing of vLLM's code on the way to a kernel is replaced: the recorders
stand where the compiled (or Triton) kernels would run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch

# name: (compute capability, SM count of the GPU the arch is checked for)
ARCHS: dict[str, tuple[tuple[int, int], int]] = {
    "sm120": ((12, 0), 188),  # RTX PRO 6000 Blackwell
    "sm121": ((12, 1), 48),  # DGX Spark (GB10)
    "sm100": ((10, 0), 148),  # B200
    "sm90": ((9, 0), 132),  # H100 / H200
}

PAGED_LOGITS = "deep_gemm.fp8_fp4_paged_mqa_logits"
PAGED_LOGITS_METADATA = "deep_gemm.get_paged_mqa_logits_metadata"
FLASHMLA_METADATA = "flashmla.get_mla_metadata"


class CallRecorded(Exception):
    """Raised by a recording kernel after it recorded its call."""


@dataclasses.dataclass(frozen=True)
class Arg:
    """What a kernel sees of one argument."""

    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    scale_format: str | None = None  # int32 scale tensors: "ue8m0x4" or "int32"
    value: Any = None  # non-tensor arguments

    def __str__(self) -> str:
        if self.dtype is None:
            return repr(self.value)
        fmt = f" {self.scale_format}" if self.scale_format else ""
        return f"{self.dtype}{list(self.shape or ())} stride {list(self.stride or ())}{fmt}"


@dataclasses.dataclass
class Call:
    kernel: str
    args: dict[str, Arg]
    caller: str = ""
    # The tensors themselves (copied at the call), for readers checked on them.
    tensors: dict[str, Any] = dataclasses.field(default_factory=dict)


def describe(value: Any, scale: bool = False) -> Arg:
    """``scale``: the argument is a scale tensor (DeepGEMM names them ``*_sf``),
    whose int32 form packs four UE8M0 bytes."""
    if isinstance(value, torch.Tensor):
        scale_format = None
        if scale and value.dtype == torch.int32 and value.numel():
            packed = value.contiguous().view(torch.uint8).reshape(-1, 4)
            four_equal = bool((packed == packed[:, :1]).all())
            scale_format = "ue8m0x4" if four_equal else "int32, not UE8M0x4"
        return Arg(
            str(value.dtype).removeprefix("torch."),
            tuple(value.shape),
            tuple(value.stride()),
            scale_format,
        )
    if isinstance(value, torch.dtype):
        return Arg(value=str(value).removeprefix("torch."))
    return Arg(value=value)


def _default(declared) -> Arg:
    """A declared default as a caller would have passed it (a ScalarType
    default is stored as its enum number; its schema text names the dtype)."""
    if str(declared.type) == "ScalarType" and declared.default_value is not None:
        text = str(declared).split("=", 1)[1]
        return describe(getattr(torch, text))
    return describe(declared.default_value)


def _bound(op, args: tuple) -> dict[str, Arg]:
    """The call's arguments by the op's declared names; those the dispatcher
    left out take their declared defaults."""
    schema = op.default._schema
    out = {}
    for i, declared in enumerate(schema.arguments):
        if i < len(args):
            out[declared.name] = describe(args[i], scale=declared.name.endswith("_sf"))
        elif declared.has_default_value():
            out[declared.name] = _default(declared)
    return out


@contextlib.contextmanager
def recording(calls: list[Call], caller: list[str]):
    """DeepGEMM's paged MQA logits ops and FlashMLA's metadata entry point
    record their calls into ``calls`` (tagged with ``caller[0]``) meanwhile."""
    import vllm.utils.deep_gemm as vllm_deep_gemm
    from vllm.v1.attention.backends.mla import sparse_swa

    module = vllm_deep_gemm._import_deep_gemm()
    assert module is not None, "vLLM finds no DeepGEMM to import"
    ops = torch.ops.deep_gemm

    def paged_logits(*args):
        op = ops.fp8_fp4_paged_mqa_logits
        names = [declared.name for declared in op.default._schema.arguments]
        tensors = {
            name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in zip(names, args)
        }
        calls.append(Call(PAGED_LOGITS, _bound(op, args), caller[0], tensors))
        raise CallRecorded(PAGED_LOGITS)

    def paged_logits_metadata(*args):
        op = ops.get_paged_mqa_logits_metadata
        calls.append(Call(PAGED_LOGITS_METADATA, _bound(op, args), caller[0]))
        num_slots = int(args[2])
        return torch.zeros(num_slots + 1, 2, dtype=torch.int32)

    def flashmla_metadata(*args, **kwargs):
        # FlashMLA's own returns an empty schedule its first kernel call fills.
        calls.append(Call(FLASHMLA_METADATA, {}, caller[0]))
        return None, None

    library = torch.library.Library("deep_gemm", "IMPL")
    library.impl("fp8_fp4_paged_mqa_logits", paged_logits, "CPU")
    library.impl("get_paged_mqa_logits_metadata", paged_logits_metadata, "CPU")
    saved = sparse_swa.get_mla_metadata
    sparse_swa.get_mla_metadata = flashmla_metadata
    try:
        yield
    finally:
        sparse_swa.get_mla_metadata = saved
        library._destroy()


# The sliding-window writers of DeepSeek-V4.1's layers (CUDA only, in vllm._C):
# the main forward's fused Q+KV insert, and the KV-only insert of forward_kv.
SWA_WRITERS = (
    "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
    "fused_deepseek_v4_kv_rope_insert",
)


@contextlib.contextmanager
def recording_writers(calls: list[Call], caller: list[str], stop_for: str | None = None):
    """vLLM's CUDA-only SWA writer ops exist meanwhile, declared with the
    schemas compiled into the installed vLLM's extension, and record their
    calls (they write nothing); a call made for ``stop_for`` then stops there
    (:class:`CallRecorded`).  Fails where the host already has them."""
    import re

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.envelope import vllm_kernels

    vllm_dir = envelope.package_dir("vllm")
    assert vllm_dir is not None
    library = torch.library.Library("_C", "FRAGMENT")

    def recorder(name: str):
        def record(*args):
            op = getattr(torch.ops._C, name)
            calls.append(Call(f"_C.{name}", _bound(op, args), caller[0]))
            if caller[0] == stop_for:
                raise CallRecorded(name)
            if op.default._schema.returns:  # the padded query
                q_in, pad = args[0], int(args[6])
                return q_in.new_zeros(q_in.shape[0], max(pad, q_in.shape[1]), q_in.shape[2])
            return None

        return record

    try:
        for name in SWA_WRITERS:
            assert not hasattr(torch.ops._C, name), f"{name} is loaded: record on a CPU host"
            pattern = re.escape(name.encode()) + rb"\([^)]*\) -> (?:\(\)|Tensor)"
            _, schema = vllm_kernels._vllm_extension(vllm_dir, pattern, f"the schema of {name}")
            library.define(schema)
            library.impl(name, recorder(name), "CPU")
        yield
    finally:
        library._destroy()


# The compressed caches' writer: vLLM's compressor publishes through
# ``rope_quant_insert``, which launches the Triton kernel its cache's record
# width names; the indexer keys' writer, ``indexer_k_norm_rope_store``.
COMPRESSED_WRITER_MODULE = "vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache"
INDEXER_K_WRITER_MODULE = "vllm.models.deepseek_v41.common.ops.indexer_k_store"
COMPRESSED_LAUNCH, INDEXER_K_LAUNCH = "triton.compressed.", "triton.indexer_k."


class _LaunchRecorder:
    """Stands where one of a writer's Triton kernels is: each launch is
    recorded (as ``<label><kernel>``) by the kernel's parameter names (and its
    grid), and writes nothing."""

    def __init__(self, name: str, kernel, calls: list[Call], caller: list[str]):
        import inspect

        self.name = name
        self.params = list(inspect.signature(kernel.fn).parameters)
        self.calls = calls
        self.caller = caller

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = {name: describe(value) for name, value in zip(self.params, args)}
            named.update({name: describe(value) for name, value in kwargs.items()})
            named["grid"] = describe(tuple(grid))
            self.calls.append(Call(self.name, named, self.caller[0]))

        return launch


@contextlib.contextmanager
def _recording_launches(
    module_name: str, function: str, label: str, calls: list[Call], caller: list[str]
):
    """The Triton kernels ``function`` of ``module_name`` can launch record
    their launches into ``calls`` meanwhile (tagged with ``caller[0]``) and
    write nothing."""
    import importlib

    from triton.runtime.jit import KernelInterface

    module = importlib.import_module(module_name)
    kernels = {
        name: getattr(module, name)
        for name in getattr(module, function).__code__.co_names
        if isinstance(getattr(module, name, None), KernelInterface)
    }
    assert kernels, f"{function} launches no Triton kernel this test knows"
    for name, kernel in kernels.items():
        setattr(module, name, _LaunchRecorder(f"{label}{name}", kernel, calls, caller))
    try:
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)


def recording_compressed_writer(calls: list[Call], caller: list[str]):
    """The compressed KV writer's (``rope_quant_insert``'s) launches, recorded."""
    return _recording_launches(
        COMPRESSED_WRITER_MODULE, "rope_quant_insert", COMPRESSED_LAUNCH, calls, caller
    )


def recording_indexer_k_writer(calls: list[Call], caller: list[str]):
    """The indexer keys' writer's (``indexer_k_norm_rope_store``'s) launches, recorded."""
    return _recording_launches(
        INDEXER_K_WRITER_MODULE, "indexer_k_norm_rope_store", INDEXER_K_LAUNCH, calls, caller
    )


def vllm_window_kv_insert(layout, cache, metadata: dict, kv, positions, cos_sin) -> None:
    """The release's main forward up to its window-KV write, on the self-test's
    SM120 layer of ``cache``: ``DeepseekV4Attention._prepare_and_attn``, whose
    ``project_query_and_cache_kv`` projects the query from a q-lora activation
    through the layer's ``wq_b`` and views it per head as the layer does, then
    hands it with the window KV ``kv`` to ``_fused_qnorm_rope_kv_insert``.
    The compressor and the indexer are left out (they run beside the write);
    ``wq_b`` (vLLM's ``ColumnParallelLinear``, which needs a tensor-parallel
    group a CPU test does not start) is a bf16 projection of the layer's
    shapes.  Record with ``recording_writers(..., stop_for=<this caller>)``:
    the forward stops at the writer op."""
    from types import SimpleNamespace

    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    layer = layout.readers[cache.layer]
    q_lora_rank = 64
    weight = torch.randn(layer.n_local_heads * layer.head_dim, q_lora_rank, dtype=torch.bfloat16)
    stand = {
        "rotary_emb": SimpleNamespace(cos_sin_cache=cos_sin),
        "wq_b": lambda x: x @ weight.T,
        "compressor": None,
        "indexer": None,
        "aux_stream_list": None,
    }
    absent = [name for name in stand if name not in vars(layer)]
    for name, value in stand.items():
        object.__setattr__(layer, name, value)
    qr = torch.randn(kv.shape[0], q_lora_rank, dtype=torch.bfloat16)
    out = torch.empty(kv.shape[0], layer.padded_heads, layer.head_dim, dtype=torch.bfloat16)
    context = ForwardContext(no_compile_layers={}, attn_metadata=metadata, slot_mapping={})
    try:
        with override_forward_context(context), contextlib.suppress(CallRecorded):
            DeepseekV4Attention._prepare_and_attn(
                layer, kv, qr, kv, None, None, None, positions, out
            )
    finally:
        for name in absent:
            object.__delattr__(layer, name)


def vllm_produce_k(layout, cache, metadata: dict, latent, positions, cos_sin) -> None:
    """The release's DeepSeek-V4.1 indexer turning a kv source's compressor
    latent into its paged index keys: ``DeepseekV4Indexer._produce_k`` run
    with the step's metadata on an indexer without its ``__init__``, holding
    what that ``__init__`` gives an index source that owns its keys: ``k_norm``
    (vLLM's ``RMSNorm`` of the 128-dim key in the model's bf16), the K cache,
    the compress ratio, the FP8 (not MXFP4) cache.  Its ``wk`` (vLLM's
    ``ReplicatedLinear``, which needs a tensor-parallel group a CPU test does
    not start) is a bf16 projection of the same shapes: 512 -> 128."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.models.deepseek_v41.attention import DeepseekV4Indexer

    indexer = DeepseekV4Indexer.__new__(DeepseekV4Indexer)
    torch.nn.Module.__init__(indexer)
    indexer.owns_k, indexer.use_fp4_kv = True, False
    indexer.compress_ratio, indexer.k_cache = cache.ratio, cache.module
    with set_current_vllm_config(_layer_config(layout)):  # a CustomOp reads the custom ops
        indexer.k_norm = RMSNorm(128, layout.model.rms_norm_eps, dtype=torch.bfloat16)
    weight = torch.randn(128, latent.shape[1], dtype=torch.bfloat16)
    indexer.wk = lambda x: (x @ weight.T, None)
    context = ForwardContext(no_compile_layers={}, attn_metadata=metadata, slot_mapping={})
    with override_forward_context(context):
        indexer._produce_k(latent, positions, SimpleNamespace(cos_sin_cache=cos_sin))


def vllm_compressed_insert(layout, cache, metadata: dict, latent, positions, cos_sin) -> None:
    """The release's DeepSeek-V4.1 compressor publishing ``latent`` into the
    compressed cache ``cache``: ``DeepseekCompressor.insert_cache`` run with
    the step's metadata on a compressor without its ``__init__`` (whose
    projection needs vLLM's CUDA ops), holding what that ``__init__`` sets
    for it as ``DeepseekV4Attention.__init__`` builds a kv source's: the
    compress ratio, the layer's prefix as ``k_cache_prefix`` (it finds the
    cache in the forward context) and the configuration's forward context."""
    from types import SimpleNamespace

    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.models.deepseek_v41.compressor import DeepseekCompressor

    compressor = DeepseekCompressor.__new__(DeepseekCompressor)
    torch.nn.Module.__init__(compressor)
    compressor.compress_ratio = cache.ratio
    compressor.k_cache_prefix = cache.name
    compressor._static_forward_context = layout.config.compilation_config.static_forward_context
    context = ForwardContext(no_compile_layers={}, attn_metadata=metadata, slot_mapping={})
    with override_forward_context(context):
        compressor.insert_cache(latent, positions, SimpleNamespace(cos_sin_cache=cos_sin))


def preload() -> None:
    """Import what decides at import time (CUDA op tables, FlashMLA's
    availability) while the host still looks like what it is."""
    import vllm.model_executor.layers.sparse_attn_indexer  # noqa: F401
    import vllm.models.deepseek_v41.attention  # noqa: F401
    import vllm.models.deepseek_v41.nvidia.flashinfer_sparse  # noqa: F401
    import vllm.v1.attention.backends.mla.indexer  # noqa: F401
    import vllm.v1.attention.backends.mla.sparse_swa  # noqa: F401


def _decision_caches():
    from vllm.utils import deep_gemm

    return [
        f
        for f in (getattr(deep_gemm, "mqa_logits_use_mx_scales", None),)
        if hasattr(f, "cache_clear")
    ]


@contextlib.contextmanager
def pretend_gpu(arch: str):
    """vLLM sees a CUDA GPU of ``arch`` meanwhile (see the module docstring)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import PlatformEnum

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import simulated_sm120_host

    capability, sm_count = ARCHS[arch]
    preload()
    platform_cls = type(current_platform)
    saved = platform_cls.__dict__.get("_enum")
    with simulated_sm120_host(capability, sm_count):
        platform_cls._enum = PlatformEnum.CUDA
        for cache in _decision_caches():
            cache.cache_clear()
        try:
            yield
        finally:
            platform_cls._enum = saved
            for cache in _decision_caches():
                cache.cache_clear()


def _layer_config(layout) -> Any:
    """The self-test's configuration as ``vllm serve`` completes it for
    DeepSeek-V4.1: the release's kernel config and its model hook's indexer
    settings (the logits dtype)."""
    from vllm import config as vllm_config
    from vllm.model_executor.models import config as model_configs

    cfg = copy.copy(layout.config)
    cfg.attention_config = copy.deepcopy(layout.config.attention_config)
    cfg.kernel_config = vllm_config.KernelConfig()
    # VllmConfig resolves one base mode; the layer is called by forward_cuda
    # below, so which one does not matter.
    cfg.compilation_config = copy.copy(layout.config.compilation_config)
    cfg.compilation_config.custom_ops = ["none"]
    for hook in ("DeepseekV4ForCausalLMConfig", "DeepseekV41ForCausalLMConfig"):
        found = getattr(model_configs, hook, None)
        if found is not None:
            try:
                found.verify_and_update_config(cfg)
            except AttributeError:
                # The hook reads parts of VllmConfig the self-test's does not
                # carry; its indexer setting is the part the call depends on.
                setter = getattr(model_configs, "_set_deepseek_indexer_logits_dtype", None)
                if setter is not None:
                    setter(cfg)
            break
    return cfg


def vllm_indexer_decode(layout, cache, metadata: dict, q_fp8: torch.Tensor, weights) -> None:
    """The release's DeepSeek-V4.1 indexer op on one decode-only step: built
    as ``DeepseekV4Indexer`` builds it (skip_k_cache_insert, the FP8 cache,
    the compress ratio), run through ``forward_cuda`` up to DeepGEMM."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size

    model = layout.model
    cfg = _layer_config(layout)
    rows = q_fp8.shape[0]
    topk = torch.full((rows, model.index_topk), -1, dtype=torch.int32)
    with set_current_vllm_config(cfg):
        layer = SparseAttnIndexer(
            cache.module,
            128,  # quant_block_size, as DeepseekV4Indexer sets it
            "ue8m0",
            model.index_topk,
            128,
            model.max_model_len // cache.ratio,
            get_max_prefill_buffer_size(cfg) // cache.ratio,
            topk,
            skip_k_cache_insert=True,
            use_fp4_cache=False,
            compress_ratio=cache.ratio,
        )
    context = ForwardContext(no_compile_layers={}, attn_metadata=metadata, slot_mapping={})
    hidden = torch.zeros(rows, 16, dtype=torch.bfloat16)
    with override_forward_context(context), contextlib.suppress(CallRecorded):
        layer.forward_cuda(hidden, q_fp8, None, weights)


def differences(want: Call, got: Call) -> list[str]:
    """Where ``got`` (the self-test's call) differs from ``want`` (vLLM's)."""
    out = []
    for name in sorted(set(want.args) | set(got.args)):
        w, g = want.args.get(name), got.args.get(name)
        if w != g:
            out.append(f"{want.kernel} {name}: vLLM passes {w}, the self-test {g}")
    return out
