"""What doctor and status print of an operator's values is safe and runnable (issue 43).

``VLLM_PLUGINS="other, mla_fixes"`` used to get the remedy ``export
VLLM_PLUGINS=other, mla_fixes,mla_fixes``: not one shell word, and vLLM
(which splits at commas and keeps the spaces) still left the plugin out.
Control characters in a setting reached the terminal raw.  The remedy is now
built from the names vLLM reads, as one shell word (``report.shell_word``);
a property runs it in bash and reads back what vLLM would split.  The whole
doctor run with such a value: ``test_doctor.py::test_glm_line_without_the_plugin_*``.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import pytest
from fix_releases import newest_covered, newest_of_earliest_fix
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import vllm_mla_fixes
from vllm_mla_fixes import settings as plugin_settings
from vllm_mla_fixes.fixes import FIXES_BY_NAME, SELECTION
from vllm_mla_fixes.report import PLUGIN, Finding, plugins_advice, shell_word, spaced_note

pytestmark = pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())

# Names as an operator may write them: plugin-like words, shell's special
# characters, spaces, control characters, bytes that are not UTF-8 (as
# os.environ holds them: surrogate escapes).
CHARACTERS = st.sampled_from(
    list("abz_-.019 ")
    + list("$`\"'\\!*;&|()<>~#{}")
    + ["\x1b", "\n", "\t", "\x7f", "\xe9", "\u2028"]
) | st.integers(0xDC80, 0xDCFF).map(chr)
NAMES = st.text(CHARACTERS, max_size=12).filter(lambda name: "," not in name)


def _command(advice: str) -> str:
    return advice.split("   (or unset VLLM_PLUGINS", 1)[0]


def _bash_reads(command: str) -> list[bytes]:
    """What VLLM_PLUGINS holds after bash runs ``command``, split as vLLM splits it."""
    done = subprocess.run(
        ["bash", "-c", f'{command} && printf %s "$VLLM_PLUGINS"'],
        env={k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"},
        capture_output=True,
        timeout=30,
        check=True,
    )
    return done.stdout.split(b",")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(NAMES, max_size=4))
@example(["other", " mla_fixes"])
@example(["lora_filesystem_resolver", " mla_fixes", "\x1b[31m\udcff"])
def test_the_plugins_remedy_is_one_shell_word_that_loads_the_plugin(names):
    vllm_plugins = ",".join(names)
    command = _command(plugins_advice(vllm_plugins))
    assert command.isprintable(), command  # no control character reaches the terminal
    wanted = list(dict.fromkeys(n for n in (*(n.strip() for n in names), PLUGIN) if n))
    read = _bash_reads(command)
    assert read == [os.fsencode(name) for name in wanted], command
    if all(name.isprintable() for name in wanted):
        assert shlex.split(command) == ["export", f"VLLM_PLUGINS={','.join(wanted)}"]


def test_the_issues_value_gets_a_remedy_that_includes_the_plugin():
    advice = plugins_advice("other, mla_fixes")
    assert advice.startswith("export VLLM_PLUGINS=other,mla_fixes   (or unset")
    assert "keeps the spaces: ' mla_fixes' is another name" in spaced_note("other, mla_fixes")
    assert spaced_note("other") == ""


@given(st.text(CHARACTERS, max_size=30))
@settings(max_examples=100, deadline=None)
def test_a_shell_word_means_exactly_its_text_and_prints(text):
    word = shell_word(text)
    assert word.isprintable()
    if text.isprintable():  # plain POSIX quoting
        assert shlex.split(word) == [text]
    done = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, timeout=30)
    assert done.stdout == os.fsencode(text)


def test_settings_are_shown_escaped_and_cut():
    reading = plugin_settings.Reading(
        "VLLM_MLA_FIXES", "\x1b[31m" + "x" * 120_000, SELECTION, problem="p"
    )
    line = reading.describe()
    assert line.isprintable() and "\\x1b[31m" in line and len(line) < 1000
    assert plugin_settings.terminal_line("a\x1b[31mb\udcff") == "a\\x1b[31mb\\udcff"
    unknown = plugin_settings.read(SELECTION, {"VLLM_MLA_FIXES": ",".join(["y" * 50_000] * 20)})
    assert unknown is not None and len(unknown.describe()) < 2000, "a long value is cut"


# -- remedies follow the cause (issue 44) ------------------------------------------

# What VLLM_PLUGINS and VLLM_MLA_FIXES may hold: unset (None), empty, lists that
# name the plugin or not (with the spaces vLLM keeps), the fixes' names, keywords
# and names no fix has.
PLUGIN_NAMES = st.sampled_from([PLUGIN, f" {PLUGIN}", f"{PLUGIN} ", "lora_filesystem_resolver", ""])
FIX_WORDS = st.sampled_from([*FIXES_BY_NAME, "all", "none", "no-such-fix", " "])
PLUGIN_SETTINGS = st.none() | st.lists(PLUGIN_NAMES, max_size=3).map(",".join)
FIX_SETTINGS = st.none() | st.lists(FIX_WORDS, max_size=3).map(",".join)
UNSET = "<unset>"  # what bash prints for a variable it does not hold (no setting here is)


def _plugin_state(environ: dict[str, str], fix: str, everything_on: str) -> str:
    """The fix's state in a process under ``environ``, as vLLM's loader reads
    VLLM_PLUGINS (exact names, split at commas) and the plugin VLLM_MLA_FIXES
    (a value not allowed is the default, all fixes); ``everything_on``: its
    state with both unset."""
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None and PLUGIN not in plugins.split(","):
        return "skipped"  # never loaded, so never evaluated
    selected = plugin_settings.value(SELECTION, environ)
    return "disabled" if selected is not None and fix not in selected else everything_on


def _after(command: str, environ: dict[str, str]) -> dict[str, str]:
    """Both settings after bash, started with ``environ``, runs ``command``."""
    script = (
        f'{command} && printf "%s\\0%s" "${{VLLM_PLUGINS-{UNSET}}}" "${{VLLM_MLA_FIXES-{UNSET}}}"'
    )
    done = subprocess.run(
        ["bash", "-c", script], env=environ, capture_output=True, timeout=30, check=True
    )
    plugins, fixes = (os.fsdecode(v) for v in done.stdout.split(b"\0"))
    read = {"VLLM_PLUGINS": plugins, "VLLM_MLA_FIXES": fixes}
    return {k: v for k, v in read.items() if v != UNSET}


@pytest.fixture(scope="module")
def judged_line():
    """The fix this release applies (where the line is served) with both
    settings unset, its state then (the plugin loaded by vLLM's loader, as
    `status` and doctor load it), doctor's environment and its parse of a
    line that meets the fix's failure."""
    from doctor_runs import DSV41_LINE

    from vllm_mla_fixes import doctor
    from vllm_mla_fixes.fixes import ALL_FIXES

    tiny_glm_dsa = Path(vllm_mla_fixes.__file__).parent / "models" / "tiny_glm_moe_dsa"
    lines = {  # a line that meets the fix's failure, for each fix that has one here
        "fp8-ds-mla-reshape": ["vllm", "serve", str(tiny_glm_dsa), "--kv-cache-dtype", "fp8"]
        + ["--attention-backend", "FLASHMLA_SPARSE", "--block-size", "64"],
        # 128-token blocks: upstream's layout does not start on SM12x, the fix's does
        "dsv41-sm120-geometry": [*DSV41_LINE[:-1], "128"],
    }
    covering = [f.INFO.name for f in ALL_FIXES if version("vllm") in f.INFO.covered_releases]
    fix = next((name for name in covering if name in lines), None)
    if fix is None:
        pytest.skip(f"no line here meets the failure of a fix vLLM {version('vllm')} needs")
    line = lines[fix]
    import vllm.plugins

    plain = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    # as in a fresh process: vLLM's loader runs once per process, and a test
    # file before this one in the worker may have run it under other settings
    vllm_mla_fixes.revert_all()
    with (
        mock.patch.dict(os.environ, plain, clear=True),
        mock.patch.object(vllm.plugins, "plugins_loaded", False),
    ):
        env, serve, _ = doctor.diagnose(line)  # the plugin's states via vLLM's loader, as status
    vllm_mla_fixes.revert_all()
    return fix, env.fix_states[fix], env, serve, plain


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(PLUGIN_SETTINGS, FIX_SETTINGS)
@example("lora_filesystem_resolver", None)  # issue 44's defect 4
@example(f"lora_filesystem_resolver, {PLUGIN}", "none")
def test_the_remedy_doctor_prints_gets_the_fix_applied(judged_line, vllm_plugins, mla_fixes):
    """Each remedy doctor prints for the fix, run in bash, gets the plugin to
    the state it has with nothing set (applied where the line is served);
    where nothing is printed, the fix is in that state already."""
    fix, everything_on, base_env, serve, plain = judged_line
    environ = dict(plain)
    for name, value in (("VLLM_PLUGINS", vllm_plugins), ("VLLM_MLA_FIXES", mla_fixes)):
        if value is not None:
            environ[name] = value

    def findings(environ: dict[str, str]) -> list[Finding]:
        state = _plugin_state(environ, fix, everything_on["state"])
        reason = everything_on["reason"] if state == everything_on["state"] else state
        env = dataclasses.replace(
            base_env,
            vllm_plugins=environ.get("VLLM_PLUGINS"),
            mla_fixes=environ.get("VLLM_MLA_FIXES"),
            fix_states={fix: {"state": state, "reason": reason}},
        )
        return FIXES_BY_NAME[fix].diagnose(env, serve)

    remedies = {
        f.advice.split("   (", 1)[0]
        for f in findings(environ)
        if f.level == "error" and f.advice.startswith("export ")
    }
    if _plugin_state(environ, fix, everything_on["state"]) == everything_on["state"]:
        assert not remedies
        return
    assert remedies, "the fix is not applied, and doctor prints no way out"
    for command in remedies:
        after = {**environ, **_after(command, environ)}
        assert _plugin_state(after, fix, everything_on["state"]) == everything_on["state"], (
            vllm_plugins,
            mla_fixes,
            command,
        )
        assert not [f for f in findings(after) if f.level == "error"], command
