"""dsv41-sm120-geometry: the claims issue 46's injected bugs got past (issue 46, item 2).

* The per-engine key: two engines that differ in one :class:`EngineConfig`
  field each get their own decision, the one a fresh process gives them.
* The drafter's own config and the speculative tokens are what the engine
  reads of vLLM's config.
* A cache folder that cannot be used leaves the fix ``applied`` on a
  pretended SM120 (where the probe would otherwise be ``not-needed`` on CPU).
* ``doctor`` on a ``config.json`` that differs from DeepSeek-V4.1-Flash in one
  field decides what the engine decides, its FlashInfer shapes included; the
  engine's settings come from vLLM's parsed arguments and config classes, not
  from doctor's ``prediction.engine_settings``.

Every test here takes only ``monkeypatch`` and ``tmp_path`` (and its
parameters), so ``test_bug_injections.py`` can run it under an injected bug.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from doctor_runs import predict_line
from fix_releases import covered

from vllm_mla_fixes import serve_line
from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import engine as engine_module
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import upstream
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import decide
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.engine import EngineConfig, engine_config
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import engine_report

pytestmark = pytest.mark.vllm_release(*covered(DSV41))

# ------------------------------------------------------------ the engine key


def _spec(method: str, tokens: int) -> Any:
    from vllm.config import SpeculativeConfig

    config = SpeculativeConfig.__new__(SpeculativeConfig)
    for name, value in dict(
        method=method, num_speculative_tokens=tokens, disable_eagle_block_drop=False
    ).items():
        object.__setattr__(config, name, value)
    return config


def _config(block_size: int = 128, model: dict | None = None, **options: Any) -> Any:
    """A real VllmConfig of the tiny DeepSeek-V4.1 (6 layers) at ``block_size``."""
    settings = repro.EngineSettings(**options)
    config = repro.make_vllm_config(block_size, None, settings)
    repro.attach_model(config, repro.tiny_model() if model is None else model)
    return config


def _dspark(tokens: int) -> Callable[[], Any]:
    def build() -> Any:
        config = repro.make_vllm_config(128)
        object.__setattr__(config, "speculative_config", _spec("dspark", tokens))
        repro.attach_model(config, repro.tiny_model(), (0, 0, 0))
        return config

    return build


def _with(change: Callable[[Any], None], **options: Any) -> Callable[[], Any]:
    def build() -> Any:
        config = _config(**options)
        change(config)
        return config

    return build


def _set(path: str, value: Any) -> Callable[[Any], None]:
    def change(config: Any) -> None:
        *owners, name = path.split(".")
        owner = config
        for part in owners:
            owner = getattr(owner, part)
        object.__setattr__(owner, name, value)

    return change


def _without(field: str) -> dict:
    return {k: v for k, v in repro.tiny_model().items() if k != field}


def _nixl(config: Any) -> None:
    from vllm.config import KVTransferConfig

    object.__setattr__(
        config,
        "kv_transfer_config",
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"),
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    """Two engines that differ in one field of the key (``env``: settings
    the second engine is read under; ``capability``: each one's device)."""

    first: Callable[[], Any]
    second: Callable[[], Any]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    capability: tuple[tuple[int, int], tuple[int, int]] = ((12, 0), (12, 0))


def _ngram(tokens: int) -> Callable[[], Any]:
    return _with(_set("speculative_config", _spec("ngram", tokens)))


_PLAIN = _config
_SM100 = ((10, 0), (10, 0))
KEY_VARIANTS: dict[str, Variant] = {
    "model": Variant(_PLAIN, functools.partial(_config, model=repro.DSV41_FLASH)),
    "model_problem": Variant(
        functools.partial(_config, model=_without("head_dim")),
        functools.partial(_config, model=_without("sliding_window")),
    ),
    "block_size": Variant(_PLAIN, functools.partial(_config, 64)),
    # a record vLLM takes on SM12x's packed layout besides fp8 (-> fp8_ds_mla)
    "cache_dtype": Variant(_PLAIN, _with(_set("cache_config.cache_dtype", "nvfp4_ds_mla"))),
    "max_model_len": Variant(_PLAIN, _with(_set("model_config.max_model_len", 65536))),
    # both draft this many tokens: the method alone differs
    "speculative_method": Variant(_ngram(3), _with(_set("speculative_config", _spec("eagle", 3)))),
    # the compressor's state ring: 8 rows for 1 token, 64 for 31 (1 and 15 tokens,
    # 8 and 32 rows, decide alike on the tiny model)
    "speculative_tokens": Variant(_ngram(1), _ngram(31)),
    "kv_connector": Variant(_PLAIN, _with(_nixl)),
    "decode_context_parallel": Variant(
        _PLAIN, _with(_set("parallel_config.decode_context_parallel_size", 2))
    ),
    "prefill_context_parallel": Variant(
        _PLAIN, _with(_set("parallel_config.prefill_context_parallel_size", 2))
    ),
    # max_in_flight_tokens = (stages, +1 with async scheduling) x batched tokens
    "pipeline_parallel": Variant(_PLAIN, _with(_set("parallel_config.pipeline_parallel_size", 2))),
    "in_flight_tokens": Variant(
        _PLAIN, _with(_set("scheduler_config.max_num_batched_tokens", 16384))
    ),
    "hisparse": Variant(_PLAIN, _with(_set("attention_config.hisparse_config", object()))),
    # the indexer's block-stride alignment, on SM100 (0.33.0 on: lcm(256, 1))
    "indexer_sparse_logits": Variant(
        _PLAIN, _with(_set("attention_config.indexer_sparse_logits", True)), capability=_SM100
    ),
    # vLLM refuses the MXFP4 indexer below SM100 (dsa_indexer_uses_fp4): both on SM100
    "indexer_fp4": Variant(
        _PLAIN, _with(_set("attention_config.indexer_kv_dtype", "mxfp4")), capability=_SM100
    ),
    "hybrid_manager_disabled": Variant(
        _PLAIN, _with(_set("scheduler_config.disable_hybrid_kv_cache_manager", True))
    ),
    "capability": Variant(_PLAIN, _PLAIN, capability=((12, 0), (9, 0))),
    "mxfp8_record": Variant(_PLAIN, _PLAIN, capability=((12, 0), (10, 0))),
    "forced_geometry": Variant(_PLAIN, _PLAIN, env={"VLLM_MLA_FIXES_DSV41_GEOMETRY": "per-ratio"}),
    "forced_drafter_rows": Variant(
        _dspark(3), _dspark(3), env={"VLLM_MLA_FIXES_DSV41_DRAFTER_SWA_ROWS": "64"}
    ),
}
# Fields that follow from another field for every config vLLM can build:
# their variant changes that field too (mxfp8_record is vLLM's rule on the
# capability: SM100's family).  The planner reads the pipeline's stages only
# through max_in_flight_tokens, so stages changed at equal in-flight tokens
# decide alike (test_pipeline_stages_reach_the_decision_through_in_flight_tokens):
# the pipeline variant changes the in-flight tokens with the stages.
DERIVED = {"mxfp8_record": "capability", "pipeline_parallel": "in_flight_tokens"}


# Fields no two engines vLLM builds on these releases decide apart by: PEP 440
# specifier -> why.  The key keeps them (a later release may read them).
UNSHOWN = {
    "indexer_sparse_logits": (
        "<0.33.0",
        "0.32.0 aligns the indexer's block stride to lcm(512, page alignment): on SM100 "
        "512, which every 512-B-aligned page already meets, so no figure can change; on "
        "SM12x lcm(512, 576) = 4608, which changed no figure in any pair tried (blocks "
        "32 to 256, the tiny and the Flash model)",
    ),
}


def unshown(field: str) -> str | None:
    """Why ``field`` cannot be shown to part two engines on the installed vLLM."""
    import vllm
    from packaging.specifiers import SpecifierSet

    found = UNSHOWN.get(field)
    if found is None or str(vllm.__version__) not in SpecifierSet(found[0]):
        return None
    return found[1]


def test_every_field_of_the_key_has_a_variant():
    """A field added to EngineConfig needs two engines that differ in it."""
    assert set(KEY_VARIANTS) == {f.name for f in dataclasses.fields(EngineConfig)}


def _read(build: Callable[[], Any], capability: tuple[int, int]) -> tuple[Any, Any]:
    with repro.sm120_platform(capability):
        config = build()
        return config, engine_config(config)


@pytest.mark.parametrize("field", sorted(KEY_VARIANTS))
def test_engines_differing_in_one_key_field_each_get_their_own_decision(field, monkeypatch):
    """Issue 46: the key leaving out a field gave the second engine the
    first one's decision.  Here the second engine's kept decision is what
    deciding it afresh gives, and differs from the first's.  Settings are
    read from the environment at each read (``settings.value``), so each
    engine is read and decided while its own settings are in force."""
    why = unshown(field)
    if why is not None:
        pytest.skip(why)
    variant = KEY_VARIANTS[field]
    for name in variant.env:
        monkeypatch.delenv(name, raising=False)
    STATE.clear()
    try:
        first, first_key = _read(variant.first, variant.capability[0])
        with repro.sm120_platform(variant.capability[0]):
            kept_first = STATE.decision_for(first)
        for name, value in variant.env.items():
            monkeypatch.setenv(name, value)
        second, second_key = _read(variant.second, variant.capability[1])
        with repro.sm120_platform(variant.capability[1]):
            kept_second = STATE.decision_for(second)
        STATE.clear()
        with repro.sm120_platform(variant.capability[1]):
            fresh_second = decide(second)
    finally:
        STATE.clear()
    differing = {
        f.name
        for f in dataclasses.fields(EngineConfig)
        if getattr(first_key, f.name) != getattr(second_key, f.name)
    }
    assert differing == {field, *([DERIVED[field]] if field in DERIVED else ())}, differing
    assert kept_second == fresh_second, (field, kept_second.reason, fresh_second.reason)
    assert kept_second != kept_first, f"{field}: the two engines decide alike; pick another pair"


def _batched(tokens: int, stages: int = 1) -> Callable[[Any], None]:
    def change(config: Any) -> None:
        object.__setattr__(config.parallel_config, "pipeline_parallel_size", stages)
        object.__setattr__(config.scheduler_config, "max_num_batched_tokens", tokens)

    return change


def test_pipeline_stages_reach_the_decision_through_in_flight_tokens():
    """Why the pipeline variant changes the in-flight tokens too: one stage
    at 3000 batched tokens and two at 2000 (async scheduling: 2 x 3000 = 3 x
    2000 in flight) differ in the stages only, and decide alike."""
    STATE.clear()
    one, one_key = _read(_with(_batched(3000)), (12, 0))
    two, two_key = _read(_with(_batched(2000, 2)), (12, 0))
    assert (one_key.pipeline_parallel, two_key.pipeline_parallel) == (1, 2)
    assert one_key.in_flight_tokens == two_key.in_flight_tokens
    with repro.sm120_platform():
        assert decide(one) == decide(two)


# ----------------------------------------------- what the engine reads of vLLM


def test_the_engine_reads_the_speculative_tokens_vllm_configures():
    for tokens in (1, 3, 7):
        with repro.sm120_platform():
            assert engine_config(_dspark(tokens)()).speculative_tokens == tokens


def test_dspark_reads_its_draft_models_own_config():
    """DSpark's layer count comes from its draft model's config where vLLM
    gives it one, the target's only where it gives none."""
    config = _dspark(3)()
    target = config.model_config.hf_text_config
    assert engine_module.dspark_layers(target) == 3
    draft = SimpleNamespace(hf_text_config=SimpleNamespace(n_mtp_layers=1))
    object.__setattr__(config.speculative_config, "draft_model_config", draft)
    with repro.sm120_platform():
        assert _drafter_layers(config) == 1
        object.__setattr__(config.speculative_config, "draft_model_config", None)
        assert _drafter_layers(config) == 3


def _drafter_layers(config: Any) -> int:
    model = engine_config(config).model
    assert model is not None, "the engine's model was read"
    return model.drafter_layers


def _dspark_engine(stages: int) -> tuple[Any, Any]:
    """A DSpark engine of ``stages`` pipeline stages, and the copy of its
    config vLLM builds DSpark's drafter under: the parallel config from
    vLLM's own ``_get_dspark_parallel_config`` (one stage, the drafter's TP),
    everything else shared (``load_dspark_model`` replaces the parallel,
    attention and load configs only; the attention one as it was here)."""
    import copy

    from vllm.v1.worker.gpu.spec_decode.dspark.utils import _get_dspark_parallel_config

    engine = _dspark(3)()
    object.__setattr__(engine.parallel_config, "pipeline_parallel_size", stages)
    # What EngineArgs.create_speculative_config hands the speculative config.
    object.__setattr__(engine.speculative_config, "target_parallel_config", engine.parallel_config)
    drafter = copy.copy(engine)
    draft_parallel = _get_dspark_parallel_config(engine.parallel_config, 1, None)
    object.__setattr__(drafter, "parallel_config", draft_parallel)
    return engine, drafter


def test_dsparks_drafter_is_decided_from_its_engines_configuration_alone(monkeypatch):
    """DSpark's drafter layers are built under vLLM's one-stage copy of the
    engine config; they get the engine's record, from configuration alone:
    a pipeline group the process holds (another engine's, a worker's) is no
    input -- the decision is a pure function of the engine's configuration."""
    from vllm.distributed import parallel_state

    engine, drafter = _dspark_engine(2)
    assert drafter.parallel_config.pipeline_parallel_size == 1
    with repro.sm120_platform():
        expected = engine_config(engine)
        assert expected.pipeline_parallel == 2
        assert engine_config(drafter) == expected
        one_stage = _config()
        alone = engine_config(one_stage)
        # A stand-in for the pipeline group a worker of some engine holds.
        monkeypatch.setattr(parallel_state, "_PP", SimpleNamespace(world_size=4), raising=False)
        assert engine_config(drafter) == expected
        assert engine_config(one_stage) == alone
    STATE.clear()
    try:
        with repro.sm120_platform():
            assert STATE.decision_for(drafter) == decide(engine)
    finally:
        STATE.clear()


# ---------------------------------------------------------------- cache folder


def _unusable(kind: str, tmp_path: Path) -> str:
    if kind == "a file":
        path = tmp_path / "screens"
        path.write_text("not a folder")
        return str(path)
    if kind == "a read-only folder":
        folder = tmp_path / "read-only"
        folder.mkdir(mode=0o555)
        # root writes anywhere it may; procfs refuses root too
        return str(folder / "screens") if os.geteuid() else "/proc/self/screens"
    if kind == "a missing parent":
        return str(tmp_path / "not-there" / "nor-this" / "screens")
    if kind == "a symlink loop":
        loop = tmp_path / "loop"
        loop.symlink_to(loop)
        return str(loop / "screens")
    raise AssertionError(kind)


UNUSABLE = ("a file", "a read-only folder", "a missing parent", "a symlink loop")


@pytest.mark.parametrize("kind", UNUSABLE)
def test_an_unusable_cache_folder_leaves_the_fix_applied_on_sm120(kind, monkeypatch, tmp_path):
    """Issue 46: on CPU the fix is always not-needed, so a probe turned off
    by a bad folder could not be seen; on a pretended SM120 it applies, and
    must still apply with the folder unusable."""
    from vllm_mla_fixes.patching import run_fix

    def state() -> str:
        import vllm

        found = run_fix(fix.for_capability((12, 0)), str(vllm.__version__))
        if found.patch is not None:
            found.patch.revert()
        return found.status.state.value

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "default"))
    monkeypatch.delenv("VLLM_MLA_FIXES_CACHE_DIR", raising=False)
    assert state() == "applied"
    monkeypatch.setenv("VLLM_MLA_FIXES_CACHE_DIR", _unusable(kind, tmp_path))
    assert state() == "applied"


