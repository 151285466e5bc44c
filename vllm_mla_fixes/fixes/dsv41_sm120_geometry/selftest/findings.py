"""Where a run's findings go: each kernel call guarded, each comparison and
problem charged to its kernel and to the cases of its step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import bounds as bd
from . import kernels as kn
from .results import GeometryResult
from .timeline import StepPlan


class DeviceFault(Exception):
    """A kernel call failed with a CUDA error.  Such an error (an illegal
    address, a launch failure) is sticky: every later call in the process fails
    too, so the geometry stops at the kernel that raised it."""

    def __init__(self, kernel: str, step: str, error: str):
        super().__init__(f"device fault in {kernel} at step '{step}': {error}")
        self.kernel = kernel


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error (PyTorch's, or one Triton raises at launch)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(mark in text for mark in ("CUDA error", "CUDA driver error", "Triton Error [CUDA]"))


class Findings:
    """The run's :class:`.results.GeometryResult`, and how every phase adds to it."""

    def __init__(
        self,
        result: GeometryResult,
        kernels: kn.Kernels,
        device: torch.device,
        q_heads: int,
        entering: Callable[[str], None] | None = None,
    ):
        self.result = result
        self.kernels = kernels
        self.device = device
        self.q_heads = q_heads
        self.entering = entering

    def call(self, plan: StepPlan, kernel: str, where: str, run: Callable[[], object]) -> bool:
        """One kernel call; its failure is a finding on ``kernel`` (False).  On a
        GPU the call is synchronised, so that an asynchronous fault is charged to
        the kernel that caused it; a CUDA error ends the geometry (:class:`DeviceFault`)."""
        if self.entering is not None:
            self.entering(kernel)
        try:
            run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.problem(plan, kernel, f"{where}: {error}")
            if is_device_fault(exc):
                raise DeviceFault(kernel, plan.name, error) from exc
            return False
        finally:
            if self.entering is not None:
                self.entering("")
        return True

    def problem(self, plan: StepPlan, kernel: str | None, text: str) -> None:
        line = f"{plan.name}: {text}"
        if kernel is not None:
            self.result.kernel(kernel).fail(line)
        for case in plan.cases:
            self.result.case(case).fail(line)

    def note(
        self,
        plan: StepPlan,
        kernel: str,
        error: float,
        limit: float | None = None,
        bound: bd.Bound | None = None,
    ) -> None:
        """One comparison on ``kernel``: ``error`` against ``limit`` (default: the
        value of ``bound``, by default the kernel's reader bound; a per-element
        bound gives the limit of the element furthest past it)."""
        bound = bound or self.bound(kernel)
        limit = bound.value if limit is None else limit
        tally = self.result.kernel(kernel)
        tally.bound = bound
        tally.note(error, limit)
        for case in plan.cases:
            self.result.case(case).note(error, limit)
        if not error <= limit:
            self.problem(plan, kernel, f"{kernel} off by {error:.3g} (bound {limit:.3g})")

    def bound(self, kernel: str) -> bd.Bound:
        return bd.bound_for(kernel, self.kernels, self.q_heads)

    def error(self, kernel: str, got: torch.Tensor, want: torch.Tensor) -> float:
        """Relative error as the kernel's bound measures it: L2 for a real
        attention kernel (it rounds through fp8/bf16), max-abs otherwise."""
        got, want = got.float(), want.float()
        if not bool(torch.isfinite(got).all()):
            return float("inf")
        if self.bound(kernel).measure == bd.REL_L2:
            norm = float(want.norm())
            return float((got - want).norm()) / norm if norm else float((got - want).norm())
        scale = float(want.abs().max()) if want.numel() else 0.0
        diff = float((got - want).abs().max()) if want.numel() else 0.0
        return diff / scale if scale else diff
