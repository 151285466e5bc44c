"""``vllm-mla-fixes doctor [--json] [-- <vllm serve args>]``.

Reports the environment (the reports' checklists, automated) and, given the
operator's serve line, which known failure that line would hit here, whether
a fix of this package covers it, and what to do.  It never raises: bad input
gets one clear line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from vllm_mla_fixes.fixes import ALL_FIXES

PACKAGES = ("vllm", "torch", "torchaudio", "torchvision", "flashinfer-python", "flashinfer-cubin",
            "flashinfer-jit-cache", "nvidia-cutlass-dsl", "quack-kernels", "deep-gemm",
            "cuda-python", "cuda-bindings", "vllm-mla-fixes")
SPARSE_MLA_ARCHITECTURES = {"GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"}
MLA_ARCHITECTURES = SPARSE_MLA_ARCHITECTURES | {
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration",
    "KimiK2ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM", "Mistral3ForConditionalGeneration",
}


class DoctorInputError(ValueError):
    """The serve line cannot be understood; the message says why."""


@dataclasses.dataclass
class Finding:
    level: str  # "ok" | "info" | "warn" | "error"
    topic: str
    message: str
    advice: str = ""


@dataclasses.dataclass
class Environment:
    packages: dict[str, str | None]
    gpu: str | None
    capability: tuple[int, int] | None
    torch_cuda: str | None
    vllm_plugins: str | None
    mla_fixes: str | None
    fix_states: dict[str, str]


@dataclasses.dataclass
class ServeLine:
    model: str | None
    architectures: list[str]
    model_config: dict
    kv_cache_dtype: str
    attention_backend: str | None
    block_size: int | None
    enforce_eager: bool
    kv_offloading: bool
    prefix_caching: bool | None
    kernel_config: dict
    attention_config: dict
    tensor_parallel_size: int
    moe_backend: str | None
    raw: list[str]


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _gpu() -> tuple[str | None, tuple[int, int] | None, str | None]:
    """Name and compute capability of GPU 0 through NVML (no CUDA context), else torch."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        capability = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
        name = name.decode() if isinstance(name, bytes) else name
    except Exception:
        name, capability = None, None
    torch_cuda = None
    try:
        import torch

        torch_cuda = torch.version.cuda
        if capability is None and torch.cuda.is_available():
            name, capability = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
    except Exception:
        pass
    return name, capability, torch_cuda


def _fix_states() -> dict[str, str]:
    """What the plugin does in a process of this environment, via vLLM's own loader."""
    if _package_version("vllm") is None:
        return {}
    try:
        import vllm.plugins

        import vllm_mla_fixes

        vllm.plugins.load_general_plugins()
        return {s.name: s.label() if s.label() != "not-needed" else f"not-needed: {s.reason}"
                for s in vllm_mla_fixes.status()}
    except Exception as exc:
        return {m.INFO.name: f"unknown: loading vLLM failed ({type(exc).__name__}: {exc})"
                for m in ALL_FIXES}


def read_environment(load_plugins: bool = True) -> Environment:
    name, capability, torch_cuda = _gpu()
    return Environment(
        packages={p: _package_version(p) for p in PACKAGES},
        gpu=name, capability=capability, torch_cuda=torch_cuda,
        vllm_plugins=os.environ.get("VLLM_PLUGINS"),
        mla_fixes=os.environ.get("VLLM_MLA_FIXES"),
        fix_states=_fix_states() if load_plugins else {},
    )


def _json_option(value: str | None, flag: str) -> dict:
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise DoctorInputError(f"{flag} is not valid JSON ({exc.msg}): {value!r}") from exc
    if not isinstance(parsed, dict):
        raise DoctorInputError(f"{flag} must be a JSON object, got {value!r}")
    return parsed


def _model_config(model: str | None) -> dict:
    """config.json of a local model directory, or of a Hugging Face cache snapshot."""
    if not model:
        return {}
    candidates = [Path(model) / "config.json"]
    hub = Path(os.environ.get("HF_HUB_CACHE", Path.home() / ".cache" / "huggingface" / "hub"))
    candidates += sorted(hub.glob(f"models--{model.replace('/', '--')}/snapshots/*/config.json"))
    for path in candidates:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
    return {}


