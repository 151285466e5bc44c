"""The table of envelopes: every kernel on a DeepSeek-V4.1 cache with what the
installed build declares it accepts, and the questions the fix asks of it."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from . import installed
from .deep_gemm import deep_gemm_envelopes
from .flashinfer import flashinfer_envelopes
from .model import COVERED_VLLM, KERNELS, KernelEnvelope, unknown_envelope
from .vllm_kernels import vllm_kernel_envelopes


@functools.cache
def kernel_envelopes() -> dict[str, KernelEnvelope]:
    """Every kernel that reads or writes a DeepSeek-V4.1 cache on SM12x, with
    what the installed build declares it accepts (read once per process)."""
    found = installed.installed_version("vllm")
    if found not in COVERED_VLLM:
        reason = f"vLLM {found or 'is not installed'}" + (
            f" is not a covered release ({', '.join(COVERED_VLLM)})" if found else ""
        )
        return {k: unknown_envelope(k, reason) for k in KERNELS}
    envelopes = {**flashinfer_envelopes(), **deep_gemm_envelopes(), **vllm_kernel_envelopes()}
    return {k: envelopes[k] for k in KERNELS}


def envelopes_for_cache(cache: str) -> list[KernelEnvelope]:
    """The envelopes of every kernel that reads or writes ``cache``."""
    return [e for e in kernel_envelopes().values() if cache in e.caches]


def accepts_rows(cache: str, rows: int) -> bool | None:
    """Whether every kernel on ``cache`` takes pages of ``rows`` rows: False
    when one rejects them, None when none rejects and one is unknown."""
    verdicts = [e.accepts_rows(rows) for e in envelopes_for_cache(cache)]
    if False in verdicts:
        return False
    return None if None in verdicts else True


def rejecting_kernels(cache: str, rows: int) -> list[KernelEnvelope]:
    """The kernels on ``cache`` whose declaration rejects ``rows``-row pages."""
    return [e for e in envelopes_for_cache(cache) if e.accepts_rows(rows) is False]


def declaration_files() -> list[Path]:
    """Every installed file whose declarations the envelopes were read from
    (a declaration names its file from its top-level package's folder)."""
    found = set()
    for name in {s.path for e in kernel_envelopes().values() for s in e.sources}:
        package = installed.package_dir(name.split("/", 1)[0])
        found.add(Path(name) if package is None else package.parent / name)
    return sorted(found)


def content_key() -> str:
    """sha256 of what the envelopes read: each declaration file's name and
    bytes, and the text of every declaration that could not be read.  A
    FlashInfer or DeepGEMM rebuilt under the same version string (other
    top-k instantiations, other page sizes) is a different key."""
    digest = hashlib.sha256()
    for path in declaration_files():
        digest.update(path.as_posix().encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError as exc:
            digest.update(f"<unreadable: {exc}>".encode())
        digest.update(b"\0")
    for envelope in kernel_envelopes().values():
        digest.update(f"{envelope.kernel}: {envelope.unknown}".encode() + b"\0")
    return digest.hexdigest()
