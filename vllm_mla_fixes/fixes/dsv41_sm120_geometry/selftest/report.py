"""Verdicts, the table ``selftest`` prints, its JSON document and its exit status."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import bounds as bd
from . import clock
from . import kernels as kn
from .layout import GEOMETRIES, TinyModel
from .pairing import BASELINES, WHAT_IS_TIMED, DecodeTiming
from .results import DSPARK_CASE, DSPARK_CONTROL, GeometryResult
from .timed_step import TIMED_KERNELS, TIMED_STEP
from .timeline import CASES
from .timing import StepCost
from .verdicts import (
    BUG,
    CAUGHT,
    EXIT_CANNOT_RUN,
    EXIT_MISMATCH,
    EXIT_OK,
    FAIL,
    MISSED,
    NO_BUG,
    PASS,
)


@dataclass
class Row:
    geometry: str
    kernel: str
    source: str
    compared: int  # reads compared (readers) or calls (writers)
    max_error: float | None  # readers; writers whose records were compared
    foreign_bytes: int | None  # writers only
    verdict: str
    problems: list[str] = field(default_factory=list)
    # what the row's error is held to: readers their reads', writers their
    # stored records' against the dense reference (and foreign bytes: none);
    # margin = error / bound, the worst of the row's comparisons
    bound: bd.Bound = bd.WRITER_BOUND
    margin: float = 0.0
    bound_value: float = 0.0  # the bound of the worst comparison (per element: its element's)

    @property
    def error(self) -> float:
        return self.max_error if self.max_error is not None else float(self.foreign_bytes or 0)


def geometry_verdict(result: GeometryResult) -> str:
    if result.role == "fix":
        exercised = all(result.cases[c].compared for c in CASES)
        return PASS if result.clean and exercised else FAIL
    if result.role == "control":
        return CAUGHT if set(result.failed_cases()) == set(CASES) else MISSED
    if result.role == "dspark":  # no PASS without its own control caught
        ran = all(result.cases[c].compared for c in (DSPARK_CASE, DSPARK_CONTROL))
        return PASS if result.clean and ran else FAIL
    return NO_BUG if result.clean else BUG


def rows_of(result: GeometryResult, kernels: kn.Kernels) -> list[Row]:
    rows = []
    for kernel in (*kn.READERS, *kn.INDEX_READERS, *kn.WRITERS):
        tally = result.kernels.get(kernel)
        if tally is None:
            continue
        reader = kernel not in kn.WRITERS
        bad = bool(tally.problems)
        if reader:
            bound = tally.bound or bd.bound_for(kernel, kernels, TinyModel.q_heads)
            margin = tally.worst_margin
        else:
            bound = tally.bound or bd.WRITER_BOUND
            margin = max(tally.worst_margin, bd.margin(tally.foreign_bytes, 0.0))
        bound_value = tally.worst_bound if bound.per_element and tally.compared else bound.value
        if result.role in ("fix", "dspark"):
            verdict = FAIL if bad or (reader and not tally.compared) else PASS
        elif result.role == "control":
            verdict = CAUGHT if bad else "-"
        else:
            verdict = BUG if bad else NO_BUG
        rows.append(
            Row(
                result.geometry,
                kernel,
                kernels.sources[kernel],
                tally.compared if reader else tally.writes,
                tally.worst if reader or tally.compared else None,
                None if reader else tally.foreign_bytes,
                verdict,
                list(tally.problems),
                bound,
                margin,
                bound_value,
            )
        )
    return rows


@dataclass
class Report:
    vllm: str
    device: kn.Device
    kernels: kn.Kernels
    results: list[GeometryResult]
    timing: list[StepCost] = field(default_factory=list)
    cannot_run: str | None = None
    notes: list[str] = field(default_factory=list)
    isolated: bool = False  # each geometry ran in a process of its own
    kernel_timing: DecodeTiming = field(
        default_factory=lambda: DecodeTiming.not_timed(clock.NOT_TIMED_CPU)
    )

    def working_layouts(self) -> list[GeometryResult]:
        """The layouts that read back as written here: the fix's that pass, and
        upstream's where it ran without a failure."""
        return [
            r for r in self.results if r.role != "dspark" and geometry_verdict(r) in (PASS, NO_BUG)
        ]

    def findings(self) -> list[str]:
        """What the run found beyond the exit status: each crash, and upstream's
        own layout on this device (information, not a failure: the exit status
        is about the fix's layouts and the control)."""
        lines = []
        for r in self.results:
            if r.aborted is not None and r.crashed_in is not None:
                scope = (
                    "it ran in a process of its own, so no other geometry's verdict depends on it"
                    if self.isolated
                    else "the geometries after it ran in the same process"
                )
                lines.append(f"geometry {r.geometry} crashed in {r.crashed_in}; {scope}")
        gpu = self.device.kind != "cpu"
        where = "this GPU" if gpu else "the CPU's simulated SM120"
        for r in self.results:
            if r.role != "upstream":
                continue
            if geometry_verdict(r) == NO_BUG:
                lines.append(
                    f"upstream's own layout{_block_size(r)} is exact on {where}"
                    + (": it needs no fix here" if gpu else "")
                )
            else:
                lines.append(
                    f"upstream's own layout{_block_size(r)} fails on {where}: "
                    "serve with the fix's layout"
                )
        return lines

    @property
    def exit_status(self) -> int:
        if self.cannot_run is not None:
            return EXIT_CANNOT_RUN
        verdicts = [geometry_verdict(r) for r in self.results]
        return EXIT_MISMATCH if FAIL in verdicts or MISSED in verdicts else EXIT_OK

    def as_json(self) -> dict[str, object]:
        return {
            "vllm": self.vllm,
            "device": {
                "kind": self.device.kind,
                "name": self.device.name,
                "capability": list(self.device.capability) if self.device.capability else None,
            },
            "exit_status": self.exit_status,
            "cannot_run": self.cannot_run,
            "notes": self.notes,
            "isolated": self.isolated,
            "findings": self.findings(),
            "verdict": self.verdict_line(),
            "not_run": self.not_run(),
            "working_layouts": [r.geometry for r in self.working_layouts()],
            "kernels": dict(self.kernels.sources),
            "geometries": [
                {
                    "name": r.geometry,
                    "title": r.title,
                    "role": r.role,
                    "verdict": geometry_verdict(r),
                    "block_size": r.block_size,
                    "status": r.status,
                    "aborted": r.aborted,
                    "crashed_in": r.crashed_in,
                    "seconds": round(r.seconds, 1),
                    "stray_bytes": r.stray_bytes,
                    "foreign_bytes": r.foreign_bytes,
                    "tiling_problems": r.tiling_problems,
                    "ratio1_slot_mismatches": r.slot_mismatches,
                    "stale_bytes_zeroed": r.stale_bytes_zeroed,
                    "reused_blocks": r.reused_blocks,
                    "offloaded_bytes": r.offloaded_bytes,
                    "timed_work": r.timed_work,
                    "layout": r.layout,
                    "cases": {
                        name: {
                            "compared": t.compared,
                            "worst_error": _num(t.worst),
                            "worst_margin": _num(t.worst_margin),
                            "foreign_bytes": t.foreign_bytes,
                            "failed": bool(t.problems),
                            "problems": t.problems,
                        }
                        for name, t in r.cases.items()
                    },
                    "rows": [
                        {
                            "kernel": row.kernel,
                            "source": row.source,
                            "compared": row.compared,
                            "max_error": _num(row.max_error),
                            "foreign_bytes": row.foreign_bytes,
                            "error": _num(row.error),
                            "bound": row.bound_value,
                            "margin": _num(row.margin),
                            "measure": row.bound.measure,
                            "bound_derivation": row.bound.formula,
                            "verdict": row.verdict,
                            "problems": row.problems,
                        }
                        for row in rows_of(r, self.kernels)
                    ],
                }
                for r in self.results
            ],
            "decode_step_timing": self.kernel_timing_json(),
            "slot_translation_us": [
                {
                    "tokens": c.tokens,
                    "kernel_slots_one_group": round(c.kernel_slots_us, 2),
                    "per_step_both_ratio1_groups": round(c.per_step_us, 2),
                    "vllm_map_to_kernel_block_table_one_group": round(
                        c.map_to_kernel_block_table_us, 2
                    ),
                }
                for c in self.timing
            ],
        }

    def text(self) -> str:
        lines = [
            f"vllm-mla-fixes selftest: DeepSeek-V4.1 KV page geometry on {self.device.label}, "
            f"vLLM {self.vllm}"
        ]
        if self.cannot_run is not None:
            return "\n".join([*lines, f"cannot run: {self.cannot_run}"])
        lines += self.table_lines()
        lines.append("")
        for result in self.results:
            verdict = geometry_verdict(result)
            failed = result.failed_cases()
            size = (
                f"--block-size {result.block_size}" if result.block_size else "block size unknown"
            )
            lines.append(
                f"[{result.geometry}] {result.title}: {verdict} ({size}, {result.seconds:.0f} s)"
            )
            if result.status:
                lines.append(f"    fix: {result.status}")
            if result.aborted:
                lines.append(f"    aborted: {result.aborted}")
            lines.append(
                f"    cases failed: {', '.join(failed) if failed else 'none'} "
                f"(of {len(result.cases)}: {', '.join(result.cases)})"
            )
            if result.role == "dspark":
                from .dspark import verdict_line

                lines += [f"    {line}" for line in result.layout[1:2]]
                lines.append(f"    {verdict_line(result, self.kernels)}")
                if verdict == FAIL:
                    for case in result.cases.values():
                        lines += [f"    {problem}" for problem in case.problems[:4]]
                continue
            lines.append(
                f"    stray bytes {result.stray_bytes}, foreign bytes "
                f"{result.foreign_bytes}, page tiling problems "
                f"{len(result.tiling_problems)}, ratio-1 writer slots off the kernel "
                f"table {result.slot_mismatches}, stale bytes zeroed "
                f"{result.stale_bytes_zeroed}, freed blocks reused {result.reused_blocks}, "
                f"bytes offloaded and reloaded {result.offloaded_bytes}"
            )
            if verdict in (FAIL, BUG, MISSED):
                for kernel, tally in result.kernels.items():
                    for problem in tally.problems[:2]:
                        lines.append(f"    {kernel}: {problem}")
        if self.timing:
            lines.append("")
            lines.append(
                "ratio-1 slot translation per step on this device (us): "
                "kernel_slots, both groups | vLLM's map_to_kernel_block_table, one group"
            )
            for cost in self.timing:
                what = "decode step" if cost.tokens <= 64 else "prefill chunk"
                lines.append(
                    f"    {what}, {cost.tokens} tokens: {cost.per_step_us:.1f} | "
                    f"{cost.map_to_kernel_block_table_us:.1f}"
                )
        lines += self.bound_lines()
        lines += self.timing_lines()
        checked: tuple[str, ...] = (*kn.READERS, *kn.WRITERS)
        if any(r.role == "dspark" for r in self.results):
            checked += tuple(k for k in kn.INDEX_READERS if k in self.kernels.sources)
        stand_ins = [k for k in checked if not self.kernels.is_real(k)]
        lines.append("")
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"finding: {finding}" for finding in self.findings()]
        if stand_ins:
            lines.append(
                "stand-ins on this device (their rows prove the layout against a "
                "PyTorch model of the kernel, not the kernel): " + "; ".join(stand_ins)
            )
        lines.append(self.verdict_line())
        working = [f"{r.geometry} ({r.title})" for r in self.working_layouts()]
        if not any(r.role != "dspark" for r in self.results):
            working = ["not checked (no layout geometry ran)"]
        lines.append(f"layouts that work on {self.device.label}: {'; '.join(working) or 'none'}")
        return "\n".join(lines)

    def not_run(self) -> list[str]:
        """The geometries this run has no result of, in the order they would run."""
        ran = {r.geometry for r in self.results}
        return [name for name in GEOMETRIES if name not in ran]

    def verdict_line(self) -> str:
        """The verdict, claiming only what the recorded results show, and
        naming the geometries it rests on and those that did not run."""
        verdicts = {r.geometry: geometry_verdict(r) for r in self.results}
        roles = {r.geometry: r.role for r in self.results}
        if self.exit_status == EXIT_MISMATCH:
            wrong = [f"{name} {v}" for name, v in verdicts.items() if v in (FAIL, MISSED)]
            line = (
                f"verdict: FAIL ({', '.join(wrong)}) - do not serve DeepSeek-V4.1 with this "
                "stack; attach this output (or --json) to a bug report"
            )
        else:
            fix = [name for name, role in roles.items() if role == "fix"]
            control = [name for name, role in roles.items() if role == "control"]
            claims = []
            if fix:
                claims.append(
                    f"the fix's {' and '.join(fix)} read back as written in every serving case"
                )
            if control:
                claims.append(f"the {' and '.join(control)} was caught in every case")
            if "dspark" in roles.values():
                claims.append(self.dspark_claim())
            line = (
                "verdict: PASS - " + "; ".join(claims)
                if claims
                else "verdict: NOT RUN - none of the geometries a verdict rests on ran"
            )
        missing = self.not_run()
        return line + (f"; not run: {', '.join(missing)}" if missing else "")

    def dspark_claim(self) -> str:
        """What a passing dspark-long-prefill run shows, and on which indexer."""
        from .dspark import GEOMETRY

        where = (
            "on this device's real indexer kernels"
            if all(
                self.kernels.sources.get(k, "").startswith("real")
                for k in (kn.INDEXER_LOGITS, kn.INDEXER_TOPK)
            )
            else "on a stand-in indexer (no claim about the real kernels' indices)"
        )
        return (
            f"{GEOMETRY}: every top-k index and gather load of a 12,288-token DSpark "
            f"prefill stayed in bounds {where}, and it caught the unbounded index it plants"
        )

    def table_lines(self) -> list[str]:
        """One row per geometry and kernel, columns aligned."""
        table = [
            (
                "geometry",
                "kernel",
                "source",
                "n",
                "max error",
                "foreign B",
                "bound",
                "error/bound",
                "verdict",
            )
        ]
        for result in self.results:
            for row in rows_of(result, self.kernels):
                table.append(
                    (
                        row.geometry,
                        row.kernel,
                        row.source,
                        str(row.compared),
                        "-" if row.max_error is None else f"{row.max_error:.2e}",
                        "-" if row.foreign_bytes is None else str(row.foreign_bytes),
                        f"{row.bound_value:.3g}",
                        f"{row.margin:.2f}",
                        row.verdict,
                    )
                )
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = []
        for i, cells in enumerate(table):
            lines.append("  ".join(cell.ljust(widths[k]) for k, cell in enumerate(cells)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return lines

    def kernel_timing_json(self) -> dict[str, object]:
        """The timed step's reading kernels: microseconds of the fix's default
        layout and of the baseline, and the ratio with its quartiles."""
        timing = self.kernel_timing
        return {
            "timed": bool(timing.kernels),
            "note": timing.note,
            "what": WHAT_IS_TIMED,
            "step": TIMED_STEP,
            "baseline": timing.baseline,
            "baseline_is": BASELINES.get(timing.baseline or ""),
            "warmup_rounds": clock.WARMUP,
            "median_of": clock.REPEATS,
            "work": timing.work,
            "kernels": {
                kernel: {
                    "fix_us": round(t.fix_us, 2),
                    "baseline_us": round(t.baseline_us, 2),
                    "ratio_fix_over_baseline": round(t.ratio, 3),
                    "ratio_quartiles": [round(q, 3) for q in t.ratio_quartiles],
                }
                for kernel, t in timing.kernels.items()
            },
        }

    def timing_lines(self) -> list[str]:
        timing = self.kernel_timing
        head = f"reading kernels of the decode step '{TIMED_STEP}' (us)"
        if not timing.kernels:
            return ["", f"{head}: {timing.note or 'not timed'}"]
        lines = [
            "",
            f"{head}, alone, the fix's layout against {BASELINES[timing.baseline or '']} "
            f"(median of {clock.REPEATS} interleaved rounds after {clock.WARMUP} warm-up rounds):",
        ]
        for kernel in TIMED_KERNELS:
            t = timing.kernels.get(kernel)
            if t is None:
                lines.append(f"    {kernel}: not timed (stand-in)")
                continue
            low, high = t.ratio_quartiles
            lines.append(
                f"    {kernel}: fix {t.fix_us:.1f} | baseline {t.baseline_us:.1f} | "
                f"fix/baseline {t.ratio:.3f} (quartiles {low:.3f}-{high:.3f})"
            )
        if timing.note:
            lines.append(f"    note: {timing.note}")
        return lines

    def bound_lines(self) -> list[str]:
        """Each bound used in the table, with its derivation, once."""
        seen: dict[str, bd.Bound] = {}
        for result in self.results:
            for row in rows_of(result, self.kernels):
                seen.setdefault(row.kernel, row.bound)
        lines = ["", "bounds (error/bound <= 1 passes; a wrong page reads 0.7 to 1e11):"]
        for kernel, bound in seen.items():
            value = "per element" if bound.per_element else f"{bound.value:.3g}"
            lines.append(f"    {kernel}: {value}, of {bound.measure}; {bound.formula}")
        return lines


def _block_size(result: GeometryResult) -> str:
    """`` (--block-size N)``, or nothing where the run died before it laid out its caches."""
    return f" (--block-size {result.block_size})" if result.block_size else ""


def _num(value: float | None) -> float | str | None:
    if value is None:
        return None
    return value if math.isfinite(value) else str(value)
