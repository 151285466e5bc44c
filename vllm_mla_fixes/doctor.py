"""``vllm-mla-fixes doctor [--json] [-- <vllm serve args>]``.

Reports the environment (the reports' checklists, automated) and, given the
operator's serve line, which known failure that line would hit on the node
that serves it, whether a fix of this package covers it, and what to do; then
one verdict.  The line is first checked by the installed vLLM's own parser and
config classes.  It never raises: bad input gets one clear line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import importlib
import json
import shlex
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path
from typing import Any

from vllm_mla_fixes import __version__, serve_line, settings
from vllm_mla_fixes.fixes import ALL_FIXES, SETTINGS
from vllm_mla_fixes.patching import release_decision
from vllm_mla_fixes.report import (
    PLUGIN,
    Environment,
    Finding,
    ServeLine,
    architectures_by_name,
    major_minor,
    plugins_advice,
    release_finding,
    runs_elsewhere,
    shell_word,
    spaced_note,
)

READY = "READY"
READY_WITH_WARNINGS = "READY WITH WARNINGS"
WILL_FAIL = "WILL FAIL"
EXIT_STATUS = {READY: 0, READY_WITH_WARNINGS: 1, WILL_FAIL: 2}
HELP_EPILOG = f"""\
The last line of the report is the verdict, for the node that serves the line
(with the plugin loaded there, as vllm serve loads it):
  {READY}                  nothing known stops this line      exit status 0
  {READY_WITH_WARNINGS}    it starts; read the WARN lines     exit status 1
  {WILL_FAIL}: <reason>    it stops, or cannot be checked     exit status 2
The serve line is checked by the installed vLLM's own parser and config classes;
what they reject is quoted, in vLLM's words.  A line with no model, or that
doctor cannot read, is exit status 2 with one line on stderr.
--json prints one JSON document on stdout: the report with "verdict", "reason"
and "exit_status", or {{"error": ..., "exit_status": 2}}.

examples:
  vllm-mla-fixes doctor
  vllm-mla-fixes doctor -- vllm serve deepseek-ai/DeepSeek-V4.1-Flash --block-size 64
"""

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

# A torchaudio built for another torch fails to import; nothing vLLM serves
# for a language model needs it (a test runs this command).
TORCHAUDIO_REMEDY = "pip uninstall -y torchaudio"


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


def _torchaudio_error() -> str | None:
    """Why torchaudio, where installed, does not import in this environment.
    Its version beside torch's says nothing: vLLM's own locks pair torchaudio
    2.11 with torch 2.13 and 2.14, and it imports there."""
    if _package_version("torchaudio") is None:
        return None
    try:
        importlib.import_module("torchaudio")
    except Exception as exc:  # an extension built for another torch: OSError, ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def read_environment(load_plugins: bool = True) -> Environment:
    name, capability, torch_cuda = _gpu()
    return Environment(
        packages={
            p: _plugin_version() if p == "vllm-mla-fixes" else _package_version(p) for p in PACKAGES
        },
        gpu=name,
        capability=capability,
        torch_cuda=torch_cuda,
        vllm_plugins=settings.environment_variable("VLLM_PLUGINS"),
        mla_fixes=settings.environment_variable(settings.FIXES_VARIABLE),
        fix_states=_fix_states() if load_plugins else {},
        torchaudio_error=_torchaudio_error(),
    )


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub resolves it."""
    hub = settings.environment_variable("HF_HUB_CACHE")
    if hub:
        return Path(hub)
    home = settings.environment_variable("HF_HOME") or Path(
        settings.environment_variable("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface"
    )
    return Path(home) / "hub"


def _model_config(model: str | None) -> tuple[dict[str, Any], str]:
    """config.json of a local model folder, or of its hub cache snapshot (the
    one ``refs/main`` names first), and where it was read."""
    if not model:
        return {}, ""
    repo = hub_cache() / f"models--{model.replace('/', '--')}"
    candidates = [(Path(model) / "config.json", "config.json in the model folder")]
    try:
        main = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
        candidates.append((repo / "snapshots" / main / "config.json", "hub cache"))
    except OSError:
        pass
    candidates += [(path, "hub cache") for path in sorted(repo.glob("snapshots/*/config.json"))]
    for path, where in candidates:
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError, RecursionError):  # vLLM's own reader says what is wrong
            continue
        if isinstance(config, dict):
            return config, f"{where}: {path}"
    return {}, ""


