"""What ``doctor`` hands each fix's ``diagnose(env, serve)`` and gets back.

A leaf module (of this package it imports only ``settings``, itself a leaf): the fix
modules and ``doctor`` both import it, and it imports neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version

from vllm_mla_fixes import settings

if TYPE_CHECKING:  # for annotations only: at run time this module imports none of the package
    from vllm_mla_fixes.patching import FixStatus

SPARSE_MLA_ARCHITECTURES = frozenset({"GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"})
MLA_ARCHITECTURES = SPARSE_MLA_ARCHITECTURES | {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "KimiK2ForCausalLM",
    "DeepseekV4ForCausalLM",
    "DeepseekV41ForCausalLM",
    "Mistral3ForConditionalGeneration",
}
# What a model's name says where its config.json is not on this machine (the
# hub offline, the model not downloaded): the architecture its published
# config.json declares.
ARCHITECTURES_BY_NAME = (
    (re.compile(r"deepseek-v4\.1", re.IGNORECASE), "DeepseekV41ForCausalLM"),
    (re.compile(r"glm-5", re.IGNORECASE), "GlmMoeDsaForCausalLM"),
    (re.compile(r"kimi-k2\.5", re.IGNORECASE), "KimiK25ForConditionalGeneration"),
    (re.compile(r"kimi-k2(?![.\d])", re.IGNORECASE), "DeepseekV3ForCausalLM"),
)


def architectures_by_name(model: str) -> list[str]:
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return [arch for pattern, arch in ARCHITECTURES_BY_NAME if pattern.search(name)][:1]


@dataclasses.dataclass
class Finding:
    level: str  # "ok" | "info" | "warn" | "error"
    topic: str
    message: str
    advice: str = ""
    facts: dict[str, Any] | None = None  # machine-readable facts behind the message (doctor --json)
    # Where the advice must run when not on this machine, and why (doctor fills
    # it from ELSEWHERE); "" where a test runs it on a machine without a GPU.
    runs_elsewhere: str = ""


# Commands doctor may print that cannot run on the machine that runs doctor
# as it is (no GPU, no network): the command's words, then where it must run
# and why.  Every other command doctor prints is run by a test on a machine
# without a GPU (tests/test_doctor_consistency.py names each one's test).
ELSEWHERE = (
    (
        "flashinfer install-jit-cache-wheel",
        "needs the network: it downloads the flashinfer-jit-cache shim and its provider from "
        "FlashInfer's own wheel index, https://flashinfer.ai/whl, not PyPI; without it, it "
        "exits 1: 'Could not resolve the flashinfer-jit-cache shim'",
    ),
    (
        "flashinfer install-cubin-wheel",
        "needs the network: it downloads flashinfer-cubin from FlashInfer's own wheel index, "
        "https://flashinfer.ai/whl, not PyPI",
    ),
    (
        "vllm-mla-fixes selftest",
        "runs on the GPU node that serves: it runs that GPU's kernels, where a machine "
        "without one runs stand-ins for them",
    ),
    (
        "vllm-mla-fixes smoke",
        "runs once `vllm serve` is up on the GPU node, from a machine that reaches it",
    ),
)


def runs_elsewhere(advice: str) -> str:
    """Where each command in ``advice`` that cannot run here must run, and why."""
    return "; ".join(f"`{command}` {where}" for command, where in ELSEWHERE if command in advice)


@dataclasses.dataclass
class Environment:
    packages: dict[str, str | None]
    gpu: str | None
    capability: tuple[int, int] | None
    torch_cuda: str | None
    vllm_plugins: str | None
    mla_fixes: str | None
    fix_states: dict[str, dict[str, str]]  # fix name -> {"state": ..., "reason": ...}
    torchaudio_error: str | None = None  # why `import torchaudio` fails here; None: it imports

    def fix_state(self, name: str) -> str:
        """``applied`` | ``not-needed`` | ``disabled`` | ``skipped`` | ``unknown`` | ``""``."""
        return self.fix_states.get(name, {}).get("state", "")

    def fix_reason(self, name: str) -> str:
        return self.fix_states.get(name, {}).get("reason", "")


@dataclasses.dataclass
class ServeLine:
    """The serve line as ``vllm serve``'s own parser reads it, parsed once by
    doctor (``doctor.serve_of``): the settings the fixes judge, one meaning for
    every spelling it accepts (the config options hold what the line changes
    from the defaults), and the parser's namespace itself, for a fix that
    builds vLLM's own configs from the line."""

    model: str | None
    architectures: list[str]
    model_config: dict[str, Any]  # config.json as vLLM reads it
    kv_cache_dtype: str
    attention_backend: str | None
    block_size: int | None
    enforce_eager: bool
    kv_offloading: bool
    prefix_caching: bool | None
    kernel_config: dict[str, Any]
    attention_config: dict[str, Any]
    tensor_parallel_size: int
    moe_backend: str | None
    speculative: bool
    kv_connector: bool
    decode_context_parallel_size: int
    prefill_context_parallel_size: int
    raw: list[str]
    # The namespace the parser built, as it built it (vLLM's checks read a
    # copy); vLLM's objects, so not in doctor --json's ``serve`` (:meth:`reported`).
    namespace: argparse.Namespace = dataclasses.field(repr=False, compare=False)
    model_source: str = ""  # where ``architectures`` come from

    def reported(self) -> dict[str, Any]:
        """``doctor --json``'s ``serve`` object: every field but the namespace."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "namespace"
        }

    def known_model(self) -> bool:
        """An MLA model, whose failures this package's fixes know."""
        text = self.model_config.get("text_config", self.model_config)
        return bool(set(self.architectures) & MLA_ARCHITECTURES) or "kv_lora_rank" in text


