"""What one geometry's run found: per kernel and per case, comparisons and problems."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import bounds as bd
from .layout import GEOMETRIES
from .timeline import CASES

# The DSpark long-prefill check's cases: its own run, and the control it must catch.
DSPARK_CASE, DSPARK_CONTROL = "long-prefill indices", "unbounded-index control"


@dataclass
class Tally:
    """What one kernel (or one case) saw over the run."""

    compared: int = 0  # reads (or writes' records) compared with the dense reference
    worst: float = 0.0  # worst error of a comparison
    bound: bd.Bound | None = None  # what the comparisons may be off by (a kernel's tally)
    worst_margin: float = 0.0  # worst error / bound of a comparison
    worst_bound: float = 0.0  # the bound of that comparison (per element: of that element)
    foreign_bytes: int = 0  # bytes written outside own pages
    writes: int = 0
    problems: list[str] = field(default_factory=list)

    def note(self, error: float, bound: float) -> None:
        self.compared += 1
        if not error <= self.worst:  # NaN counts as worst
            self.worst = error
        ratio = bd.margin(error, bound)
        if not ratio <= self.worst_margin or self.compared == 1:
            self.worst_margin, self.worst_bound = ratio, bound

    def fail(self, problem: str) -> None:
        if len(self.problems) < 8:
            self.problems.append(problem)
        elif len(self.problems) == 8:
            self.problems.append("...")


@dataclass
class GeometryResult:
    geometry: str
    title: str
    role: str
    block_size: int = 0
    status: str = ""
    layout: list[str] = field(default_factory=list)
    guard_error: str | None = None
    kernels: dict[str, Tally] = field(default_factory=dict)
    cases: dict[str, Tally] = field(default_factory=dict)
    stray_bytes: int = 0
    tiling_problems: list[str] = field(default_factory=list)
    slot_mismatches: int = 0  # ratio-1 writer slots != ktable[req, pos // k] * k + pos % k
    stale_bytes_zeroed: int = 0
    reused_blocks: int = 0
    offloaded_bytes: int = 0  # bytes copied out and back by the offload-reload case
    aborted: str | None = None
    crashed_in: str | None = None  # the kernel of a device fault (or of its process's death)
    # What the timed step launches of each timed kernel: the layers, launches
    # and rows (the same in every geometry, or their times do not compare).
    timed_work: dict[str, dict[str, object]] = field(default_factory=dict)
    seconds: float = 0.0

    def kernel(self, name: str) -> Tally:
        return self.kernels.setdefault(name, Tally())

    def case(self, name: str) -> Tally:
        return self.cases.setdefault(name, Tally())

    @property
    def foreign_bytes(self) -> int:
        return sum(t.foreign_bytes for t in self.kernels.values())

    def failed_cases(self) -> list[str]:
        return [name for name, tally in self.cases.items() if tally.problems]

    @property
    def clean(self) -> bool:
        """Every read matched, every byte accounted for."""
        return (
            self.aborted is None
            and not any(t.problems for t in self.kernels.values())
            and not self.failed_cases()
            and self.stray_bytes == 0
            and not self.tiling_problems
            and self.slot_mismatches == 0
        )


def new_result(name: str) -> GeometryResult:
    """An empty result for geometry ``name``, every case listed."""
    geometry = GEOMETRIES[name]
    result = GeometryResult(geometry.name, geometry.title, geometry.role)
    for case in (DSPARK_CASE, DSPARK_CONTROL) if geometry.role == "dspark" else CASES:
        result.case(case)
    return result