def _model(model: str | None) -> tuple[dict[str, Any], list[str], str]:
    """The model's config, architectures and where they come from."""
    config, source = _model_config(model)
    if config:
        listed = config.get("architectures")
        # a list of names, as vLLM takes it; anything else is vLLM's to refuse, never letters
        names = [a for a in listed if isinstance(a, str)] if isinstance(listed, list) else []
        return config, names, source
    by_name = architectures_by_name(model or "")
    elsewhere = f"no config.json in {model!r} or under {hub_cache()}"
    if by_name:
        return {}, by_name, f"by its name ({elsewhere})"
    return {}, [], elsewhere


def serve_of(argv: list[str], args: argparse.Namespace) -> ServeLine:
    """The line as every fix's ``diagnose`` reads it: ``args`` is the
    namespace ``vllm serve``'s own parser built from ``argv``
    (``serve_line.parse``), so every spelling it accepts (abbreviations,
    underscores, ``-ac``, ``--group.key value``, ``--config`` YAML) means the
    same here; the settings that matter to the known failures are read from
    it, and it is kept whole for a fix that builds vLLM's configs from it.
    Config options are the settings the line changes from what
    ``vllm serve`` alone gets, whichever form the release's parser gives them
    (a dict, or vLLM's config dataclass)."""
    from vllm_mla_fixes import serve_line

    bare = serve_line.bare_line()
    attention_config = _changed(_option(args, "attention_config"), bare.get("attention_config"))
    kernel_config = _changed(_option(args, "kernel_config"), bare.get("kernel_config"))
    moe_backend = _option(args, "moe_backend")
    if moe_backend == bare.get("moe_backend"):  # vLLM then keeps the kernel config's
        moe_backend = kernel_config.get("moe_backend")
    offloading_backend = _option(args, "kv_offloading_backend")
    model = args.model
    config, architectures, source = _model(model)
    return ServeLine(
        model=model,
        architectures=architectures,
        model_config=config,
        kv_cache_dtype=str(_plain(_option(args, "kv_cache_dtype") or "auto")),
        attention_backend=_text(_option(args, "attention_backend"))
        or _text(attention_config.get("backend")),
        block_size=_option(args, "block_size"),
        enforce_eager=bool(_option(args, "enforce_eager")),
        kv_offloading=_option(args, "kv_offloading_size") is not None
        or offloading_backend != bare.get("kv_offloading_backend"),
        prefix_caching=_option(args, "enable_prefix_caching"),
        kernel_config=kernel_config,
        attention_config=attention_config,
        tensor_parallel_size=_option(args, "tensor_parallel_size") or 1,
        moe_backend=_text(moe_backend),
        speculative=_option(args, "speculative_config") is not None,
        kv_connector=_option(args, "kv_transfer_config") is not None,
        decode_context_parallel_size=_option(args, "decode_context_parallel_size") or 1,
        prefill_context_parallel_size=_option(args, "prefill_context_parallel_size") or 1,
        raw=argv,
        namespace=args,
        model_source=source,
    )


def _option(args: argparse.Namespace, name: str) -> Any:
    """An option of the namespace; None where this release has no such option."""
    return getattr(args, name, None)


def _text(value: object) -> str | None:
    return None if value is None else str(_plain(value))


