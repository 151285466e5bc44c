"""Build FlashInfer's SM120 sparse-MLA JIT module (the one DeepSeek-V4.1's
``FLASHINFER_MLA_SPARSE_DSV41`` backend compiles on first use on an SM12x
GPU) with the lock's own CUDA toolkit wheels, on a machine without a GPU.

The GPU sessions point ``CUDA_HOME`` at ``site-packages/nvidia/cu13``
(``cuda_toolkit.py``); this proves that toolkit compiles and links the
module, for ``sm_120a``, before an SM120 runner spends its time on it.
Prints one ``RESULT=`` JSON line (seconds, library path and size).  On a
machine without a driver it links against an empty ``libcuda.so`` stub.

    FLASHINFER_WORKSPACE_BASE=/tmp/fi python tests/gpu/flashinfer_sm120_jit.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_toolkit import locked_toolkit, toolkit_env  # noqa: E402

# No GPU to ask: name the target FlashInfer's compilation context builds for.
SM120_ARCH = "12.0a"


def main() -> int:
    toolkit = locked_toolkit()
    if toolkit is None:
        print("RESULT=" + json.dumps({"error": "no nvidia/cu13 toolkit wheels in this env"}))
        return 2
    workspace = Path(os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(Path.home())))
    link_dir = workspace / "cuda-link"
    env = toolkit_env(link_dir)
    linked_against = "the driver's libcuda.so.1"
    if not (link_dir / "libcuda.so").exists():
        # No driver here, and the toolkit wheels ship no libcuda stub: an empty
        # library of that name satisfies -lcuda (unresolved names stay for the
        # loader).  The module proves it compiles and links; it is not for use.
        subprocess.run(
            [
                "cc",
                "-shared",
                "-Wl,-soname,libcuda.so.1",
                "-o",
                str(link_dir / "libcuda.so"),
                "-x",
                "c",
                "/dev/null",
            ],
            check=True,
        )
        linked_against = "an empty libcuda.so stub (no driver on this machine)"
    os.environ["CUDA_HOME"] = env["CUDA_HOME"]
    os.environ["PATH"] = os.pathsep.join([env["CUDA_TOOLKIT_BIN"], os.environ.get("PATH", "")])
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = env["FLASHINFER_EXTRA_LDFLAGS"]
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = SM120_ARCH

    from importlib.metadata import version

    from flashinfer.jit.mla import gen_sparse_mla_sm120_module

    spec = gen_sparse_mla_sm120_module()
    started = time.monotonic()
    spec.build(verbose=os.environ.get("FLASHINFER_JIT_VERBOSE") == "1")
    seconds = time.monotonic() - started
    library = Path(spec.get_library_path())
    print(
        "RESULT="
        + json.dumps(
            {
                "flashinfer": version("flashinfer-python"),
                "cuda_home": str(toolkit),
                "arch": SM120_ARCH,
                "sources": len(spec.sources),
                "build_seconds": round(seconds, 1),
                "library": str(library),
                "library_bytes": library.stat().st_size if library.exists() else None,
                "max_jobs": os.environ.get("MAX_JOBS"),
                "linked_against": linked_against,
            }
        ),
        flush=True,
    )
    return 0 if library.exists() else 1


if __name__ == "__main__":
    sys.exit(main())
