"""Every bug in ``injections.py`` turns one of its catching tests red (issue 46).

Each injection is applied in this process, then its catchers run one after
another (their bodies, with a fresh ``monkeypatch`` and ``tmp_path``) until
one fails; the injection is undone after.  The test prints the table
injection -> the test that caught it (also written to ``$INJECTION_TABLE``
where set), and fails if any injection survives every catcher.  One vLLM
import, no second interpreter.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path

import pytest
from fix_releases import DSV41, covered
from injections import Catcher, injections

pytestmark = pytest.mark.vllm_release(*covered(DSV41))
# Opt-in (`nox -s injections-<release>` sets this variable): the catchers it
# runs leave this process's state behind (CI run 4: test_dsv41_offload's
# per-layer page mover, run after it in the same worker, then failed), so it
# runs in a session of its own, never beside other test files.
INJECTIONS_ENV = "VLLM_MLA_FIXES_TEST_INJECTIONS"


def _releases_of(function: object, module: object) -> tuple[str, ...] | None:
    marks = [*getattr(function, "pytestmark", ()), *_as_list(getattr(module, "pytestmark", ()))]
    named = [m.args for m in marks if m.name == "vllm_release"]
    return named[0] if named else None  # the closest mark: the function's own first


def _as_list(marks: object) -> list:
    return list(marks) if isinstance(marks, (list, tuple)) else [marks]


def _run(catcher: Catcher, release: str, tmp_path: Path) -> str | None:
    """Why the catcher failed (None: it passed); raises Skipped where it
    does not run on ``release``."""
    module_name, function_name, params = catcher
    module = importlib.import_module(module_name)
    function = getattr(module, function_name)
    releases = _releases_of(function, module)
    if releases is not None and release not in releases:
        pytest.skip(f"{function_name} does not run on {release}")
    tmp_path.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        arguments = dict(params)
        names = function.__code__.co_varnames[: function.__code__.co_argcount]
        if "monkeypatch" in names:
            arguments["monkeypatch"] = monkeypatch
        if "tmp_path" in names:
            arguments["tmp_path"] = tmp_path
        try:
            function(**arguments)
        except Exception as exc:  # noqa: BLE001 - red is what is looked for
            first = (str(exc).strip().splitlines() or [""])[0]
            return f"{type(exc).__name__}: {first[:120]}"
    return None


def _shown(catcher: Catcher) -> str:
    module_name, function_name, params = catcher
    ids = "-".join(str(v) for v in params.values())
    return f"{module_name}.py::{function_name}" + (f"[{ids}]" if ids else "")


def test_every_injected_bug_is_caught(request, tmp_path):
    import vllm_mla_fixes
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE

    release = request.config.vllm_release
    if not os.environ.get(INJECTIONS_ENV):
        pytest.skip(f"runs alone: `nox -s injections-{release}`")
    rows, survivors = [], []
    started = time.monotonic()
    for number, injection in enumerate(injections()):
        caught = None
        with pytest.MonkeyPatch.context() as mp:
            injection.inject(mp)
            for index, catcher in enumerate(injection.catchers):
                vllm_mla_fixes.revert_all()
                STATE.clear()
                try:
                    why = _run(catcher, release, tmp_path / f"{number}-{index}")
                except pytest.skip.Exception:
                    continue
                finally:
                    STATE.clear()
                if why is not None:
                    caught = (catcher, why)
                    break
        if caught is None:
            survivors.append(injection.name)
            rows.append(f"| {injection.name} | **survived** | |")
        else:
            rows.append(f"| {injection.name} | `{_shown(caught[0])}` | {caught[1]} |")
    table = "\n".join(
        [
            f"vLLM {release}: {len(rows)} injections, {len(survivors)} survived, "
            f"{time.monotonic() - started:.0f} s",
            "",
            "| injection | caught by | how |",
            "|---|---|---|",
            *rows,
        ]
    )
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n" + table)
    if os.environ.get("INJECTION_TABLE"):
        Path(os.environ["INJECTION_TABLE"]).write_text(table + "\n", encoding="utf-8")
    assert not survivors, survivors
