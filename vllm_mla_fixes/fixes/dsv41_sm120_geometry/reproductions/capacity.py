"""KV-cache capacity of DeepSeek-V4.1-Flash on SM12x: the fix's geometries against upstream.

Every figure is vLLM's own: the layers of the dossier's 40-layer
DeepSeek-V4.1-Flash layout (``dsv41_sm120_geometry.DSV41_FLASH``) go through the
installed release's planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups`` for 1 GiB per rank) and its start-up token
figure (``get_kv_cache_capacity``: "GPU KV cache size: N tokens").  The fixed
rows apply the fix as on an SM120 device; its spec producers then ask the
fix's own ``decide`` with the engine config the row (or the serve
line) builds, exactly as they do at start-up.  ``benchmarks/dsv41_kv_capacity.py``
prints the table; ``doctor`` plans an operator's serve line with the same planner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import simulated
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import (
    decide,
    flashinfer_takes_runtime_swa_pages,
)
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

MAX_MODEL_LENS = (8192, 131072)
UPSTREAM_BLOCK_SIZES = (128, 64)
BASELINE_BLOCK_SIZE = 128
DSPARK_OPTIONS = {"method": "dspark", "num_speculative_tokens": 3}
"""The DSpark row's ``--speculative-config`` (the width does not enter the decision)."""
DSPARK_DRAFTER_RATIOS = (0, 0, 0)
"""DSpark's drafter layers as vLLM builds them: ``n_mtp_layers`` (else
``num_nextn_predict_layers``, else 3) sliding-window-only decoder layers
numbered past the backbone (``models/deepseek_v41/nvidia/dspark.py``).  doctor
assumes vLLM's default of 3, the count that costs most capacity (see below)."""
DSPARK_DRAFTER_COUNTS = (1, 3)
"""The benchmark's DSpark rows: one drafter layer (a checkpoint whose config
says so) and vLLM's default of 3.  With 64-row pages, three sliding-window
layers more make the split's hybrid grouping open a tenth KV-cache group
(one fits the backbone's groups); with the fix's 128-row drafter pages they
share one group of half the per-request cost."""


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    max_model_len: int
    groups: int
    block_stride: int
    num_blocks: int
    tokens: int
    concurrency: float
    context_bytes_per_token: float
    geometry: str  # "upstream", or the geometry the fix chose
    reason: str  # why that geometry
    drafter_layers: int  # a drafter's own layers planned beside the backbone's

    def versus(self, baseline: Row) -> float:
        return self.tokens / baseline.tokens


@contextlib.contextmanager
def fixed_on_sm120() -> Iterator[None]:
    """The fix applied as on an SM120 device, reverted afterwards."""
    with repro.applied((12, 0)) as result:
        if result.status.state.value != "applied":
            raise RuntimeError(f"the fix did not apply: {result.status.label()}")
        yield


