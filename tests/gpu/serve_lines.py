"""Every serve line the GPU tests run on the installed vLLM release, parsed
by that release's own ``vllm serve`` argument parser and validator, turned
into engine arguments and built into a ``VllmConfig`` as far as a CPU allows;
every bench line parsed by its ``vllm bench serve`` parser.  Prints one
``RESULT=`` JSON line: per line, the values the GPU test relies on, and the
error where building stopped.

vLLM cannot infer a device without a GPU; as its own ``vllm bench`` command
does on such a machine, the platform is set to vLLM's CPU platform first.
That platform adjusts a few values afterwards (a CPU block size of 16, no
chunked prefill for MLA), so the values reported are the engine arguments,
before the platform touched them.

    CUDA_VISIBLE_DEVICES= python tests/gpu/serve_lines.py
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))


def _fix_folder_serve_lines(release: str) -> dict[str, tuple[Path, list[str]]]:
    """The serve lines of the GPU tests in the fixes' own test folders
    (``tests/<fix>/gpu/test_*.py``): each module's ``serve_lines(release)``."""
    lines = {}
    for path in sorted(TESTS.glob("*/gpu/test_*.py")):
        module_name = ".".join(path.relative_to(TESTS).with_suffix("").parts)
        lines.update(importlib.import_module(module_name).serve_lines(release))
    return lines


def _serve_lines(release: str) -> dict[str, tuple[Path, list[str]]]:
    """name -> (model, serve arguments after the model) of each GPU test on ``release``."""
    lines = {}
    if release.startswith("0.25."):
        from gpu import test_fa4_compile_strides_gpu as fa4

        lines["fa4 bench serve"] = (fa4.MODEL, fa4.SERVE_ARGS)
        lines["fa4 report's line"] = (fa4.MODEL, fa4.REPORT_SERVE_ARGS)
    return lines | _fix_folder_serve_lines(release)


def _bench_lines(release: str) -> dict[str, list[str]]:
    if not release.startswith("0.25."):
        return {}
    from gpu import test_fa4_compile_strides_gpu as fa4

    return {"fa4 bench": fa4.BENCH_ARGS, "fa4 report's bench": fa4.REPORT_BENCH_ARGS}


def _serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    return parser, serve


def build_serve_line(model: Path, flags: list[str]) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser, serve = _serve_parser()
    args = parser.parse_args(["serve", str(model), "--host", "127.0.0.1", "--port", "8000", *flags])
    serve.validate(args)
    args.model = args.model_tag  # what `vllm serve MODEL` does with its positional
    engine_args = AsyncEngineArgs.from_cli_args(args)
    attention = engine_args.attention_config
    seen = {
        "block_size": engine_args.block_size,
        "kv_cache_dtype": engine_args.kv_cache_dtype,
        "attention_backend": str(getattr(engine_args, "attention_backend", None)),
        "mla_prefill_backend": getattr(attention, "mla_prefill_backend", None),
        "indexer_kv_dtype": getattr(attention, "indexer_kv_dtype", None),
        "enforce_eager": engine_args.enforce_eager,
        "max_model_len": engine_args.max_model_len,
        "max_num_batched_tokens": engine_args.max_num_batched_tokens,
        "load_format": engine_args.load_format,
    }
    try:
        config = engine_args.create_engine_config()
        seen["engine_config"] = {
            "architectures": config.model_config.architectures,
            "max_model_len": config.model_config.max_model_len,
        }
        if config.speculative_config is not None:
            seen["engine_config"]["speculative"] = speculative_seen(config.speculative_config)
    except Exception as exc:  # noqa: BLE001 - report where the CPU stopped
        seen["engine_config_error"] = f"{type(exc).__name__}: {exc}"[:600]
    return seen


# The fields of the draft's config that vLLM's DeepSeek-V4.1 DSpark drafter
# reads at start-up (``models/deepseek_v41/nvidia/dspark.py``).
DSPARK_DRAFT_FIELDS = ("dspark_target_layer_ids", "dspark_markov_rank", "num_nextn_predict_layers")


def speculative_seen(speculative) -> dict:
    """What a line's ``SpeculativeConfig`` became: method, width and the draft."""
    draft = speculative.draft_model_config.hf_config
    return {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "draft_architectures": list(draft.architectures),
        "draft_fields": {name: getattr(draft, name, None) for name in DSPARK_DRAFT_FIELDS},
    }


def build_llm_case(**changes) -> dict:
    """``fa4_llm_case.py``'s ``LLM(...)`` options, as ``LLM`` turns them into engine arguments."""
    from vllm.engine.arg_utils import EngineArgs

    from gpu import fa4_llm_case
    from gpu import test_fa4_compile_strides_gpu as fa4

    engine_args = EngineArgs(model=str(fa4.MODEL), **{**fa4_llm_case.ENGINE_OPTIONS, **changes})
    config = engine_args.create_engine_config()
    return {
        "mla_prefill_backend": str(config.attention_config.mla_prefill_backend),
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "enable_cutedsl_warmup": getattr(config.kernel_config, "enable_cutedsl_warmup", None),
    }


def parse_bench_line(flags: list[str]) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--model", "m", *flags])
    return {
        key: getattr(args, key)
        for key in ("dataset_name", "random_input_len", "random_output_len", "num_prompts")
    } | {"max_concurrency": args.max_concurrency}


def main() -> int:
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    if platforms.current_platform.is_unspecified():
        platforms.current_platform = CpuPlatform()
    release = version("vllm")
    serve: dict[str, object] = {}
    bench: dict[str, object] = {}
    llm: dict[str, object] = {}
    result = {"vllm": release, "serve": serve, "bench": bench, "llm": llm}
    for name, (model, flags) in _serve_lines(release).items():
        serve[name] = build_serve_line(model, flags)
    for name, flags in _bench_lines(release).items():
        bench[name] = parse_bench_line(flags)
    if release.startswith("0.25."):
        llm["fa4 case"] = build_llm_case()
        llm["fa4 case TRTLLM_RAGGED"] = build_llm_case(
            attention_config={"mla_prefill_backend": "TRTLLM_RAGGED"}
        )
        llm["fa4 case warm-up off"] = build_llm_case(kernel_config={"enable_cutedsl_warmup": False})
    print("RESULT=" + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_PLUGINS", "")
    sys.exit(main())
