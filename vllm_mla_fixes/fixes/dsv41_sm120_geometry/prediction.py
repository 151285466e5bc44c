"""What a DeepSeek-V4.1 serve line gets on SM12x, predicted in ``doctor``'s
own process where no GPU is visible: the engine's own decision.

1. The namespace the installed vLLM's ``vllm serve`` parser built from the
   line (doctor's one parse, held by its :class:`~vllm_mla_fixes.report.ServeLine`)
   becomes ``AsyncEngineArgs``, as ``vllm serve`` builds them
   (:func:`vllm_mla_fixes.serve_line.engine_args`).
2. The settings the decision reads go into a real ``VllmConfig`` (its
   post-init resolves them as at start-up: ``--kv-offloading-size`` becomes an
   offloading connector, ``--kv-offloading-backend`` alone enables nothing),
   with the operator's ``config.json`` as its model config (the built-in
   DeepSeek-V4.1-Flash layout where there is none), built by
   :mod:`~vllm_mla_fixes.fixes.dsv41_sm120_geometry.simulated` as the
   reproductions build theirs.
3. :func:`~.decision.decide` runs on it with vLLM's platform answering as an
   SM120 device -- the same function, on the same inputs, that each engine
   process calls -- so ``doctor --json``'s ``dsv41`` object is the one
   ``status --json`` shows in the engine's process for that config.
4. Each rank's FlashInfer call shape is held against the installed
   FlashInfer's ``supported_sparse_mla_sm120_configs()``.

Nothing is patched and nothing starts: no second interpreter, no second
import of vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import simulated, upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import Decision, decide_for
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig, engine_config
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import PAGE_ROWS, UPSTREAM_SWA_BLOCK
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import engine_report
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.vocabulary import Geometry

if TYPE_CHECKING:
    from vllm_mla_fixes.report import ServeLine

# Per-rank shapes users reported with no SM120 sparse-MLA kernel: (heads, top-k) -> reports.
REPORTED_SHAPES = {
    (16, 512): "flashinfer#5135 (DeepSeek-V4 at TP4: prefill kernel not instantiated; open)",
    (64, 1152): "vllm#56837 (DeepSeek-V4.1-Flash at TP1 on FlashInfer 0.6.18.post1: "
    "'SM120 sparse-MLA has no decode kernel for this shape')",
}
FLASH_HEADS = 64  # DeepSeek-V4.1-Flash's, where its config.json is not on this machine
FLASH_INDEX_TOPK = 512
DEFAULT_MAX_MODEL_LEN = 8192  # where neither the line nor the config sets one


@dataclasses.dataclass(frozen=True)
class LineSettings:
    block_size: int | None
    tensor_parallel_size: int
    speculative_method: str | None
    kv_offloading_size: float | None
    kv_offloading_backend: str | None  # only where the line sets it (it has a default)
    kv_connector: str | None  # what VllmConfig resolved


@dataclasses.dataclass(frozen=True)
class Shape:
    flashinfer: str
    heads: int
    topk: int
    page: int
    extra_page: int | None
    role: str
    decode_kernel: bool
    reported: str | None


@dataclasses.dataclass(frozen=True)
class Prediction:
    vllm: str
    platform: str
    settings: LineSettings
    engine: EngineConfig
    decision: Decision
    model_figures: str  # where the model's figures come from
    best_working_upstream: tuple[int, int] | None  # (block size, tokens/GiB) where the line's fails
    shapes: tuple[Shape, ...]
    shape_problem: str | None  # why the shapes could not be checked

    def report(self) -> dict[str, object]:
        """``doctor --json``'s ``dsv41`` object: the engine's own report, and
        the line's figure against the best upstream layout that works for it
        (its own where it works, else the other block size's), as the text says."""
        if self.decision.upstream is not None and self.decision.upstream.works:
            best_size: int | None = self.decision.upstream.block_size
            versus = self.decision.vs_upstream
        elif self.best_working_upstream is not None:
            best_size, versus = self.best_working_upstream[0], self.vs_best_working_upstream
        else:
            best_size, versus = None, None
        return {
            **self.engine_report(),
            "best_working_upstream_block_size": best_size,
            "vs_best_working_upstream": versus,
        }

    def engine_report(self) -> dict[str, object]:
        """The part of :meth:`report` an engine reports too (``status --json``):
        the engine's record and its decision."""
        return engine_report(self.engine, self.decision)

    @property
    def vs_best_working_upstream(self) -> float | None:
        if self.best_working_upstream is None or self.decision.fix_tokens is None:
            return None
        return round(self.decision.fix_tokens / self.best_working_upstream[1], 4)


def engine_settings(args: Any) -> simulated.EngineSettings:  # args: an AsyncEngineArgs
    """The parts of the engine config the decision reads, as vLLM config objects."""
    from vllm.config import CacheConfig, ParallelConfig

    cache_fields = set(CacheConfig.__dataclass_fields__)
    cache_options = {
        name: getattr(args, name)
        for name in ("kv_offloading_size", "kv_offloading_backend")
        if name in cache_fields and getattr(args, name, None) is not None
    }
    parallel_fields = ParallelConfig.__dataclass_fields__
    sections: dict[str, Any] = {
        "parallel_config": ParallelConfig(
            **{
                name: getattr(args, name)
                for name in (
                    "tensor_parallel_size",
                    "pipeline_parallel_size",
                    "decode_context_parallel_size",
                    "prefill_context_parallel_size",
                )
                if name in parallel_fields and hasattr(args, name)
            }
        ),
        "attention_config": args.attention_config,
    }
    if args.kv_transfer_config is not None:
        sections["kv_transfer_config"] = args.kv_transfer_config
    attached = {}
    if args.speculative_config is not None:
        attached["speculative_config"] = simulated.speculative_config_as_written(
            {k.replace("-", "_"): v for k, v in args.speculative_config.items()}
        )
    return simulated.EngineSettings(
        cache_options=cache_options, sections=sections, attached=attached
    )


def model_text(model_config: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The model's text config (its ``text_config`` where it has one) and
    where its figures come from: the operator's config.json where it holds
    the DeepSeek-V4.1 topology, else DeepSeek-V4.1-Flash's."""
    text = (model_config or {}).get("text_config", model_config or {})
    if isinstance(text, dict) and "compress_ratios" in text:
        return text, "from config.json"
    return (
        dict(simulated.DSV41_FLASH),
        "DeepSeek-V4.1-Flash's (no DeepSeek-V4.1 config.json read here)",
    )


def predict(serve: ServeLine) -> Prediction:
    """The decision an SM12x engine takes for the line, from doctor's one
    parse of it and the model's config.json it read; raises what vLLM's
    configs and planner raise where they refuse the line."""
    import vllm

    from vllm_mla_fixes.serve_line import cuda_device_type_while_parsing, engine_args

    with cuda_device_type_while_parsing() as platform, _model_name_kept():
        args = engine_args(serve.namespace)
    settings = engine_settings(args)
    text, figures = model_text(serve.model_config or None)
    length = args.max_model_len or text.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN
    with simulated.sm120_platform():
        block_size = args.block_size or upstream.picked_block_size(
            upstream.declared_kernel_blocks()
        )
        config = simulated.make_vllm_config(block_size, None, settings)
        config.cache_config.user_specified_block_size = args.block_size is not None
        simulated.attach_model(config, text, (), int(length))
        engine = engine_config(config)
        decision = decide_for(engine, config)
        _planner_refusal(engine, config, decision, block_size)
        best = _best_working_upstream(engine, config, decision)
    heads = int(text.get("num_attention_heads", FLASH_HEADS))
    tp = int(args.tensor_parallel_size or 1)
    shapes: tuple[Shape, ...] = ()
    problem = None
    if heads % tp:
        problem = f"{heads} attention heads do not split over TP {tp}"
    else:
        shapes, problem = flashinfer_shapes(
            heads // tp,
            int(text["sliding_window"]),
            int(text.get("index_topk", FLASH_INDEX_TOPK)),
            decision,
        )
    return Prediction(
        vllm=str(vllm.__version__),
        platform=platform,
        settings=LineSettings(
            block_size=args.block_size,
            tensor_parallel_size=tp,
            speculative_method=engine.speculative_method,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_backend=args.kv_offloading_backend
            if any(a.split("=")[0] == "--kv-offloading-backend" for a in serve.raw)
            else None,
            kv_connector=engine.kv_connector if config.kv_transfer_config is not None else None,
        ),
        engine=engine,
        decision=decision,
        model_figures=figures,
        best_working_upstream=best,
        shapes=shapes,
        shape_problem=problem,
    )


@contextlib.contextmanager
def _model_name_kept() -> Iterator[None]:
    """The prediction reads the line's settings, and the model's figures from
    the config.json doctor read (built-in ones where none was): never the
    model's files.  With HF_HUB_OFFLINE=1 vLLM's engine arguments swap a hub
    name for its hub-cache folder, and stop where it is not cached; held off
    here, a hub name out of reach is predicted alike with the setting or with
    no network (doctor's model finding says the name is all it has)."""
    import huggingface_hub.constants

    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE = offline


def _planner_refusal(
    engine: EngineConfig, config: Any, decision: Decision, block_size: int
) -> None:
    """Where the decision planned nothing, vLLM's planner still has its say on
    the line's own block size: its ValueError or AssertionError (context
    parallelism with sliding windows, for one) reaches doctor in vLLM's words."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import upstream_tokens

    planned = decision.fix_tokens is not None or decision.upstream_tokens is not None
    if planned or engine.model is None or engine.max_model_len is None:
        return
    try:
        upstream_tokens(engine, config, block_size)
    except (ValueError, AssertionError):
        raise
    except Exception:  # noqa: BLE001 - not plannable here: the decision's evidence says so
        return


def _best_working_upstream(
    engine: EngineConfig, config: Any, decision: Decision
) -> tuple[int, int] | None:
    """Where upstream's layout for the line's block size does not work: the
    block size whose upstream layout works and holds the most KV tokens."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import upstream_tokens

    if decision.upstream is None or decision.upstream.works or engine.model is None:
        return None
    declared = upstream.declared_kernel_blocks()
    ratios = engine.model.owned_ratios or (1, 2)
    found = []
    for size in (64, 128):
        if upstream.upstream_layout(size, ratios, declared).works:
            try:
                found.append((upstream_tokens(engine, config, size), size))
            except Exception:  # noqa: BLE001 - not plannable here: no comparison
                continue
    if not found:
        return None
    tokens, size = max(found)
    return size, tokens


def flashinfer_shapes(
    heads_per_rank: int, window: int, index_topk: int, decision: Decision
) -> tuple[tuple[Shape, ...], str | None]:
    """Each per-rank call shape of the decided layout against the installed
    FlashInfer's SM120 decode envelope."""
    import flashinfer
    from flashinfer import mla

    version = str(flashinfer.__version__)
    lookup = getattr(mla, "supported_sparse_mla_sm120_configs", None)
    if lookup is None:
        return (), f"FlashInfer {version} has no supported_sparse_mla_sm120_configs()"
    config = lookup()["dsv4"]
    extra_pages = sorted(config.extra_page_block_sizes)
    stepped_aside = decision.geometry is Geometry.UPSTREAM
    window_page = UPSTREAM_SWA_BLOCK if stepped_aside else decision.backbone_swa_rows
    calls = [
        (window, window_page, "sliding-window pages, the primary cache", False),
        (index_topk, PAGE_ROWS, "compressed pages, the extra cache", True),
    ]
    if not stepped_aside and decision.drafter_swa_rows != decision.backbone_swa_rows:
        calls.append(
            (
                window,
                decision.drafter_swa_rows,
                "a drafter's sliding-window pages, the primary",
                False,
            )
        )
    shapes = []
    for topk, page, role, extra in calls:
        decode = config.supports_decode(
            heads_per_rank, topk, num_tokens=1, page_block_size=page
        ) and (not extra or not extra_pages or PAGE_ROWS in extra_pages)
        shapes.append(
            Shape(
                flashinfer=version,
                heads=heads_per_rank,
                topk=topk,
                page=page,
                extra_page=PAGE_ROWS if extra else None,
                role=role,
                decode_kernel=bool(decode),
                reported=REPORTED_SHAPES.get((heads_per_rank, topk)),
            )
        )
    return tuple(shapes), None
