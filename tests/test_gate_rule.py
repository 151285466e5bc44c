"""The release rule every fix follows (issue 11, item 3), on version strings.

Below the affected range, or at/after ``fixed_in``: not-needed.  A release in
a range known to carry the bug that the fix does not cover: skipped, naming the
way out.  A release newer than ``newest_reviewed`` while upstream is open:
skipped ("not reviewed"), naming the newest reviewed release -- nightlies of
the next version count as newer.  Anything else in ``affected`` goes to the
fix's probe (``None`` here).
"""

from __future__ import annotations

import dataclasses

import pytest
from gate_rule_tables import PROBE, expected_decisions
from packaging.version import Version

from vllm_mla_fixes.fixes import ALL_FIXES, FIXES_BY_NAME
from vllm_mla_fixes.patching import State, release_decision, run_fix

EXPECTED = expected_decisions()


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
                assert status is not None, (info.name, release)
                assert status.state is State.SKIPPED and "not covered here" in status.reason
        after = f"{newest.major}.{newest.minor + 1}.0"
        status = release_decision(info, after)
        assert status is not None, (info.name, after)
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
        assert status is not None, module.INFO.name
        assert status.state is State.SKIPPED and "not a PEP 440 version" in status.reason


def test_run_fix_decides_by_release_before_probing():
    def probe():
        raise AssertionError("the release rule decides before the probe runs")

    def apply(patch):
        raise AssertionError("the release rule decides before anything is applied")

    for module in ALL_FIXES:
        fix = dataclasses.replace(module, probe=probe, apply=apply)
        result = run_fix(fix, "9.0.0")
        assert result.patch is None
        expected = State.SKIPPED if module.INFO.fixed_in is None else State.NOT_NEEDED
        assert result.status.state is expected, result.status


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
            newest = FIXES_BY_NAME[fix].INFO.newest_reviewed
            assert f"serve with vLLM {newest}" in finding.advice, finding