def _plain(value: object) -> Any:
    """``value`` as JSON has it: an enum member as its name (vLLM's
    ``AttentionBackendEnum.FLASHMLA`` as ``FLASHMLA``, as the flag spells it),
    a config dataclass as a dict of its fields."""
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _changed(value: object, bare: object) -> dict[str, Any]:
    """The keys of a config option whose value differs from ``bare``'s, the
    same option on a line that sets nothing."""
    given, default = _plain(value), _plain(bare)
    if not isinstance(given, dict):
        return {}
    default = default if isinstance(default, dict) else {}
    missing = object()
    return {k: v for k, v in given.items() if default.get(k, missing) != v}


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
    if env.vllm_plugins is not None and PLUGIN not in env.vllm_plugins.split(","):
        findings.append(
            Finding(
                "error",
                "environment",
                f"VLLM_PLUGINS={settings.shown(env.vllm_plugins)} excludes this plugin"
                f"{spaced_note(env.vllm_plugins)}",
                plugins_advice(env.vllm_plugins),
            )
        )
    if env.torchaudio_error:
        findings.append(
            Finding(
                "warn",
                "environment",
                f"torchaudio {env.packages.get('torchaudio')} does not import here "
                f"({env.torchaudio_error}); whatever loads it then fails (vLLM's audio "
                "inputs; a language-model-only serve does not need it)",
                TORCHAUDIO_REMEDY,
            )
        )
    findings += setting_findings()
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


def setting_findings() -> list[Finding]:
    """A WARN for each VLLM_MLA_FIXES* variable whose value is not allowed
    (the plugin ignores it), a note for each name no setting has."""
    return [
        Finding("warn", "settings", reading.describe(), "give it an allowed value, or unset it")
        if reading.setting is not None
        else Finding("info", "settings", reading.describe())
        for reading in settings.readings(SETTINGS)
        if not reading.valid
    ]


def _no_model(default: str | None) -> str:
    served = f"vLLM's default model, {default}" if default else "vLLM's default model"
    return (
        f"the serve line names no model (`vllm serve` would serve {served}); "
        "name it: vllm-mla-fixes doctor -- vllm serve <model> [options]"
    )


def check_with_vllm(
    argv: list[str], vllm_version: str
) -> tuple[Finding, argparse.Namespace | None]:
    """The line through the installed vLLM's own parser and model-free config
    classes: an error in vLLM's words, else which of them accept it; with the
    namespace the parser built (None where the parser rejects the line), the
    one parse every finding reads.  Raises DoctorInputError when the line
    names no model."""
    args = None
    with serve_line.cuda_device_type_while_parsing():
        try:
            args = serve_line.parse(argv)
            if not serve_line.model_given(argv, args):
                raise DoctorInputError(_no_model(serve_line.default_model()))
            # vLLM's checks change the objects they are given (its engine config
            # turns the line's KV transfer config into the offloading connector's):
            # they read a copy, and the namespace stays as the parser built it
            copied = copy.deepcopy(args)
            built = serve_line.check_configs(copied)
            serve_line.check_engine_args(copied)
            local_model = serve_line.names_local_model(args.model)
            if local_model:
                serve_line.check_engine_config(copied)
        except serve_line.Rejected as exc:
            if args is not None and _offline(exc):
                return _offline_finding(argv, args.model), args
            return Finding(
                "error",
                "serve line",
                f"vLLM {vllm_version} rejects this line: {exc}",
                "correct the line: `vllm serve` stops on it too",
            ), args
    checked = f", its {', '.join(built)}" if built else ""
    model_checked = (
        ", and its engine config built from the model's config"
        if local_model
        else " (the model's own config is checked when vLLM starts)"
    )
    return Finding(
        "ok",
        "serve line",
        f"vLLM {vllm_version}'s `vllm serve` parser{checked} and its engine arguments "
        f"accept this line{model_checked}",
    ), args


# What huggingface_hub and its HTTP clients raise where the hub cannot be
# reached: HF_HUB_OFFLINE=1, or no network.
OFFLINE_ERRORS = frozenset(
    {
        "LocalEntryNotFoundError",
        "OfflineModeIsEnabled",
        "ConnectionError",
        "ConnectError",
        "ConnectTimeout",
        "MaxRetryError",
        "NameResolutionError",
    }
)
LOCAL_MODEL_PLACEHOLDER = "<folder with the model's config.json>"


