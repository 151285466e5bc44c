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
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path

from vllm_mla_fixes import __version__
from vllm_mla_fixes.fixes import ALL_FIXES
from vllm_mla_fixes.patching import release_decision
from vllm_mla_fixes.report import (
    Environment,
    Finding,
    ServeLine,
    major_minor,
    plugins_advice,
    release_finding,
)

PACKAGES = (
    "vllm",
    "torch",
    "torchaudio",
    "torchvision",
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "deep-gemm",
    "cuda-python",
    "cuda-bindings",
    "vllm-mla-fixes",
)
# A coherent cuda-python/cuda-bindings pair: what this project's vLLM 0.32/0.33
# locks pin.  Uninstall first: pip installs the new cuda-bindings before it
# removes cuda-python 12.x, whose RECORD lists the same cuda/bindings files, so
# a plain `pip install` of the pair deletes what it just wrote (a test runs
# this command in a scratch environment that has the clash).
CUDA_PYTHON_PAIR = "13.4.4"
CUDA_PYTHON_REMEDY = (
    "pip uninstall -y cuda-python cuda-bindings && "
    f"pip install cuda-python=={CUDA_PYTHON_PAIR} cuda-bindings=={CUDA_PYTHON_PAIR}"
)


class DoctorInputError(ValueError):
    """The serve line cannot be understood; the message says why."""


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _plugin_version() -> str | None:
    """vllm-mla-fixes where vLLM runs: its own distribution, or the patched vLLM
    wheel (``build-wheel``) that carries the package inside it."""
    own = _package_version("vllm-mla-fixes")
    if own is not None:
        return own
    if "vllm" in packages_distributions().get("vllm_mla_fixes", ()):
        return f"{__version__} (inside vllm {_package_version('vllm')})"
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


def _fix_states() -> dict[str, dict[str, str]]:
    """What the plugin does in a process of this environment, via vLLM's own loader."""
    if _package_version("vllm") is None:
        return {}
    try:
        import vllm.plugins

        import vllm_mla_fixes

        vllm.plugins.load_general_plugins()
        return {
            s.name: {"state": s.state.value, "reason": s.reason} for s in vllm_mla_fixes.status()
        }
    except Exception as exc:
        return {
            m.INFO.name: {
                "state": "unknown",
                "reason": f"loading vLLM failed ({type(exc).__name__}: {exc})",
            }
            for m in ALL_FIXES
        }


def read_environment(load_plugins: bool = True) -> Environment:
    name, capability, torch_cuda = _gpu()
    return Environment(
        packages={
            p: _plugin_version() if p == "vllm-mla-fixes" else _package_version(p) for p in PACKAGES
        },
        gpu=name,
        capability=capability,
        torch_cuda=torch_cuda,
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
    parser.add_argument(
        "--enable-prefix-caching", dest="prefix_caching", action="store_true", default=None
    )
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--kernel-config", action="append")
    parser.add_argument("--attention-config", action="append")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--moe-backend")
    parser.add_argument("-sc", "--speculative-config")
    parser.add_argument("--kv-transfer-config")
    parser.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=1)
    parser.add_argument("-pcp", "--prefill-context-parallel-size", type=int, default=1)
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
        model=model,
        architectures=list(config.get("architectures") or []),
        model_config=config,
        kv_cache_dtype=known.kv_cache_dtype,
        attention_backend=known.attention_backend,
        block_size=known.block_size,
        enforce_eager=known.enforce_eager,
        kv_offloading=known.kv_offloading_size is not None
        or known.kv_offloading_backend is not None,
        prefix_caching=known.prefix_caching,
        kernel_config=kernel_config,
        attention_config=attention_config,
        tensor_parallel_size=known.tensor_parallel_size,
        moe_backend=known.moe_backend,
        speculative=known.speculative_config is not None,
        kv_connector=known.kv_transfer_config is not None,
        decode_context_parallel_size=known.decode_context_parallel_size,
        prefill_context_parallel_size=known.prefill_context_parallel_size,
        raw=argv,
    )


