"""The source-screen cache (issue 11, plugin cost): same verdicts as screening,
no vLLM source parsed when the key matches, and a screen again on any change."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla_fixes import patching, screen_cache
from vllm_mla_fixes.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, str(tmp_path / "screens"))
    patching.vllm_source.cache_clear()
    yield tmp_path / "screens"
    patching.vllm_source.cache_clear()


def _screen_outcome(fix) -> str | None:
    try:
        return fix.source_screen()
    except (patching.TargetMismatch, patching.CannotProbe) as exc:
        return f"raised {type(exc).__name__}"


@pytest.mark.parametrize("fix", ALL_FIXES, ids=[f.INFO.name for f in ALL_FIXES])
def test_a_screen_reads_only_the_modules_its_key_covers(fix, cache, monkeypatch):
    """The key hashes the files of the modules in REVIEWED; a screen reading
    any other vLLM file could be served a stale verdict."""
    read: list[Path] = []
    original = pathlib.Path.read_text

    def recording_read_text(self, *args, **kwargs):
        read.append(Path(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", recording_read_text)
    _screen_outcome(fix)
    covered = {screen_cache.source_file(module) for module, _ in fix.REVIEWED}
    assert set(read) <= covered, sorted(set(read) - covered)


@pytest.mark.vllm_release("0.25.1", "0.32.0")
@pytest.mark.parametrize("fix", ALL_FIXES, ids=[f.INFO.name for f in ALL_FIXES])
def test_cached_verdict_is_the_screened_one_and_parses_nothing(fix, cache):
    calls = []

    def screen():
        calls.append(1)
        return fix.source_screen()

    try:
        first = screen_cache.cached_screen(fix, screen)
    except (patching.TargetMismatch, patching.CannotProbe):
        # Not the reviewed code on this release: never cached, screened every time.
        with pytest.raises((patching.TargetMismatch, patching.CannotProbe)):
            screen_cache.cached_screen(fix, screen)
        assert len(calls) == 2 and not list(cache.glob("*.json"))
        return
    patching.vllm_source.cache_clear()
    assert screen_cache.cached_screen(fix, screen) == first
    assert len(calls) == 1 and patching.vllm_source.cache_info().misses == 0


@pytest.mark.vllm_release("0.25.1")
def test_a_changed_vllm_file_is_screened_again(cache, tmp_path, monkeypatch):
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape as fp8

    calls = []

    def screen():
        calls.append(1)
        return fp8.source_screen()

    assert screen_cache.cached_screen(fp8, screen) is None  # 0.25.1 carries the bug
    edited = tmp_path / "attn_utils.py"
    edited.write_text(
        screen_cache.source_file(fp8.RESHAPE_MODULE).read_text() + "\n# hand-patched\n"
    )
    real = screen_cache.source_file
    monkeypatch.setattr(
        screen_cache,
        "source_file",
        lambda module: edited if module == fp8.RESHAPE_MODULE else real(module),
    )
    screen_cache.cached_screen(fp8, screen)
    assert len(calls) == 2


@pytest.mark.vllm_release("0.25.1")
def test_unusable_cache_falls_back_to_screening(cache, monkeypatch):
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape as fp8

    assert screen_cache.cached_screen(fp8, fp8.source_screen) is None
    (entry,) = cache.glob("*.json")
    entry.write_text('{"key": "truncated')
    assert screen_cache.cached_screen(fp8, fp8.source_screen) is None
    blocked = cache / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, str(blocked / "screens"))
    assert screen_cache.cached_screen(fp8, fp8.source_screen) is None


@pytest.mark.vllm_release("0.32.0", "0.33.0")
def test_dsv41_probe_on_sm120_parses_nothing_the_second_time(cache):
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41

    assert dsv41.probe((12, 0)) is None
    assert patching.vllm_source.cache_info().misses > 0
    patching.vllm_source.cache_clear()
    assert dsv41.probe((12, 0)) is None
    assert patching.vllm_source.cache_info().misses == 0


@pytest.mark.vllm_release("0.25.1")
def test_every_vllm_process_after_the_first_parses_nothing(tmp_path):
    """Two fresh processes, as vLLM starts them: same fix states, and the second
    reads no vLLM source through the parser."""
    run = (
        "import json, vllm.plugins\n"
        "vllm.plugins.load_general_plugins()\n"
        "import vllm_mla_fixes\n"
        "from vllm_mla_fixes import patching\n"
        "print('RESULT=' + json.dumps({'parsed': patching.vllm_source.cache_info().misses,\n"
        "    'states': [[s.name, s.state.value, s.reason] for s in vllm_mla_fixes.status()]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    env.update(CUDA_VISIBLE_DEVICES="", **{screen_cache.CACHE_DIR_ENV: str(tmp_path)})
    results = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", run],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            timeout=300,
        ).stdout
        results.append(
            json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT="))[7:])
        )
    assert results[0]["states"] == results[1]["states"]
    assert ["fp8-ds-mla-reshape", "applied"] == results[1]["states"][0][:2]
    assert results[0]["parsed"] > 0 and results[1]["parsed"] == 0


@pytest.mark.vllm_release("0.32.0", "0.33.0")
def test_a_changed_reviewed_table_is_screened_again(cache, monkeypatch):
    from vllm_mla_fixes.fixes import dsv41_sm120_geometry as dsv41

    assert dsv41.probe((12, 0)) is None  # cached: the reviewed code
    target = (dsv41.ATTENTION_MODULE, "DeepseekV4Attention.get_kv_cache_spec")
    monkeypatch.setitem(dsv41.REVIEWED, target, {"0000000000000000": "not this release"})
    with pytest.raises(patching.TargetMismatch, match="get_kv_cache_spec"):
        dsv41.probe((12, 0))
