"""``build-wheel`` and ``review`` against broken inputs, and reproducible,
serialised builds (issue 35).

The upstream wheels here are small ones made by the test (a build copies
upstream's entries byte for byte whatever they hold); the real 0.25.1 wheel
is rebuilt in ``test_build_wheel.py``.  The review case packs the installed
release's own reviewed modules, one of them broken.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from cli_runs import cli
from fix_releases import newest_covered, newest_of_earliest_fix

from vllm_mla_fixes import atomic, wheel

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm_release(newest_of_earliest_fix(), newest_covered())
UPSTREAM = "vllm-0.25.1-py3-none-any.whl"
INFO = "vllm-0.25.1.dist-info/"
METADATA = b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.1\n\nvLLM\n"


def _upstream(folder: Path, entries: dict[str, bytes] | None = None, padding: int = 0) -> Path:
    """A vLLM wheel: METADATA, entry points, a module, and ``padding`` bytes
    of incompressible data (a build of it then takes a while)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / UPSTREAM
    files = {
        "vllm/__init__.py": b"__version__ = '0.25.1'\n",
        "vllm/padding.bin": os.urandom(padding),
        INFO + "METADATA": METADATA,
        INFO + "entry_points.txt": b"[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n",
        INFO + "RECORD": b"",
        **(entries or {}),
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 2, 3, 4, 6)), data)
    return path


def _one_error(proc: subprocess.CompletedProcess, status: int, says: str) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == status, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- reproducible -----------------------------------------------------------------------


def test_the_same_input_gives_the_same_bytes(tmp_path):
    upstream = _upstream(tmp_path / "in")
    first = wheel.build(upstream, tmp_path / "one")
    second = wheel.build(upstream, tmp_path / "two")
    assert first.name == second.name and first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as archive:
        times = {info.filename: info.date_time for info in archive.infolist()}
    added = {name for name in times if not name.startswith(("vllm/", "vllm-"))}
    added.add(next(n for n in times if n.endswith(".dist-info/RECORD")))
    assert {times[n] for n in added} == {(1980, 1, 1, 0, 0, 0)}  # never the clock
    assert times["vllm/__init__.py"] == (2026, 1, 2, 3, 4, 6)  # upstream's own


def test_source_date_epoch_sets_the_time_of_every_added_file(tmp_path, monkeypatch):
    upstream = _upstream(tmp_path / "in")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767323046")  # 2026-01-02 03:04:06 UTC
    built = wheel.build(upstream, tmp_path / "out")
    with zipfile.ZipFile(built) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("RECORD"))
        plugin = archive.getinfo("vllm_mla_fixes/__init__.py")
    assert record.date_time == plugin.date_time == (2026, 1, 2, 3, 4, 6)


def test_a_source_date_epoch_that_is_not_a_number_is_refused_first(tmp_path):
    upstream = _upstream(tmp_path / "in")
    proc = cli(
        "build-wheel",
        "--vllm-wheel",
        str(upstream),
        "--out",
        "dist",
        cwd=tmp_path,
        SOURCE_DATE_EPOCH="yesterday",
    )
    _one_error(proc, 2, "SOURCE_DATE_EPOCH='yesterday' is not a whole number of seconds")
    assert not (tmp_path / "dist").exists()


# -- serialised, and a killed build's leftovers removed ---------------------------------


def test_a_build_waits_for_the_one_writing_into_the_same_folder(tmp_path):
    upstream = _upstream(tmp_path / "in")
    out = tmp_path / "dist"
    out.mkdir()
    with atomic.folder_lock(out):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_mla_fixes",
                "build-wheel",
                "--vllm-wheel",
                str(upstream),
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("waiting for another build writing into ")
        assert proc.poll() is None and not list(out.glob("*.whl"))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    (built,) = out.glob("*.whl")
    assert f"sha256   {_sha(built)}  {built.name}" in stdout