def major_minor(version: str | None) -> tuple[int, ...] | None:
    try:
        return Version(version).release[:2] if version else None
    except InvalidVersion:
        return None


def fix_verdict(env: Environment, name: str) -> Finding:
    """Whether the plugin applies fix ``name`` where the line is served, and if not, why."""
    state = env.fix_state(name)
    serving_node = env.fix_states.get(name, {}).get("serving_node")
    if state == "applied" and serving_node:
        return Finding(
            "ok", name, f"on {serving_node} the plugin loads the fix ({env.fix_reason(name)})"
        )
    if state == "applied":
        return Finding("ok", name, "the fix is applied in this environment")
    if env.packages.get("vllm-mla-fixes") is None:
        return Finding(
            "error", name, "vllm-mla-fixes is not installed where vLLM runs", install_advice()
        )
    if env.vllm_plugins is not None and PLUGIN not in env.vllm_plugins.split(","):
        # once loaded, the plugin reads VLLM_MLA_FIXES: a remedy that leaves the fix
        # deselected there would only lead to the next finding
        from vllm_mla_fixes.fixes import SELECTION

        selected = settings.value(SELECTION, {SELECTION.name: env.mla_fixes or ""})
        deselected = selected is not None and name not in selected
        return Finding(
            "error",
            name,
            f"VLLM_PLUGINS={settings.shown(env.vllm_plugins)} does not name {PLUGIN}"
            f"{spaced_note(env.vllm_plugins)}, so vLLM never loads the fix"
            + (
                f", and VLLM_MLA_FIXES={settings.shown(env.mla_fixes or '')} leaves it out"
                if deselected
                else ""
            ),
            plugins_advice(env.vllm_plugins, enable_all=deselected),
        )
    where = f"on {serving_node}" if serving_node else "here"
    if state == "not-needed":
        return Finding(
            "info",
            name,
            f"the plugin leaves vLLM untouched for this fix {where} "
            f"(not-needed: {env.fix_reason(name)})",
        )
    if state == "disabled":
        return Finding(
            "error",
            name,
            f"the fix is not applied {where}: disabled: {env.fix_reason(name)}",
            ENABLE_ALL_ADVICE,
        )
    described = f"{state}: {env.fix_reason(name)}" if state else "not evaluated"
    return Finding(
        "error",
        name,
        f"the fix is not applied {where}: {described}",
        "vllm-mla-fixes status   (each fix's state and reason, as the plugin decides them)",
    )


# VLLM_MLA_FIXES=none, or a list without the fix, disables it (a test runs this).
ENABLE_ALL_ADVICE = "export VLLM_MLA_FIXES=all   (then `vllm-mla-fixes status` says applied)"


