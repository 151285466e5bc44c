"""``vllm-mla-fixes build-wheel``: one vLLM wheel that carries the fixes.

Takes an upstream vLLM wheel (a local file, or a release downloaded from the
package index and checked against the index's published sha256) and writes
``vllm-<ver>+mlafixes.<plugin version>-<tags>.whl``:

* every upstream file byte-identical (compiled kernels included);
* this package (``vllm_mla_fixes/``) added, with its general-plugin entry point
  and its console script in ``entry_points.txt``;
* ``METADATA`` carrying the new version, and a ``RECORD`` (PEP 376/427:
  urlsafe-base64 sha256 and size) computed from the bytes actually stored.

It needs only the standard library and ``packaging`` (a dependency of this
package), so it runs in any environment that has vllm-mla-fixes.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
from packaging.version import Version

import vllm_mla_fixes

DEFAULT_INDEX = "https://pypi.org/simple"
CACHE = Path.home() / ".cache" / "vllm-mla-fixes" / "wheels"
PLUGIN_ENTRY = "mla_fixes = vllm_mla_fixes:register"
SCRIPT_ENTRY = "vllm-mla-fixes = vllm_mla_fixes.cli:main"
PACKAGE_DIR = Path(vllm_mla_fixes.__file__).resolve().parent


class WheelBuildError(RuntimeError):
    """The patched wheel cannot be built; the message says why and what to do."""


# -- download -----------------------------------------------------------------------


def _index_files(index_url: str, project: str = "vllm") -> list[dict]:
    """The project's files on a PEP 691 (JSON simple API) index."""
    url = f"{index_url.rstrip('/')}/{project}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            page = json.load(response)
    except (OSError, ValueError) as exc:
        raise WheelBuildError(
            f"cannot read the package index at {url}: {exc}. Download the "
            f"wheel yourself and pass --vllm-wheel PATH."
        ) from exc
    return page.get("files", [])


