"""A simulated SM120 engine, built on a machine with no GPU: the real
``VllmConfig`` a DeepSeek-V4.1 serve has on SM120 when its layers are built,
and vLLM's platform answering as that device.

``doctor``'s prediction (``prediction.py``) and the reproductions
(``reproductions/``) both build their engine configs here, so doctor reads
nothing of the reproductions.  Everything is vLLM's own config classes; what
stands in is named where it is built: the model config (a namespace holding
what the fix and the planner read of it), the hardware queries
(:func:`sm120_platform`) and a speculative config whose draft checkpoint was
not read (:func:`speculative_config_as_written`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

# DeepSeek-V4.1-Flash's sparse-attention topology, from third-party copies of
# its config.json (the dossier's layout): 40 layers, ratios [0,0]+[2]*18+[1]*20,
# compressed-KV (and index-K) sources on layers 2, 8, 14 and 20, 128-token window.
DSV41_FLASH: dict[str, Any] = {
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20],
    "sliding_window": 128,
    "head_dim": 512,
    "index_head_dim": 128,
}

STAND_IN_MAX_MODEL_LEN = 8192  # the scheduler's own default where no model sets one


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """Settings of a serve line beyond ``--kv-cache-dtype fp8 --block-size``:
    ``cache_options`` go to vLLM's ``CacheConfig`` (e.g. ``kv_offloading_size``),
    ``sections`` to ``VllmConfig`` itself (e.g. ``parallel_config``), so that
    ``VllmConfig``'s own post-init resolves them as ``vllm serve`` does.
    ``attached`` sections are set after it: a speculative config whose draft
    checkpoint was not read (its post-init sizes look-ahead from the draft)."""

    cache_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)
    attached: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A drafter's own layers, registered beside the backbone's as its proposer
    # does (see ``reproductions.failures.build_layers``): one compress ratio per drafter layer.
    drafter_ratios: tuple[int, ...] = ()


def make_vllm_config(
    block_size: int,
    num_gpu_blocks_override: int | None = None,
    settings: EngineSettings | None = None,
) -> Any:  # a vllm.config.VllmConfig
    """A real ``VllmConfig`` as an SM120 serve with ``--kv-cache-dtype fp8
    --block-size B`` has it when the model's layers are built, plus the
    serve line's ``settings`` where given.  The hybrid KV cache manager is on,
    as ``VllmConfig`` resolves it for this model."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    settings = settings or EngineSettings()
    config = VllmConfig(
        device_config=DeviceConfig(device="cuda"),
        cache_config=CacheConfig(
            block_size=block_size,
            cache_dtype="fp8",
            num_gpu_blocks_override=num_gpu_blocks_override,
            **settings.cache_options,
        ),
        **settings.sections,
    )
    for name, value in settings.attached.items():
        object.__setattr__(config, name, value)
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def attach_model(
    vllm_config: Any,  # a vllm.config.VllmConfig
    model: dict[str, Any],
    drafter_ratios: tuple[int, ...] = (),
    max_model_len: int = STAND_IN_MAX_MODEL_LEN,
) -> None:
    """Give ``vllm_config`` (which has no model) a model config as a serve's
    has it for this model: its text config's DeepSeek-V4.1 topology (a
    drafter's layers listed past the backbone, ``n_mtp_layers`` of them, as
    a DSpark checkpoint's config lists them) and the max-model-len.  The fix
    reads both to decide; a real ``ModelConfig`` inspects the model class in a
    subprocess, so this is a namespace holding what is read of it."""
    if vllm_config.model_config is not None:
        return
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    # model_type: vLLM's planner reads it (a DeepSeek-V4.1 drafter's trailing layers)
    defaults = {
        "qk_rope_head_dim": 64,
        "index_topk": 512,
        "model_type": DeepseekV41Config.model_type,
    }
    text = SimpleNamespace(**{**defaults, **model})
    text.compress_ratios = [*model["compress_ratios"], *drafter_ratios]
    if drafter_ratios:
        text.n_mtp_layers = len(drafter_ratios)
    stand_in = SimpleNamespace(
        hf_config=text,
        hf_text_config=text,
        max_model_len=max_model_len,
        use_mla=True,  # DeepSeek-V4.1 is MLA; a KV connector's planning asks
    )
    object.__setattr__(vllm_config, "model_config", stand_in)


def speculative_config_as_written(options: dict[str, Any]) -> Any:  # a SpeculativeConfig
    """vLLM's ``SpeculativeConfig`` holding ``options`` as a serve line writes them.

    Its validation resolves the draft from the target model's checkpoint
    (DSpark: the stages shipped inside it), which is not on the machine where
    operators write serve lines, so the object is created without it: every
    field takes its declared default, then the line's values.  The geometry
    decision reads only which method is configured."""
    from vllm.config import SpeculativeConfig

    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(SpeculativeConfig)})
    if unknown:
        raise ValueError(f"--speculative-config has no field(s) {unknown}")
    config = object.__new__(SpeculativeConfig)
    for field in dataclasses.fields(SpeculativeConfig):
        if field.name in options:
            value = options[field.name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        object.__setattr__(config, field.name, value)
    return config


@contextlib.contextmanager
def sm120_platform(capability: tuple[int, int] = (12, 0), num_sms: int = 188) -> Iterator[None]:
    """vLLM's current platform answering hardware queries as an SM120 GPU's
    driver would (default: an RTX PRO 6000 Blackwell, 188 SMs).  Only the
    queries are stood in (``get_device_capability``, ``num_compute_units``:
    NVML and the CUDA runtime on a CUDA platform); vLLM's own capability logic
    (``is_device_capability_family``, ``has_device_capability``) runs on their
    answers.  0.34.0's backends choose their SM12x kernel block sizes through it."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    platform_class = type(current_platform)
    answers = {
        "get_device_capability": classmethod(
            lambda cls, device_id=0: DeviceCapability(*capability)
        ),
        "num_compute_units": classmethod(lambda cls, device_id=0: num_sms),
    }
    own = {name: platform_class.__dict__.get(name) for name in answers}
    for name, answer in answers.items():
        setattr(platform_class, name, answer)
    try:
        yield
    finally:
        for name, previous in own.items():
            if previous is None:
                delattr(platform_class, name)
            else:
                setattr(platform_class, name, previous)