# --------------------------------------------------------- doctor = engine


FLASH = {**repro.DSV41_FLASH, "num_attention_heads": 64, "index_topk": 512}
# One config.json per field that differs from DeepSeek-V4.1-Flash's.
ONE_FIELD = {
    "layers": {"num_hidden_layers": 38, "compress_ratios": FLASH["compress_ratios"][:38]},
    "heads": {"num_attention_heads": 32},
    "top-k": {"index_topk": 1024},
    "window": {"sliding_window": 256},
    "compress ratios": {"compress_ratios": [0, 0] + [2] * 10 + [1] * 28},
    "drafter": {"n_mtp_layers": 1},
}
DSPARK = ["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}']
NIXL = ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}']
LINES = {name: DSPARK for name in ONE_FIELD} | {"kv-transfer": NIXL}


def _section(cls: type, args: Any) -> Any:
    """vLLM's config class from every parsed argument it declares a field for."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = {}
    for name, field in fields.items():
        if not field.init or not hasattr(args, name):
            continue
        value = getattr(args, name)
        if value is None or value == field.default:
            continue
        given[name] = value
    return cls(**given)


def _drafters(line: list[str], model: dict) -> tuple[int, ...]:
    """DSpark's drafter layers on ``line`` (each with compress ratio 0), as
    many as the model's config names; none without DSpark."""
    if not any('"dspark"' in arg for arg in line):
        return ()
    return (0,) * int(model.get("n_mtp_layers") or engine_module.DEFAULT_DSPARK_LAYERS)


