"""The release rule every fix follows (issue 11, item 3), on version strings.

Below the affected range, or at/after ``fixed_in``: not-needed.  A release in
a range known to carry the bug that the fix does not cover: skipped, naming the
way out.  A release newer than ``newest_reviewed`` while upstream is open:
skipped ("not reviewed"), naming the newest reviewed release -- nightlies of
the next version count as newer.  Anything else in ``affected`` goes to the
fix's probe (``None`` here).
"""

from __future__ import annotations

import logging

import pytest
from packaging.version import Version

from vllm_mla_fixes.fixes import ALL_FIXES, FIXES_BY_NAME
from vllm_mla_fixes.patching import State, release_decision, run_fix

PROBE = "probe"
NOT_REVIEWED = "skipped: not reviewed: vLLM {v} is newer than 0.34.0"
NOT_COVERED = "skipped: bug present in vLLM {v}, not covered here; upgrade to 0.32.0+"

EXPECTED = {
    "fp8-ds-mla-reshape": {
        "0.24.0": "not-needed",
        "0.25.0": PROBE,
        "0.25.1": PROBE,
        "0.25.2rc1.dev1133+g1234abc": PROBE,
        "0.26.0": "not-needed",
        "0.26.0+cu130": "not-needed",
        "0.26.1.dev3+gabcdef0": "not-needed",
        "0.34.0": "not-needed",
        "0.40.0": "not-needed",
    },
    "fa4-compile-strides": {
        "0.23.0": "not-needed",
        "0.23.1rc1.dev1133+g1234abc": PROBE,
        "0.24.0": PROBE,
        "0.25.1": PROBE,
        "0.26.0": "not-needed",
        "0.26.1.dev3+gabcdef0": "not-needed",
        "0.40.0": "not-needed",
    },
    "dsv41-sm120-geometry": {
        "0.26.0": "not-needed",
        "0.29.0": "not-needed",
        "0.30.0": NOT_COVERED,
        "0.31.0": NOT_COVERED,
        "0.31.1rc1.dev5+g1234abc": NOT_COVERED,
        "0.32.0": PROBE,
        "0.33.0": PROBE,
        "0.33.1.dev7+g1234abc": PROBE,
        "0.34.0": PROBE,
        "0.34.0+cu130": PROBE,
        "0.34.0rc2": PROBE,
        "0.34.1": NOT_REVIEWED,
        "0.34.1.dev12+g1234abc": NOT_REVIEWED,
        "0.35.0rc1.dev3+g1234abc": NOT_REVIEWED,
        "0.35.0": NOT_REVIEWED,
        "1.0.0": NOT_REVIEWED,
    },
}


def _label(status) -> str:
    if status is None:
        return PROBE
    return f"skipped: {status.reason}" if status.state is State.SKIPPED else status.state.value


@pytest.mark.parametrize(
    "fix, version", [(fix, v) for fix, table in EXPECTED.items() for v in table]
)
def test_release_rule(fix, version):
    expected = EXPECTED[fix][version].format(v=version)
    label = _label(release_decision(FIXES_BY_NAME[fix].INFO, version))
    assert label.startswith(expected), label


def test_every_fix_declares_a_consistent_release_record():
    for module in ALL_FIXES:
        info = module.INFO
        newest = Version(info.newest_reviewed)
        for release in info.covered_releases:
            assert Version(release) <= newest, (info.name, release)
            assert release_decision(info, release) is None, (info.name, release)
        for uncovered in info.not_covered:
            for release in uncovered.releases:
                status = release_decision(info, release)
                assert status.state is State.SKIPPED and "not covered here" in status.reason
        after = f"{newest.major}.{newest.minor + 1}.0"
        status = release_decision(info, after)
        if info.fixed_in is None:
            assert status.state is State.SKIPPED and info.newest_reviewed in status.reason, (
                info.name
            )
        else:
            assert newest >= Version(info.fixed_in)  # the fixed release itself was reviewed
            assert status.state is State.NOT_NEEDED, info.name


def test_unparseable_version_is_skipped_not_called_unaffected():
    for module in ALL_FIXES:
        status = release_decision(module.INFO, "not-a-version")
        assert status.state is State.SKIPPED and "not a PEP 440 version" in status.reason


def test_run_fix_decides_by_release_before_probing():
    def probe():
        raise AssertionError("the release rule decides before the probe runs")

    for module in ALL_FIXES:
        fix = type("Fix", (), {"INFO": module.INFO, "probe": staticmethod(probe), "apply": None})
        result = run_fix(fix, "9.0.0")
        assert result.patch is None
        expected = State.SKIPPED if module.INFO.fixed_in is None else State.NOT_NEEDED
        assert result.status.state is expected, result.status


def test_plugin_warns_naming_the_newest_reviewed_release(fresh_plugin, monkeypatch):
    import vllm
    import vllm.logger  # noqa: F401  its logging set-up clears child handlers: run it first

    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("vllm.mla_fixes")
    logger.addHandler(handler)
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv("VLLM_MLA_FIXES", raising=False)
    try:
        fresh_plugin.register()
    finally:
        logger.removeHandler(handler)
    status = {s.name: s for s in fresh_plugin.status()}
    assert status["dsv41-sm120-geometry"].state is State.SKIPPED
    assert status["fp8-ds-mla-reshape"].state is State.NOT_NEEDED
    assert status["fa4-compile-strides"].state is State.NOT_NEEDED
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "dsv41-sm120-geometry" in warnings[0] and "not reviewed" in warnings[0]
    assert "newer than 0.34.0, the newest release reviewed for this fix" in warnings[0]


@pytest.mark.parametrize(
    "fix, version", [(fix, v) for fix, table in EXPECTED.items() for v in table]
)
def test_doctor_follows_the_same_rule(fix, version, monkeypatch):
    """doctor's finding for a release the gate decides says what the plugin says;
    where the probe decides, the fix's own diagnosis runs."""
    from vllm_mla_fixes.doctor import diagnose
    from vllm_mla_fixes.report import Environment

    expected = EXPECTED[fix][version].format(v=version)
    env = Environment(
        packages={"vllm": version},
        gpu=None,
        capability=None,
        torch_cuda=None,
        vllm_plugins=None,
        mla_fixes=None,
        fix_states={},
    )
    monkeypatch.setattr("vllm_mla_fixes.doctor.read_environment", lambda load_plugins: env)
    findings = [f for f in diagnose([])[2] if f.topic == fix]
    if expected == PROBE:
        assert findings == FIXES_BY_NAME[fix].diagnose(env, None)
        return
    (finding,) = findings
    if expected == "not-needed":
        assert finding.level == "ok" and finding.message.startswith("not needed: "), finding
    else:
        assert finding.level == "warn" and finding.message.startswith(expected), finding
        if "not reviewed" in expected:
            assert "serve with vLLM 0.34.0" in finding.advice, finding
