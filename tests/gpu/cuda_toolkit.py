"""The environment that points FlashInfer's (and DeepGEMM's) JIT at the CUDA
toolkit the lock file installed, printed as one JSON line.

vLLM 0.32/0.33 ship no FlashInfer jit-cache wheel: the SM120 sparse-MLA
module is compiled from ``.cu`` on first use, with ``$CUDA_HOME/bin/nvcc``
(else ``which nvcc``, else ``/usr/local/cuda``) and linked with
``-L$CUDA_HOME/lib64 -lcudart -lcuda``.  The locks install nvcc, headers and
libraries as wheels under ``site-packages/nvidia/cu13`` (``bin``, ``include``,
``lib``), which none of those finds, and ``lib`` has only ``libcudart.so.13``.
So: ``CUDA_HOME`` = that folder, its ``bin`` first on ``PATH``, and a folder
of two links (``libcudart.so`` to the wheel's, ``libcuda.so`` to the driver's
``libcuda.so.1``) passed with ``FLASHINFER_EXTRA_LDFLAGS``.

    python tests/gpu/cuda_toolkit.py      # run with the environment's python
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path


def locked_toolkit() -> Path | None:
    root = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13"
    return root if (root / "bin" / "nvcc").exists() else None


def driver_library() -> str | None:
    """Path of the driver's libcuda.so.1 as the dynamic loader knows it."""
    try:
        listing = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        return None
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libcuda.so.1 ") and "x86-64" in name:
            return path.strip()
    return None


def toolkit_env(link_dir: Path) -> dict[str, str]:
    toolkit = locked_toolkit()
    if toolkit is None:
        return {}
    link_dir.mkdir(parents=True, exist_ok=True)
    links = {"libcudart.so": toolkit / "lib" / "libcudart.so.13"}
    driver = driver_library()
    if driver:
        links["libcuda.so"] = Path(driver)
    for name, target in links.items():
        link = link_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return {
        "CUDA_HOME": str(toolkit),
        "CUDA_TOOLKIT_BIN": str(toolkit / "bin"),
        "FLASHINFER_EXTRA_LDFLAGS": f"-L{link_dir} -L{toolkit / 'lib'}",
    }


if __name__ == "__main__":
    print(json.dumps(toolkit_env(Path(sys.prefix) / "cuda-link")))