def parse_serve_args(argv: list[str]) -> ServeLine:
    """The flags of a ``vllm serve`` line that matter to the known failures."""
    if argv and argv[0] == "vllm":
        argv = argv[1:]
    if argv and argv[0] == "serve":
        argv = argv[1:]
    expanded = []
    for arg in argv:  # vLLM also accepts --group.key=value
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key, _, val = arg[2:].partition("=")
            group, _, field = key.partition(".")
            expanded += [f"--{group}", json.dumps({field: _scalar(val)})]
        else:
            expanded.append(arg)
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--attention-backend")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-offloading-size")
    parser.add_argument("--kv-offloading-backend")
    parser.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=None)
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--kernel-config", action="append")
    parser.add_argument("--attention-config", action="append")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--moe-backend")
    try:
        known, _ = parser.parse_known_args(expanded)
    except SystemExit as exc:  # argparse's way of saying "bad value"
        raise DoctorInputError(f"cannot parse the serve arguments: {shlex.join(argv)}") from exc
    kernel_config, attention_config = {}, {}
    for value in known.kernel_config or []:
        kernel_config.update(_json_option(value, "--kernel-config"))
    for value in known.attention_config or []:
        attention_config.update(_json_option(value, "--attention-config"))
    model = known.model or known.model_tag
    config = _model_config(model)
    return ServeLine(
        model=model, architectures=list(config.get("architectures") or []), model_config=config,
        kv_cache_dtype=known.kv_cache_dtype, attention_backend=known.attention_backend,
        block_size=known.block_size, enforce_eager=known.enforce_eager,
        kv_offloading=known.kv_offloading_size is not None or known.kv_offloading_backend is not None,
        prefix_caching=known.prefix_caching, kernel_config=kernel_config,
        attention_config=attention_config, tensor_parallel_size=known.tensor_parallel_size,
        moe_backend=known.moe_backend, raw=argv)


