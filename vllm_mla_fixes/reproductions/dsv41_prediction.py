"""What a DeepSeek-V4.1 serve line gets on SM12x, predicted where no GPU is visible.

``doctor`` runs this module in its own interpreter (it applies the fix, and
prints one JSON document as its last line of output)::

    python -m vllm_mla_fixes.reproductions.dsv41_prediction [--model-config JSON] -- <serve args>

and reads the one JSON document it prints.  The steps are the installed
vLLM's own, then the fix's own:

1. the serve line is parsed by ``vllm serve``'s parser (``ServeSubcommand``)
   and turned into ``AsyncEngineArgs`` by ``from_cli_args``
   (:mod:`vllm_mla_fixes.serve_line`, which also lets a machine without a GPU
   parse it);
2. the engine settings the geometry depends on go into a real ``VllmConfig``,
   whose post-init resolves them as at start-up (``--kv-offloading-size``
   becomes an offloading connector; ``--kv-offloading-backend`` alone enables
   nothing);
3. the fix, applied as on an SM120 device, plans the DeepSeek-V4.1-Flash
   layout through vLLM's planner; its spec producers and its
   ``geometry_decision`` decide the geometry from that config, as the plugin
   does at start-up, and the capacity figures are vLLM's;
4. the shape each rank hands FlashInfer is checked against the installed
   FlashInfer's ``flashinfer.mla.supported_sparse_mla_sm120_configs()``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_mla_fixes.serve_line import Rejected, cuda_device_type_while_parsing, engine_args

# DeepSeek-V4.1-Flash's attention figures, used when the model's config.json
# is not on this machine (third-party copies of it; the dossier's layout).
FLASH_HEADS = 64
FLASH_INDEX_TOPK = 512
FLASH_WINDOW = 128

# Per-rank shapes users reported with no SM120 sparse-MLA kernel: (heads, top-k) -> reports.
REPORTED_SHAPES = {
    (16, 512): "flashinfer#5135 (DeepSeek-V4 at TP4: prefill kernel not instantiated; open)",
    (64, 1152): "vllm#56837 (DeepSeek-V4.1-Flash at TP1 on FlashInfer 0.6.18.post1: "
    "'SM120 sparse-MLA has no decode kernel for this shape')",
}


def engine_settings(args: Any):
    """The geometry-relevant parts of the engine config, as vLLM config objects."""
    from vllm.config import CacheConfig, ParallelConfig

    from vllm_mla_fixes.reproductions.dsv41_capacity import (
        DSPARK_DRAFTER_RATIOS,
        speculative_config_as_written,
    )
    from vllm_mla_fixes.reproductions.dsv41_sm120_geometry import EngineSettings

    cache_fields = {f for f in CacheConfig.__dataclass_fields__}
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
    drafter_ratios: tuple[int, ...] = ()
    if args.speculative_config is not None:
        attached["speculative_config"] = speculative_config_as_written(
            {k.replace("-", "_"): v for k, v in args.speculative_config.items()}
        )
        if str(args.speculative_config.get("method", "")).lower() == "dspark":
            drafter_ratios = DSPARK_DRAFTER_RATIOS
    return EngineSettings(
        cache_options=cache_options,
        sections=sections,
        attached=attached,
        drafter_ratios=drafter_ratios,
    )


def flashinfer_shapes(
    heads_per_rank: int,
    window: int,
    index_topk: int,
    drafter_page: int | None = None,
    window_page: int = 64,
) -> list[dict]:
    """Each per-rank call shape against the installed FlashInfer's SM120 decode
    envelope; ``window_page``: the backbone's sliding-window page rows (64
    under the fix, 32 in upstream's layout); ``drafter_page``: a drafter's,
    where they differ from 64."""
    import flashinfer
    from flashinfer import mla

    version = str(flashinfer.__version__)
    lookup = getattr(mla, "supported_sparse_mla_sm120_configs", None)
    if lookup is None:
        return [{"flashinfer": version, "error": "no supported_sparse_mla_sm120_configs()"}]
    config = lookup()["dsv4"]
    extra_pages = sorted(config.extra_page_block_sizes)
    calls = [
        (window, window_page, "sliding-window pages, the primary cache", False),
        (index_topk, 64, "compressed pages, the extra cache", True),
    ]
    if drafter_page is not None and drafter_page != 64:
        calls.append((window, drafter_page, "a drafter's sliding-window pages, the primary", False))
    shapes = []
    for topk, page, role, extra in calls:
        decode = config.supports_decode(
            heads_per_rank, topk, num_tokens=1, page_block_size=page
        ) and (not extra or not extra_pages or 64 in extra_pages)
        shapes.append(
            {
                "flashinfer": version,
                "heads": heads_per_rank,
                "topk": topk,
                "page": page,
                "extra_page": 64 if extra else None,
                "extra_pages_listed": extra_pages,
                "role": role,
                "decode_kernel": decode,
                "reported": REPORTED_SHAPES.get((heads_per_rank, topk)),
            }
        )
    return shapes


def predict(serve_argv: list[str], model_config: dict | None = None) -> dict:
    import vllm

    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream as fix_upstream
    from vllm_mla_fixes.reproductions import dsv41_capacity as capacity
    from vllm_mla_fixes.reproductions import dsv41_sm120_geometry as repro
    from vllm_mla_fixes.reproductions import dsv41_truth_table as table

    with cuda_device_type_while_parsing() as platform:
        args = engine_args(serve_argv)
    settings = engine_settings(args)
    lens = (args.max_model_len,) if args.max_model_len else capacity.MAX_MODEL_LENS
    method = (args.speculative_config or {}).get("method")
    # The decision reads the backends' kernel blocks, which vLLM declares per device.
    with repro.sm120_platform():
        block_size = args.block_size or fix_upstream.picked_block_size(
            fix_upstream.declared_kernel_blocks()
        )
        # The line as the fix lays it out first: vLLM's planner refuses some
        # lines there (DCP with sliding-window caches) before a worker starts.
        fixed = capacity.measure("this serve line, fixed", block_size, lens, settings)
        planned = fix.planned_drafter_rows() if settings.drafter_ratios else None
        line = table.evaluate((12, 0), args.block_size, settings, str(method or "none"), lens)
        best = table.best_working_upstream((12, 0), settings, lens)
        resolved = repro.make_vllm_config(block_size, None, settings).kv_transfer_config
    upstream = capacity.upstream_rows(lens, settings.drafter_ratios)
    drafters = len(settings.drafter_ratios)
    text = (model_config or {}).get("text_config", model_config or {})
    heads = int(text.get("num_attention_heads", FLASH_HEADS))
    tp = int(args.tensor_parallel_size or 1)
    return {
        "vllm": str(vllm.__version__),
        "platform": platform,
        "settings": {
            "block_size": args.block_size,
            "tensor_parallel_size": tp,
            "speculative_method": (args.speculative_config or {}).get("method"),
            "kv_offloading_size": args.kv_offloading_size,
            # the backend has a default: report it only where the line sets it
            "kv_offloading_backend": args.kv_offloading_backend
            if any(a.split("=")[0] == "--kv-offloading-backend" for a in serve_argv)
            else None,
            # what VllmConfig resolved: offloading becomes a connector only with a size
            "kv_connector": resolved.kv_connector if resolved is not None else None,
        },
        "geometry": fixed[0].geometry,
        "reason": fixed[0].reason
        + (
            ""
            if planned is None
            else f"; drafter sliding-window pages: {planned[0]} rows ({planned[1]})"
        ),
        "dsv41": {
            "block_size": block_size,
            "upstream_starts": line.upstream_starts,
            "upstream_start_error": line.start_error,
            "upstream_works": line.upstream_works,
            "upstream_rejected": [r.as_dict() for r in line.upstream_rejected],
            "unknown_envelopes": list(line.unknown_envelopes),
            "decision": line.decision,
            "reason": line.reason,
            "vs_best_working_upstream": None
            if best is None
            else round(line.fix_tokens[lens[0]] / best[1][lens[0]], 4),
            "best_working_upstream_block_size": None if best is None else best[0],
            "at_max_model_len": lens[0],
        },
        "capacity": [
            {
                "max_model_len": row.max_model_len,
                "tokens_per_gib": row.tokens,
                "upstream_128": capacity.baseline(
                    upstream, row.max_model_len, 128, drafters
                ).tokens,
                "upstream_64": capacity.baseline(upstream, row.max_model_len, 64, drafters).tokens,
            }
            for row in fixed
        ],
        "model_figures": "from config.json"
        if text
        else "DeepSeek-V4.1-Flash's (config.json not found here)",
        "shapes": flashinfer_shapes(
            heads // tp,
            int(text.get("sliding_window", FLASH_WINDOW)),
            int(text.get("index_topk", FLASH_INDEX_TOPK)),
            drafter_page=(planned or fix.drafter_swa_rows())[0]
            if drafters and fixed[0].geometry != fix.UPSTREAM
            else None,
            window_page=fix.UPSTREAM_SWA_BLOCK if fixed[0].geometry == fix.UPSTREAM else 64,
        )
        if heads % tp == 0
        else [{"error": f"{heads} attention heads do not split over TP {tp}"}],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="", help="the model's config.json, as JSON")
    parser.add_argument("serve", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    serve = options.serve[1:] if options.serve[:1] == ["--"] else options.serve
    model_config = json.loads(options.model_config) if options.model_config else None
    try:
        print(json.dumps(predict(serve, model_config)))
    # vLLM rejects the line: its parser stops, its configs raise ValueError, its
    # planner asserts (e.g. "DCP not support sliding window.")
    except Rejected as exc:  # already in vLLM's words
        print(json.dumps({"error": str(exc)}))
        return 1
    except (ValueError, AssertionError) as exc:
        first = str(exc).strip().splitlines()
        print(json.dumps({"error": f"{type(exc).__name__}: {' '.join(first[:2])}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
