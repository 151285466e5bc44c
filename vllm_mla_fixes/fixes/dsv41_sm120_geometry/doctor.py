"""Doctor: ``vllm-mla-fixes doctor``'s findings for this fix, including the
geometry and capacity a serve line gets on SM12x (the fix's own decision,
taken in doctor's process on the config vLLM's own parser builds)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_mla_fixes.fixes.dsv41_sm120_geometry import dspark_long_prompt
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import (
    GAIN_TO_APPLY,
    INFO,
    UPSTREAM,
)

if TYPE_CHECKING:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.prediction import Prediction, Shape
    from vllm_mla_fixes.report import Environment, Finding, ServeLine


def diagnose(env: Environment, serve: ServeLine | None) -> list[Finding]:
    """``vllm-mla-fixes doctor``'s findings for this fix on a release its probe
    decides: ``serve`` is doctor's one parse of the line (None without one)."""
    from vllm_mla_fixes.report import fix_verdict

    out_of_scope = _out_of_scope_finding(env, serve)
    if out_of_scope is not None:
        return [out_of_scope]
    env = as_sm12x_node(env)
    findings = _sm12x_gpu_findings(env.capability) + _flashinfer_package_findings(env)
    if serve is not None:
        findings += _serve_line_findings(env, serve)
    findings.append(fix_verdict(env, INFO.name))
    return findings


def _out_of_scope_finding(env: Environment, serve: ServeLine | None) -> Finding | None:
    """The one finding where the line or the GPU is not this fix's concern, else None."""
    from vllm_mla_fixes.report import Finding

    if (
        serve is not None
        and (serve.model_config or serve.architectures)  # its config, or its name, says
        and "DeepseekV41ForCausalLM" not in serve.architectures
    ):
        return Finding("ok", INFO.name, "not a DeepSeek-V4.1 model")
    sm = env.capability
    if sm is not None and sm[0] != 12:
        return Finding(
            "ok",
            INFO.name,
            f"SM{sm[0]}{sm[1]}: the page-geometry failure is specific to "
            "SM120/SM121 (FlashInfer's SM120 sparse-MLA and indexer kernels); nothing changes here",
        )
    return None


def _sm12x_gpu_findings(sm: tuple[int, int] | None) -> list[Finding]:
    """Which SM12x GPUs the fix covers, and how to prove it on the one that serves."""
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    return [
        Finding(
            "info",
            name,
            f"GPU {f'SM{sm[0]}{sm[1]}' if sm else 'not visible'}: SM120 (RTX PRO 6000) "
            "and SM121 (GB10) are both compute capability 12.x; the fix applies to both "
            "(neither has been run on hardware by this project)",
        ),
        Finding(
            "info",
            name,
            f"prove the KV layouts on {'this GPU' if sm else 'the SM12x GPU that serves'} "
            "before serving: the self-test runs "
            "FlashInfer's SM120 sparse-MLA, DeepGEMM's paged MQA logits and the indexer-K "
            "gather over the fix's layouts and upstream's own (the one left in place where "
            "the fix steps aside) against a dense reference (exit 0 pass, "
            "1 mismatch, 2 cannot run); once the server is up, check its replies for "
            "U+FFFD; attach both outputs to a bug report",
            f"{SELFTEST_COMMAND}; then {SMOKE_COMMAND}",
        ),
    ]


def _flashinfer_package_findings(env: Environment) -> list[Finding]:
    """FlashInfer's kernel packages: versions it refuses to start with, or a missing JIT cache."""
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    findings = []
    fi, cubin, jit = (
        env.packages.get(p)
        for p in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
    )
    if fi and cubin and fi != cubin:
        findings.append(
            Finding(
                "error",
                name,
                f"flashinfer-cubin {cubin} != flashinfer-python {fi}; FlashInfer refuses to "
                "start (unless FLASHINFER_DISABLE_VERSION_CHECK=1)",
                f"{FLASHINFER_CUBIN_COMMAND}   (FlashInfer's own command: flashinfer-cubin "
                f"{fi} from FlashInfer's wheel index; PyPI has no 0.7.x)",
            )
        )
    if jit is None:
        findings.append(
            Finding(
                "info",
                name,
                "flashinfer-jit-cache is not installed (this project's locks do not install "
                "it either): FlashInfer compiles its SM120 kernels with nvcc on first use "
                "($CUDA_HOME, else nvcc on PATH, else /usr/local/cuda) and keeps them under "
                "~/.cache/flashinfer, so the first start takes longer.  The report's 4 KB "
                "shim is FlashInfer's flashinfer-jit-cache package, from FlashInfer's own "
                f"wheel index for torch's CUDA {env.torch_cuda or '(unknown)'}, not PyPI; "
                "the SM120/SM121 kernels are in its flashinfer-jit-cache-sm120f provider, and "
                "FlashInfer's command installs the two, with --no-deps, at flashinfer-python's "
                "version",
                JIT_CACHE_COMMAND,
            )
        )
    elif fi and jit.split("+")[0] != fi:
        findings.append(
            Finding(
                "error",
                name,
                f"flashinfer-jit-cache {jit} does not match flashinfer-python "
                f"{fi}; FlashInfer refuses to start (unless FLASHINFER_DISABLE_VERSION_CHECK=1)",
                f"{JIT_CACHE_COMMAND}   (FlashInfer's own command: the shim and the sm120f "
                f"provider at {fi}, with --no-deps)",
            )
        )
    return findings


