"""The GitHub workflows: no job on a self-hosted runner can run for a pull
request, the release publishes only after the lint and every test, and CI on
GitHub-hosted runners runs what .ci/run runs first.

A pull request's run takes the workflow files of the pull request itself, so
a guard in a workflow's ``if:`` binds nobody who can edit it: a workflow with a
self-hosted job has no trigger a pull request (or a comment, or a run a pull
request started) can fire, and pushes only to protected branches.  The
repository settings that stop a pull request from adding such a job are in
SECURITY.md.  Each ``if:`` is still evaluated here, as a second layer, with a
small evaluator of the Actions expression language, in the context of a
pull request from a fork that carries every label the workflow names."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
# The events through which a pull request's author can start a workflow.
PULL_REQUEST_EVENTS = ("pull_request", "pull_request_target")

pytestmark = pytest.mark.vllm_release("0.25.1")  # files only; also in ci.yml's CPU job


# -- a GitHub Actions expression evaluator (the subset workflows use) ----------------

_TOKEN = re.compile(
    r"\s*(?:(?P<string>'(?:[^']|'')*')|(?P<number>\d+(?:\.\d+)?)"
    r"|(?P<op>&&|\|\||==|!=|<=|>=|[!()<>,])"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_-]*(?:\.(?:\*|[A-Za-z_][A-Za-z0-9_-]*))*))"
)


class _Expression:
    """Parses and evaluates one expression against a context of nested dicts.
    ``a.*.b`` maps over a list; missing properties are null, as in Actions."""

    def __init__(self, text: str, context: dict):
        self.tokens: list[tuple[str, str]] = []
        position, text = 0, text.strip()
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None or match.end() == position:
                raise ValueError(f"cannot read expression at {text[position:]!r}")
            kind = match.lastgroup
            assert kind is not None
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.context, self.at = context, 0

    def value(self):
        result = self._or()
        if self.at != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.at][1]!r}")
        return result

    def _peek(self) -> str | None:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> tuple[str, str]:
        token = self.tokens[self.at]
        if expected is not None and token[1] != expected:
            raise ValueError(f"expected {expected!r}, found {token[1]!r}")
        self.at += 1
        return token

    def _or(self):
        left = self._and()
        while self._peek() == "||":
            self._take()
            right = self._and()
            left = left if _truthy(left) else right
        return left

    def _and(self):
        left = self._compare()
        while self._peek() == "&&":
            self._take()
            right = self._compare()
            left = right if _truthy(left) else left
        return left

    def _compare(self):
        left = self._unary()
        while self._peek() in ("==", "!="):
            op = self._take()[1]
            right = self._unary()
            equal = _loose(left) == _loose(right)
            left = equal if op == "==" else not equal
        return left

    def _unary(self):
        if self._peek() == "!":
            self._take()
            return not _truthy(self._unary())
        return self._primary()

    def _primary(self):
        kind, text = self._take()
        if text == "(":
            inner = self._or()
            self._take(")")
            return inner
        if kind == "string":
            return text[1:-1].replace("''", "'")
        if kind == "number":
            return float(text)
        if kind != "name":
            raise ValueError(f"unexpected {text!r}")
        if text in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[text]
        if self._peek() == "(":
            return self._call(text)
        return _lookup(self.context, text.split("."))

    def _call(self, function: str):
        self._take("(")
        args = []
        while self._peek() != ")":
            args.append(self._or())
            if self._peek() == ",":
                self._take()
        self._take(")")
        name = function.lower()
        if name == "contains":
            haystack, needle = args
            if isinstance(haystack, list):
                return any(_loose(item) == _loose(needle) for item in haystack)
            return str(needle).lower() in str(haystack or "").lower()
        if name in ("startswith", "endswith"):
            text, part = (str(a or "").lower() for a in args)
            return text.startswith(part) if name == "startswith" else text.endswith(part)
        if name in ("always", "success"):
            return True
        if name in ("failure", "cancelled"):
            return False
        raise ValueError(f"function {function}() is not known to this evaluator")


def _lookup(value, path: list[str]):
    for i, key in enumerate(path):
        if key == "*":
            return [_lookup(item, path[i + 1 :]) for item in (value or [])]
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _truthy(value) -> bool:
    return value not in (None, False, 0, 0.0, "")


def _loose(value):
    """Actions compares strings case-insensitively."""
    return value.lower() if isinstance(value, str) else value


def evaluate(condition, context: dict):
    if condition is None:
        return True  # no `if:`: the job runs
    if isinstance(condition, bool):
        return condition
    text = str(condition).strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    return _truthy(_Expression(text, context).value())


# -- the workflows -------------------------------------------------------------------


def _triggers(workflow: dict) -> dict:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return dict(on or {})


def _labels(runs_on) -> list[str]:
    if isinstance(runs_on, dict):
        runs_on = runs_on.get("labels", [])
    return [str(label) for label in (runs_on if isinstance(runs_on, list) else [runs_on])]


def _fork_pull_request(event: str, workflow_text: str) -> dict:
    """A pull request from a fork, labelled with every quoted name the workflow holds."""
    labels = [{"name": name} for name in re.findall(r"'([^']*)'", workflow_text)]
    return {
        "github": {
            "event_name": event,
            "repository": "vllm-mla-fixes/vllm-mla-fixes",
            "event": {
                "pull_request": {
                    "labels": labels,
                    "head": {
                        "repo": {"fork": True, "full_name": "someone/vllm-mla-fixes"},
                    },
                }
            },
        }
    }


def self_hosted_jobs_open_to_forks(workflow_text: str) -> list[str]:
    """The self-hosted jobs of one workflow that a fork's pull request can run."""
    workflow = yaml.safe_load(workflow_text)
    events = [e for e in PULL_REQUEST_EVENTS if e in _triggers(workflow)]
    open_jobs = []
    for name, job in (workflow.get("jobs") or {}).items():
        if "self-hosted" not in _labels(job.get("runs-on")):
            continue
        for event in events:
            if evaluate(job.get("if"), _fork_pull_request(event, workflow_text)):
                open_jobs.append(f"{name} ({event})")
    return open_jobs