def _offline(exc: BaseException) -> bool:
    """Whether ``exc`` or what it was raised from says the hub cannot be reached."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in OFFLINE_ERRORS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _hub_out_of_reach(model: str | None) -> bool:
    """Whether ``model`` is a hub name whose config.json is on this machine
    nowhere doctor reads, and the hub cannot be reached: vLLM raises only with
    HF_HUB_OFFLINE=1, and without it a machine with no network would be judged
    by the name alone, silently.  Asked of the hub itself (a model's info, a
    few seconds at most); a hub that answers, even "no such model", is reached."""
    if not model or serve_line.names_local_model(model) or _model_config(model)[0]:
        return False
    try:
        import huggingface_hub

        huggingface_hub.HfApi().model_info(model, timeout=HUB_TIMEOUT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - any answer but "unreachable" is an answer
        return _offline(exc)
    return False


HUB_TIMEOUT_SECONDS = 10


def _offline_finding(argv: list[str], model: str) -> Finding:
    """The hub is out of reach: the line may well be right, doctor cannot read
    the model's config; the same check with a local copy of it can."""
    local = [
        {
            model: LOCAL_MODEL_PLACEHOLDER,
            f"--model={model}": f"--model={LOCAL_MODEL_PLACEHOLDER}",
        }.get(arg, arg)
        for arg in argv
    ]
    return Finding(
        "warn",
        "model",
        f"cannot check the model's config: offline (HF_HUB_OFFLINE or no network); pass a "
        f"local path (the model's folder, or one holding just its config.json) in place of "
        f"{model}; meanwhile the model is judged by its name",
        f"vllm-mla-fixes doctor -- vllm serve {' '.join(shell_word(arg) for arg in local)}".replace(
            shlex.quote(LOCAL_MODEL_PLACEHOLDER), LOCAL_MODEL_PLACEHOLDER
        ),
    )


def diagnose(
    serve_args: list[str], load_plugins: bool = True
) -> tuple[Environment, ServeLine | None, list[Finding]]:
    """Environment, parsed serve line and every fix's findings (each fix module
    has ``diagnose(env, serve)``), judged as the node that serves the line sees
    them; raises DoctorInputError on a line that names no model or cannot be read."""
    argv = serve_line.line_arguments(serve_args)
    if serve_args and not argv:
        raise DoctorInputError(_no_model(None))
    installed = _package_version("vllm")
    line_check, args = check_with_vllm(argv, installed) if argv and installed else (None, None)
    if line_check is not None and line_check.level == "ok" and args is not None:
        if _hub_out_of_reach(args.model):  # as HF_HUB_OFFLINE=1 makes vLLM say
            line_check = _offline_finding(argv, args.model)
    rejected = line_check is not None and line_check.level == "error"
    serve = None
    if args is not None:
        with serve_line.cuda_device_type_while_parsing():
            serve = serve_of(argv, args)
    env = read_environment(load_plugins)
    findings = environment_findings(env)
    vllm_version = env.packages.get("vllm")
    if vllm_version is None:  # the environment findings say so; no fix can be judged
        return env, serve, findings
    if line_check is not None:
        findings.append(line_check)
    if rejected:  # the line never starts: nothing after the parser is reached
        return env, serve, findings
    if serve is not None and not serve.known_model():
        findings.append(
            Finding(
                "info",
                "model",
                f"unknown model: not checked ({serve.model}: "
                f"{', '.join(serve.architectures) or 'architecture unknown'}, "
                f"{serve.model_source}); the failures known here are those of MLA models "
                "(DeepSeek-V4.1, GLM-5.x, Kimi, DeepSeek-V3.x)",
            )
        )
        return env, serve, findings
    for fix in ALL_FIXES:
        decided = release_decision(fix.INFO, vllm_version)  # the plugin's own rule
        if decided is None:
            findings += fix.diagnose(env, serve)
        else:
            findings.append(release_finding(fix.INFO.name, decided, fix.INFO.newest_reviewed))
    return env, serve, findings