def _serve_line_findings(env: Environment, serve: ServeLine) -> list[Finding]:
    """What the serve line's own settings meet on SM120, and the geometry it gets."""
    from vllm_mla_fixes.report import Finding, fix_verdict

    name = INFO.name
    findings = []
    attention = serve.attention_config
    if str(attention.get("indexer_kv_dtype", "fp8")).lower() == "mxfp4":
        findings.append(
            Finding(
                "error",
                name,
                "indexer_kv_dtype='mxfp4' requires SM10x (B200/GB200); "
                "SM120 rejects it at start-up",
                f"the fp8 indexer cache: {INDEXER_FP8_FLAG}",
            )
        )
    if attention.get("indexer_sparse_logits"):
        findings.append(
            Finding(
                "error",
                name,
                "indexer_sparse_logits needs the MXFP4 indexer cache, which SM120 does not support",
                "remove indexer_sparse_logits",
            )
        )
    fixed = env.fix_state(name) == "applied"
    # where the fix is not applied, why (and its remedy) is the plugin check's own
    findings += predicted_geometry(serve, fixed, None if fixed else fix_verdict(env, name))
    findings.append(
        Finding(
            "info",
            name,
            "PR #56509 (64-token kernel blocks inside 128-token blocks) "
            "starts but writes ratio-1 latents through untranslated slots into other "
            "layers' pages: U+FFFD output; do not serve with it",
        )
    )
    if (serve.moe_backend or "auto") in ("triton", "b12x"):
        findings.append(
            Finding(
                "error",
                name,
                f"--moe-backend {serve.moe_backend} is not supported on SM120",
                "the default: drop --moe-backend (auto picks DEEPGEMM_MXFP4); "
                f"or Marlin: {MOE_MARLIN_FLAG}",
            )
        )
    return findings


SM12X_NODE = "an SM12x serving node"


def as_sm12x_node(env: Environment) -> Environment:
    """``env`` as the node that serves the line sees this fix: where no GPU is
    visible here, the plugin's decision there, from its probe for SM120 on
    the installed vLLM (this process decides not-needed for want of a GPU)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.gate import probe
    from vllm_mla_fixes.patching import CannotProbe, TargetMismatch
    from vllm_mla_fixes.report import as_serving_node

    if env.capability is not None or env.fix_state(INFO.name) != "not-needed":
        return env
    try:
        reason = probe((12, 0))
    except (CannotProbe, TargetMismatch) as exc:
        return as_serving_node(env, INFO.name, SM12X_NODE, "skipped", str(exc))
    if reason is not None:
        return as_serving_node(env, INFO.name, SM12X_NODE, "not-needed", reason)
    return as_serving_node(env, INFO.name, SM12X_NODE, "applied", "its probe for SM120 passes")


SPLIT_ERROR_0_34 = (
    "ValueError: FLASHINFER_MLA_SPARSE_DSV41 needs 64-token kernel blocks, which packed "
    "128-token KV cache blocks cannot be split into."
)


# Commands doctor suggests; tests run both (tests/dsv41_sm120_geometry/test_selftest.py, tests/test_smoke.py).
SELFTEST_COMMAND = "vllm-mla-fixes selftest"


SMOKE_COMMAND = "vllm-mla-fixes smoke http://<host>:<port>"


# FlashInfer's own commands (flashinfer-python's CLI) for its kernel packages;
# tests/test_doctor.py runs both with --dry-run.
JIT_CACHE_COMMAND = "flashinfer install-jit-cache-wheel --mode minimal --sm sm120f"
FLASHINFER_CUBIN_COMMAND = "flashinfer install-cubin-wheel"


# Serve flags doctor suggests; tests check them with each affected release's own config classes.
INDEXER_FP8_FLAG = '--attention-config \'{"indexer_kv_dtype": "fp8"}\''


MOE_MARLIN_FLAG = "--moe-backend marlin"


def predicted_geometry(
    serve: ServeLine, fixed: bool = True, why_not: Finding | None = None
) -> list[Finding]:
    """doctor's findings on what ``serve`` gets on SM12x: the fix's own
    decision, in this process, on the engine config vLLM builds from the
    parsed line and the model's config.json (works where no GPU is visible)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.prediction import predict
    from vllm_mla_fixes.report import Finding

    try:
        prediction = predict(serve)
    except (ValueError, AssertionError) as exc:  # vLLM's configs and planner refuse the line
        first = " ".join(str(exc).strip().splitlines()[:2])
        return [_rejected(f"{type(exc).__name__}: {first}")]
    except Exception as exc:  # noqa: BLE001 - say what failed, never a traceback
        return [
            Finding(
                "warn",
                INFO.name,
                f"could not predict this line's KV geometry on SM12x ({type(exc).__name__}: {exc})",
            )
        ]
    return prediction_findings(prediction, fixed, why_not)


