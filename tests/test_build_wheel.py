"""``vllm-mla-fixes build-wheel`` on the real vLLM 0.25.1 wheel (issue 6)."""

from __future__ import annotations

import csv
import functools
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

import vllm_mla_fixes
from vllm_mla_fixes import wheel as wheel_builder
from vllm_mla_fixes.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm_release("0.25.1")


def _record(path: Path) -> dict[str, tuple[str, str]]:
    with zipfile.ZipFile(path) as z:
        record_name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.StringIO(z.read(record_name).decode()))
        return {row[0]: (row[1], row[2]) for row in rows if row}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    upstream = wheel_builder.download_verified("0.25.1")
    patched = wheel_builder.build(upstream, tmp_path_factory.mktemp("dist"), build_number=3)
    return upstream, patched


# The local label names the plugin release inside, then the rebuild number.
PATCHED_VERSION = f"0.25.1+mlafixes.{vllm_mla_fixes.__version__}.build3"


def test_name_version_and_metadata(built):
    upstream, patched = built
    assert patched.name == upstream.name.replace("vllm-0.25.1-", f"vllm-{PATCHED_VERSION}-")
    with zipfile.ZipFile(patched) as z:
        info = f"vllm-{PATCHED_VERSION}.dist-info/"
        metadata = z.read(info + "METADATA").decode()
        entry_points = z.read(info + "entry_points.txt").decode()
        assert not any(n.startswith("vllm-0.25.1.dist-info/") for n in z.namelist())
    assert f"\nVersion: {PATCHED_VERSION}\n" in metadata
    assert "[vllm.general_plugins]" in entry_points
    assert "mla_fixes = vllm_mla_fixes:register" in entry_points
    assert "lora_filesystem_resolver = " in entry_points  # vLLM's own plugins stay
    assert "vllm = vllm.entrypoints.cli.main:main" in entry_points
    assert "vllm-mla-fixes = vllm_mla_fixes.cli:main" in entry_points


def test_upstream_files_are_byte_identical_and_record_is_correct(built):
    upstream, patched = built
    before, after = _record(upstream), _record(patched)
    upstream_files = {p: v for p, v in before.items() if ".dist-info/" not in p}
    assert upstream_files and all(after.get(p) == v for p, v in upstream_files.items())
    added = {p for p in after if p.startswith("vllm_mla_fixes/")}
    assert "vllm_mla_fixes/__init__.py" in added and "vllm_mla_fixes/fixes/__init__.py" in added
    with zipfile.ZipFile(patched) as z:  # RECORD matches the stored bytes of what we changed/added
        for path in [
            *added,
            *(p for p in after if ".dist-info/" in p and not p.endswith("RECORD")),
        ]:
            digest, size = after[path]
            data = z.read(path)
            expected = (
                "sha256="
                + __import__("base64")
                .urlsafe_b64encode(hashlib.sha256(data).digest())
                .rstrip(b"=")
                .decode()
            )
            assert (digest, size) == (expected, str(len(data))), path


def test_patched_wheel_installs_and_applies_the_025_fixes(built, tmp_path):
    _, patched = built
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            str(python),
            str(patched),
            "-c",
            str(ROOT / "envs" / "vllm-0.25.1.txt"),
        ],
        check=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    out = subprocess.run(
        [str(venv / "bin" / "vllm-mla-fixes"), "status", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    report = json.loads(out[out.index("{") :])
    assert report["vllm"] == "0.25.1"  # vllm.__version__ is upstream's
    assert report["vllm_mla_fixes"] == vllm_mla_fixes.__version__
    states = {f["name"]: f["state"] for f in report["fixes"]}
    for fix in ALL_FIXES:  # on CPU: applied where its probe runs here, else skipped
        covers = report["vllm"] in fix.INFO.covered_releases
        assert states[fix.INFO.name] in (("applied", "skipped") if covers else ("not-needed",))
    assert states.get("fp8-ds-mla-reshape", "applied") == "applied"  # where it is still a fix
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, vllm_mla_fixes; "
            "print(m.version('vllm'), vllm_mla_fixes.__file__)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert where[0] == PATCHED_VERSION
    doctor = subprocess.run(
        [str(venv / "bin" / "vllm-mla-fixes"), "doctor", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(doctor.stdout)
    assert report["vllm_mla_fixes"] == vllm_mla_fixes.__version__
    # the package arrived inside vLLM's wheel: doctor must not call it missing
    assert report["environment"]["packages"]["vllm-mla-fixes"] == (
        f"{vllm_mla_fixes.__version__} (inside vllm {PATCHED_VERSION})"
    )
    assert not [f for f in report["findings"] if "not installed" in f["message"]]
    assert where[1].startswith(str(venv))  # the copy inside the patched wheel, not this checkout


def test_release_download_is_checked_with_sha256sum(built, tmp_path):
    """docs/install.md, way 2: the patched wheel and SHA256SUMS from a release,
    checked with ``sha256sum -c --ignore-missing SHA256SUMS`` before installing."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import release_check

    _, patched = built
    release = tmp_path / "release"
    (release / "vllm").mkdir(parents=True)
    os.link(patched, release / "vllm" / patched.name)  # the artifact as the release stages it
    sums = release_check.write_sums(release)
    downloads = tmp_path / "downloads"  # what the operator downloaded: one wheel and the sums
    downloads.mkdir()
    os.link(patched, downloads / patched.name)
    (downloads / "SHA256SUMS").write_bytes(sums.read_bytes())
    check = ["sha256sum", "-c", "--ignore-missing", "SHA256SUMS"]
    proc = subprocess.run(check, cwd=downloads, capture_output=True, text=True)
    assert proc.returncode == 0 and f"{patched.name}: OK" in proc.stdout, proc.stdout + proc.stderr
    (downloads / patched.name).unlink()
    (downloads / patched.name).write_bytes(b"a truncated or substituted download")
    proc = subprocess.run(check, cwd=downloads, capture_output=True, text=True)
    assert proc.returncode == 1 and f"{patched.name}: FAILED" in proc.stdout


class _Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_refuses_a_hash_mismatch(tmp_path, built):
    upstream, _ = built
    served = tmp_path / "served"
    (served / "vllm").mkdir(parents=True)
    (served / upstream.name).write_bytes(b"not the wheel the index vouches for")
    page = {
        "files": [
            {
                "filename": upstream.name,
                "url": f"../{upstream.name}",
                "hashes": {"sha256": "0" * 64},
            }
        ]
    }
    (served / "vllm" / "index.html").write_text(json.dumps(page))
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Index, directory=str(served))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(wheel_builder.WheelBuildError, match="sha256 mismatch"):
            wheel_builder.download_verified(
                "0.25.1", f"http://127.0.0.1:{server.server_port}", cache=tmp_path / "cache"
            )
    finally:
        server.shutdown()
    assert not any((tmp_path / "cache").glob("*.whl"))


def test_refuses_an_already_patched_wheel(built, tmp_path):
    _, patched = built
    with pytest.raises(wheel_builder.WheelBuildError, match="already patched"):
        wheel_builder.build(patched, tmp_path)


def test_building_the_same_wheel_twice_gives_the_same_bytes(built, tmp_path):
    """Issue 35: RECORD and the added files carry a fixed time, never the clock."""
    upstream, patched = built
    again = wheel_builder.build(upstream, tmp_path, build_number=3)
    assert again.name == patched.name
    assert (
        hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(patched.read_bytes()).digest()
    )
