"""``vllm-mla-fixes build-wheel``: one vLLM wheel that carries the fixes.

Takes an upstream vLLM wheel (a local file, or a release downloaded from the
package index and checked against the index's published sha256) and writes
``vllm-<ver>+mlafixes.<plugin version>-<tags>.whl``:

* every upstream file byte-identical (compiled kernels included);
* this package (``vllm_mla_fixes/``) added, with its general-plugin entry point
  and its console script in ``entry_points.txt``;
* ``METADATA`` carrying the new version, and a ``RECORD`` (PEP 376/427:
  urlsafe-base64 sha256 and size) computed from the bytes actually stored.

The wheel is written under a temporary name in the output folder, checked
(it opens as a zip, every file matches its RECORD row, the METADATA version is
the file name's) and only then moved to its final name: an interrupted or
failed build leaves the folder as it was (:mod:`vllm_mla_fixes.atomic`).

It needs only the standard library and ``packaging`` (a dependency of this
package), so it runs in any environment that has vllm-mla-fixes.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import shutil
import sys
import time
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

import vllm_mla_fixes
from vllm_mla_fixes import atomic, settings

DEFAULT_INDEX = "https://pypi.org/simple"
CACHE = Path.home() / ".cache" / "vllm-mla-fixes" / "wheels"
PLUGIN_ENTRY = "mla_fixes = vllm_mla_fixes:register"
SCRIPT_ENTRY = "vllm-mla-fixes = vllm_mla_fixes.cli:main"
PACKAGE_DIR = Path(vllm_mla_fixes.__file__).resolve().parent


class WheelBuildError(RuntimeError):
    """The patched wheel cannot be built; the message says why and what to do."""


# -- download -----------------------------------------------------------------------


def _index_files(index_url: str, project: str = "vllm") -> list[dict[str, object]]:
    """The project's files on a PEP 691 (JSON simple API) index."""
    url = f"{index_url.rstrip('/')}/{project}/"
    try:
        request = urllib.request.Request(
            url, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            page = json.load(response)
    except (OSError, ValueError) as exc:
        raise WheelBuildError(
            f"cannot read the package index at {url}: {exc}. Download the "
            f"wheel yourself and pass --vllm-wheel PATH."
        ) from exc
    files = page.get("files") if isinstance(page, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise WheelBuildError(f"{url} is not a PEP 691 project page (no list of files)")
    return files


def _pick_wheel(files: list[dict[str, object]], release: str) -> tuple[str, dict[str, object]]:
    """The file name and index entry of the wheel of ``release`` that this
    machine would install."""
    try:
        wanted = Version(release)
    except InvalidVersion:
        raise WheelBuildError(f"{release!r} is not a release number (e.g. 0.25.1)") from None
    candidates: dict[object, tuple[str, dict[str, object]]] = {}
    for entry in files:
        name = entry.get("filename")
        if not isinstance(name, str) or not name.endswith(".whl"):
            continue  # no file name, or not a wheel's: not a candidate
        try:
            _, ver, _, tags = parse_wheel_filename(name)
        except InvalidWheelFilename:
            continue  # not ours to judge; it is simply not a candidate
        if ver == wanted:
            for tag in tags:
                candidates[tag] = (name, entry)
    for tag in sys_tags():
        if tag in candidates:
            return candidates[tag]
    raise WheelBuildError(
        f"the index has no vLLM {release} wheel for this platform "
        f"(found: {sorted({name for name, _ in candidates.values()}) or 'none'})"
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
    name, entry = _pick_wheel(_index_files(index_url), release)
    hashes = entry.get("hashes")
    expected = hashes.get("sha256") if isinstance(hashes, dict) else None
    if not (isinstance(expected, str) and re.fullmatch(r"[0-9a-fA-F]{64}", expected)):
        raise WheelBuildError(
            f"the index publishes no sha256 for {name} (hashes: {hashes!r:.80}); refusing "
            "an unverifiable download"
        )
    expected = expected.lower()
    wheel_url = entry.get("url")
    if not isinstance(wheel_url, str):
        raise WheelBuildError(f"the index gives no URL for {name} (url: {wheel_url!r:.80})")
    cache.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temporaries(cache)
    target = cache / name
    if not (target.exists() and _sha256(target) == expected):
        url = urllib.parse.urljoin(f"{index_url.rstrip('/')}/vllm/", wheel_url)
        # One temporary file per process (two builds downloading at once must not
        # write into the same file), in the cache under its final name only once checked.
        with atomic.replacing(target) as partial:
            with urllib.request.urlopen(url, timeout=600) as response, open(partial, "wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
            found = _sha256(partial)
            if found != expected:
                raise WheelBuildError(
                    f"sha256 mismatch for {name}: the index publishes "
                    f"{expected}, the download is {found}. Refusing to build from it."
                )
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


def upstream_version(upstream_wheel: Path) -> Version:
    """The vLLM version of an upstream wheel, from its file name."""
    try:
        name, version, _, _ = parse_wheel_filename(upstream_wheel.name)
    except InvalidWheelFilename as exc:
        raise WheelBuildError(f"{upstream_wheel.name} is not a wheel file name: {exc}") from exc
    if name != "vllm":
        raise WheelBuildError(f"{upstream_wheel.name} is not a vLLM wheel")
    if "mlafixes" in str(version):
        raise WheelBuildError(
            f"{upstream_wheel.name} is already patched; start from upstream's wheel"
        )
    return version


def build(
    upstream_wheel: Path,
    out_dir: Path,
    build_number: int | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> Path:
    """Write the patched wheel into ``out_dir`` and return its path.  Any
    failure or interruption leaves ``out_dir`` as it was: no file under the
    final name, an earlier wheel of that name intact, no folder created.
    The same input gives the same bytes (:func:`added_file_time`)."""
    if build_number is not None and build_number < 0:
        raise WheelBuildError(f"the build number must be 0 or more, not {build_number}")
    version = upstream_version(upstream_wheel)
    new_version = _patched_version(version, build_number)
    tags = upstream_wheel.name[: -len(".whl")].split("-", 2)[2]
    target = out_dir / f"vllm-{new_version}-{tags}.whl"
    # One build at a time per folder: a second waits, then writes the same bytes.
    with atomic.folder(out_dir), atomic.folder_lock(out_dir, on_wait=log):
        atomic.remove_stale_temporaries(out_dir, log)
        with atomic.replacing(target) as partial:
            _write_patched(upstream_wheel, partial, version, new_version)
            check_wheel(partial, new_version)
    return target


def check_wheel(path: Path, version: str) -> None:
    """Raise WheelBuildError unless ``path`` is a whole wheel: it opens as a zip,
    RECORD lists every file with the sha256 and size of its stored bytes, and
    METADATA carries ``version``."""
    info = f"vllm-{version}.dist-info/"
    try:
        with zipfile.ZipFile(path) as archive:
            rows = list(csv.reader(io.StringIO(archive.read(info + "RECORD").decode())))
            recorded = {row[0]: row[1:] for row in rows if row}
            for name in archive.namelist():
                if name == info + "RECORD":
                    continue
                if name not in recorded:
                    raise WheelBuildError(f"{path.name}: {name} is missing from RECORD")
                _, digest, size = _record_row(name, archive.read(name))
                if recorded[name] != [digest, size]:
                    raise WheelBuildError(f"{path.name}: {name} does not match its RECORD row")
            metadata = archive.read(info + "METADATA").decode()
    except (zipfile.BadZipFile, KeyError, zipfile.LargeZipFile) as exc:
        raise WheelBuildError(f"{path.name} is not a whole wheel: {exc}") from exc
    if f"\nVersion: {version}\n" not in metadata:
        raise WheelBuildError(f"{path.name}: METADATA does not carry version {version}")


EARLIEST_ZIP_TIME = 315532800  # 1980-01-01 00:00:00 UTC, the first time a zip entry can hold


def added_file_time() -> tuple[int, int, int, int, int, int]:
    """The time stamp of every file the build adds (this package, RECORD):
    $SOURCE_DATE_EPOCH where set (reproducible-builds.org), else 1980-01-01,
    never the clock, so the same input gives the same bytes.  Upstream's
    files keep upstream's time stamps."""
    raw = (settings.environment_variable("SOURCE_DATE_EPOCH") or "").strip()
    try:
        epoch = max(int(raw), EARLIEST_ZIP_TIME) if raw else EARLIEST_ZIP_TIME
    except ValueError:
        raise WheelBuildError(
            f"SOURCE_DATE_EPOCH={raw!r:.40} is not a whole number of seconds since 1970"
        ) from None
    return time.gmtime(min(epoch, 4354819199))[:6]  # a zip entry's last year is 2107


def _read_entry(source: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    try:
        return source.read(info)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise WheelBuildError(
            f"{Path(str(source.filename)).name}: {info.filename} cannot be read ({exc}); "
            "download the wheel again"
        ) from exc


def _text(data: bytes, arcname: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WheelBuildError(
            f"{arcname} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


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
    added_time = added_file_time()
    with (
        atomic.interruptions_between_steps() as stop_if_signalled,
        source,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as patched,
    ):

        def store(arcname: str, data: bytes, like: zipfile.ZipInfo | None = None) -> None:
            stop_if_signalled()  # between entries: zipfile cannot unwind from inside one
            entry = zipfile.ZipInfo(arcname, date_time=like.date_time if like else added_time)
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
            data = _read_entry(source, info)
            arcname = info.filename
            if arcname.startswith(old_info):
                arcname = new_info + arcname[len(old_info) :]
                leaf = arcname[len(new_info) :]
                if leaf == "METADATA":
                    data = _with_version(_text(data, info.filename), new_version).encode()
                elif leaf == "entry_points.txt":
                    data = _with_entry_points(_text(data, info.filename)).encode()
                elif leaf == "top_level.txt":
                    data = data.rstrip(b"\n") + b"\nvllm_mla_fixes\n"
            store(arcname, data, info)
        if new_info + "entry_points.txt" not in patched.namelist():
            store(new_info + "entry_points.txt", _with_entry_points("").encode())
        for arcname, data in _package_files():
            store(arcname, data)
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*record, (new_info + "RECORD", "", "")])
        record_entry = zipfile.ZipInfo(new_info + "RECORD", date_time=added_time)
        record_entry.external_attr = 0o644 << 16
        record_entry.compress_type = zipfile.ZIP_DEFLATED
        patched.writestr(record_entry, text.getvalue())


def run(
    vllm_wheel: str | None,
    vllm_release: str | None,
    out_dir: str,
    build_number: int | None,
    index_url: str,
    print_: Callable[[str], None] = print,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> int:
    """The command: 0 built, 1 the build failed (the reason is logged)."""
    try:
        if vllm_wheel:
            source = Path(vllm_wheel)
            if not source.is_file():
                raise WheelBuildError(f"no such wheel: {source}")
        elif vllm_release:
            log(f"downloading vLLM {vllm_release} from {index_url} (sha256 checked)")
            source = download_verified(vllm_release, index_url)
        else:
            raise WheelBuildError("give --vllm-wheel PATH or --vllm VERSION")
        target = build(source, Path(out_dir), build_number, log)
    except WheelBuildError as exc:
        log(f"vllm-mla-fixes build-wheel: error: {exc}")
        return 1
    print_(f"upstream {source.name}: {source.stat().st_size / 2**20:.1f} MiB")
    print_(f"patched  {target}: {target.stat().st_size / 2**20:.1f} MiB")
    print_(f"sha256   {_sha256(target)}  {target.name}")
    print_(f"install with: pip install {target}")
    return 0