def _rejected(message: str) -> Finding:
    from vllm_mla_fixes.report import Finding

    return Finding(
        "error",
        INFO.name,
        f"vLLM rejects this serve line: {message}",
        "correct the line; `vllm serve` would stop with the same error",
    )


def prediction_findings(
    prediction: Prediction, fixed: bool = True, why_not: Finding | None = None
) -> list[Finding]:
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    decision = prediction.decision
    findings = _upstream_findings(prediction, fixed, why_not)
    if fixed and decision.applies:
        findings.append(
            Finding(
                "info",
                name,
                f"on SM12x this line gets the {decision.geometry.value} geometry: "
                f"{decision.reason} (the fix's own decision, on the engine config "
                f"vLLM {prediction.vllm}'s `vllm serve` parser builds from this line; "
                f"{prediction.platform}; model figures {prediction.model_figures})",
            )
        )
    findings.append(Finding("info", name, _capacity_line(prediction, fixed)))
    settings = prediction.settings
    if settings.kv_offloading_backend and settings.kv_offloading_size is None:
        findings.append(
            Finding(
                "info",
                name,
                f"--kv-offloading-backend {settings.kv_offloading_backend} without "
                f"--kv-offloading-size enables nothing in vLLM {prediction.vllm} "
                "(offloading starts only with a size), so it is not offloading here",
            )
        )
    findings += _shape_findings(prediction)
    findings += dspark_long_prompt.findings(prediction.engine)
    return findings


def _capacity_line(prediction: Prediction, fixed: bool) -> str:
    """The decision's capacity figures, each stated once."""
    decision = prediction.decision
    at = f"max_model_len {decision.max_model_len}"
    parts = []
    if decision.fix_tokens is not None and (fixed and decision.applies):
        parts.append(f"the fix's {decision.geometry.value} layout {decision.fix_tokens:,}")
    if decision.upstream_tokens is not None and decision.upstream is not None:
        parts.append(
            f"upstream's --block-size {decision.upstream.block_size} layout "
            f"{decision.upstream_tokens:,}"
        )
    if prediction.best_working_upstream is not None:
        size, tokens = prediction.best_working_upstream
        parts.append(f"upstream's working --block-size {size} layout {tokens:,}")
    if not parts:
        return f"KV capacity not planned here: {'; '.join(decision.evidence) or 'no figures'}"
    return (
        f"KV tokens per GiB per rank at {at} (vLLM's planner on the model's layers): "
        + "; ".join(parts)
    )