def _scalar(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# -- per-fix diagnoses -------------------------------------------------------------


def _fix_verdict(env: Environment, name: str) -> Finding:
    state = env.fix_states.get(name)
    if state == "applied":
        return Finding("ok", name, "the fix is applied in this environment", "run the same serve line")
    if env.packages.get("vllm-mla-fixes") is None:
        return Finding("error", name, "vllm-mla-fixes is not installed where vLLM runs",
                       "pip install vllm-mla-fixes into this environment")
    if env.vllm_plugins is not None and "mla_fixes" not in env.vllm_plugins.split(","):
        return Finding("error", name, f"VLLM_PLUGINS={env.vllm_plugins!r} does not name mla_fixes, "
                       "so vLLM never loads the fix", "add mla_fixes to VLLM_PLUGINS (comma list)")
    if state and state.startswith("not-needed"):
        return Finding("info", name, f"the plugin does not apply the fix in this process ({state}); "
                       "each vLLM process decides again on its own GPU",
                       "run doctor on the serving node to see the decision there")
    return Finding("error", name, f"the fix is not applied here: {state or 'not evaluated'}",
                   "see `vllm-mla-fixes status`; VLLM_MLA_FIXES=all enables every needed fix")


def diagnose_fp8_ds_mla(env: Environment, serve: ServeLine | None) -> list[Finding]:
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape as fix

    name = fix.INFO.name
    vllm_version = env.packages.get("vllm")
    if not vllm_version or not fix.INFO.admits(vllm_version):
        return [Finding("ok", name, f"vLLM {vllm_version} does not have this bug "
                        f"(affected: {', '.join(fix.INFO.affected_releases)})")]
    if serve is None:
        return [Finding("info", name, f"vLLM {vllm_version} has this bug for sparse-MLA models "
                        "(GLM-5.x, DeepSeek-V3.2) with --kv-cache-dtype fp8 on FLASHMLA_SPARSE"),
                _fix_verdict(env, name)]
    findings = []
    archs = set(serve.architectures)
    sparse = bool(archs & SPARSE_MLA_ARCHITECTURES) or "index_topk" in serve.model_config
    if not serve.model_config:
        findings.append(Finding("info", name, f"cannot read the config of {serve.model!r} offline; "
                                "assuming it may be a sparse-MLA model"))
        sparse = True
    fp8 = serve.kv_cache_dtype.startswith("fp8")
    sm = env.capability[0] if env.capability else None
    backend = serve.attention_backend or ("FLASHMLA_SPARSE" if sm == 9 else None)
    if not (sparse and fp8):
        findings.append(Finding("ok", name, "this line does not store fp8_ds_mla "
                                f"(sparse MLA: {sparse}, --kv-cache-dtype {serve.kv_cache_dtype})"))
        return findings
    if backend not in ("FLASHMLA_SPARSE", None):
        findings.append(Finding("ok", name, f"--attention-backend {backend}: this failure is "
                                "specific to FLASHMLA_SPARSE"))
        return findings
    findings.append(Finding("warn", name, f"vLLM {vllm_version} + sparse MLA + --kv-cache-dtype "
                            f"{serve.kv_cache_dtype} (stored as fp8_ds_mla, 656 B/token) on "
                            f"{backend or 'FLASHMLA_SPARSE (likely on this GPU)'} fails at start-up: "
                            f"{fix.INFO.error}"))
    if serve.enforce_eager:
        findings.append(Finding("warn", name, "--enforce-eager does not avoid this crash on 0.25.x: "
                                "KV-cache initialisation fails the same way after profiling is skipped",
                                "drop --enforce-eager once the fix is applied (it costs CUDA-graph speed)"))
    if serve.kv_offloading or serve.prefix_caching:
        findings.append(Finding("info", name, "KV offloading / prefix caching are not a factor: the "
                                "reshape fails before either is used; no need to remove them"))
    findings.append(_fix_verdict(env, name))
    return findings


def _major_minor(ver: str | None) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(ver).release[:2] if ver else None
    except InvalidVersion:
        return None


def diagnose_dsv41_sm120(env: Environment, serve: ServeLine | None) -> list[Finding]:
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix

    name = fix.INFO.name
    vllm_version = env.packages.get("vllm")
    if not vllm_version or not fix.INFO.admits(vllm_version):
        return [Finding("ok", name, f"vLLM {vllm_version} is outside the releases this fix reviews "
                        f"({', '.join(fix.INFO.affected_releases)})")]
    if serve is not None and serve.model_config and "DeepseekV41ForCausalLM" not in serve.architectures:
        return [Finding("ok", name, "not a DeepSeek-V4.1 model")]
    sm = env.capability
    if sm is not None and sm[0] != 12:
        return [Finding("ok", name, f"SM{sm[0]}{sm[1]}: the page-geometry failure is specific to "
                        "SM120/SM121 (FlashInfer's SM120 sparse-MLA and indexer kernels); nothing changes here")]
    findings = [Finding("info", name, f"GPU {'SM%d%d' % sm if sm else 'not visible'}: SM120 (RTX PRO 6000) "
                        "and SM121 (GB10) are both compute capability 12.x; the fix applies to both "
                        "(neither has been run on hardware by this project)")]
    fi, cubin, jit = (env.packages.get(p) for p in ("flashinfer-python", "flashinfer-cubin",
                                                      "flashinfer-jit-cache"))
    if fi and cubin and fi != cubin:
        findings.append(Finding("error", name, f"flashinfer-cubin {cubin} != flashinfer-python {fi}",
                                f"pip install flashinfer-cubin=={fi}"))
    if jit is None:
        findings.append(Finding("warn", name, "flashinfer-jit-cache is not installed: SM120 kernels come "
                                "from the sm120f jit-cache; the report installs its 4 KB shim with --no-deps",
                                "pip install --no-deps the flashinfer-jit-cache matching flashinfer-python"))
    elif fi and jit.split("+")[0] != fi:
        findings.append(Finding("error", name, f"flashinfer-jit-cache {jit} does not match flashinfer-python "
                                f"{fi}; FlashInfer refuses to start (unless FLASHINFER_DISABLE_VERSION_CHECK=1)",
                                f"install flashinfer-jit-cache {fi} (a +cuXXX suffix is fine)"))
    torch_v, audio_v = env.packages.get("torch"), env.packages.get("torchaudio")
    if audio_v and _major_minor(audio_v) != _major_minor(torch_v):
        findings.append(Finding("warn", name, f"torchaudio {audio_v} was built for another torch than "
                                f"{torch_v} (vLLM {vllm_version}'s own pins); it can fail to load",
                                "pip uninstall -y torchaudio (a language-model-only serve does not need it)"))
    py_v, bind_v = env.packages.get("cuda-python"), env.packages.get("cuda-bindings")
    if py_v and bind_v and _major_minor(py_v)[:1] != _major_minor(bind_v)[:1]:
        findings.append(Finding("warn", name, f"cuda-python {py_v} beside cuda-bindings {bind_v}: both write "
                                "cuda/bindings, and vllm.models.deepseek_v41 then fails to import "
                                "(cuda.bindings.runtime has no attribute cudaLibrary_t)",
                                f"pip install cuda-python=={bind_v.split('+')[0]} cuda-bindings=={bind_v.split('+')[0]}"))
    if serve is None:
        findings.append(_fix_verdict(env, name))
        return findings
    attention = serve.attention_config
    if str(attention.get("indexer_kv_dtype", "fp8")).lower() == "mxfp4":
        findings.append(Finding("error", name, "indexer_kv_dtype='mxfp4' requires SM10x (B200/GB200); "
                                "SM120 rejects it at start-up",
                                "use --attention-config '{\"indexer_kv_dtype\": \"fp8\"}'"))
    if attention.get("indexer_sparse_logits"):
        findings.append(Finding("error", name, "indexer_sparse_logits needs the MXFP4 indexer cache, which "
                                "SM120 does not support", "remove indexer_sparse_logits"))
    block = serve.block_size
    fixed = env.fix_states.get(name) == "applied"
    if block == 64 and not fixed:
        findings.append(Finding("warn", name, f"--block-size 64 fails at start-up: {fix.INFO.error}"))
    elif block in (None, 128) and not fixed:
        findings.append(Finding("warn", name, "--block-size 128 starts, but page 32 reaches FlashInfer: "
                                "that is the 32-token sliding-window cache of a SWA-only layer (not a "
                                "ratio-2 page, as the report says); FlashInfer 0.7.0.post1 rejects it on the "
                                "first request (page_block_size=32), and SM120's indexer takes only 64-state "
                                "pages while ratio-1 layers get 128"))
    if fixed:
        findings.append(Finding("info", name, "with the fix, --block-size no longer decides these pages on "
                                "SM12x: ratio-1 caches use 64-token blocks, ratio-2 128, sliding window 64 "
                                "(KV capacity about 0.65x of block-128 at 128k context: see README)"))
    findings.append(Finding("info", name, "PR #56509 (64-token kernel blocks inside 128-token blocks) "
                            "starts but writes ratio-1 latents through untranslated slots into other "
                            "layers' pages: U+FFFD output; do not serve with it"))
    if (serve.moe_backend or "auto") in ("triton", "b12x"):
        findings.append(Finding("error", name, f"--moe-backend {serve.moe_backend} is not supported on SM120",
                                "leave it on auto (DEEPGEMM_MXFP4) or use --moe-backend marlin"))
    findings.append(_fix_verdict(env, name))
    return findings


def diagnose_fa4(env: Environment, serve: ServeLine | None) -> list[Finding]:
    from vllm_mla_fixes.fixes import fa4_compile_strides

    return fa4_compile_strides.doctor_findings(env, serve)


DIAGNOSES = {
    "fp8-ds-mla-reshape": diagnose_fp8_ds_mla,
    "fa4-compile-strides": diagnose_fa4,
    "dsv41-sm120-geometry": diagnose_dsv41_sm120,
}


def environment_findings(env: Environment) -> list[Finding]:
    findings = []
    if env.packages.get("vllm") is None:
        findings.append(Finding("error", "environment", "vLLM is not installed in this environment",
                                "run doctor with the Python environment that runs `vllm serve`"))
    if env.vllm_plugins is not None and "mla_fixes" not in env.vllm_plugins.split(","):
        findings.append(Finding("error", "environment",
                                f"VLLM_PLUGINS={env.vllm_plugins!r} excludes this plugin",
                                "add mla_fixes to VLLM_PLUGINS, or unset it"))
    return findings


def run(argv: list[str], as_json: bool = False, print_=print) -> int:
    """Exit status: 0 nothing blocks this line here, 1 something does, 2 bad input."""
    try:
        serve = parse_serve_args(argv) if argv else None
    except DoctorInputError as exc:
        print_(f"doctor: {exc}")
        return 2
    env = read_environment()
    findings = environment_findings(env)
    for module in ALL_FIXES:
        diagnose = DIAGNOSES.get(module.INFO.name)
        if diagnose is not None:
            findings += diagnose(env, serve)
    if as_json:
        print_(json.dumps({"environment": dataclasses.asdict(env),
                           "serve": dataclasses.asdict(serve) if serve else None,
                           "findings": [dataclasses.asdict(f) for f in findings]}, indent=2))
    else:
        _print_human(env, serve, findings, print_)
    return 1 if any(f.level == "error" for f in findings) else 0


def _print_human(env: Environment, serve: ServeLine | None, findings: list[Finding], print_) -> None:
    print_("Environment")
    for name, ver in env.packages.items():
        print_(f"  {name:<22} {ver or '-'}")
    gpu = f"{env.gpu} (SM{env.capability[0]}{env.capability[1]})" if env.capability else "none visible"
    print_(f"  {'GPU':<22} {gpu}")
    print_(f"  {'torch CUDA':<22} {env.torch_cuda or '-'}")
    print_(f"  {'VLLM_PLUGINS':<22} {env.vllm_plugins if env.vllm_plugins is not None else '(unset: all plugins)'}")
    print_(f"  {'VLLM_MLA_FIXES':<22} {env.mla_fixes or '(unset: all)'}")
    for name, state in env.fix_states.items():
        print_(f"  fix {name:<18} {state}")
    if serve is not None:
        print_(f"Serve line: {shlex.join(serve.raw)}")
        print_(f"  model {serve.model} ({', '.join(serve.architectures) or 'architecture unknown'})")
    print_("Findings")
    marks = {"ok": "ok  ", "info": "info", "warn": "WARN", "error": "FAIL"}
    for f in findings:
        print_(f"  [{marks[f.level]}] {f.topic}: {f.message}")
        if f.advice:
            print_(f"         -> {f.advice}")
