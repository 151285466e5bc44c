"""Test selection by vLLM release.

Each nox session installs one real vLLM release and runs
``pytest --vllm-release X``.  A test marked ``@pytest.mark.vllm_release("0.25.1", ...)``
runs only in the sessions of the releases it names; unmarked tests run in every
session.  Without ``--vllm-release`` the installed release is used.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import pytest
from doctor_runs import NO_HUB

from vllm_mla_fixes.fixes import ALL_FIXES

# Tests run the fixes' verifiers in process (a self-test may run vLLM's Triton
# kernels on CPU, in Triton's interpreter): each fix sets up the process as
# `vllm-mla-fixes verify` does, before any test imports vLLM.
for _fix in ALL_FIXES:
    _fix.prepare_verify()

# No test reaches the Hugging Face hub, here or on a CI runner with a network:
# doctor judges a hub model's line as a machine with no network does (issue 44).
os.environ.setdefault("HF_ENDPOINT", NO_HUB)


def pytest_addoption(parser):
    parser.addoption(
        "--vllm-release",
        default=None,
        help="the vLLM release installed in this environment (checked)",
    )


def _installed_vllm() -> str | None:
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def pytest_configure(config):
    wanted = config.getoption("--vllm-release")
    installed = _installed_vllm()
    if wanted is not None and wanted != installed:
        raise pytest.UsageError(
            f"--vllm-release {wanted} given, but this environment has vLLM {installed}"
        )
    config.vllm_release = wanted or installed


def pytest_collection_modifyitems(config, items):
    release = config.vllm_release
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("vllm_release")
        (keep if marker is None or release in marker.args else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def fresh_plugin():
    """The plugin with nothing applied; every fix reverted afterwards."""
    import vllm_mla_fixes

    vllm_mla_fixes.revert_all()
    yield vllm_mla_fixes
    vllm_mla_fixes.revert_all()


@pytest.fixture
def swap_fix(monkeypatch):
    """Put a record in the plugin in place of the fix of its name, for the
    test (e.g. a probe that answers for a device this host stands in for)."""
    import vllm_mla_fixes

    def swap(record):
        name = record.INFO.name
        fixes = tuple(record if f.INFO.name == name else f for f in vllm_mla_fixes.ALL_FIXES)
        monkeypatch.setattr(vllm_mla_fixes, "ALL_FIXES", fixes)
        monkeypatch.setattr(vllm_mla_fixes, "FIXES_BY_NAME", {f.INFO.name: f for f in fixes})

    return swap


def pytest_terminal_summary(terminalreporter):
    """The property suite's size (test_properties.py records each test's
    count of generated inputs; xdist carries it from the workers)."""
    counts = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "generated_examples"
    ]
    if counts:
        terminalreporter.write_line(
            f"property suite: {sum(counts)} generated inputs in {len(counts)} properties"
        )
