"""GPU tests on a runner that declares its GPU: a skip is a failure there.

``VLLM_MLA_FIXES_EXPECT_GPU_CC`` names the compute-capability major the
runner promises (``9`` an H100/H200, ``10`` a B200/GB200, ``12`` an RTX PRO
6000 Blackwell).  Where it is set:

* a test that skips because no GPU, or no GPU of that major, is visible fails
  instead (an error where a fixture skipped; its skip reason is the message) -- an old driver, a CUDA
  13 torch on an R57x driver or a container without the device make every
  test skip, and such a job must not go green;
* a test that skips for another reason (another GPU's test, another vLLM
  release) stays skipped;
* the session fails unless at least one test passed.

Without the variable (a developer's machine, CPU CI) skips stay skips.
"""

from __future__ import annotations

import os

import pytest

EXPECT_GPU_ENV = "VLLM_MLA_FIXES_EXPECT_GPU_CC"
# Skip reasons written by gpu.serving.require_gpu / require_vllm.  Only the
# first two mean "the declared GPU is not usable here".
NO_GPU_REASONS = ("needs a CUDA GPU", "torch is not installed")


def declared_gpu_major() -> int | None:
    value = os.environ.get(EXPECT_GPU_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise pytest.UsageError(
            f"{EXPECT_GPU_ENV}={value!r}: expected a compute-capability major such as 9, 10 or 12"
        )
    return int(value)


def skip_is_failure(reason: str, declared: int | None) -> bool:
    """True when a test skipped for ``reason`` on a runner that declared the
    GPU major ``declared`` must count as failed."""
    if declared is None:
        return False
    if any(marker in reason for marker in NO_GPU_REASONS):
        return True
    # "this GPU is SM90; needs SM12x: ..." -- only a failure when the GPU that
    # is there is not the one the runner declared.
    prefix = "this GPU is SM"
    if reason.startswith(prefix):
        found = reason[len(prefix) :].split(";", 1)[0]  # major and one-digit minor, e.g. "120"
        return found[:-1] != str(declared)
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = report.longrepr[2].removeprefix("Skipped: ")
    declared = declared_gpu_major()
    if skip_is_failure(reason, declared):
        report.outcome = "failed"
        report.longrepr = (
            f"{EXPECT_GPU_ENV}={declared} declares an SM{declared}x GPU on this "
            f"runner, but the test skipped: {reason}"
        )


def pytest_sessionfinish(session, exitstatus):
    declared = declared_gpu_major()
    if declared is None or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else 0
    if passed == 0:
        if reporter is not None:
            reporter.write_line(
                f"{EXPECT_GPU_ENV}={declared}: no GPU test passed in this "
                f"session; a runner that declares its GPU must pass at least one",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
