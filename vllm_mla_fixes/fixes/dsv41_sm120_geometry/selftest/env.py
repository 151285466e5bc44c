"""Process environment for running vLLM's Triton kernels on a CPU-only host.

Two things have to hold before vLLM (and with it Triton) is imported:

* ``TRITON_INTERPRET=1``: ``@triton.jit`` then builds interpreted kernels that
  run on CPU tensors;
* ``CUDA_VISIBLE_DEVICES=""``: keeps ``vllm.triton_utils.HAS_TRITON`` true on
  a machine without a driver.

:func:`simulated_sm120_host` then makes the driverless host look like the one
the issue is about, for the duration of a harness run: vLLM's platform reports
compute capability 12.0, the indexer's metadata builder sees the SM count of
an RTX PRO 6000 Blackwell (188) instead of asking a driver, and host buffers
are not pinned (there is no driver to pin them), so ``BlockTables`` keeps its
staging buffers as plain CPU tensors.  Nothing else of vLLM is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

from vllm_mla_fixes import settings

REQUIRED_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def prepare_process_env() -> None:
    """Set the variables the harness needs, unless the caller chose otherwise
    or it is too late for them to matter (:func:`interpreter_problem` then
    says whether what was built can run here)."""
    # vllm.triton_utils decides HAS_TRITON when it is imported; Triton reads
    # TRITON_INTERPRET whenever a kernel is decorated, i.e. when vLLM's
    # DeepSeek-V4.1 op modules are imported.
    if "vllm.triton_utils" not in sys.modules:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", REQUIRED_ENV["CUDA_VISIBLE_DEVICES"])
    if "vllm.models.deepseek_v41.common.ops" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", REQUIRED_ENV["TRITON_INTERPRET"])
    if settings.environment_variable("TRITON_INTERPRET") == "1":
        skip_discarded_overflow_checks()


def skip_discarded_overflow_checks() -> bool:
    """Triton's interpreter computes an overflow check for every integer add,
    subtract and multiply (its option ``sanitize_overflow``, on by default),
    then drops it: ``device_assert`` asserts nothing unless the option
    ``debug`` is on, as a GPU build compiles no assert without debug.  The
    dropped checks are about a fifth of a CPU self-test's time; every kernel's
    results are the same without them.  With ``debug`` on they stay, and a
    Triton whose interpreter is built otherwise is left as it is.  Returns
    whether the checks are skipped."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if builder is None or not dataclasses.is_dataclass(options) or isinstance(options, type):
        return False
    if getattr(options, "debug", True):
        return False  # the checks assert: they stay
    if getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def interpreter_problem() -> str | None:
    """Why vLLM's Triton kernels cannot run on CPU in this process, or None."""
    for name, value in REQUIRED_ENV.items():
        if settings.environment_variable(name) != value:
            return f"{name} must be {value!r} before vLLM is imported (it is {settings.environment_variable(name)!r})"
    from vllm.models.deepseek_v41.common.ops import fused_compress_quant_cache as m
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return "vllm.triton_utils.HAS_TRITON is False"
    kernel = m._rope_quant_insert_kernel
    if type(kernel).__name__ != "InterpretedFunction":
        return (
            "vLLM's Triton kernels were built for a GPU "
            f"({type(kernel).__name__}); TRITON_INTERPRET was set too late"
        )
    return None


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """PyTorch on one thread meanwhile.  The harness's CPU tensors are small
    (one attention row: 8 x 512 against a few hundred rows): a second intra-op
    thread saves nothing and, on a loaded machine, makes each op wait for a
    thread that is not running (measured on 2 busy cores: 0.45 ms against
    3.96 ms per attention row).  The geometries run in parallel processes instead."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def drafter_pages_at_128() -> Iterator[None]:
    """A DSpark drafter's sliding-window pages kept at 128 rows meanwhile
    (``VLLM_MLA_FIXES_DSV41_DRAFTER_SWA_ROWS=128``, which skips the fix's
    planning).  The self-test checks the layout an engine with several
    drafter layers gets; its one-layer tiny drafter would plan 64, the page
    size every other cache it checks already has.  Where the operator set the
    variable, their value stands."""
    from vllm_mla_fixes import settings
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.settings import DSV41_DRAFTER_SWA_ROWS

    name = DSV41_DRAFTER_SWA_ROWS.name
    saved = settings.environment_variable(name)
    if settings.value(DSV41_DRAFTER_SWA_ROWS) is not None:
        yield  # the operator chose the rows: the self-test checks what they serve
        return
    os.environ[name] = "128"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def simulated_sm120_host(
    capability: tuple[int, int] = (12, 0), sm_count: int = 188
) -> Iterator[object]:  # yields vLLM's current platform
    """vLLM's platform reports ``capability`` and no pinned memory meanwhile."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils import platform_utils
    from vllm.v1.attention.backends.mla import indexer

    platform_cls = type(current_platform)
    cap = DeviceCapability(*capability)
    replaced = {
        "get_device_capability": classmethod(lambda cls, device_id=0: cap),
        "is_pin_memory_available": classmethod(lambda cls: False),
        "device_type": "cpu",
    }
    saved = {name: platform_cls.__dict__.get(name, _MISSING) for name in replaced}
    for name, value in replaced.items():
        setattr(platform_cls, name, value)
    saved_sm_count = indexer.num_compute_units
    indexer.num_compute_units = lambda device_id=0: sm_count
    # 0.33 also caches the pinned-memory answer in a module constant.
    from vllm.utils import torch_utils

    saved_pin = torch_utils.__dict__.get("PIN_MEMORY", _MISSING)
    if saved_pin is not _MISSING:
        torch_utils.PIN_MEMORY = False
    platform_utils.is_pin_memory_available.cache_clear()
    platform_utils.is_uva_available.cache_clear()
    try:
        yield current_platform
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(platform_cls, name)
            else:
                setattr(platform_cls, name, value)
        indexer.num_compute_units = saved_sm_count
        if saved_pin is not _MISSING:
            torch_utils.PIN_MEMORY = saved_pin
        platform_utils.is_pin_memory_available.cache_clear()
        platform_utils.is_uva_available.cache_clear()


_MISSING = object()
