"""Bugs injected into the DeepSeek-V4.1 fix, each named with the test that must catch it (issue 46).

Each :class:`Injection` monkeypatches one thing in this package -- never in
vLLM -- to bring back one bug the decision core exists to prevent, and names
its catchers: tests of this folder, as ``(module, function, parameters)``.
``test_bug_injections.py`` runs each catcher in this process under its
injection and fails where none goes red.  A catcher takes only
``monkeypatch`` and ``tmp_path`` besides its parameters.  A new claim of
the fix brings its injection here, beside the fix it attacks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllm_mla_fixes.fix import Fix

Catcher = tuple[str, str, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Injection:
    name: str
    inject: Callable[[pytest.MonkeyPatch], None]
    catchers: tuple[Catcher, ...]


HELD = "test_dsv41_held_claims"
KEY_TEST = (HELD, "test_engines_differing_in_one_key_field_each_get_their_own_decision")
DOCTOR_TEST = (HELD, "test_doctor_decides_what_the_engine_decides_one_field_from_flash")


# ------------------------------------------------ kernel-declaration cache key


def _key_of_paths_and_versions(mp: pytest.MonkeyPatch) -> None:
    """The envelopes' content key made of the declaration files' paths and
    the installed versions, never their bytes."""
    from importlib.metadata import version

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import envelope
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.envelope import table

    def content_key() -> str:
        digest = hashlib.sha256(f"{version('vllm')} {version('flashinfer-python')}".encode())
        for path in table.declaration_files():
            digest.update(path.as_posix().encode() + b"\0")
        return digest.hexdigest()

    mp.setattr(table, "content_key", content_key)
    mp.setattr(envelope, "content_key", content_key)


# ----------------------------------------------------------------- revert()


def _owner(owner: Any) -> str:
    if isinstance(owner, ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return type(owner).__qualname__


def _watch_patches(
    mp: pytest.MonkeyPatch, seen: Callable[[Any, str], None], drop_undo: str | None = None
) -> None:
    """Wrap ``Patch.replace`` and ``Patch.replace_function``: ``seen`` hears
    each change the fix asks for itself (not the rebinding inside one), and
    the undo steps of the change named ``drop_undo`` are thrown away."""
    from vllm_mla_fixes import patching

    depth = [0]

    def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, owner: Any, attr: str, new: Any) -> Any:
            top = depth[0] == 0
            undo = list(self._undo)
            depth[0] += 1
            try:
                return original(self, owner, attr, new)
            finally:
                depth[0] -= 1
                if top:
                    seen(owner, attr)
                    if f"{_owner(owner)}.{attr}" == drop_undo:
                        self._undo[:] = [u for u in self._undo if any(u is k for k in undo)]

        return method

    mp.setattr(patching.Patch, "replace", wrapped(patching.Patch.replace))
    mp.setattr(patching.Patch, "replace_function", wrapped(patching.Patch.replace_function))


def _import_patched_modules() -> None:
    """Every vLLM module the fix patches imported, as the revert test does."""
    from test_dsv41_one_decision import _fix_modules_imported

    _fix_modules_imported()


def patch_targets() -> list[str]:
    """Every change ``apply`` makes on this release, as ``owner.attribute``."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

    _import_patched_modules()
    found: dict[str, None] = {}
    with pytest.MonkeyPatch.context() as mp:
        _watch_patches(mp, lambda owner, attr: found.setdefault(f"{_owner(owner)}.{attr}"))
        with repro.applied((12, 0)):
            pass
    return list(found)


def _revert_skips(target: str) -> Callable[[pytest.MonkeyPatch], None]:
    def inject(mp: pytest.MonkeyPatch) -> None:
        _watch_patches(mp, lambda owner, attr: None, drop_undo=target)

    return inject


# ------------------------------------------------------------------- doctor


def _doctor_reads_flash(field: str) -> Callable[[pytest.MonkeyPatch], None]:
    """doctor's model figures: ``field`` of DeepSeek-V4.1-Flash, the rest of config.json."""

    def inject(mp: pytest.MonkeyPatch) -> None:
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry import prediction
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions.failures import DSV41_FLASH

        flash = {
            **DSV41_FLASH,
            "num_attention_heads": prediction.FLASH_HEADS,
            "index_topk": prediction.FLASH_INDEX_TOPK,
        }
        original = prediction.model_text

        def model_text(model_config: dict | None) -> tuple[dict, str]:
            text, figures = original(model_config)
            text = dict(text)
            if field == "n_mtp_layers":  # Flash's config names no drafter count
                text.pop("n_mtp_layers", None)
                text.pop("num_nextn_predict_layers", None)
            else:
                text[field] = flash[field]
            return text, figures

        mp.setattr(prediction, "model_text", model_text)

    return inject


