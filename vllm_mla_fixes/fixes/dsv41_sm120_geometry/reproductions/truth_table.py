"""DeepSeek-V4.1 on SM12x: the truth table of the installed vLLM, derived by its own code.

One cell per ``--block-size`` (64, 128, not given), speculative method (none,
DSpark, ngram) and device (SM120, SM121).  Each cell runs, on CPU with the
platform answering as that device (:func:`simulated.sm120_platform`):

* upstream's start-up (vLLM's layers, planner, kernel block sizes, metadata
  builders, allocation and binding), giving vLLM's own error where it stops;
* every page a kernel reads in upstream's bound layout, held against the
  installed kernels' own envelopes (:mod:`...dsv41_sm120_geometry.envelope`):
  each page a kernel would reject, and which kernel;
* KV tokens per GiB (vLLM's ``get_kv_cache_capacity``) of upstream's layout
  and of the fix's, at 8k and 128k tokens;
* the fix's own decision for the line (applied as on that device), and its
  capacity against the best upstream layout that works for the same model.

``python -m vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions.truth_table [--json|--markdown]``
prints it; ``status --json`` and ``doctor`` read it; the README's table is its
markdown, checked by ``tests/dsv41_sm120_geometry/test_dsv41_truth_table.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope, simulated, upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import capacity
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

BLOCK_SIZES: tuple[int | None, ...] = (64, 128, None)
SPECULATION: dict[str, dict[str, Any] | None] = {
    "none": None,
    "dspark": capacity.DSPARK_OPTIONS,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
}
DSPARK_DRAFTER_LAYERS = 3  # vLLM's default n_mtp_layers
CAPABILITIES = ((12, 0), (12, 1))
MAX_MODEL_LENS = capacity.MAX_MODEL_LENS
GAIN_TO_APPLY = fix.GAIN_TO_APPLY

_KIND = {"swa": upstream.SWA, "compressed": upstream.COMPRESSED, "indexer": upstream.INDEXER}


@dataclasses.dataclass(frozen=True)
class Cell:
    vllm: str
    device: str
    block_size: int | None  # as the line gives it (None: not given)
    picked_block_size: int  # what vLLM planned with
    speculation: str
    upstream_starts: bool
    start_error: str | None
    upstream_rejected: tuple[upstream.Rejection, ...]
    unknown_envelopes: tuple[str, ...]
    upstream_tokens: dict[int, int] | None  # max_model_len -> tokens per GiB; None: no start
    decision: str
    reason: str
    fix_tokens: dict[int, int]
    vs_best_working_upstream: dict[int, float] | None = None

    @property
    def upstream_works(self) -> bool | None:
        if not self.upstream_starts or self.upstream_rejected:
            return False
        return None if self.unknown_envelopes else True

    def as_dict(self) -> dict[str, object]:
        return {
            "vllm": self.vllm,
            "device": self.device,
            "block_size": self.block_size,
            "picked_block_size": self.picked_block_size,
            "speculation": self.speculation,
            "upstream_starts": self.upstream_starts,
            "start_error": self.start_error,
            "upstream_works": self.upstream_works,
            "upstream_rejected": [r.as_dict() for r in self.upstream_rejected],
            "unknown_envelopes": list(self.unknown_envelopes),
            "upstream_tokens_per_gib": _str_keys(self.upstream_tokens),
            "decision": self.decision,
            "reason": self.reason,
            "fix_tokens_per_gib": _str_keys(self.fix_tokens),
            "vs_best_working_upstream": _str_keys(self.vs_best_working_upstream),
        }


def _str_keys(values: Mapping[int, object] | None) -> dict[str, object] | None:
    return None if values is None else {str(k): v for k, v in values.items()}


def _settings(speculation: str) -> simulated.EngineSettings:
    options = SPECULATION[speculation]
    if options is None:
        return simulated.EngineSettings()
    attached = {"speculative_config": simulated.speculative_config_as_written(options)}
    drafters = (0,) * DSPARK_DRAFTER_LAYERS if speculation == "dspark" else ()
    return simulated.EngineSettings(attached=attached, drafter_ratios=drafters)


def vllm_picked_block_size(settings: simulated.EngineSettings) -> int:
    """The block size vLLM's platform picks for this model when the line
    gives none: its own ``_preferred_block_size_for_backends`` over the
    backends of the built layers, as its config update runs it."""
    from vllm.config import CacheConfig
    from vllm.platforms import current_platform

    config = simulated.make_vllm_config(CacheConfig.DEFAULT_BLOCK_SIZE, None, settings)
    repro.build_layers(config, simulated.DSV41_FLASH, settings.drafter_ratios)
    platform = type(current_platform)
    backends = platform._find_non_ssm_backends(config)
    return int(
        platform._preferred_block_size_for_backends(
            backends, CacheConfig.DEFAULT_BLOCK_SIZE, config
        )
    )


def _upstream_start(
    block_size: int, settings: simulated.EngineSettings
) -> tuple[list[repro.Page] | None, str | None]:
    """Upstream's bound pages for the line, or vLLM's start-up error."""
    geometry = repro.plan_geometry(block_size, settings=settings)
    try:
        repro.select_kernel_block_sizes(geometry)
        repro.create_metadata_builders(geometry)
        repro.allocate_and_bind(geometry)
    except ValueError as exc:
        return None, str(exc)
    return repro.flashinfer_pages(geometry), None


def page_verdicts(
    pages: list[repro.Page],
) -> tuple[tuple[upstream.Rejection, ...], tuple[str, ...]]:
    """(pages a kernel rejects, envelopes that could not be read) of a bound layout."""
    kinds = {(_KIND[p.kind], p.compress_ratio, p.rows) for p in pages}
    return upstream.page_verdicts(sorted(kinds))


def _tokens(rows: list[capacity.Row]) -> dict[int, int]:
    return {row.max_model_len: row.tokens for row in rows}


def cell(capability: tuple[int, int], block_size: int | None, speculation: str) -> Cell:
    """One cell of the table for the installed release."""
    return evaluate(capability, block_size, _settings(speculation), speculation)


def evaluate(
    capability: tuple[int, int],
    block_size: int | None,
    settings: simulated.EngineSettings,
    speculation: str,
    max_model_lens: tuple[int, ...] = MAX_MODEL_LENS,
) -> Cell:
    """Upstream's start, pages and capacity, and the fix's decision and
    capacity, for one engine configuration on one device."""
    with simulated.sm120_platform(capability):
        picked = vllm_picked_block_size(settings) if block_size is None else block_size
        pages, error = _upstream_start(picked, settings)
        rejected, unknown = page_verdicts(pages) if pages is not None else ((), ())
        upstream_tokens = None
        if pages is not None:
            upstream_tokens = _tokens(
                capacity.measure("upstream", picked, max_model_lens, settings, fixed=False)
            )
        rows = capacity.measure("fixed", picked, max_model_lens, settings, fixed=True)
    return Cell(
        vllm=repro._installed_vllm(),
        device=f"SM{capability[0]}{capability[1]}",
        block_size=block_size,
        picked_block_size=picked,
        speculation=speculation,
        upstream_starts=pages is not None,
        start_error=error,
        upstream_rejected=rejected,
        unknown_envelopes=unknown,
        upstream_tokens=upstream_tokens,
        decision=rows[0].geometry,
        reason=rows[0].reason,
        fix_tokens=_tokens(rows),
    )


def with_best_working_upstream(cells: list[Cell]) -> list[Cell]:
    """Each cell with the fix's capacity over the best upstream layout that
    works for the same device and speculation (None where none works)."""
    out = []
    for c in cells:
        working = [
            o.upstream_tokens
            for o in cells
            if o.device == c.device
            and o.speculation == c.speculation
            and o.upstream_works
            and o.upstream_tokens
        ]
        ratios = None
        if working:
            ratios = {
                n: round(c.fix_tokens[n] / max(w[n] for w in working), 4) for n in MAX_MODEL_LENS
            }
        out.append(dataclasses.replace(c, vs_best_working_upstream=ratios))
    return out


def best_working_upstream(
    capability: tuple[int, int],
    settings: simulated.EngineSettings,
    max_model_lens: tuple[int, ...],
) -> tuple[int, dict[int, int]] | None:
    """(block size, tokens per GiB) of the best upstream layout that works for
    these settings (over the block sizes of the table), or None where none works."""
    best: tuple[int, dict[int, int]] | None = None
    with simulated.sm120_platform(capability):
        for block_size in (64, 128):
            pages, _ = _upstream_start(block_size, settings)
            if pages is None:
                continue
            rejected, unknown = page_verdicts(pages)
            if rejected or unknown:
                continue
            tokens = _tokens(
                capacity.measure("upstream", block_size, max_model_lens, settings, fixed=False)
            )
            if best is None or tokens[max_model_lens[0]] > best[1][max_model_lens[0]]:
                best = (block_size, tokens)
    return best


def truth_table(capabilities: tuple[tuple[int, int], ...] = CAPABILITIES) -> list[Cell]:
    cells = [
        cell(capability, block_size, speculation)
        for capability in capabilities
        for speculation in SPECULATION
        for block_size in BLOCK_SIZES
    ]
    return with_best_working_upstream(cells)


def markdown(cells: list[Cell]) -> str:
    """The README's table for these cells."""
    lines = [
        "| vLLM | device | --block-size | speculation | upstream starts | pages a kernel rejects "
        "| upstream tokens/GiB (8k / 128k) | fix decision | fix tokens/GiB (8k / 128k) "
        "| vs best working upstream |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        size = str(c.block_size) if c.block_size is not None else f"unset ({c.picked_block_size})"
        starts = "yes" if c.upstream_starts else f"no: {c.start_error}"
        rejected = (
            "; ".join(f"{r.cache} {r.rows} rows: {r.kernel}" for r in c.upstream_rejected)
            if c.upstream_starts
            else "-"
        ) or "none"
        if c.unknown_envelopes:
            rejected += " (unknown: " + "; ".join(c.unknown_envelopes) + ")"
        up = (
            " / ".join(f"{c.upstream_tokens[n]:,}" for n in MAX_MODEL_LENS)
            if c.upstream_tokens
            else "-"
        )
        ours = " / ".join(f"{c.fix_tokens[n]:,}" for n in MAX_MODEL_LENS)
        versus = (
            " / ".join(f"{c.vs_best_working_upstream[n]:.3f}x" for n in MAX_MODEL_LENS)
            if c.vs_best_working_upstream
            else "n/a"
        )
        lines.append(
            f"| {c.vllm} | {c.device} | {size} | {c.speculation} | {starts} | {rejected} | {up} "
            f"| {c.decision} | {ours} | {versus} |"
        )
    return "\n".join(lines) + "\n"


def summary_markdown(cells: list[Cell]) -> str:
    """The README's short table: SM120, no speculation, one row per block size."""
    lines = [
        "| vLLM | --block-size | upstream's layout on SM120 | the fix | vs best working upstream (8k / 128k) |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        if c.device != "SM120" or c.speculation != "none":
            continue
        size = (
            str(c.block_size)
            if c.block_size is not None
            else f"unset (vLLM picks {c.picked_block_size})"
        )
        if not c.upstream_starts:
            verdict = f"does not start: {c.start_error}"
        elif c.upstream_rejected:
            verdict = "starts; rejected: " + "; ".join(
                f"{r.cache} pages of {r.rows} rows by {r.kernel}" for r in c.upstream_rejected
            )
        elif c.unknown_envelopes:
            verdict = "starts; kernels' envelopes unknown"
        else:
            verdict = "works: every page inside the kernels' own envelopes"
        decision = "steps aside" if c.decision == fix.UPSTREAM else c.decision
        versus = (
            " / ".join(f"{c.vs_best_working_upstream[n]:.3f}x" for n in MAX_MODEL_LENS)
            if c.vs_best_working_upstream
            else "n/a"
        )
        lines.append(f"| {c.vllm} | {size} | {verdict} | {decision} | {versus} |")
    return "\n".join(lines) + "\n"


COMMAND = "vllm-mla-fixes status --json --truth-table"
DERIVE_TIMEOUT_S = 3600.0  # a few minutes on a CPU; far past that it is stuck


NOT_COVERED = "not a release the DeepSeek-V4.1 fix covers"


def _cache_file() -> Path | str:
    """Where the installed build's table is kept, keyed by what deriving it
    reads: the bytes of every kernel declaration file the envelopes were read
    from, of vLLM's sources the fix reviews, and of this package's
    DeepSeek-V4.1 code, with vLLM's and FlashInfer's versions; else why there
    is none (outside the covered releases, no cache folder)."""
    from importlib.metadata import PackageNotFoundError, version

    from vllm_mla_fixes import screen_cache
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import gate

    try:
        installed = version("vllm")
        flashinfer = version("flashinfer-python")
    except PackageNotFoundError:
        return NOT_COVERED
    if installed not in fix.INFO.covered_releases:
        return NOT_COVERED
    fix_folder = Path(__file__).resolve().parents[1]  # its reproductions and self-test too
    sources = sorted(fix_folder.rglob("*.py"))
    digest = hashlib.sha256()
    try:
        for path in sources:
            digest.update(path.read_bytes())
        digest.update(envelope.content_key().encode())
        digest.update(screen_cache.screen_key(gate.REVIEWED, gate.source_screen).encode())
        folder = screen_cache.cache_dir()
    except (OSError, ValueError) as exc:
        return f"no cache to keep it in: {exc}"
    key = f"{installed}-{flashinfer}-{digest.hexdigest()[:24]}"
    return folder / "truth-tables" / f"{key}.json"


def _cached_cells(cache: Path) -> Any:
    """The cells kept at ``cache``, or None where there are none to read."""
    try:
        cells = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logging.getLogger("vllm.mla_fixes").debug("truth-table cache %s not read: %s", cache, exc)
        return None
    return cells if isinstance(cells, list) else None


def for_status(compute: bool) -> dict[str, object]:
    """``status --json``'s ``dsv41_truth_table``: the installed build's cells,
    from the cache or (``compute``) derived now in a fresh interpreter and
    kept; else where they would come from."""
    cache = _cache_file()
    if isinstance(cache, str):
        return {"cells": None, "source": cache}
    cells = _cached_cells(cache)
    if cells is not None:
        return {"cells": cells, "source": str(cache)}
    if not compute:
        return {
            "cells": None,
            "source": f"not derived yet for this install: run `{COMMAND}` (a few minutes on CPU, "
            "once per installed vLLM)",
        }
    import subprocess

    from vllm_mla_fixes import children

    try:
        done = children.run(
            [sys.executable, "-m", __name__, "--watch-parent", str(os.getpid())],
            timeout=DERIVE_TIMEOUT_S,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
    except subprocess.TimeoutExpired:
        return {"cells": None, "source": f"could not derive it within {DERIVE_TIMEOUT_S:g} s"}
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        return {
            "cells": None,
            "source": f"could not derive it: {' '.join(tail) or done.returncode}",
        }
    from vllm_mla_fixes.atomic import write_atomic

    printed = done.stdout.strip().splitlines()[-1]
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, printed)
    except OSError as exc:  # the table stands without its cache
        logging.getLogger("vllm.mla_fixes").debug(
            "truth-table cache %s not written: %s", cache, exc
        )
        return {"cells": json.loads(printed), "source": "derived now (not kept: the cache failed)"}
    return {"cells": json.loads(printed), "source": str(cache)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the docs' full table")
    parser.add_argument("--summary", action="store_true", help="print the README's short table")
    parser.add_argument(
        "--device", choices=("sm120", "sm121", "both"), default="both", help="devices to cover"
    )
    parser.add_argument("--watch-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.watch_parent is not None:  # started by status: ends with it
        from vllm_mla_fixes import children

        children.watch_parent(args.watch_parent)
    chosen = {"sm120": ((12, 0),), "sm121": ((12, 1),), "both": CAPABILITIES}[args.device]
    with contextlib.redirect_stdout(sys.stderr):  # vLLM's logging stays off the table
        cells = truth_table(chosen)
    if args.summary:
        print(summary_markdown(cells), end="")
    elif args.markdown:
        print(markdown(cells), end="")
    else:
        print(json.dumps([c.as_dict() for c in cells]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
