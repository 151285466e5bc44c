"""Fixtures of the DeepSeek-V4.1 fix's tests (the shared ones are in ``tests/conftest.py``)."""

from __future__ import annotations

from importlib.metadata import version

import pytest


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
    lock = Path(__file__).resolve().parents[2] / "envs" / f"vllm-{release}.txt"
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