def as_serving_node(env: Environment, name: str, node: str, state: str, reason: str) -> Environment:
    """``env`` with fix ``name`` in the ``state`` the plugin gives it on
    ``node`` (e.g. "an SM12x GPU"), for a fix this process cannot decide (no
    such GPU here): doctor judges a line as the node that serves it sees it."""
    judged = {"state": state, "reason": reason, "serving_node": node}
    return dataclasses.replace(env, fix_states={**env.fix_states, name: judged})


def covered_failure(env: Environment, name: str, failure: str) -> Finding:
    """The failure fix ``name`` exists for, as the serving node meets it:
    an error where the fix is not applied, else what the fix spares this line."""
    if env.fix_state(name) == "applied":
        return Finding("info", name, f"without the fix, {failure}; the fix covers this")
    return Finding("error", name, failure)


def release_finding(name: str, decided: FixStatus, newest_reviewed: str) -> Finding:
    """doctor's finding when the release alone decides fix ``name``: the same
    rule as the plugin's (``decided`` is the gate's ``FixStatus``, from
    ``patching.release_decision``)."""
    if decided.state.value == "not-needed":
        return Finding("ok", name, f"not needed: {decided.reason}")
    advice = ""
    if decided.reason.startswith("not reviewed"):
        advice = (
            f"serve with vLLM {newest_reviewed}, the newest release reviewed for this fix, or "
            "with a vllm-mla-fixes that has reviewed this release"
        )
    return Finding(
        "warn", name, f"skipped: {decided.reason}; the plugin leaves vLLM untouched here", advice
    )


def install_advice() -> str:
    """The command that installs this copy of the package (it is not on PyPI)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():  # running from a checkout
        return f"pip install {shlex.quote(str(root))}"
    return "install vllm-mla-fixes into this environment (see its README)"


PLUGIN = "mla_fixes"  # this package's entry point name, as VLLM_PLUGINS names it


def spaced_note(vllm_plugins: str) -> str:
    """Why a VLLM_PLUGINS that seems to name the plugin does not: vLLM splits
    it at commas and keeps the spaces (``"other, mla_fixes"``)."""
    if any(name.strip() == PLUGIN for name in vllm_plugins.split(",")):
        return f" (vLLM splits it at commas and keeps the spaces: ' {PLUGIN}' is another name)"
    return ""


def plugins_advice(vllm_plugins: str, enable_all: bool = False) -> str:
    """The VLLM_PLUGINS setting that keeps the plugins named (without the
    spaces vLLM would keep) and loads this one, as one shell word; with
    ``enable_all``, VLLM_MLA_FIXES=all in the same command."""
    names = dict.fromkeys(n for n in (*(p.strip() for p in vllm_plugins.split(",")), PLUGIN) if n)
    return f"export VLLM_PLUGINS={shell_word(','.join(names))}" + (
        " VLLM_MLA_FIXES=all   (or unset VLLM_PLUGINS VLLM_MLA_FIXES: then vLLM loads "
        "every plugin, and the plugin every fix)"
        if enable_all
        else "   (or unset VLLM_PLUGINS: then vLLM loads every plugin)"
    )


def shell_word(text: str) -> str:
    """``text`` as one shell word that means exactly ``text``: ``shlex.quote``
    where every character prints, else bash's ``$'...'`` with escapes, so no
    control character reaches the terminal.  A byte the environment did not
    decode (held as a surrogate escape) becomes that byte again."""
    if text.isprintable():
        return shlex.quote(text)
    escaped = []
    for character in text:
        code = ord(character)
        if 0xDC80 <= code <= 0xDCFF:  # os.environ's surrogateescape of byte code - 0xDC00
            escaped.append(f"\\x{code - 0xDC00:02x}")
        elif character in "\\'":
            escaped.append(f"\\{character}")
        elif character.isprintable():
            escaped.append(character)
        elif code < 0x100:
            escaped.append(f"\\x{code:02x}")
        elif code < 0x10000:
            escaped.append(f"\\u{code:04x}")
        else:
            escaped.append(f"\\U{code:08x}")
    return "$'" + "".join(escaped) + "'"