@contextlib.contextmanager
def environment_variable(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` in the environment for the duration (None: unset)."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def drafter_pages_kept_at_64() -> contextlib.AbstractContextManager[None]:
    """``VLLM_MLA_FIXES_DSV41_DRAFTER_SWA_ROWS=64`` for the duration."""
    return environment_variable(fix.DRAFTER_SWA_ENV, str(fix.PAGE_ROWS))


def forced_geometry(name: str | None) -> contextlib.AbstractContextManager[None]:
    """``VLLM_MLA_FIXES_DSV41_GEOMETRY=name`` for the duration (None: unset)."""
    return environment_variable(fix.GEOMETRY_ENV, name)


def context_bytes_per_token(geometry: repro.Geometry) -> float:
    """Bytes a long request pays per context token in the groups that grow
    with it (all but the sliding-window and ring groups): each block of the
    shared pool costs the pool's block stride, whichever group holds it."""
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    stride = geometry.kv_cache_config.kv_cache_tensors[0].block_stride
    total = 0.0
    for group in geometry.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        first = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        if not isinstance(first, (SlidingWindowSpec, CircularBufferSpec)):
            total += stride / spec.block_size
    return total


def measure(
    label: str,
    block_size: int,
    max_model_lens: tuple[int, ...],
    settings: simulated.EngineSettings | None = None,
    fixed: bool = True,
    model: dict[str, Any] | None = None,
) -> list[Row]:
    """Rows for one geometry: upstream (``fixed=False``), or the fix applied as
    on SM120, whose own decision picks the geometry for ``settings`` at each
    max-model-len (its 2% rule is judged there); ``model``: a text config's
    DeepSeek-V4.1 topology (DeepSeek-V4.1-Flash's where None)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    rows = []
    plan = None
    with fixed_on_sm120() if fixed else contextlib.nullcontext():
        for max_model_len in max_model_lens:
            if plan is None or fixed:
                plan = repro.plan_geometry(
                    block_size,
                    model=model,
                    num_gpu_blocks_override=None,
                    settings=settings,
                    max_model_len=max_model_len,
                )
            if fixed:
                decision = decide(plan.vllm_config)
                geometry, reason = decision.geometry.value, decision.reason
            else:
                geometry, reason = "upstream", f"vLLM's own layout for --block-size {block_size}"
            kv_config = plan.kv_cache_config
            # What the capacity figure reads of the model config (a real
            # ModelConfig inspects the model class in a subprocess).
            plan.vllm_config.model_config = SimpleNamespace(max_model_len=max_model_len)
            tokens, concurrency = get_kv_cache_capacity(plan.vllm_config, kv_config)
            rows.append(
                Row(
                    label=label,
                    max_model_len=max_model_len,
                    groups=len(kv_config.kv_cache_groups),
                    block_stride=int(kv_config.kv_cache_tensors[0].block_stride),
                    num_blocks=int(kv_config.num_blocks),
                    tokens=int(tokens),
                    concurrency=float(concurrency),
                    context_bytes_per_token=context_bytes_per_token(plan),
                    geometry=geometry,
                    reason=reason,
                    drafter_layers=len(settings.drafter_ratios) if settings else 0,
                )
            )
    return rows


def upstream_rows(
    max_model_lens: tuple[int, ...] = MAX_MODEL_LENS, drafter_ratios: tuple[int, ...] = ()
) -> list[Row]:
    """Upstream's layouts of the same model: with a drafter's layers where the
    compared line has them, so that both sides hold the same caches."""
    count = len(drafter_ratios)
    drafters = f", with {count} drafter layer{'s' if count > 1 else ''}" if count else ""
    return [
        row
        for block_size in UPSTREAM_BLOCK_SIZES
        for row in measure(
            f"upstream --block-size {block_size} (SWA 32{drafters})",
            block_size,
            max_model_lens,
            settings=simulated.EngineSettings(drafter_ratios=drafter_ratios),
            fixed=False,
        )
    ]


def default_block_size() -> int:
    """The block size vLLM plans DeepSeek-V4.1 with on SM12x when the line
    gives none (the fix's own prediction of vLLM's pick, which the truth-table
    test checks against the platform's real choice)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream

    with simulated.sm120_platform():
        return upstream.picked_block_size(upstream.declared_kernel_blocks())


def benchmark_rows(max_model_lens: tuple[int, ...] = MAX_MODEL_LENS) -> list[Row]:
    """Upstream at --block-size 128 and 64; then, for the line with no
    --block-size (vLLM's default, where the fix steps aside if upstream's layout
    works) and, where that default is not 128, for a --block-size 128 line: the
    fix's default and fallback, and its choice for DSpark serve lines.  The
    fixed rows are decided as on an SM120 device."""
    rows = upstream_rows(max_model_lens)
    for count in DSPARK_DRAFTER_COUNTS:
        rows += upstream_rows(max_model_lens, (0,) * count)
    picked = default_block_size()
    lines = [(picked, f"default line (no --block-size: vLLM picks {picked})")]
    if picked != BASELINE_BLOCK_SIZE:
        lines.append((BASELINE_BLOCK_SIZE, f"--block-size {BASELINE_BLOCK_SIZE} line"))
    for block_size, line_label in lines:
        rows += _fixed_rows(block_size, line_label, max_model_lens)
    return rows


def _fixed_rows(block_size: int, line_label: str, max_model_lens: tuple[int, ...]) -> list[Row]:
    rows = []
    with simulated.sm120_platform(), forced_geometry(None):
        rows += measure(f"fixed, {line_label}", block_size, max_model_lens)
    with simulated.sm120_platform(), forced_geometry(fix.PER_RATIO):
        rows += measure(
            f"fixed, {line_label}, forced fallback: per-ratio (ratio-1 64, ratio-2 128, SWA 64)",
            block_size,
            max_model_lens,
        )
    speculative = (
        '(--speculative-config \'{"method": "dspark", "num_speculative_tokens": '
        f"{DSPARK_OPTIONS['num_speculative_tokens']}}}')"
    )
    # Where FlashInfer takes run-time page sizes the drafter's pages are 128
    # rows by default; the environment variable keeps them at 64.
    drafter_pages: list[tuple[str, Callable[[], contextlib.AbstractContextManager[object]]]] = [
        ("", contextlib.nullcontext)
    ]
    if flashinfer_takes_runtime_swa_pages():
        drafter_pages.append((f", {fix.DRAFTER_SWA_ENV}=64", drafter_pages_kept_at_64))
    for count in DSPARK_DRAFTER_COUNTS:
        for suffix, pages in drafter_pages:
            with simulated.sm120_platform(), forced_geometry(None), pages():
                dspark = simulated.EngineSettings(
                    attached={
                        "speculative_config": simulated.speculative_config_as_written(
                            DSPARK_OPTIONS
                        )
                    },
                    drafter_ratios=(0,) * count,
                )
                rows += measure(
                    f"fixed, {line_label}, DSpark with {count} drafter "
                    f"layer{'s' if count > 1 else ''}{suffix} {speculative}",
                    block_size,
                    max_model_lens,
                    settings=dspark,
                )
    return rows


def baseline(
    rows: list[Row],
    max_model_len: int,
    block_size: int = BASELINE_BLOCK_SIZE,
    drafter_layers: int = 0,
) -> Row:
    """Upstream's row for the same model (drafter layers included) and length."""
    prefix = f"upstream --block-size {block_size} "
    return next(
        r
        for r in rows
        if r.label.startswith(prefix)
        and r.max_model_len == max_model_len
        and r.drafter_layers == drafter_layers
    )