def _scalar(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def environment_findings(env: Environment) -> list[Finding]:
    """What is wrong with the environment itself, whichever fix is concerned."""
    findings = []
    if env.packages.get("vllm") is None:
        findings.append(
            Finding(
                "error",
                "environment",
                "vLLM is not installed in this environment",
                "run doctor with the Python environment that runs `vllm serve`",
            )
        )
    if env.vllm_plugins is not None and "mla_fixes" not in env.vllm_plugins.split(","):
        findings.append(
            Finding(
                "error",
                "environment",
                f"VLLM_PLUGINS={env.vllm_plugins!r} excludes this plugin",
                plugins_advice(env.vllm_plugins),
            )
        )
    py_v, bind_v = env.packages.get("cuda-python"), env.packages.get("cuda-bindings")
    if py_v and bind_v and (major_minor(py_v) or (0,))[:1] != (major_minor(bind_v) or (0,))[:1]:
        findings.append(
            Finding(
                "warn",
                "environment",
                f"cuda-python {py_v} beside cuda-bindings {bind_v}: "
                "both write cuda/bindings, and whichever was installed last wins; with "
                "12.x files, vllm.models.deepseek_v41 fails to import "
                "(cuda.bindings.runtime has no attribute cudaLibrary_t)",
                CUDA_PYTHON_REMEDY,
            )
        )
    return findings


def diagnose(
    serve_args: list[str], load_plugins: bool = True
) -> tuple[Environment, ServeLine | None, list[Finding]]:
    """Environment, parsed serve line and every fix's findings (each fix module
    has ``diagnose(env, serve)``); raises DoctorInputError on a bad serve line."""
    serve = parse_serve_args(serve_args) if serve_args else None
    env = read_environment(load_plugins)
    findings = environment_findings(env)
    vllm_version = env.packages.get("vllm")
    if vllm_version is None:  # the environment findings say so; no fix can be judged
        return env, serve, findings
    for fix in ALL_FIXES:
        decided = release_decision(fix.INFO, vllm_version)  # the plugin's own rule
        if decided is None:
            findings += fix.diagnose(env, serve)
        else:
            findings.append(release_finding(fix.INFO.name, decided, fix.INFO.newest_reviewed))
    return env, serve, findings


def report(
    env: Environment,
    serve: ServeLine | None,
    findings: list[Finding],
    as_json: bool = False,
    print_=print,
) -> int:
    """Print the report; exit status: 0 nothing blocks this line here, 1 something does."""
    if as_json:
        print_(
            json.dumps(
                {
                    "vllm_mla_fixes": __version__,
                    "environment": dataclasses.asdict(env),
                    "serve": dataclasses.asdict(serve) if serve else None,
                    "findings": [dataclasses.asdict(f) for f in findings],
                },
                indent=2,
            )
        )
    else:
        _print_human(env, serve, findings, print_)
    return 1 if any(f.level == "error" for f in findings) else 0


def _print_human(
    env: Environment, serve: ServeLine | None, findings: list[Finding], print_
) -> None:
    print_(f"vllm-mla-fixes {__version__} doctor")
    print_("Environment")
    for name, ver in env.packages.items():
        print_(f"  {name:<22} {ver or '-'}")
    gpu = (
        f"{env.gpu} (SM{env.capability[0]}{env.capability[1]})"
        if env.capability
        else "none visible"
    )
    print_(f"  {'GPU':<22} {gpu}")
    print_(f"  {'torch CUDA':<22} {env.torch_cuda or '-'}")
    print_(
        f"  {'VLLM_PLUGINS':<22} {env.vllm_plugins if env.vllm_plugins is not None else '(unset: all plugins)'}"
    )
    print_(f"  {'VLLM_MLA_FIXES':<22} {env.mla_fixes or '(unset: all)'}")
    for name in env.fix_states:
        print_(f"  fix {name:<18} {env.fix_state(name)}: {env.fix_reason(name)}")
    if serve is not None:
        print_(f"Serve line: {shlex.join(serve.raw)}")
        print_(
            f"  model {serve.model} ({', '.join(serve.architectures) or 'architecture unknown'})"
        )
    print_("Findings")
    marks = {"ok": "ok  ", "info": "info", "warn": "WARN", "error": "FAIL"}
    for f in findings:
        print_(f"  [{marks[f.level]}] {f.topic}: {f.message}")
        if f.advice:
            print_(f"         -> {f.advice}")
