"""The doctor command run as an operator runs it, and its JSON findings: the
helpers of ``test_doctor*.py`` here and in the fixes' own test folders."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the line of --help's example, and of the report (001): its first error
DSV41_LINE = ["vllm", "serve", "deepseek-ai/DeepSeek-V4.1-Flash", "--block-size", "64"]
NO_HUB = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused


def run_doctor(
    *args: str, python: str = sys.executable, hub: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """The doctor command as an operator runs it, on a machine without a GPU,
    with ``python`` (this one unless given); ``hub``: an empty Hugging Face home
    and no network (the hub's endpoint a closed local port, here and on a CI
    runner that has one), so the model is known by its name only."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    full_env.update(CUDA_VISIBLE_DEVICES="", **env)
    if hub is not None:
        full_env.pop("HF_HUB_CACHE", None)
        full_env["HF_HOME"] = str(hub)
        full_env.setdefault("HF_ENDPOINT", NO_HUB)
    return subprocess.run(
        [python, "-m", "vllm_mla_fixes", "doctor", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )


def findings_of(proc) -> list[dict]:
    return json.loads(proc.stdout)["findings"]  # stdout is the JSON document alone


def accepted_by_vllm(flag: str) -> None:
    """Build the config object vLLM builds from this serve flag (it validates
    names and values with pydantic, as `vllm serve` does)."""
    from vllm.config import AttentionConfig, KernelConfig

    option, value = shlex.split(flag)
    if option == "--moe-backend":
        assert KernelConfig(moe_backend=value).moe_backend == value
        return
    config_class = {"--attention-config": AttentionConfig, "--kernel-config": KernelConfig}[option]
    fields = json.loads(value)
    config = config_class(**fields)
    for key, wanted in fields.items():
        assert str(getattr(config, key)).split(".")[-1] == str(wanted), (flag, getattr(config, key))


def serve_of(line: list[str]):
    """doctor's ServeLine of ``line``: the namespace of the installed vLLM's
    own parser, read by ``doctor.serve_of``, in this process (no model files
    and no hub are consulted beyond the model's config.json)."""
    from vllm_mla_fixes import doctor, serve_line

    with serve_line.cuda_device_type_while_parsing():
        return doctor.serve_of(serve_line.line_arguments(line), serve_line.parse(line))


def predict_line(line: list[str], model_config: dict | None = None):
    """The DeepSeek-V4.1 prediction doctor makes for ``line`` (its one parse,
    :func:`serve_of`), with ``model_config`` as the config.json doctor read:
    None for none (the prediction then takes DeepSeek-V4.1-Flash's figures)."""
    import dataclasses

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.prediction import predict

    return predict(dataclasses.replace(serve_of(line), model_config=model_config or {}))