def _config_json(line: list[str], model: dict) -> dict:
    """The ``config.json`` the engine of ``line`` reads: a DSpark checkpoint
    lists its drafter layers past the backbone, as the engine's planned
    model config has them (``repro.attach_model``)."""
    drafters = _drafters(line, model)
    if not drafters:
        return model
    ratios = [*model["compress_ratios"], *drafters]
    return {**model, "compress_ratios": ratios, "n_mtp_layers": len(drafters)}


def _engine_from_vllms_args(line: list[str], model: dict, max_model_len: int):
    """The engine's decision for ``line``: the settings from vLLM's parsed
    arguments through vLLM's config classes, the layers planned by vLLM."""
    from vllm.config import ParallelConfig

    with serve_line.cuda_device_type_while_parsing():
        args = serve_line.engine_args(serve_line.parse(line))
    sections: dict[str, Any] = {
        "parallel_config": _section(ParallelConfig, args),
        "attention_config": args.attention_config,
    }
    if args.kv_transfer_config is not None:
        sections["kv_transfer_config"] = args.kv_transfer_config
    speculative = None
    drafters: tuple[int, ...] = ()
    if args.speculative_config:
        written = args.speculative_config
        speculative = _spec(written["method"], int(written["num_speculative_tokens"]))
        drafters = _drafters(line, model)
    with repro.applied((12, 0)), repro.sm120_platform():
        block_size = args.block_size or upstream.picked_block_size(
            upstream.declared_kernel_blocks()
        )
        plan = repro.plan_geometry(
            block_size,
            model=model,
            settings=repro.EngineSettings(sections=sections),
            speculative_config=speculative,
            drafter_ratios=drafters,
            max_model_len=max_model_len,
        )
        config = plan.vllm_config
        return engine_config(config), STATE.decision_for(config)


