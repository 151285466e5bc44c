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

import os
import shlex
import subprocess

import pytest
from fix_releases import FP8, newest, newest_covered
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_mla_fixes import settings as plugin_settings
from vllm_mla_fixes.report import PLUGIN, plugins_advice, shell_word, spaced_note

pytestmark = pytest.mark.vllm_release(newest(FP8), newest_covered())

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
        "VLLM_MLA_FIXES", "\x1b[31m" + "x" * 120_000, plugin_settings.FIXES, problem="p"
    )
    line = reading.describe()
    assert line.isprintable() and "\\x1b[31m" in line and len(line) < 1000
    assert plugin_settings.terminal_line("a\x1b[31mb\udcff") == "a\\x1b[31mb\\udcff"
    unknown = plugin_settings.read(
        plugin_settings.FIXES, {"VLLM_MLA_FIXES": ",".join(["y" * 50_000] * 20)}
    )
    assert unknown is not None and len(unknown.describe()) < 2000, "a long value is cut"
