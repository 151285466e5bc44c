"""dsv41-sm120-geometry: one decision per engine (issue 37).

The decision is a pure function of the engine's configuration and the
installed kernels.  Engines started one after another in one process --
through vLLM's own plugin loading, then vLLM's spec collection, planner,
kernel-block selection, metadata builders, allocation and binding -- each get
what they get alone, in every order; pipeline ranks holding different layers
get one decision; ``revert()`` leaves every patched vLLM attribute as it was.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from fix_releases import covered

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import check_workers_agree
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.decision import decide
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.status import engine_reports

pytestmark = pytest.mark.vllm_release(*covered(DSV41))


def _dspark():
    from vllm.config import SpeculativeConfig

    config = SpeculativeConfig.__new__(SpeculativeConfig)
    for name, value in dict(
        method="dspark", num_speculative_tokens=3, disable_eagle_block_drop=False
    ).items():
        object.__setattr__(config, name, value)
    return config


@dataclasses.dataclass(frozen=True)
class Engine:
    label: str
    block_size: int
    dspark: bool = False
    capability: tuple[int, int] = (12, 0)


@dataclasses.dataclass(frozen=True)
class Outcome:
    geometry: str
    reason: str
    pages: tuple[tuple[str, int, int], ...]  # (kind, ratio, rows), distinct
    error: str | None


def _start(engine: Engine) -> Outcome:
    """One engine's start-up, each step vLLM's own, on ``engine.capability``."""
    with repro.sm120_platform(engine.capability):
        geometry = repro.plan_geometry(
            engine.block_size,
            speculative_config=_dspark() if engine.dspark else None,
            drafter_ratios=(0, 0, 0) if engine.dspark else (),
        )
        decision = STATE.decision_for(geometry.vllm_config)  # taken as the layers were built
        try:
            repro.select_kernel_block_sizes(geometry)
            repro.create_metadata_builders(geometry)
            repro.allocate_and_bind(geometry)
        except ValueError as exc:
            return Outcome(decision.geometry.value, decision.reason, (), str(exc).splitlines()[0])
        pages = tuple(
            sorted({(p.kind, p.compress_ratio, p.rows) for p in repro.flashinfer_pages(geometry)})
        )
    return Outcome(decision.geometry.value, decision.reason, pages, None)


@pytest.fixture
def plugin_loaded_by_vllm(fresh_plugin, monkeypatch, swap_fix):
    """The plugin loaded through vLLM's own general-plugin loader, its probe
    answering for an SM120 device (this CPU host stands in for one)."""
    import vllm.plugins

    swap_fix(fix.for_capability((12, 0)))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    states = {s.name: s.state.value for s in fresh_plugin.status()}
    assert states[fix.INFO.name] == "applied", states
    return fresh_plugin


def _alone(engine: Engine, fresh_plugin) -> Outcome:
    """What ``engine`` gets as the first engine of a process (a fresh plugin)."""
    import vllm.plugins

    fresh_plugin.revert_all()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    return _start(engine)


ENGINES = {
    e.label: e
    for e in (
        Engine("64", 64),
        Engine("128", 128),
        Engine("64+dspark", 64, dspark=True),
        Engine("128+dspark", 128, dspark=True),
        Engine("128@sm90", 128, capability=(9, 0)),
    )
}
ORDERS = [
    ("64", "128"),
    ("128", "64"),
    ("64", "64+dspark", "128", "128+dspark"),
    ("128+dspark", "64+dspark", "64", "128"),
    ("128", "128@sm90", "128"),
    ("64", "128@sm90", "64+dspark"),
]


def test_every_engine_of_a_process_gets_what_it_gets_alone(plugin_loaded_by_vllm):
    """Red before issue 37 on 0.34.0: after a --block-size 64 engine stepped
    aside, a --block-size 128 engine in the same process got upstream's kernel
    blocks and stopped with vLLM's "cannot be split into" (``nox -t verify``).
    Every order of engines, DSpark on and off, an SM90 engine between two
    SM120 ones: each engine's decision, reason and bound pages are exactly
    what it gets as the first engine of a process."""
    alone = {label: _alone(engine, plugin_loaded_by_vllm) for label, engine in ENGINES.items()}
    for label, outcome in alone.items():
        if ENGINES[label].capability[0] == 12:  # the fix's layouts all start
            assert outcome.error is None, (label, outcome.error)
    # SM90 is vLLM's own start-up, untouched (the stand-in attention class is
    # SM12x's, so what it gives there is compared, whatever it is)
    for order in ORDERS:
        plugin_loaded_by_vllm.revert_all()
        import vllm.plugins

        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        for position, label in enumerate(order):
            got = _start(ENGINES[label])
            assert got == alone[label], (order, position, label, got, alone[label])
        reported = [entry["decision"] for entry in engine_reports()]
        assert reported == [alone[label].geometry for label in dict.fromkeys(order)], reported


def test_status_is_not_needed_only_where_every_engine_stepped_aside(plugin_loaded_by_vllm):
    """One engine that steps aside: ``status`` says not-needed; one more
    engine that gets the fix's layout: applied, naming both decisions."""
    upstream_engine = _start(ENGINES["64"])
    entry = {s.name: s for s in plugin_loaded_by_vllm.status()}[fix.INFO.name]
    if upstream_engine.geometry == fix.UPSTREAM:
        assert entry.state.value == "not-needed", entry
        assert "geometry upstream (not-needed: upstream's --block-size 64" in entry.reason
    _start(ENGINES["128"])
    entry = {s.name: s for s in plugin_loaded_by_vllm.status()}[fix.INFO.name]
    assert entry.state.value == "applied", entry
    assert "geometry interleaved-split" in entry.reason


