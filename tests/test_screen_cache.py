"""The source-screen cache (issue 11, plugin cost): same verdicts as screening,
no vLLM source parsed when the key matches, and a screen again on any change."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest
from fix_releases import covered_by, first_covered_after, newest_covered, newest_of_earliest_fix
from log_records import KeptRecords
from screen_cache_folder import fresh_screen_cache

from vllm_mla_fixes import patching, screen_cache
from vllm_mla_fixes.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    yield from fresh_screen_cache(tmp_path, monkeypatch)


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


@pytest.mark.parametrize("fix", ALL_FIXES, ids=[f.INFO.name for f in ALL_FIXES])
def test_a_changed_module_beside_the_screen_changes_its_key(fix, monkeypatch):
    """The DeepSeek-V4.1 gate screens with constants of ``info`` beside it; a key
    of the screen's own file alone kept a stale verdict after ``info`` changed."""
    before = screen_cache.screen_key(fix.REVIEWED, fix.source_screen)
    folder = Path(inspect.getfile(fix.source_screen)).parent
    neighbours = [p for p in folder.glob("*.py") if p != Path(inspect.getfile(fix.source_screen))]
    assert neighbours
    original = pathlib.Path.read_bytes
    edited = neighbours[0]

    def edited_read_bytes(self):
        data = original(self)
        return data + b"\n# edited\n" if Path(self) == edited else data

    monkeypatch.setattr(pathlib.Path, "read_bytes", edited_read_bytes)
    assert screen_cache.screen_key(fix.REVIEWED, fix.source_screen) != before, edited


@pytest.mark.vllm_release(newest_of_earliest_fix(), *first_covered_after(newest_of_earliest_fix()))
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


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_a_changed_vllm_file_is_screened_again(cache, tmp_path, monkeypatch):
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape as fp8

    calls = []

    def screen():
        calls.append(1)
        return fp8.source_screen()

    assert screen_cache.cached_screen(fp8.FIX, screen) is None  # 0.25.1 carries the bug
    edited = tmp_path / "attn_utils.py"
    source = screen_cache.source_file(fp8.RESHAPE_MODULE)
    assert source is not None, fp8.RESHAPE_MODULE
    edited.write_text(source.read_text() + "\n# hand-patched\n")
    real = screen_cache.source_file
    monkeypatch.setattr(
        screen_cache,
        "source_file",
        lambda module: edited if module == fp8.RESHAPE_MODULE else real(module),
    )
    screen_cache.cached_screen(fp8.FIX, screen)
    assert len(calls) == 2


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_unusable_cache_falls_back_to_screening(cache, monkeypatch):
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape as fp8

    assert screen_cache.cached_screen(fp8.FIX, fp8.source_screen) is None
    (entry,) = cache.glob("*.json")
    entry.write_text('{"key": "truncated')
    assert screen_cache.cached_screen(fp8.FIX, fp8.source_screen) is None
    blocked = cache / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, str(blocked / "screens"))
    assert screen_cache.cached_screen(fp8.FIX, fp8.source_screen) is None


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
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


# -- a cache folder that cannot be used never turns a fix off (issue 35) ------------------


@pytest.fixture
def plugin_log():
    """Records of the plugin's logger (vLLM's logger tree does not propagate to caplog)."""
    import logging

    import vllm.logger  # noqa: F401  its logging set-up clears child handlers: run it first

    handler = KeptRecords()
    records = handler.records
    logger = logging.getLogger("vllm.mla_fixes")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _states(plugin) -> list[tuple[str, str]]:
    plugin.revert_all()
    plugin.register()
    return [(s.name, s.state.value) for s in plugin.status()]


UNUSABLE_CACHE_DIRS = {
    "a name too long for the file system": ("/" + "a" * 300, "File name too long (ENAMETOOLONG)"),
    "a path too long for the file system": (
        "/tmp/" + "b/" * 3000,
        "File name too long (ENAMETOOLONG)",
    ),
    "under a file": ("/etc/passwd/sub", "'/etc/passwd' is a file"),
    "a file": ("/etc/passwd", "it exists and is not a folder"),
    "a folder it may not write in": ("/proc/1/screens", "may not write in '/proc/1'"),
}


@pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())
@pytest.mark.parametrize("case", UNUSABLE_CACHE_DIRS, ids=str)
def test_an_unusable_cache_folder_warns_once_and_turns_no_fix_off(
    case, fresh_plugin, plugin_log, monkeypatch, tmp_path
):
    value, reason = UNUSABLE_CACHE_DIRS[case]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the default the setting falls back to
    monkeypatch.delenv(screen_cache.CACHE_DIR_ENV, raising=False)
    without = _states(fresh_plugin)
    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, value)
    plugin_log.clear()
    assert _states(fresh_plugin) == without
    said = [r.getMessage() for r in plugin_log if screen_cache.CACHE_DIR_ENV in r.getMessage()]
    assert len(said) == 1 and reason in said[0] and "is not allowed" in said[0], said
    assert not [r for r in plugin_log if "internal error" in r.getMessage()]
    assert len(said[0]) < 600  # one readable line, however long the value


def _without_dac_override():
    """In the child: drop root's right to read and search any folder
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a folder of mode 000 refuses
    it as it refuses any service user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # PR_CAPBSET_DROP = 24
        if libc.prctl(24, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_a_cache_folder_the_user_may_not_look_into_is_flagged_and_fixes_apply(tmp_path):
    """PermissionError from stat(): status --json in a process of a user who
    may not search the parent folder."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MLA_FIXES")}
    env.pop("VLLM_PLUGINS", None)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        XDG_CACHE_HOME=str(tmp_path / "default"),
        **{screen_cache.CACHE_DIR_ENV: str(locked / "screens")},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "status", "--json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
    )
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    document = json.loads(proc.stdout)
    (setting,) = document["settings"]
    assert not setting["valid"] and "Permission denied (EACCES)" in setting["problem"], setting
    assert document["exit_status"] == proc.returncode == 2
    states = {f["name"]: f["state"] for f in document["fixes"]}
    assert states["fp8-ds-mla-reshape"] == "applied", document["fixes"]
    warnings = [ln for ln in proc.stderr.splitlines() if screen_cache.CACHE_DIR_ENV in ln]
    assert len(warnings) == 1 and "Permission denied" in warnings[0], proc.stderr[-2000:]


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_a_configured_cache_that_cannot_be_written_warns_once(
    fresh_plugin, plugin_log, monkeypatch, tmp_path
):
    """Valid when read, unwritable when used (here: a file where the cache's
    entry must go): the verdict comes from screening, and one warning names
    the variable."""
    from vllm_mla_fixes.fixes import fp8_ds_mla_reshape as fp8

    folder = tmp_path / "screens"
    monkeypatch.setenv(screen_cache.CACHE_DIR_ENV, str(folder))
    monkeypatch.setattr(screen_cache, "_warned_folders", set())
    monkeypatch.setattr(screen_cache, "_store", _refuse)
    for _ in range(2):
        assert screen_cache.cached_screen(fp8.FIX, fp8.source_screen) is None
    said = [r.getMessage() for r in plugin_log if screen_cache.CACHE_DIR_ENV in r.getMessage()]
    assert said == [
        f"vllm-mla-fixes: {screen_cache.CACHE_DIR_ENV}={str(folder)!r} cannot be written "
        "(OSError: No space left on device); the fixes work without the cache, each vLLM "
        "process screening vLLM's sources itself"
    ]


def _refuse(entry: Path, payload: dict) -> None:
    import errno

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