@dataclasses.dataclass(frozen=True)
class Verdict:
    label: str  # READY | READY WITH WARNINGS | WILL FAIL
    reason: str  # the first error, else the first warning, else ""

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.label]

    def line(self) -> str:
        return f"{WILL_FAIL}: {self.reason}" if self.label == WILL_FAIL else self.label


def verdict(findings: list[Finding]) -> Verdict:
    for level, label in (("error", WILL_FAIL), ("warn", READY_WITH_WARNINGS)):
        first = next((f for f in findings if f.level == level), None)
        if first is not None:
            return Verdict(label, f"{first.topic}: {first.message}")
    return Verdict(READY, "")


def json_facts(findings: list[Finding]) -> dict[str, dict[str, Any] | None]:
    """Each fix's machine-readable facts (``Finding.facts``) under the
    top-level key the fix declares (``DOCTOR_JSON_KEY``); null where none of
    its findings carries any (e.g. no DeepSeek-V4.1 line was judged)."""
    return {
        fix.DOCTOR_JSON_KEY: next(
            (f.facts for f in findings if f.topic == fix.INFO.name and f.facts), None
        )
        for fix in ALL_FIXES
        if fix.DOCTOR_JSON_KEY is not None
    }


def report(
    env: Environment,
    serve: ServeLine | None,
    findings: list[Finding],
    as_json: bool = False,
    print_: Callable[[str], object] = print,
) -> int:
    """Print the report and its verdict; return the verdict's exit status."""
    findings = [
        dataclasses.replace(f, runs_elsewhere=f.runs_elsewhere or runs_elsewhere(f.advice))
        for f in findings
    ]
    judged = verdict(findings)
    if as_json:
        print_(
            json.dumps(
                {
                    "vllm_mla_fixes": __version__,
                    "environment": dataclasses.asdict(env),
                    "serve": serve.reported() if serve else None,
                    "findings": [dataclasses.asdict(f) for f in findings],
                    **json_facts(findings),
                    "verdict": judged.label,
                    "reason": judged.reason,
                    "exit_status": judged.exit_status,
                },
                indent=2,
            )
        )
    else:  # every line safe for a terminal, whatever the operator set
        _print_human(env, serve, findings, lambda line: print_(settings.terminal_line(line)))
        print_(settings.terminal_line(judged.line()))
    return judged.exit_status


def _print_human(
    env: Environment,
    serve: ServeLine | None,
    findings: list[Finding],
    print_: Callable[[str], object],
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
    plugins = settings.plain(env.vllm_plugins) if env.vllm_plugins is not None else None
    print_(f"  {'VLLM_PLUGINS':<22} {plugins or '(unset: all plugins)'}")
    print_(f"  {'VLLM_MLA_FIXES':<22} {settings.plain(env.mla_fixes or '') or '(unset: all)'}")
    for name in env.fix_states:
        print_(f"  fix {name:<18} {env.fix_state(name)}: {env.fix_reason(name)}")
    if serve is not None:
        print_(f"Serve line: vllm serve {' '.join(shell_word(arg) for arg in serve.raw)}")
        architecture = ", ".join(serve.architectures) or "architecture unknown"
        print_(f"  model {settings.plain(str(serve.model))} ({architecture}; {serve.model_source})")
    print_("Findings")
    marks = {"ok": "ok  ", "info": "info", "warn": "WARN", "error": "FAIL"}
    for f in findings:
        print_(f"  [{marks[f.level]}] {f.topic}: {f.message}")
        if f.advice:
            print_(f"         -> {f.advice}")
        if f.runs_elsewhere:
            print_(f"            where: {f.runs_elsewhere}")