DOCTOR_FIELDS = {
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "top-k": "index_topk",
    "window": "sliding_window",
    "compress ratios": "compress_ratios",
    "drafter": "n_mtp_layers",
}


def _doctor_drops_kv_transfer(mp: pytest.MonkeyPatch) -> None:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import prediction

    original = prediction.engine_settings

    def engine_settings(args: Any) -> Any:
        settings = original(args)
        settings.sections.pop("kv_transfer_config", None)
        return settings

    mp.setattr(prediction, "engine_settings", engine_settings)


# ------------------------------------------------------------- cache folder


def _usable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".written"
        probe.write_text("")
        probe.unlink()
    except OSError:
        return False
    return True


def _bad_cache_folder_turns_the_fix_off(mp: pytest.MonkeyPatch) -> None:
    """The probe says not-needed where ``VLLM_MLA_FIXES_CACHE_DIR`` cannot be used."""
    from vllm_mla_fixes import screen_cache

    original = screen_cache.cached_screen

    def cached_screen(fix: Fix, screen: Callable[[], str | None]) -> str | None:
        raw = os.environ.get(screen_cache.CACHE_DIR_ENV, "").strip()
        if raw and not _usable(Path(raw)):
            return f"not-needed: {raw} cannot be used"
        return original(fix, screen)

    mp.setattr(screen_cache, "cached_screen", cached_screen)


# --------------------------------------------------------------- engine key


def _key_without(field: str) -> Callable[[pytest.MonkeyPatch], None]:
    """The per-engine key compares and hashes every field but ``field``."""

    def inject(mp: pytest.MonkeyPatch) -> None:
        from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig

        names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != field]

        def kept(self: Any) -> tuple[Any, ...]:
            return tuple(getattr(self, n) for n in names)

        mp.setattr(EngineConfig, "__eq__", lambda self, other: kept(self) == kept(other))
        mp.setattr(EngineConfig, "__hash__", lambda self: hash(kept(self)))

    return inject


# ------------------------------------------------------------------ drafter


def _drafter_config_ignored(mp: pytest.MonkeyPatch) -> None:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import engine

    def drafter_config(vllm_config: Any, text_config: Any) -> Any:
        return text_config if engine.speculative_method(vllm_config) == engine.DSPARK else None

    mp.setattr(engine, "_drafter_config", drafter_config)


def _no_speculative_tokens(mp: pytest.MonkeyPatch) -> None:
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import engine

    mp.setattr(engine, "_speculative_tokens", lambda vllm_config: 0)


