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
import functools
import itertools

import pytest
from fix_releases import DSV41, covered

from vllm_mla_fixes.fixes import dsv41_sm120_geometry as fix
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import gate
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions import failures as repro

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
        decision = fix.STATE.decision_for(geometry.vllm_config)  # taken as the layers were built
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
def plugin_loaded_by_vllm(fresh_plugin, monkeypatch):
    """The plugin loaded through vLLM's own general-plugin loader, its probe
    answering for an SM120 device (this CPU host stands in for one)."""
    import vllm.plugins

    monkeypatch.setattr(fix, "probe", functools.partial(gate.probe, (12, 0)))
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
        reported = [entry["decision"] for entry in fix.engine_reports()]
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
        recorded = [fix.STATE.decision_for(config) for config in configs]
        for permutation in itertools.permutations(configs):
            again = [fix.decide(config) for config in permutation]
            assert again == [recorded[configs.index(c)] for c in permutation]


# --------------------------------------------------------------- pipeline


def _rank_layers(model: dict, pp_size: int, rank: int) -> tuple[int, int]:
    """The backbone layers vLLM's own partition gives ``rank``."""
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(model["num_hidden_layers"], rank, pp_size)


def _rank_specs(
    block_size: int, pp_size: int, rank: int, tp_size: int, dspark: bool
) -> tuple[object, fix.Decision, dict]:
    """One pipeline rank of a TP x PP engine: its own layers (the drafter's on
    the last rank), its decision and its specs, through vLLM's spec collection."""
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    model = repro.DSV41_FLASH
    start, end = _rank_layers(model, pp_size, rank)
    drafters = (0, 0, 0) if dspark else ()
    settings = repro.EngineSettings(
        sections={
            "parallel_config": ParallelConfig(
                tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
            )
        }
    )
    config = repro.make_vllm_config(block_size, None, settings)
    if dspark:
        object.__setattr__(config, "speculative_config", _dspark())
    repro.attach_model(config, model, drafters)
    layers = range(start, end)
    if dspark and rank == pp_size - 1:
        layers = [*layers, *range(model["num_hidden_layers"], model["num_hidden_layers"] + 3)]
    repro.build_layers(config, model, drafters, only=layers)
    return config, fix.STATE.decision_for(config), get_kv_cache_spec(config)


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
@pytest.mark.parametrize("pp_size", [2, 4])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_pipeline_ranks_decide_alike(pp_size, tp_size, dspark):
    """Every rank of a --pipeline-parallel-size engine, each holding only its
    own layers (DSpark's drafter on the last), decides the same geometry and
    page rows, and the engine core's agreement check passes over their specs."""
    for block_size in (64, 128):
        decisions, specs, configs = [], [], []
        with repro.applied((12, 0)), repro.sm120_platform():
            for rank in range(pp_size):
                config, decision, rank_specs = _rank_specs(
                    block_size, pp_size, rank, tp_size, dspark
                )
                configs.append(config)
                decisions.append(decision)
                specs.append(rank_specs)
            fix.check_workers_agree(configs[0], specs)  # the engine core's check
        assert len(set(decisions)) == 1, [d.reason for d in decisions]
        rows = {
            spec.block_size
            for rank_specs in specs
            for name, spec in rank_specs.items()
            if name.endswith("swa_cache")
        }
        expected = {decisions[0].backbone_swa_rows}
        if dspark:
            expected.add(decisions[0].drafter_swa_rows)
        assert rows == expected


# ------------------------------------------------------------------ revert


def _vllm_attributes() -> dict[tuple[str, str], int]:
    """Identity of every attribute of every imported vLLM module and of
    every class such a module defines: the fix's targets, and every module
    that imported a patched function by name, without a list of them."""
    import sys
    from types import ModuleType

    found = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm.") or not isinstance(module, ModuleType):
            continue
        for name, value in list(vars(module).items()):
            found[module_name, name] = id(value)
            if isinstance(value, type) and value.__module__ == module_name:
                for attr, member in list(vars(value).items()):
                    found[module_name, f"{value.__qualname__}.{attr}"] = id(member)
    return found


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
