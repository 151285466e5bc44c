"""Test selection by vLLM release.

Each nox session installs one real vLLM release and runs
``pytest --vllm-release X``.  A test marked ``@pytest.mark.vllm_release("0.25.1", ...)``
runs only in the sessions of the releases it names; unmarked tests run in every
session.  Without ``--vllm-release`` the installed release is used.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest


def _no_gpu() -> bool:
    try:
        import torch
    except ModuleNotFoundError:
        return True
    return not torch.cuda.is_available()


if _no_gpu():
    # The DeepSeek-V4.1 self-test runs vLLM's Triton kernels on CPU: Triton's
    # interpreter must be chosen before any test imports vLLM.
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.selftest.env import prepare_process_env

    prepare_process_env()


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
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("vllm_release")
        (keep if marker is None or release in marker.args else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def kernels_as_locked(request):
    """For a test whose per-release expectations embed what the release's
    kernels accept: the installed FlashInfer must be the one the release's
    lock file pins, and DeepGEMM the copy vendored in vLLM.  Another build
    under the same vLLM fails here, instead of being taken for the locked one
    (``test_dsv41_envelope.py`` keys its expectations by the build itself)."""
    import importlib.util
    from pathlib import Path

    release = request.config.vllm_release
    lock = Path(__file__).resolve().parent.parent / "envs" / f"vllm-{release}.txt"
    pinned = [
        line.split("==", 1)[1]
        for line in lock.read_text().splitlines()
        if line.startswith("flashinfer-python==")
    ]
    installed = version("flashinfer-python")
    assert pinned == [installed], (
        f"this test's expectations for vLLM {release} hold for FlashInfer {pinned} "
        f"({lock.name}); this environment has {installed}"
    )
    assert importlib.util.find_spec("deep_gemm") is None, (
        f"this test's expectations for vLLM {release} hold for the DeepGEMM vendored in "
        "vLLM; this environment has a deep_gemm package of its own"
    )


@pytest.fixture
def fresh_plugin():
    """The plugin with nothing applied; every fix reverted afterwards."""
    import vllm_mla_fixes

    vllm_mla_fixes.revert_all()
    yield vllm_mla_fixes
    vllm_mla_fixes.revert_all()


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