def _upstream_findings(
    prediction: Prediction, fixed: bool, why_not: Finding | None = None
) -> list[Finding]:
    """What upstream's own layout does on SM12x for the line, from the
    decision (which ``doctor --json`` prints as its ``dsv41`` object)."""
    from vllm_mla_fixes.report import ENABLE_ALL_ADVICE, Finding

    name = INFO.name
    decision = prediction.decision
    facts = prediction.report()
    layout = decision.upstream
    if layout is None:
        return [Finding("warn", name, "; ".join(decision.evidence), facts=facts)]
    size = f"--block-size {layout.block_size}"
    if layout.works and not decision.applies:
        return [
            Finding(
                "ok",
                name,
                f"upstream's {size} layout starts, and every page it hands a kernel is inside "
                f"the installed kernels' own envelopes: the fix steps aside on this line "
                f"(decision {UPSTREAM}; {decision.reason})",
                facts=facts,
            )
        ]
    if layout.works:
        return [
            Finding(
                "info",
                name,
                f"upstream's {size} layout starts, and every page it hands a kernel is inside "
                f"the installed kernels' own envelopes, but the fix's {decision.geometry.value} "
                f"geometry holds at least {GAIN_TO_APPLY:.2f}x its KV tokens for this line, so "
                + ("the fix applies" if fixed else "the fix would apply if it were enabled")
                + f" ({decision.reason})",
                facts=facts,
            )
        ]
    if not layout.starts:
        problem = f"does not start: {(layout.start_error or '').rstrip('.')}"
    elif layout.rejected:
        problem = "starts, but " + "; ".join(
            f"{r.kernel} rejects the {r.cache} pages of {r.rows} rows" for r in layout.rejected
        )
    else:
        problem = "cannot be judged: " + "; ".join(layout.unknown)
    if fixed:
        return _fixed_findings(prediction, size, problem, facts)
    return [
        Finding(
            "error",
            name,
            f"upstream's {size} layout {problem}, and "
            + (why_not.message if why_not else "the fix is not enabled here"),
            why_not.advice if why_not else ENABLE_ALL_ADVICE,
            facts=facts,
        )
    ]


def _fixed_findings(
    prediction: Prediction, size: str, problem: str, facts: dict[str, Any]
) -> list[Finding]:
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    findings = [
        Finding(
            "info",
            name,
            f"upstream's {size} layout {problem}; the fix lays out its "
            f"{prediction.decision.geometry.value} geometry instead",
            facts=facts,
        )
    ]
    versus = prediction.vs_best_working_upstream
    if versus is not None and versus < 1 and prediction.best_working_upstream is not None:
        better = prediction.best_working_upstream[0]
        findings.append(
            Finding(
                "warn",
                name,
                f"upstream's own --block-size {better} layout works on this vLLM and holds "
                f"more KV tokens than the fix's layout for this line ({versus:.3f}x)",
                f"serve with --block-size {better}: the fix then steps aside",
            )
        )
    return findings


def _shape_findings(prediction: Prediction) -> list[Finding]:
    from vllm_mla_fixes.report import Finding

    name = INFO.name
    tp = prediction.settings.tensor_parallel_size
    if prediction.shape_problem:
        return [
            Finding(
                "warn", name, f"per-rank FlashInfer shape not checked: {prediction.shape_problem}"
            )
        ]

    def described(shape: Shape) -> str:
        extra = f", extra page {shape.extra_page}" if shape.extra_page else ""
        return (
            f"{shape.heads} heads (TP {tp}), top-k {shape.topk}, page {shape.page}"
            f"{extra} ({shape.role})"
        )

    shapes = prediction.shapes
    version = shapes[0].flashinfer if shapes else "?"
    findings = []
    for shape in (s for s in shapes if not s.decode_kernel):
        reported = f"; reported in {shape.reported}" if shape.reported else ""
        findings.append(
            Finding(
                "error",
                name,
                f"FlashInfer {version} has no SM120 sparse-MLA decode kernel for this rank's "
                f"shape: {described(shape)} (flashinfer.mla.supported_sparse_mla_sm120_configs())"
                f"{reported}",
                f"use FlashInfer {RUNTIME_ENVELOPE_FLASHINFER} or newer (its DSV4 decode envelope "
                "takes any head count up to 128 and any top-k), or another --tensor-parallel-size",
            )
        )
    accepted = [s for s in shapes if s.decode_kernel]
    if accepted:
        reports = [f"{described(s)}: {s.reported}" for s in accepted if s.reported]
        findings.append(
            Finding(
                "ok",
                name,
                f"FlashInfer {version}'s SM120 decode envelope takes this rank's shapes: "
                + "; ".join(described(shape) for shape in accepted)
                + (
                    f" (a shape users hit on older FlashInfer: {'; '.join(reports)})"
                    if reports
                    else ""
                )
                + "; supported_sparse_mla_sm120_configs() describes decode kernels only, so "
                "prefill is not checked here",
            )
        )
    return findings


RUNTIME_ENVELOPE_FLASHINFER = "0.7.0.post1"
"""Oldest FlashInfer in this project's locks (vLLM 0.32.0's): its DSV4 decode
envelope takes any head count up to 128 and any top-k.  FlashInfer 0.6.18
(main as of 2026-08-22) instantiated fixed (heads, top-k) pairs with top-k in
{128, 192, 256, 512, 1024}: 64 heads with top-k 1152 (vllm#56837) had neither
a decode nor a prefill kernel there."""
