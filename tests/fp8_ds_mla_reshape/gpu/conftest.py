"""The GPU tests' rules (``tests/gpu/conftest.py``) for this fix's GPU test: a
runner that declares its GPU turns a skip for a missing GPU into a failure
here too, and the session's "at least one GPU test passed" check runs once
(here only where pytest did not collect ``tests/gpu`` as well).

No ``__init__.py`` in this folder: a package named ``gpu`` here would clash
with ``tests/gpu``.
"""

from __future__ import annotations

from gpu import conftest as shared_gpu_rules
from gpu.conftest import pytest_runtest_makereport  # noqa: F401 - a hook for this folder's tests


def pytest_sessionfinish(session, exitstatus):
    if not session.config.pluginmanager.is_registered(shared_gpu_rules):
        shared_gpu_rules.pytest_sessionfinish(session, exitstatus)