def _drafter_keyed_by_its_own_copy(mp: pytest.MonkeyPatch) -> None:
    """The engine's parallel layout read from the config a layer is built
    under: DSpark's drafter, built under vLLM's one-stage copy, gets a
    decision of its own."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import engine

    mp.setattr(engine, "engine_parallel_config", lambda vllm_config: vllm_config.parallel_config)


def _stages_from_the_process(mp: pytest.MonkeyPatch) -> None:
    """A one-stage config's stages read from the pipeline group the process
    holds (vLLM's private ``parallel_state._PP``): process state on the
    decision's path."""
    import copy

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import engine

    def engine_parallel_config(vllm_config: Any) -> Any:
        from vllm.distributed import parallel_state

        parallel = vllm_config.parallel_config
        group = getattr(parallel_state, "_PP", None)
        if parallel.pipeline_parallel_size > 1 or group is None:
            return parallel
        parallel = copy.copy(parallel)
        object.__setattr__(parallel, "pipeline_parallel_size", group.world_size)
        return parallel

    mp.setattr(engine, "engine_parallel_config", engine_parallel_config)


# ------------------------------------------------------------ pipeline ranks


def _stage_of(vllm_config: Any) -> tuple[int, int]:
    """(this rank's pipeline stage, the stages), as vLLM's worker sets
    ``parallel_config.rank`` = stage * tensor-parallel size + TP rank."""
    parallel = vllm_config.parallel_config
    return parallel.rank // parallel.tensor_parallel_size, parallel.pipeline_parallel_size


def _with_decide_for(mp: pytest.MonkeyPatch, rewrite: Callable[[Any, int, int], Any]) -> None:
    """Decide each engine from ``rewrite(engine, stage, stages)``."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import fix_state

    honest = fix_state.decide_for

    def decide_for(engine: Any, vllm_config: Any) -> Any:
        if engine.model is None:
            return honest(engine, vllm_config)
        return honest(rewrite(engine, *_stage_of(vllm_config)), vllm_config)

    mp.setattr(fix_state, "decide_for", decide_for)


def drafter_dropped_off_the_last_stage(mp: pytest.MonkeyPatch) -> None:
    """Every stage but the last plans without DSpark's drafter layers, which
    vLLM builds only on the last stage."""

    def rewrite(engine: Any, stage: int, stages: int) -> Any:
        if stage == stages - 1:
            return engine
        return dataclasses.replace(
            engine, model=dataclasses.replace(engine.model, drafter_layers=0)
        )

    _with_decide_for(mp, rewrite)


def _planned_on_the_stages_backbone(mp: pytest.MonkeyPatch) -> None:
    """Each stage plans (its capacity figures, the 2% rule) on the backbone
    layers vLLM's partition gives it, not the whole model's."""
    from vllm.distributed.utils import get_pp_indices

    def rewrite(engine: Any, stage: int, stages: int) -> Any:
        model = engine.model
        start, end = get_pp_indices(model.backbone_layers, stage, stages)

        def held(layers: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(layer - start for layer in layers if start <= layer < end)

        return dataclasses.replace(
            engine,
            model=dataclasses.replace(
                model,
                backbone_layers=end - start,
                compress_ratios=model.compress_ratios[start:end],
                kv_sources=held(model.kv_sources),
                index_sources=held(model.index_sources),
            ),
        )

    _with_decide_for(mp, rewrite)


# -------------------------------------------------------------------- table


def injections() -> Iterator[Injection]:
    """Every injection, on the installed release (``revert()``'s come from
    the changes ``apply`` makes there)."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig

    yield Injection(
        "kernel-declaration cache key of paths and versions, not bytes",
        _key_of_paths_and_versions,
        (
            (
                "test_dsv41_kernel_rebuild",
                "test_a_kernel_rebuilt_in_place_under_the_same_version_is_decided_from_its_bytes",
                {},
            ),
        ),
    )
    for target in patch_targets():
        yield Injection(
            f"revert() skips {target}",
            _revert_skips(target),
            (("test_dsv41_one_decision", "test_revert_restores_every_patched_attribute", {}),),
        )
    for case, field in DOCTOR_FIELDS.items():
        yield Injection(
            f"doctor reads Flash's {case} ({field}), not config.json's",
            _doctor_reads_flash(field),
            ((*DOCTOR_TEST, {"case": case}),),
        )
    from test_dsv41_held_claims import UNUSABLE

    yield Injection(
        "an unusable VLLM_MLA_FIXES_CACHE_DIR makes the probe not-needed",
        _bad_cache_folder_turns_the_fix_off,
        tuple(
            (HELD, "test_an_unusable_cache_folder_leaves_the_fix_applied_on_sm120", {"kind": k})
            for k in UNUSABLE
        ),
    )
    from test_dsv41_held_claims import DERIVED, unshown

    # Not injected: a key without a field that follows from another key field
    # (DERIVED: mxfp8_record is vLLM's rule on the capability; the pipeline's
    # stages reach the decision only through the in-flight tokens) still tells
    # apart every two engines that decide differently, so it is no bug; nor
    # one without a field no two engines are decided apart by on this release
    # (test_dsv41_held_claims.UNSHOWN).
    for key_field in dataclasses.fields(EngineConfig):
        if key_field.name in DERIVED or unshown(key_field.name):
            continue
        yield Injection(
            f"engine key without {key_field.name}",
            _key_without(key_field.name),
            ((*KEY_TEST, {"field": key_field.name}),),
        )
    yield Injection(
        "the draft model's own config ignored (DSpark)",
        _drafter_config_ignored,
        ((HELD, "test_dspark_reads_its_draft_models_own_config", {}),),
    )
    drafter_test: Catcher = (
        HELD,
        "test_dsparks_drafter_is_decided_from_its_engines_configuration_alone",
        {},
    )
    yield Injection(
        "DSpark's drafter decided from its own one-stage copy of the config",
        _drafter_keyed_by_its_own_copy,
        (drafter_test,),
    )
    yield Injection(
        "pipeline stages read from the process's pipeline group (parallel_state._PP)",
        _stages_from_the_process,
        (drafter_test,),
    )
    pipeline_test = (
        "test_dsv41_one_decision",
        "test_pipeline_ranks_decide_alike",
        {"pp_size": 2, "tp_size": 1, "dspark": True},
    )
    yield Injection(
        "DSpark's drafter layers dropped on every pipeline stage but the last",
        drafter_dropped_off_the_last_stage,
        (pipeline_test,),
    )
    yield Injection(
        "each pipeline stage planned on the backbone layers it holds",
        _planned_on_the_stages_backbone,
        (pipeline_test,),
    )
    yield Injection(
        "speculative tokens forced to 0",
        _no_speculative_tokens,
        (
            (HELD, "test_the_engine_reads_the_speculative_tokens_vllm_configures", {}),
            (*KEY_TEST, {"field": "speculative_tokens"}),
        ),
    )
    yield Injection(
        "doctor's settings drop --kv-transfer-config",
        _doctor_drops_kv_transfer,
        ((*DOCTOR_TEST, {"case": "kv-transfer"}),),
    )