def test_the_decision_is_the_same_function_everywhere():
    """``decide`` on an engine config is what the engine's process records,
    and calling it again, in any order, gives the same answer."""
    with repro.applied((12, 0)), repro.sm120_platform():
        configs = [
            repro.plan_geometry(size, drafter_ratios=drafters, speculative_config=spec).vllm_config
            for size, drafters, spec in ((64, (), None), (128, (0, 0, 0), _dspark()))
        ]
        recorded = [STATE.decision_for(config) for config in configs]
        for permutation in itertools.permutations(configs):
            again = [decide(config) for config in permutation]
            assert again == [recorded[configs.index(c)] for c in permutation]


# --------------------------------------------------------------- pipeline


def _fresh_decisions() -> None:
    """Forget every kept decision, as a process that has decided nothing yet
    (the rest of the fix's state -- its backends -- stays applied)."""
    STATE.decisions.clear()
    STATE.spec_mismatches.clear()


def _engine_config(block_size: int, pp_size: int, tp_size: int, dspark: bool, rank: int = 0):
    """The engine config of global ``rank`` of a TP x PP serve line, as vLLM's
    worker has it: ``ParallelConfig.rank`` = pp_rank * tp_size + tp_rank."""
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(
        tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, rank=rank
    )
    config = repro.make_vllm_config(
        block_size, None, repro.EngineSettings(sections={"parallel_config": parallel})
    )
    if dspark:
        object.__setattr__(config, "speculative_config", _dspark())
    repro.attach_model(config, repro.DSV41_FLASH, (0, 0, 0) if dspark else ())
    return config


def _rank(block_size: int, pp_size: int, pp_rank: int, tp_size: int, dspark: bool):
    """One pipeline rank deciding in a fresh state: its rank in
    ``parallel_config`` (its stage's last TP rank), its backbone layers from
    vLLM's own partition, the drafter's only on the last stage -- vLLM 0.34.0
    builds the speculator only where ``is_last_pp_rank``
    (vllm/v1/worker/gpu/model_runner.py:312) and loads the drafter's layers
    through it (model_runner.py:432) -- and its specs through vLLM's spec
    collection.  Returns (decision, specs)."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    model = repro.DSV41_FLASH
    backbone = model["num_hidden_layers"]
    rank = pp_rank * tp_size + tp_size - 1
    config = _engine_config(block_size, pp_size, tp_size, dspark, rank)
    assert config.parallel_config.rank == rank
    _fresh_decisions()
    layers = list(range(*get_pp_indices(backbone, pp_rank, pp_size)))
    if dspark and pp_rank == pp_size - 1:
        layers += range(backbone, backbone + 3)
    repro.build_layers(config, model, (0, 0, 0) if dspark else (), only=layers)
    return STATE.decision_for(config), get_kv_cache_spec(config)


def _pipeline_engine(block_size: int, pp_size: int, tp_size: int, dspark: bool) -> None:
    """Every rank decides alone; afterwards their answers are compared with
    each other and with the engine core's (global rank 0, its own fresh
    state), and the engine core's agreement check runs over their specs."""
    ranks = [_rank(block_size, pp_size, r, tp_size, dspark) for r in range(pp_size)]
    decisions = [decision for decision, _ in ranks]
    assert len(set(decisions)) == 1, [
        (d.geometry.value, d.drafter_swa_rows, d.fix_tokens) for d in decisions
    ]
    _fresh_decisions()
    core = _engine_config(block_size, pp_size, tp_size, dspark)
    check_workers_agree(core, [specs for _, specs in ranks])  # the engine core's check
    core_decision = STATE.decision_for(core)
    assert decisions[0] == core_decision
    rows = {
        spec.block_size
        for _, specs in ranks
        for name, spec in specs.items()
        if name.endswith("swa_cache")
    }
    expected = {core_decision.backbone_swa_rows}
    if dspark:
        expected.add(core_decision.drafter_swa_rows)
    assert rows == expected


PIPELINES = [(2, 1, True), (2, 8, False), (4, 2, True), (4, 1, False)]


@pytest.mark.parametrize(
    ("pp_size", "tp_size", "dspark"),
    PIPELINES,
    ids=[f"pp{p}-tp{t}-{'dspark' if d else 'plain'}" for p, t, d in PIPELINES],
)
def test_pipeline_ranks_decide_alike(pp_size, tp_size, dspark):
    """Every rank of a --pipeline-parallel-size engine, each holding only its
    own layers (DSpark's drafter on the last) and deciding in its own fresh
    state, decides what the others and the engine core decide, and the
    engine core's agreement check passes over their specs."""
    with repro.applied((12, 0)), repro.sm120_platform():
        for block_size in (64, 128):
            _pipeline_engine(block_size, pp_size, tp_size, dspark)


