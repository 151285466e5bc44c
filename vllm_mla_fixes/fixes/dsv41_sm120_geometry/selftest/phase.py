"""What the phases of one geometry's run share: its layout, kernels, inputs,
the records kept for the readers, and where problems are charged."""

from __future__ import annotations

from typing import NamedTuple

from . import kernels as kn
from . import records
from .findings import Findings
from .inputs import Inputs
from .layout import Layout


class RunParts(NamedTuple):
    """One run's parts, built once by :class:`~.harness.Run`."""

    layout: Layout
    kernels: kn.Kernels
    inputs: Inputs
    stored: records.Stored
    findings: Findings


class Phase:
    """A phase of the run (its writes, its attention reads, its indexer
    reads), holding the run's parts under their own names."""

    def __init__(self, parts: RunParts) -> None:
        self.layout = parts.layout
        self.model = parts.layout.model
        self.kernels = parts.kernels
        self.inputs = parts.inputs
        self.stored = parts.stored
        self.findings = parts.findings