def _workflow_files() -> list[Path]:
    return sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])


def test_no_self_hosted_job_runs_for_a_forks_pull_request():
    files = _workflow_files()
    assert {f.name for f in files} >= {"ci.yml", "gpu-regression.yml", "release.yml"}
    found = {f.name: self_hosted_jobs_open_to_forks(f.read_text()) for f in files}
    assert not any(found.values()), found


# The events a workflow with a self-hosted job may have, and the branches
# whose pushes may start it (protected: every change there came through review).
SELF_HOSTED_EVENTS = {"push", "schedule", "workflow_dispatch"}
PROTECTED_BRANCHES = {"main"}


def self_hosted_triggers_open_to_pull_requests(workflow_text: str) -> list[str]:
    """A workflow with a self-hosted job: its triggers a pull request, its
    author or anyone else outside can fire, whatever its jobs' ``if:`` say."""
    workflow = yaml.safe_load(workflow_text)
    jobs = (workflow.get("jobs") or {}).values()
    if not any("self-hosted" in _labels(job.get("runs-on")) for job in jobs):
        return []
    triggers = _triggers(workflow)
    problems = [f"on: {event}" for event in sorted(set(triggers) - SELF_HOSTED_EVENTS)]
    push = triggers.get("push")
    if "push" in triggers:
        branches = set((push or {}).get("branches") or [])
        if not branches or branches - PROTECTED_BRANCHES or (push or {}).get("tags"):
            problems.append(f"on: push {push!r}, not only to {sorted(PROTECTED_BRANCHES)}")
    return problems


