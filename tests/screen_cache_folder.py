"""The screen cache in a folder of the test's own: the ``cache`` fixture of
``test_screen_cache*.py`` here and in the fixes' own test folders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_mla_fixes import patching, screen_cache


def fresh_screen_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the cache at an empty folder, with no vLLM source parsed yet."""
    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, str(tmp_path / "screens"))
    patching.vllm_source.cache_clear()
    yield tmp_path / "screens"
    patching.vllm_source.cache_clear()
