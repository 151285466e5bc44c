"""The source-screen cache through the DeepSeek-V4.1 fix's probe (the shared
cache tests are in ``tests/test_screen_cache.py``)."""

from __future__ import annotations

import pytest
from fix_releases import covered
from screen_cache_folder import fresh_screen_cache

from vllm_mla_fixes import patching
from vllm_mla_fixes.fixes.dsv41_sm120_geometry.info import INFO as DSV41


@pytest.fixture
def cache(tmp_path, monkeypatch):
    yield from fresh_screen_cache(tmp_path, monkeypatch)


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_dsv41_probe_on_sm120_parses_nothing_the_second_time(cache):
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41

    assert dsv41.probe((12, 0)) is None
    assert patching.vllm_source.cache_info().misses > 0
    patching.vllm_source.cache_clear()
    assert dsv41.probe((12, 0)) is None
    assert patching.vllm_source.cache_info().misses == 0


@pytest.mark.vllm_release(*covered(DSV41, "<0.34.0"))
def test_a_changed_reviewed_table_is_screened_again(cache, monkeypatch):
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41

    assert dsv41.probe((12, 0)) is None  # cached: the reviewed code
    target = (dsv41.ATTENTION_MODULE, "DeepseekV4Attention.get_kv_cache_spec")
    monkeypatch.setitem(dsv41.REVIEWED, target, {"0000000000000000": "not this release"})
    with pytest.raises(patching.TargetMismatch, match="get_kv_cache_spec"):
        dsv41.probe((12, 0))