def test_no_workflow_runs_a_self_hosted_job_for_a_pull_request_event():
    found = {
        f.name: self_hosted_triggers_open_to_pull_requests(f.read_text()) for f in _workflow_files()
    }
    assert not any(found.values()), found
    gpu = yaml.safe_load((WORKFLOWS / "gpu-regression.yml").read_text())
    assert "self-hosted" in _labels(gpu["jobs"]["gpu"]["runs-on"])
    assert set(_triggers(gpu)) == SELF_HOSTED_EVENTS  # the GPU jobs still run


@pytest.mark.parametrize(
    ("on", "open_to_pull_requests"),
    [
        ("  pull_request:\n", True),  # whatever the job's if: says
        ("  pull_request_target:\n", True),
        ("  issue_comment:\n", True),
        ("  workflow_run:\n    workflows: [ci]\n", True),
        ("  push:\n", True),  # every branch
        ("  push:\n    branches: [main, 'feature/*']\n", True),
        ("  push:\n    branches: [main]\n  schedule:\n    - cron: '0 3 * * *'\n", False),
        ("  workflow_dispatch:\n", False),
    ],
)
def test_the_trigger_check_tells_open_workflows_from_closed_ones(on, open_to_pull_requests):
    text = (
        f"on:\n{on}jobs:\n  gpu:\n    runs-on: [self-hosted, sm120]\n"
        "    if: github.event_name != 'pull_request'\n    steps:\n      - run: nox\n"
    )
    assert bool(self_hosted_triggers_open_to_pull_requests(text)) is open_to_pull_requests


def test_security_names_the_repository_settings_the_gpu_runners_rely_on():
    security = " ".join((ROOT / "SECURITY.md").read_text().split())  # lines wrap anywhere
    for setting in (
        "Require approval for all external contributors",
        "Runner groups",
        "Selected workflows",
        "gpu-regression.yml@refs/heads/main",
        "Require a pull request before merging",
    ):
        assert setting in security, setting


def _closure(jobs: dict, name: str) -> set[str]:
    """Every job that ``name`` waits for, directly or not."""
    needs = jobs[name].get("needs") or []
    direct = {needs} if isinstance(needs, str) else set(needs)
    return direct.union(*(_closure(jobs, n) for n in direct)) if direct else set()


def test_the_release_publishes_only_after_the_lint_and_every_test():
    release = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    jobs = release["jobs"]
    publishing = [
        name
        for name, job in jobs.items()
        if (job.get("permissions") or {}).get("contents") == "write"
        or (job.get("permissions") or {}).get("id-token") == "write"
    ]
    assert sorted(publishing) == ["github", "pypi"]
    for name in publishing:
        assert {"lint", "tests", "build", "check"} <= _closure(jobs, name), name
    # the tests job is the whole suite: every release this project locks, as
    # the lint job's step lists them (run here as the workflow runs it)
    locked = sorted(p.name[len("vllm-") : -len(".txt")] for p in (ROOT / "envs").glob("vllm-*.txt"))
    assert (
        jobs["tests"]["strategy"]["matrix"]["vllm"]
        == "${{ fromJSON(needs.lint.outputs.sessions) }}"
    )
    (listing,) = [s["run"] for s in jobs["lint"]["steps"] if s.get("id") == "sessions"]
    command = listing.splitlines()[0].removeprefix("sessions=$(").removesuffix(")")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT)
    assert json.loads(done.stdout) == locked, done.stderr
    (run,) = [s["run"] for s in jobs["tests"]["steps"] if "nox" in s.get("run", "")[:3]]
    assert run == 'nox --non-interactive -s "vllm-$RELEASE"'
    assert "nox --non-interactive -s lint" in [s.get("run") for s in jobs["lint"]["steps"]]


SELF_HOSTED_ON_PULL_REQUESTS = """
on:
  pull_request:
  workflow_dispatch:
jobs:
  gpu:
    runs-on: [self-hosted, "${{{{ matrix.runner }}}}"]
{condition}
    steps:
      - run: nox -s gpu-0.25.1
"""


