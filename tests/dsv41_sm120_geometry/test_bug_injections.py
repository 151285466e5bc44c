"""Every bug in ``injections.py`` turns one of its catching tests red (issue 46).

Each injection is applied in this process, then its catchers run one after
another (their bodies, with a fresh ``monkeypatch`` and ``tmp_path``) until
one fails; the injection is undone after, and every attribute of every vLLM
module and class, and of this package's, is put back as it was before the
first: an injected ``revert()`` that skips a patch leaves that patch in vLLM,
which the tests run after this one in the same process must not inherit.
The test prints the table injection -> the test that caught it (also
written to ``$INJECTION_TABLE`` where set), and fails if any injection
survives every catcher.  One vLLM import, no second interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest
from fix_releases import covered
from injections import Catcher, injections
from test_dsv41_one_decision import attribute_owners

import vllm_mla_fixes
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41

pytestmark = pytest.mark.vllm_release(*covered(DSV41))
# CI runs the table on the newest covered release (the noxfile sets this
# variable in that release's test session); `nox -s injections-<release>`
# runs it on any covered release.  Elsewhere it is skipped: it costs ~20 s.
INJECTIONS_ENV = "VLLM_MLA_FIXES_TEST_INJECTIONS"
PACKAGE = Path(vllm_mla_fixes.__file__).parent

_MISSING = object()
# Owner (module or class) name -> (the owner, a copy of its attributes).
Attributes = dict[str, tuple[Any, dict[str, Any]]]


def _attributes() -> Attributes:
    """Every attribute of every imported module of vLLM and of this package,
    and of every class they define."""
    return {
        owner_name: (owner, dict(vars(owner)))
        for owner_name, owner in attribute_owners("vllm", "vllm_mla_fixes")
    }


def _differs(owner: Any, saved: dict[str, Any]) -> bool:
    """Whether ``owner``'s attributes are not ``saved`` (one comparison in C:
    dict equality takes identical values as equal without asking them)."""
    try:
        return bool(dict(vars(owner)) != saved)
    except Exception:  # noqa: BLE001 - a changed value whose == gives no bool (an array)
        return True


def _ours(value: Any) -> bool:
    """A function or class of this package (a wrapper's ``__module__`` is
    the wrapped one's, its code is ours)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, FunctionType):
        return Path(value.__code__.co_filename).is_relative_to(PACKAGE)
    return isinstance(value, type) and value.__module__.startswith("vllm_mla_fixes")


def _restore(before: Attributes) -> None:
    """Every attribute ``before`` holds set back to its value there; one
    added since to an owner it knew is removed where it is a class's or one
    of ours (a module gains its submodules legitimately)."""
    for owner, saved in before.values():
        if not _differs(owner, saved):
            continue
        current = dict(vars(owner))
        for name, value in current.items():
            if name not in saved:
                if isinstance(owner, type) or _ours(value):
                    delattr(owner, name)
            elif saved[name] is not value:
                setattr(owner, name, saved[name])
        for name, value in saved.items():
            if name not in current:
                setattr(owner, name, value)


def _left_behind(before: Attributes, meta_path: list[Any]) -> list[str]:
    """What differs from ``before``: an attribute changed, a vLLM attribute
    anywhere holding one of ours (a module imported while a patch was in
    place keeps the patched function), an import hook left installed."""
    changed = [
        f"{owner_name}.{name}"
        for owner_name, (owner, saved) in before.items()
        if _differs(owner, saved)
        for name, value in saved.items()
        if vars(owner).get(name, _MISSING) is not value
    ]
    held = [
        f"{owner_name}.{name}"
        for owner_name, owner in attribute_owners("vllm")
        for name, value in list(vars(owner).items())
        if _ours(value)
    ]
    hooks = [repr(hook) for hook in sys.meta_path if hook not in meta_path]
    return changed + held + hooks


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
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.fix_state import STATE

    release = request.config.vllm_release
    if not os.environ.get(INJECTIONS_ENV):
        pytest.skip(f"set {INJECTIONS_ENV}=1 or run `nox -s injections-{release}`")
    rows, survivors = [], []
    started = time.monotonic()
    table = list(injections())  # imports every module the fix patches
    vllm_mla_fixes.revert_all()
    STATE.clear()
    at_start, meta_path = _attributes(), list(sys.meta_path)
    for number, injection in enumerate(table):
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
        vllm_mla_fixes.revert_all()
        STATE.clear()
        _restore(at_start)
        if caught is None:
            survivors.append(injection.name)
            rows.append(f"| {injection.name} | **survived** | |")
        else:
            rows.append(f"| {injection.name} | `{_shown(caught[0])}` | {caught[1]} |")
    assert _left_behind(at_start, meta_path) == [], "the injections left state behind"
    report = "\n".join(
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
        print("\n" + report)
    if os.environ.get("INJECTION_TABLE"):
        Path(os.environ["INJECTION_TABLE"]).write_text(report + "\n", encoding="utf-8")
    assert not survivors, survivors