def test_two_builds_at_once_print_the_sha256_of_the_file_on_disk(tmp_path):
    upstream = _upstream(tmp_path / "in", padding=24 << 20)
    out = tmp_path / "dist"
    command = [
        sys.executable,
        "-m",
        "vllm_mla_fixes",
        "build-wheel",
        "--vllm-wheel",
        str(upstream),
        "--out",
        str(out),
    ]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    (built,) = out.glob("*.whl")
    for printed in outputs:
        assert f"sha256   {_sha(built)}  {built.name}" in printed, printed
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_later_build_removes_what_a_killed_build_left(tmp_path):
    """A build stopped by SIGKILL (no clean-up can run) leaves its temporary
    file; the next build into the folder removes it, and leaves alone the one
    of a build still running."""
    import signal
    import time

    upstream = _upstream(tmp_path / "in", padding=24 << 20)
    out = tmp_path / "dist"
    out.mkdir()
    killed = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_mla_fixes",
            "build-wheel",
            "--vllm-wheel",
            str(upstream),
            "--out",
            str(out),
        ],
    )
    deadline = time.monotonic() + 120
    while not list(out.glob(".*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    (left,) = out.glob(".*.tmp")
    running = out / f".vllm-0.25.1+mlafixes.0.1.0-py3-none-any.whl.{os.getpid()}.0123abcd.tmp"
    running.write_bytes(b"a build still running")
    proc = cli("build-wheel", "--vllm-wheel", str(upstream), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not left.exists() and running.exists()
    assert f"removed {left.name}, left by a build that was stopped (process {killed.pid})" in (
        proc.stderr
    )


# -- broken upstream wheels -------------------------------------------------------------


def _corrupt_crc(path: Path, member: str) -> None:
    """Flip one byte of ``member``'s stored data, so its CRC no longer matches."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    data = bytearray(path.read_bytes())
    header = info.header_offset
    name_length = int.from_bytes(data[header + 26 : header + 28], "little")
    extra_length = int.from_bytes(data[header + 28 : header + 30], "little")
    start = header + 30 + name_length + extra_length
    data[start] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_entry_with_a_bad_crc_is_one_line(tmp_path):
    upstream = _upstream(tmp_path / "in", {"vllm/model.py": b"x = 1\n" * 2000})
    _corrupt_crc(upstream, "vllm/model.py")
    proc = cli("build-wheel", "--vllm-wheel", str(upstream), "--out", "dist", cwd=tmp_path)
    _one_error(proc, 1, f"{UPSTREAM}: vllm/model.py cannot be read (")
    assert "download the wheel again" in proc.stderr and not (tmp_path / "dist").exists()


def test_metadata_that_is_not_utf8_is_one_line(tmp_path):
    upstream = _upstream(tmp_path / "in", {INFO + "METADATA": METADATA + b"Summary: \xff\xfe\n"})
    proc = cli("build-wheel", "--vllm-wheel", str(upstream), "--out", "dist", cwd=tmp_path)
    at = len(METADATA + b"Summary: ")
    _one_error(proc, 1, f"{INFO}METADATA is not UTF-8 text (invalid start byte at byte {at})")


# -- package indexes with entries of odd types ------------------------------------------


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def index(tmp_path):
    """An index serving ``files`` as vLLM's PEP 691 project page."""
    served = tmp_path / "served"
    (served / "vllm").mkdir(parents=True)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(served))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def serve(files: list) -> str:
        (served / "vllm" / "index.html").write_text(json.dumps({"files": files}))
        return f"http://127.0.0.1:{server.server_port}/simple-root".replace("/simple-root", "")

    yield serve
    server.shutdown()


ODD_ENTRIES = {
    "a string for hashes": (
        [{"filename": UPSTREAM, "url": UPSTREAM, "hashes": "sha256=abc"}],
        f"the index publishes no sha256 for {UPSTREAM} (hashes: 'sha256=abc')",
    ),
    "no url": (
        [{"filename": UPSTREAM, "hashes": {"sha256": "0" * 64}}],
        f"the index gives no URL for {UPSTREAM} (url: None)",
    ),
    "an int for a file name": (
        [{"filename": 5, "url": "x", "hashes": {"sha256": "0" * 64}}],
        "the index has no vLLM 0.25.1 wheel for this platform (found: none)",
    ),
    "a list for the sha256": (
        [{"filename": UPSTREAM, "url": UPSTREAM, "hashes": {"sha256": ["0" * 64]}}],
        f"the index publishes no sha256 for {UPSTREAM}",
    ),
}


@pytest.mark.parametrize("command, status", [("build-wheel", 1), ("review", 2)])
@pytest.mark.parametrize("case", ODD_ENTRIES, ids=str)
def test_an_odd_index_entry_is_named_in_one_line(case, command, status, index, tmp_path):
    """build-wheel fails (1); review cannot run (2): the same entry, the same words."""
    files, says = ODD_ENTRIES[case]
    url = index(files)
    argv = [command, "--vllm", "0.25.1", "--index-url", url]
    if command == "build-wheel":
        argv += ["--out", "dist"]
    proc = cli(*argv, cwd=tmp_path, HOME=str(tmp_path / "home"))
    _one_error(proc, status, says)


def test_review_latest_skips_entries_of_odd_types(index, tmp_path):
    url = index([{"filename": 5}, {"filename": None, "yanked": True}, {"url": "x"}])
    proc = cli("review", "--vllm", "latest", "--index-url", url, cwd=tmp_path)
    _one_error(proc, 2, f"the index at {url} lists no vLLM wheel")
