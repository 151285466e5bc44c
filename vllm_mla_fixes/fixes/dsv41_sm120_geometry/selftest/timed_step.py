"""The decode step whose reading kernels are timed on a GPU, and its launches kept.

The timed step is a CUDA-graph padded decode of two requests, the same batch
in every geometry; :mod:`.pairing` makes its launches again, alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

from . import kernels as kn
from .timeline import TIMELINE, StepPlan

TIMED_STEP = next(plan.name for plan in TIMELINE if "graph-padded" in plan.cases)
TIMED_KERNELS = (kn.ATTENTION_DECODE, kn.INDEXER_LOGITS)


class TimedLaunch(NamedTuple):
    """One launch of a timed kernel in the timed step."""

    layer: int
    rows: int  # query rows the launch reads for
    launch: kn.Launch


def timed_work(launches: dict[str, list[TimedLaunch]]) -> dict[str, dict[str, object]]:
    return {
        kernel: {
            "layers": sorted({t.layer for t in timed}),
            "launches": len(timed),
            "rows": sum(t.rows for t in timed),
        }
        for kernel, timed in launches.items()
    }


class TimedStep:
    """The timed step's launches of each timed kernel, kept from that step on."""

    def __init__(self, kernels: kn.Kernels, backbone_layers: int, step: str = TIMED_STEP):
        self.kernels = kernels
        self.backbone_layers = backbone_layers
        self.step = step
        self.running = False
        self.launches: dict[str, list[TimedLaunch]] = {k: [] for k in TIMED_KERNELS}

    @contextlib.contextmanager
    def during(self, plan: StepPlan) -> Iterator[None]:
        """The reads of ``plan``, their launches kept if it is the timed step."""
        self.running = plan.name == self.step
        try:
            yield
        finally:
            self.running = False

    def kept(
        self, kernel: str, layer: int, rows: int, call: Callable[[], object]
    ) -> Callable[[], object]:
        """``call``, its launches kept where it is the timed step's launch of a
        timed kernel on a backbone layer: every geometry has those (upstream's
        layout has no drafter layer), so each times the same work."""
        if not self.running or kernel not in self.launches or layer >= self.backbone_layers:
            return call

        def recorded() -> None:
            launches: list[kn.Launch] = []
            with self.kernels.recording(launches):
                call()
            self.launches[kernel] += [TimedLaunch(layer, rows, x) for x in launches]

        return recorded