@pytest.mark.parametrize(
    ("condition", "open_to_forks"),
    [
        ("", True),  # no guard
        ("    if: contains(github.event.pull_request.labels.*.name, 'gpu-tests')", True),
        ("    if: github.event_name != 'pull_request'", False),
        ("    if: ${{ !github.event.pull_request.head.repo.fork }}", False),
        (
            "    if: github.event.pull_request.head.repo.full_name == github.repository",
            False,
        ),
        (
            "    if: >-\n      github.event_name != 'pull_request'\n"
            "      || (contains(github.event.pull_request.labels.*.name, 'gpu-tests')\n"
            "          && !github.event.pull_request.head.repo.fork)",
            False,
        ),
        (
            "    if: github.event_name != 'pull_request' || "
            "contains(github.event.pull_request.labels.*.name, 'gpu-tests')",
            True,
        ),
    ],
)
def test_the_check_tells_guarded_jobs_from_open_ones(condition, open_to_forks):
    text = SELF_HOSTED_ON_PULL_REQUESTS.format(condition=condition)
    assert bool(self_hosted_jobs_open_to_forks(text)) is open_to_forks


def test_a_github_hosted_job_may_run_for_any_pull_request():
    text = SELF_HOSTED_ON_PULL_REQUESTS.format(condition="").replace(
        '[self-hosted, "${{ matrix.runner }}"]', "ubuntu-latest"
    )
    assert self_hosted_jobs_open_to_forks(text) == []


def test_ci_runs_the_lint_session_and_a_cpu_session_for_pushes_and_pull_requests():
    ci = yaml.safe_load((WORKFLOWS / "ci.yml").read_text())
    assert {"push", "pull_request"} <= set(_triggers(ci))
    commands = {
        name: [step.get("run", "") for step in job["steps"]] for name, job in ci["jobs"].items()
    }
    assert all(
        "self-hosted" not in _labels(job["runs-on"]) for job in ci["jobs"].values()
    )  # GitHub-hosted runners only
    run_ci = (ROOT / ".ci" / "run").read_text()
    assert "-s lint" in run_ci and "nox --non-interactive -s lint" in commands["lint"]
    # the same nox and uv pins as .ci/run
    pins = re.search(r"pip install .*?(nox==\S+ uv==\S+)", run_ci)
    assert pins is not None
    assert all(
        any(pins.group(1) in command for command in job_commands)
        for job_commands in commands.values()
    )
    assert any(
        re.fullmatch(r"nox --non-interactive -s vllm-[\d.]+", c) for c in commands["cpu-tests"]
    )
    assert ci["jobs"]["cpu-tests"]["needs"] == "lint"


@pytest.mark.parametrize("workflow", ["ci.yml", "release.yml"])
def test_lint_takes_actionlint_from_its_official_release_with_a_pinned_checksum(workflow):
    ci = yaml.safe_load((WORKFLOWS / "ci.yml").read_text())
    linted = yaml.safe_load((WORKFLOWS / workflow).read_text())
    assert re.fullmatch(r"\d+\.\d+\.\d+", linted["env"]["ACTIONLINT_VERSION"])
    assert re.fullmatch(r"[0-9a-f]{64}", linted["env"]["ACTIONLINT_SHA256"])
    pins = ("ACTIONLINT_VERSION", "ACTIONLINT_SHA256")
    assert [linted["env"][p] for p in pins] == [ci["env"][p] for p in pins]  # one pin
    script = next(
        s["run"] for s in linted["jobs"]["lint"]["steps"] if "rhysd/actionlint" in s.get("run", "")
    )
    assert "https://github.com/rhysd/actionlint/releases/download/" in script
    assert "sha256sum --check --strict" in script
    # the checksum is checked before the archive is unpacked or run
    assert (
        script.index("sha256sum")
        < script.index("tar -xzf")
        < script.index('"$RUNNER_TEMP/actionlint"')
    )