def _pick_wheel(files: list[dict], release: str) -> dict:
    """The index's wheel of ``release`` that this machine would install."""
    candidates = {}
    for entry in files:
        name = entry.get("filename", "")
        if not name.endswith(".whl"):
            continue
        _, ver, _, tags = parse_wheel_filename(name)
        if ver == Version(release):
            for tag in tags:
                candidates[tag] = entry
    for tag in sys_tags():
        if tag in candidates:
            return candidates[tag]
    raise WheelBuildError(
        f"the index has no vLLM {release} wheel for this platform "
        f"(found: {sorted({e['filename'] for e in candidates.values()}) or 'none'})"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_verified(release: str, index_url: str = DEFAULT_INDEX, cache: Path = CACHE) -> Path:
    """Download vLLM ``release`` (or reuse a cached copy) and check it against the
    sha256 the index publishes; refuse on any mismatch."""
    entry = _pick_wheel(_index_files(index_url), release)
    expected = (entry.get("hashes") or {}).get("sha256")
    if not expected:
        raise WheelBuildError(
            f"the index publishes no sha256 for {entry['filename']}; refusing "
            "an unverifiable download"
        )
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / entry["filename"]
    if not (target.exists() and _sha256(target) == expected):
        url = urllib.parse.urljoin(f"{index_url.rstrip('/')}/vllm/", entry["url"])
        # One partial file per process: two builds downloading at once must not
        # write into the same file.
        partial = target.with_name(f"{target.name}.{os.getpid()}.part")
        with urllib.request.urlopen(url, timeout=600) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
        found = _sha256(partial)
        if found != expected:
            partial.unlink()
            raise WheelBuildError(
                f"sha256 mismatch for {entry['filename']}: the index publishes "
                f"{expected}, the download is {found}. Refusing to build from it."
            )
        partial.replace(target)
    return target


# -- patch --------------------------------------------------------------------------


def _patched_version(upstream: Version, build_number: int | None) -> str:
    """``<upstream>+mlafixes.<this package's version>[.build<N>]``, after any local
    label upstream had: the version says which plugin release the wheel carries."""
    plugin = Version(vllm_mla_fixes.__version__)
    # A local label allows only [a-z0-9] segments joined by dots; the plugin's
    # own local part (a checkout's "+g1234") becomes more segments.
    label = f"mlafixes.{plugin.public}" + (f".{plugin.local}" if plugin.local else "")
    if build_number is not None:
        label += f".build{build_number}"
    if upstream.local:
        label = f"{upstream.local}.{label}"
    return f"{upstream.public}+{label}"


def _with_entry_points(text: str) -> str:
    """Add the plugin and the console script to an entry_points.txt."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = re.fullmatch(r"\s*\[(.+)\]\s*", line)
        if header:
            current = header.group(1)
            sections.setdefault(current, [])
        elif line.strip() and current is not None:
            sections[current].append(line.strip())
    sections.setdefault("console_scripts", []).append(SCRIPT_ENTRY)
    sections.setdefault("vllm.general_plugins", []).append(PLUGIN_ENTRY)
    return "".join(
        f"[{name}]\n" + "".join(f"{line}\n" for line in lines) + "\n"
        for name, lines in sections.items()
    )


def _with_version(metadata: str, new_version: str) -> str:
    lines = metadata.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("Version: "):
            lines[i] = f"Version: {new_version}"
            break
        if not line:  # end of headers
            raise WheelBuildError("METADATA has no Version header")
    if not any(re.match(r"Requires-Dist: packaging\b", line) for line in lines):
        header_end = lines.index("") if "" in lines else len(lines)
        lines.insert(header_end, "Requires-Dist: packaging>=23")
    return "\n".join(lines)


def _package_files() -> list[tuple[str, bytes]]:
    """This package's own files, as they are installed or checked out."""
    files = []
    for path in sorted(PACKAGE_DIR.rglob("*")):
        if (
            path.is_file()
            and (path.suffix == ".py" or path.suffix == ".json")
            and "__pycache__" not in path.parts
        ):
            files.append(
                (f"vllm_mla_fixes/{path.relative_to(PACKAGE_DIR).as_posix()}", path.read_bytes())
            )
    return files


def _record_row(arcname: str, data: bytes) -> tuple[str, str, str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return arcname, f"sha256={digest}", str(len(data))


def build(upstream_wheel: Path, out_dir: Path, build_number: int | None = None) -> Path:
    """Write the patched wheel into ``out_dir`` and return its path."""
    try:
        name, upstream_version, _, _ = parse_wheel_filename(upstream_wheel.name)
    except ValueError as exc:  # packaging's InvalidWheelFilename
        raise WheelBuildError(f"{upstream_wheel.name} is not a wheel file name: {exc}") from exc
    if name != "vllm":
        raise WheelBuildError(f"{upstream_wheel.name} is not a vLLM wheel")
    if "mlafixes" in str(upstream_version):
        raise WheelBuildError(
            f"{upstream_wheel.name} is already patched; start from upstream's wheel"
        )
    new_version = _patched_version(upstream_version, build_number)
    tags = upstream_wheel.name[: -len(".whl")].split("-", 2)[2]
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"vllm-{new_version}-{tags}.whl"
    try:
        _write_patched(upstream_wheel, target, upstream_version, new_version)
    except BaseException:
        target.unlink(missing_ok=True)  # never leave half a wheel behind
        raise
    return target


def _write_patched(
    upstream_wheel: Path, target: Path, upstream_version: Version, new_version: str
) -> None:
    old_info = f"vllm-{upstream_version}.dist-info/"
    new_info = f"vllm-{new_version}.dist-info/"
    try:
        source = zipfile.ZipFile(upstream_wheel)
    except zipfile.BadZipFile as exc:
        raise WheelBuildError(f"{upstream_wheel} is not a valid wheel (zip) file: {exc}") from exc
    record: list[tuple[str, str, str]] = []
    with source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as patched:

        def store(arcname: str, data: bytes, like: zipfile.ZipInfo | None = None) -> None:
            entry = zipfile.ZipInfo(
                arcname, date_time=like.date_time if like else (1980, 1, 1, 0, 0, 0)
            )
            entry.external_attr = like.external_attr if like else 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            patched.writestr(entry, data)
            record.append(_record_row(arcname, data))

        names = set(source.namelist())
        if old_info + "METADATA" not in names:
            raise WheelBuildError(f"{upstream_wheel.name} has no {old_info}METADATA")
        if any(n.startswith("vllm_mla_fixes/") for n in names):
            raise WheelBuildError(f"{upstream_wheel.name} already contains vllm_mla_fixes")
        for info in source.infolist():
            if info.is_dir() or info.filename == old_info + "RECORD":
                continue  # RECORD is rewritten below from what is stored
            data = source.read(info)
            arcname = info.filename
            if arcname.startswith(old_info):
                arcname = new_info + arcname[len(old_info) :]
                leaf = arcname[len(new_info) :]
                if leaf == "METADATA":
                    data = _with_version(data.decode(), new_version).encode()
                elif leaf == "entry_points.txt":
                    data = _with_entry_points(data.decode()).encode()
                elif leaf == "top_level.txt":
                    data = data.rstrip(b"\n") + b"\nvllm_mla_fixes\n"
            store(arcname, data, info)
        if new_info + "entry_points.txt" not in patched.namelist():
            store(new_info + "entry_points.txt", _with_entry_points("").encode())
        for arcname, data in _package_files():
            store(arcname, data)
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*record, (new_info + "RECORD", "", "")])
        patched.writestr(new_info + "RECORD", text.getvalue())


def run(
    vllm_wheel: str | None,
    vllm_release: str | None,
    out_dir: str,
    build_number: int | None,
    index_url: str,
    print_=print,
) -> int:
    try:
        if vllm_wheel:
            source = Path(vllm_wheel)
            if not source.is_file():
                raise WheelBuildError(f"no such wheel: {source}")
        elif vllm_release:
            print_(f"downloading vLLM {vllm_release} from {index_url} (sha256 checked)")
            source = download_verified(vllm_release, index_url)
        else:
            raise WheelBuildError("give --vllm-wheel PATH or --vllm VERSION")
        target = build(source, Path(out_dir), build_number)
    except WheelBuildError as exc:
        print_(f"build-wheel: {exc}")
        return 1
    print_(f"upstream {source.name}: {source.stat().st_size / 2**20:.1f} MiB")
    print_(f"patched  {target}: {target.stat().st_size / 2**20:.1f} MiB")
    print_(f"sha256   {_sha256(target)}  {target.name}")
    print_(f"install with: pip install {target}")
    return 0