@pytest.mark.parametrize("case", sorted(LINES))
def test_doctor_decides_what_the_engine_decides_one_field_from_flash(case, monkeypatch):
    """Issue 46: doctor's shape check read Flash's heads, and its settings
    were compared with themselves.  One config.json per field that differs
    from Flash; doctor's decision, report and shapes against the engine's."""
    model = {**FLASH, **ONE_FIELD.get(case, {})}
    line = [
        "vllm",
        "serve",
        "/models/checkpoint",
        "--block-size",
        "128",
        "--tensor-parallel-size",
        "2",
    ]
    line += ["--max-model-len", "16384", *LINES[case]]
    predicted = predict_line(line, {"text_config": _config_json(line, model)})
    engine, decision = _engine_from_vllms_args(line, model, 16384)
    assert predicted.model_figures == "from config.json"
    differing = {
        f.name: (getattr(predicted.engine, f.name), getattr(engine, f.name))
        for f in dataclasses.fields(engine)
        if getattr(predicted.engine, f.name) != getattr(engine, f.name)
    }
    assert differing == {}, (case, differing)
    assert predicted.decision == decision, (case, predicted.decision.reason, decision.reason)
    assert predicted.engine_report() == engine_report(engine, decision)
    heads = {s.heads for s in predicted.shapes}
    topks = {s.topk for s in predicted.shapes}
    assert heads == {model["num_attention_heads"] // 2}, heads
    assert topks == {model["sliding_window"], model["index_topk"]}, topks