def test_pipeline_test_catches_rank_dependent_planning(monkeypatch):
    """The injected bug (``injections.py``, here on every covered release):
    stages without DSpark's drafter plan without its layers (its rows, the
    2% rule's figures), their stage read from ``parallel_config.rank`` as
    vLLM's worker sets it.  The pipeline test's comparison must go red."""
    from injections import drafter_dropped_off_the_last_stage

    drafter_dropped_off_the_last_stage(monkeypatch)
    with repro.applied((12, 0)), repro.sm120_platform(), pytest.raises(AssertionError) as caught:
        _pipeline_engine(128, 2, 2, True)
    assert "assert 2 == 1" in str(caught.value), caught.value  # the ranks' answers differ


def test_engines_differing_only_in_parallel_layout_each_get_a_fresh_decision():
    """Engines that differ only in PP / TP / DP, one after another in one
    process, each get exactly the decision a fresh state gives them.  PP
    changes the capacity figures (vLLM reserves sliding-window blocks for
    every in-flight batch); TP and DP change none."""
    layouts = [(1, 1, 1), (2, 1, 1), (4, 2, 1), (1, 8, 1), (1, 1, 2)]

    def config(pp, tp, dp):
        from vllm.config import ParallelConfig

        parallel = ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp
        )
        engine = repro.make_vllm_config(
            64, None, repro.EngineSettings(sections={"parallel_config": parallel})
        )
        object.__setattr__(engine, "speculative_config", _dspark())
        repro.attach_model(engine, repro.DSV41_FLASH, (0, 0, 0))
        return engine

    with repro.applied((12, 0)), repro.sm120_platform():
        kept = {layout: STATE.decision_for(config(*layout)) for layout in layouts}
        for layout in layouts:
            _fresh_decisions()
            assert kept[layout] == STATE.decision_for(config(*layout)), layout
    assert kept[1, 1, 1].fix_tokens != kept[2, 1, 1].fix_tokens  # PP is a figure's input
    assert kept[1, 1, 1] == kept[1, 8, 1] == kept[1, 1, 2]  # TP and DP are none's


# ------------------------------------------------------------------ revert


def attribute_owners(*packages: str) -> Iterator[tuple[str, Any]]:
    """Every imported module of ``packages`` and every class such a module
    defines, with its dotted name."""
    import sys
    from types import ModuleType

    prefixes = tuple(f"{package}." for package in packages)
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(prefixes) or not isinstance(module, ModuleType):
            continue
        yield module_name, module
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module_name:
                yield f"{module_name}.{value.__qualname__}", value


def _vllm_attributes() -> dict[tuple[str, str], int]:
    """Identity of every attribute of every imported vLLM module and of
    every class such a module defines: the fix's targets, and every module
    that imported a patched function by name, without a list of them."""
    return {
        (owner_name, name): id(value)
        for owner_name, owner in attribute_owners("vllm")
        for name, value in list(vars(owner).items())
    }


def _fix_modules_imported() -> None:
    """Every vLLM module the fix patches, imported before the first look."""
    import importlib

    from vllm_mla_fixes.fixes.dsv41_sm120_geometry import info
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.checks import SPEC_MERGE_SITES

    for name in (
        info.ATTENTION_MODULE,
        info.FLASHINFER_MODULE,
        info.INDEXER_MODULE,
        info.WARMUP_MODULE,
        info.WORKER_UTILS_MODULE,
        *(module for module, _ in SPEC_MERGE_SITES),
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # a spec-merge candidate this release does not have
            pass


def test_revert_restores_every_patched_attribute():
    """Issue 46: the test checked a hand-written list that left out the
    spec-merge site and the modules importing patched functions by name.
    Here every attribute of every vLLM module (and of its classes) is
    compared with what it was before ``apply``."""
    _fix_modules_imported()
    before = _vllm_attributes()
    with repro.applied((12, 0)) as result, repro.sm120_platform():
        assert result.status.state.value == "applied"
        during = _vllm_attributes()
    after = _vllm_attributes()
    patched = {k for k in before if during.get(k) != before[k]}
    assert patched, "apply changed nothing"
    changed = {k: "changed" for k in before if after.get(k) != before[k]}
    assert changed == {}, sorted(changed)


def test_revert_after_binding_restores_every_patched_attribute():
    """The same after an engine's layers were planned, allocated and bound."""
    _fix_modules_imported()
    before = _vllm_attributes()
    with repro.applied((12, 0)), repro.sm120_platform():
        repro.allocate_and_bind(_geometry_bound(128))
    after = _vllm_attributes()
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert changed == [], changed


def _geometry_bound(block_size: int):
    geometry = repro.plan_geometry(block_size)
    repro.select_kernel_block_sizes(geometry)
    repro.create_metadata_builders(geometry)
    return geometry
