"""Before the GPU tests: is the GPU this runner declares usable from this
environment?  With ``VLLM_MLA_FIXES_EXPECT_GPU_CC`` set, exits 1 naming the
cause (no ``nvidia-smi``, no CUDA in torch, a driver older than the CUDA 13
wheels need, another GPU); without it, only reports.

    python tests/gpu/preflight.py
    python tests/gpu/preflight.py --declared   # the major a GPU session must expect

``--declared`` (no torch needed; the GPU nox sessions run it before
installing anything) prints the declared major, or, where none is declared,
the major of the GPU ``nvidia-smi`` sees, saying on stderr that it was
derived.  With neither it exits 1: a GPU session without a GPU must not go
green on skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

EXPECT_GPU_ENV = "VLLM_MLA_FIXES_EXPECT_GPU_CC"
# CUDA 13.0 user-mode libraries need a driver of branch R580 or newer.
MIN_DRIVER_FOR_CUDA_MAJOR = {13: 580, 12: 525}


def problems(declared: int) -> tuple[list[str], list[str]]:
    found, wrong = [], []
    smi = shutil.which("nvidia-smi")
    driver = None
    if smi is None:
        wrong.append("nvidia-smi is not on PATH: no NVIDIA driver in this job")
    else:
        query = subprocess.run(
            [smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if query.returncode != 0:
            wrong.append(f"nvidia-smi failed: {(query.stderr or query.stdout).strip()}")
        else:
            found.append(f"nvidia-smi: {query.stdout.strip()}")
            driver = int(query.stdout.splitlines()[0].split(",")[-1].strip().split(".")[0])
    import torch

    cuda = torch.version.cuda
    found.append(f"torch {torch.__version__}, CUDA {cuda}")
    if cuda:
        need = MIN_DRIVER_FOR_CUDA_MAJOR.get(int(cuda.split(".")[0]))
        if need and driver is not None and driver < need:
            wrong.append(
                f"driver R{driver} is older than R{need}, which torch's CUDA {cuda} needs: "
                f"update the runner's driver"
            )
    if not torch.cuda.is_available():
        wrong.append("torch.cuda.is_available() is False")
    else:
        major, minor = torch.cuda.get_device_capability()
        found.append(f"device 0: {torch.cuda.get_device_name()} (SM{major}{minor})")
        if major != declared:
            wrong.append(f"device 0 is SM{major}{minor}, the runner declares SM{declared}x")
    return found, wrong


def visible_gpu() -> tuple[int, str] | None:
    """(compute-capability major, description) of GPU 0 per nvidia-smi, or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = subprocess.run(
        [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    lines = query.stdout.strip().splitlines()
    if query.returncode != 0 or not lines:
        return None
    name, capability = (part.strip() for part in lines[0].rsplit(",", 1))
    return int(capability.split(".")[0]), f"{name} (compute capability {capability})"


def declared_major() -> int:
    value = os.environ.get(EXPECT_GPU_ENV, "").strip()
    if value:
        if not value.isdigit():
            print(
                f"preflight: {EXPECT_GPU_ENV}={value!r} is not a major such as 9, 10 or 12",
                file=sys.stderr,
            )
            return 1
        print(value)
        return 0
    gpu = visible_gpu()
    if gpu is None:
        print(
            f"preflight: refusing to run the GPU tests: {EXPECT_GPU_ENV} is not set and "
            f"nvidia-smi sees no GPU, so every test would skip and the session would go green. "
            f"Run on a GPU runner, or set {EXPECT_GPU_ENV} to the GPU's compute-capability major.",
            file=sys.stderr,
        )
        return 1
    major, description = gpu
    print(
        f"preflight: {EXPECT_GPU_ENV} is not set; expecting SM{major}x, derived from the GPU "
        f"nvidia-smi sees: {description}",
        file=sys.stderr,
    )
    print(major)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--declared"]:
        return declared_major()
    value = os.environ.get(EXPECT_GPU_ENV, "").strip()
    declared = int(value) if value.isdigit() else None
    found, wrong = problems(declared if declared is not None else -1)
    for line in found:
        print(f"preflight: {line}")
    if declared is None:
        print(f"preflight: {EXPECT_GPU_ENV} is not set; GPU tests skip where no GPU fits")
        return 0
    for line in wrong:
        print(f"preflight: FAIL: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
