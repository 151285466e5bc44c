"""doctor tells one story per report (issue 36), over a matrix of real runs.

Each case is a doctor run on a real vLLM release (no GPU visible here): a
release, the plugin's settings (fixes on or off, the hub offline) and a serve
line, or none.  Every check below reads one report, its text and its JSON
together, and looks for two lines that disagree:

- the verdict is the report's last word, and its first error or warning;
- a fix that the serving node does not apply describes no layout as the line's;
- a workaround called sufficient is not then failed or recommended again;
- the GPU wording matches whether a GPU is visible;
- one capacity figure never appears with two values, nor without its baseline
  where the report gives it two;
- with no serve line, nothing speaks of "the serve line";
- every command doctor prints is run by a test on a machine without a GPU
  (``TESTED_HERE`` names the test), or says where it must run, and why.

The runs of one release and one setting share an interpreter (one vLLM
import), calling doctor's own ``diagnose`` and ``report`` as the CLI does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doctor_runs import serve_of
from fix_releases import covered_by
from json_schemas import schema_problems

from vllm_mla_fixes.doctor import EXIT_STATUS, LOCAL_MODEL_PLACEHOLDER
from vllm_mla_fixes.fixes.dsv41_sm120_geometry import dspark_long_prompt
from vllm_mla_fixes.report import Environment, Finding

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "vllm_mla_fixes" / "models"
DSV41_TOPIC = "dsv41-sm120-geometry"

GLM_FP8 = [str(MODELS / "tiny_glm_moe_dsa"), "--kv-cache-dtype", "fp8"]
MLA = [str(MODELS / "tiny_deepseek_v3_mla")]
DSV41 = [str(MODELS / "tiny_deepseek_v41")]
WARMUP_OFF = ["--kernel-config", '{"enable_cutedsl_warmup": false}']
RAGGED = ["--attention-config", '{"mla_prefill_backend": "TRTLLM_RAGGED"}']
DSPARK = ["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}']
# the docs' line for DeepSeek-V4.1, by its hub name
DOCS_LINE = [
    "deepseek-ai/DeepSeek-V4.1-Flash",
    "--tensor-parallel-size",
    "8",
    "--kv-cache-dtype",
    "fp8",
    "--attention-config",
    '{"indexer_kv_dtype": "fp8"}',
    "--block-size",
    "64",
    *DSPARK,
]
# the speculative config (vllm#56771), and doctor's advice for short prompts
DSPARK_5 = ["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 5}']
SHORT_PROMPTS = dspark_long_prompt.SHORT_PROMPTS_FLAG.split()
# (canonical flags, a spelling vLLM's parser reads as the same), each failing on SM120
MXFP4 = '{"indexer_kv_dtype": "mxfp4"}'
SPELLINGS = (
    (("--attention-config", MXFP4), ("-ac", MXFP4)),
    (("--moe-backend", "triton"), ("--moe_backend", "triton")),
)
FIXES_OFF = (("VLLM_MLA_FIXES", "none"),)
OFFLINE = (("HF_HUB_OFFLINE", "1"),)  # and an empty Hugging Face home


@dataclasses.dataclass(frozen=True)
class Case:
    release: str
    name: str
    line: tuple[str, ...] = ()
    setting: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.release} {self.name}"


CASES = [
    Case("0.25.1", "no line"),
    Case("0.25.1", "GLM fp8", tuple(GLM_FP8)),
    Case("0.25.1", "GLM fp8, fixes off", tuple(GLM_FP8), FIXES_OFF),
    Case("0.25.1", "MLA warm-up off", (*MLA, *WARMUP_OFF)),
    Case("0.25.1", "MLA warm-up off, fixes off", (*MLA, *WARMUP_OFF), FIXES_OFF),
    Case("0.25.1", "MLA TRTLLM_RAGGED, fixes off", (*MLA, *RAGGED), FIXES_OFF),
    Case(
        "0.25.1",
        "GLM hub name offline",
        ("zai-org/GLM-5.1-FP8", "--kv-cache-dtype", "fp8"),
        OFFLINE,
    ),
    Case("0.32.0", "no line"),
    Case("0.32.0", "GLM fp8", tuple(GLM_FP8)),
    Case("0.32.0", "DSV4.1 block 64", (*DSV41, "--block-size", "64")),
    Case("0.32.0", "DSV4.1 block 64, fixes off", (*DSV41, "--block-size", "64"), FIXES_OFF),
    Case("0.33.0", "DSV4.1 block 128", (*DSV41, "--block-size", "128")),
    Case("0.33.0", "DSV4.1 docs line offline", tuple(DOCS_LINE), OFFLINE),
    Case("0.34.0", "no line"),
    Case("0.34.0", "DSV4.1 block 64", (*DSV41, "--block-size", "64")),
    Case("0.34.0", "DSV4.1 block 128 DSpark", (*DSV41, "--block-size", "128", *DSPARK)),
    # vllm#56771: DSpark on SM12x, each tensor-parallel size on each release it is reported on
    *(
        Case(release, f"DSV4.1 DSpark tp {tp}", (*DSV41, "-tp", str(tp), *DSPARK_5))
        for release in dspark_long_prompt.AFFECTED_RELEASES
        for tp in (1, 2, 4, 8)
    ),
    Case("0.32.0", "DSV4.1 DSpark tp 4, fixes off", (*DSV41, "-tp", "4", *DSPARK_5), FIXES_OFF),
    Case("0.34.0", "DSV4.1 DSpark short prompts", (*DSV41, *DSPARK_5, *SHORT_PROMPTS)),
    # issue 43: spellings vLLM reads as the canonical flags (doctor read them otherwise)
    *(
        Case("0.34.0", f"DSV4.1 {' '.join(flags)}", (*DSV41, *flags))
        for pair in SPELLINGS
        for flags in pair
    ),
]

# One interpreter per release and setting: doctor's diagnose and report, as the CLI calls them.
RUNNER = r"""
import json, sys
from vllm_mla_fixes import cli, doctor
reports = []
for line in json.loads(sys.argv[1]):
    with cli.logs_to_stderr():
        env, serve, findings = doctor.diagnose(line)
    text, document = [], []
    status = doctor.report(env, serve, findings, print_=text.append)
    doctor.report(env, serve, findings, as_json=True, print_=document.append)
    loaded = sorted(name for name in sys.modules if ".reproductions." in name)
    reports.append(
        {"text": text, "json": json.loads(document[0]), "status": status, "loaded": loaded}
    )
print(json.dumps(reports))
"""


@dataclasses.dataclass
class Report:
    case: Case
    text: list[str]
    json: dict
    status: int
    reproductions_loaded: list[str] = dataclasses.field(default_factory=list)

    @property
    def findings(self) -> list[dict]:
        return self.json["findings"]

    def gpu_visible(self) -> bool:
        return self.json["environment"]["capability"] is not None


def _run_setting(release: str, setting: tuple, cases: list[Case], hub: Path) -> list[Report]:
    # the case's setting alone: none of this package's settings, nor VLLM_PLUGINS,
    # inherited from the worker (CI run 9: one left in it gave the DSpark
    # short-prompt case a first finding of 'info')
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "VLLM_PLUGINS" and not k.startswith("VLLM_MLA_FIXES")
    }
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **dict(setting))
    if dict(setting).get("HF_HUB_OFFLINE"):
        env.pop("HF_HUB_CACHE", None)
        env["HF_HOME"] = str(hub)
    lines = [["vllm", "serve", *case.line] if case.line else [] for case in cases]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(lines)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600 * len(cases),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    return [
        Report(case, run["text"], run["json"], run["status"], run["loaded"])
        for case, run in zip(cases, runs)
    ]


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory) -> dict[str, Report]:
    """Every case of this session's release, by its id."""
    release = request.config.vllm_release
    mine = [case for case in CASES if case.release == release]
    found: dict[str, Report] = {}
    for setting in dict.fromkeys(case.setting for case in mine):
        same = [case for case in mine if case.setting == setting]
        hub = tmp_path_factory.mktemp("empty-hf-home")
        found.update({r.case.id: r for r in _run_setting(release, setting, same, hub)})
    return found


# -- the checks: each returns what disagrees in one report ---------------------------


def verdict_is_the_last_word(report: Report) -> list[str]:
    document = report.json
    errors = [f for f in report.findings if f["level"] == "error"]
    warnings = [f for f in report.findings if f["level"] == "warn"]
    first = (errors or warnings)[:1]
    reason = f"{first[0]['topic']}: {first[0]['message']}" if first else ""
    label = document["verdict"]
    said = f"WILL FAIL: {reason}" if label == "WILL FAIL" else label
    problems = []
    if (document["reason"], report.text[-1], report.status) != (reason, said, EXIT_STATUS[label]):
        problems.append(f"verdict {said!r} / {document['reason']!r} / exit {report.status}")
    return problems


# What a fix says it lays out for the line.
LAYOUT_CLAIM = re.compile(r"gets the [\w-]+ geometry|the fix lays out|capacity of that geometry")


def geometry_agrees_with_verdict(report: Report) -> list[str]:
    """A fix the serving node does not apply lays out nothing for the line."""
    states = report.json["environment"]["fix_states"]
    off = {name for name, state in states.items() if state["state"] == "disabled"}
    return [
        f"{f['topic']} is disabled, yet: {f['message'][:160]}"
        for f in report.findings
        if f["topic"] in off and LAYOUT_CLAIM.search(f["message"])
    ]


SUFFICIENT = re.compile(r"\(the workaround\) avoids|avoids the crash")
QUOTED_FLAG = re.compile(r"(--[a-z][\w-]*) '([^']*)'")


def workaround_not_failed(report: Report) -> list[str]:
    """A workaround called sufficient: its fix has no error, and no advice
    recommends a flag the line already carries."""
    covered = {f["topic"] for f in report.findings if SUFFICIENT.search(f["message"])}
    line = report.json["serve"]["raw"] if report.json["serve"] else []
    given = {(flag, json.dumps(_json_or_text(value))) for flag, value in zip(line, line[1:])}
    problems = [
        f"{f['topic']}: workaround called sufficient, then [FAIL] {f['message'][:120]}"
        for f in report.findings
        if f["topic"] in covered and f["level"] == "error"
    ]
    for f in report.findings:
        recommended = [c for c in advice_clauses(f["advice"]) if c.startswith("--")]
        for flag, value in QUOTED_FLAG.findall(" ".join(recommended)):
            if (flag, json.dumps(_json_or_text(value))) in given:
                problems.append(f"{f['topic']}: recommends {flag} {value}, already on the line")
    return problems


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


NEEDS_A_VISIBLE_GPU = re.compile(r"\bthis GPU\b|run doctor on the (?:GPU|serving) node")
SAYS_NO_GPU = re.compile(r"GPU not visible|no GPU is visible|none visible")


def gpu_wording(report: Report) -> list[str]:
    """Where no GPU is visible, nothing speaks of "this GPU"; where one is,
    nothing says none is."""
    wrong = SAYS_NO_GPU if report.gpu_visible() else NEEDS_A_VISIBLE_GPU
    return [
        f"{f['topic']}: {said.group(0)!r} in {text[:160]!r}"
        for f in report.findings
        for text in (f["message"], f["advice"])
        if (said := wrong.search(text))
    ]


RATIO = re.compile(r"(?<!at least )(?<!least the )\b(\d+\.\d{3})x")
MAX_MODEL_LEN = re.compile(r"max_model_len (\d+)")
BASELINE = re.compile(r"--block-size (\d+)")


def capacity_figures(message: str) -> list[tuple[str | None, str, str]]:
    """Each capacity ratio in a finding (three decimals; a rule such as "at
    least 1.02x" is no figure): (max_model_len, baseline, value).  Its
    max_model_len is the nearest one named before it, else after it; its
    baseline is the --block-size named in its own clause, else "unnamed"."""
    figures = []
    for match in RATIO.finditer(message):
        before = MAX_MODEL_LEN.findall(message[: match.start()])
        after = MAX_MODEL_LEN.findall(message[match.end() :])
        length = before[-1] if before else (after[0] if after else None)
        clause = re.split(r";|\d\.\d{3}x", message[match.end() :], maxsplit=1)[0]
        named = BASELINE.search(clause)
        figures.append((length, named.group(1) if named else "unnamed", match.group(1)))
    return figures


def capacity_figures_agree(report: Report) -> list[str]:
    """One figure (max_model_len, baseline) has one value in a report, and a
    ratio without its baseline is only printed where it cannot be misread."""
    values: dict[tuple, set[str]] = {}
    for f in report.findings:
        for length, baseline, value in capacity_figures(f["message"]):
            values.setdefault((length, baseline), set()).add(value)
    problems = [f"{key}: {sorted(v)}" for key, v in values.items() if len(v) > 1]
    for (length, baseline), unnamed in values.items():
        if baseline != "unnamed":
            continue
        at_length = set().union(*(v for (n, _), v in values.items() if n == length))
        if len(at_length) > 1:
            problems.append(
                f"max_model_len {length}: {sorted(unnamed)} printed without a baseline, "
                f"beside {sorted(at_length)}"
            )
    return problems


def no_line_no_line_talk(report: Report) -> list[str]:
    if report.json["serve"] is not None:
        return []
    return [
        f"{f['topic']}: {text[:160]!r}"
        for f in report.findings
        for text in (f["message"], f["advice"])
        if re.search(r"\bserve line\b|\bthis line\b", text)
    ]


# Each command doctor prints that a test runs on a machine without a GPU: its
# first words, and the test.  Serve flags are checked by each release's own
# config classes.  What cannot run here says where (report.ELSEWHERE).
TESTED_HERE = {
    "pip install ": "test_cli_contract.py installs a checkout",
    "pip uninstall -y ": "test_doctor.py::test_remedy_*",
    "export VLLM_PLUGINS=": "test_doctor.py::test_glm_line_without_the_plugin_*, "
    "test_printed_values.py::test_the_remedy_doctor_prints_gets_the_fix_applied (run by bash)",
    "export VLLM_MLA_FIXES=": "test_enable_all_advice_applies_the_fixes, below",
    "vllm-mla-fixes status": "the README's tested block",
    "vllm-mla-fixes doctor ": "test_offline_advice_runs_on_a_local_folder, below",
    "--attention-config ": "test_doctor.py::test_remedy_*_flags_are_valid_serve_flags",
    "--kernel-config ": "test_doctor.py::test_remedy_fa4_workaround_flags_are_valid_serve_flags",
    "--moe-backend ": "test_doctor.py::test_remedy_dsv41_flags_are_valid_serve_flags",
    "--max-model-len ": "test_dspark_short_prompt_advice_takes_the_warning_away, below",
    "vllm-mla-fixes selftest --geometry dspark-long-prefill": "test_dspark_long_prompt_evidence.py"
    "::test_the_printed_dspark_check_command_runs_and_passes_here",
}
COMMAND_START = re.compile(
    r"(pip |export |unset |vllm-mla-fixes |vllm serve|flashinfer |python |--[a-z])"
)


def advice_clauses(advice: str) -> list[str]:
    """The alternatives and steps of one advice, each stripped of its lead-in."""
    parts = re.split(r";\s*(?:or |then )?|,\s*or |\s+&&\s+", advice)
    return [re.sub(r"^(?:or )?[\w ]*: ", "", part.strip()) for part in parts if part.strip()]


def commands_run_or_say_where(report: Report) -> list[str]:
    problems = []
    for f in report.findings:
        if not f["advice"]:
            continue
        commands = [c for c in advice_clauses(f["advice"]) if COMMAND_START.match(c)]
        if not commands:
            problems.append(f"{f['topic']}: advice is no command: {f['advice'][:120]!r}")
        for command in commands:
            tested = any(command.startswith(start) for start in TESTED_HERE)
            placed = any(
                command.startswith(p) for p in re.findall(r"`([^`]+)`", f["runs_elsewhere"])
            )
            if not (tested or placed):
                problems.append(f"{f['topic']}: neither run by a test nor placed: {command!r}")
    return problems


def json_matches_its_schema(report: Report) -> list[str]:
    """doctor --json has every documented key and no other (issue 44)."""
    return schema_problems("doctor", report.json)


def loads_no_reproduction(report: Report) -> list[str]:
    """doctor sits below the reproductions (issue 45): the SM120 engine config
    its prediction builds is ``dsv41_sm120_geometry.simulated``'s, so no
    reproduction module is loaded by a doctor run (its interpreter, up to this report)."""
    return [f"doctor loaded {name}" for name in report.reproductions_loaded]


CHECKS = {
    check.__name__: check
    for check in (
        json_matches_its_schema,
        loads_no_reproduction,
        verdict_is_the_last_word,
        geometry_agrees_with_verdict,
        workaround_not_failed,
        gpu_wording,
        capacity_figures_agree,
        no_line_no_line_talk,
        commands_run_or_say_where,
    )
}

# DeepSeek-V4.1's own findings, which its decision rewrite replaces (issue 36:
# not changed here): each case and check they still fail.  strict: once the
# rewrite fixes one, its entry must go.
DSV41_REWRITE = "DeepSeek-V4.1's doctor findings: the decision rewrite (issue 36)"
KNOWN: set[tuple[str, str]] = set()


def _matrix():
    for case in CASES:
        for name in CHECKS:
            marks = [pytest.mark.vllm_release(case.release)]
            if (case.id, name) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=DSV41_REWRITE))
            yield pytest.param(case.id, name, marks=marks, id=f"{case.id} :: {name}")


@pytest.mark.parametrize(("case_id", "check"), _matrix())
def test_report_tells_one_story(reports, case_id, check):
    report = reports[case_id]
    problems = CHECKS[check](report)
    assert not problems, "\n".join([*problems, "", *report.text])


# -- the checks see what the issue saw ------------------------------------------------


def _environment(gpu: tuple | None = None, fix_states: dict | None = None) -> Environment:
    return Environment(
        packages={"vllm": "0.25.1", "vllm-mla-fixes": "0.1.0"},
        gpu=gpu[0] if gpu else None,
        capability=gpu[1] if gpu else None,
        torch_cuda="13.0",
        vllm_plugins=None,
        mla_fixes=None,
        fix_states=fix_states or {},
    )


def _report_of(findings: list[Finding], line: list[str] | None = None, env=None) -> Report:
    """doctor's own report (text and JSON) of ``findings``."""
    from vllm_mla_fixes import doctor

    env = env or _environment()
    serve = serve_of(["vllm", "serve", *line]) if line else None
    text: list[str] = []
    document: list[str] = []
    status = doctor.report(env, serve, findings, print_=text.append)
    doctor.report(env, serve, findings, as_json=True, print_=document.append)
    return Report(Case("-", "-"), text, json.loads(document[0]), status)


def test_capacity_check_catches_one_figure_with_two_values():
    """0.34.0 --block-size 128 with DSpark, as the issue quotes it: "would hold
    1.066x its KV tokens", then 1.051x for the same max_model_len."""
    findings = [
        Finding(
            "info", "t", "the fix's layout would hold 1.066x its KV tokens at max_model_len 8192"
        ),
        Finding(
            "info",
            "t",
            "max_model_len 8192: 67,209 tokens = 1.051x upstream --block-size 128 (63,944) "
            "and 1.066x --block-size 64 (63,050), at least the 1.02x of the rule",
        ),
    ]
    (problem,) = capacity_figures_agree(_report_of(findings))
    assert "printed without a baseline" in problem and "1.051" in problem
    named = [findings[1], Finding("info", "t", "max_model_len 8192: 1.052x --block-size 128")]
    (problem,) = capacity_figures_agree(_report_of(named))
    assert "('8192', '128'): ['1.051', '1.052']" in problem


# the warm-up flag's releases: vLLM's own parser reads the line (older ones reject the key)
@pytest.mark.vllm_release(*covered_by("fa4-compile-strides")[-1:])
def test_workaround_check_catches_a_flag_recommended_again():
    line = [*MLA, *WARMUP_OFF]
    findings = [
        Finding("info", "fix", "enable_cutedsl_warmup=false (the workaround) avoids the crash"),
        Finding(
            "error",
            "fix",
            "not applied",
            f"or work around it: {' '.join(WARMUP_OFF[:1])} '{WARMUP_OFF[1]}' (a JIT stall)",
        ),
    ]
    problems = workaround_not_failed(_report_of(findings, line))
    assert len(problems) == 2, problems


# -- a GPU visible: the fixes' findings say "this GPU", never "no GPU" ---------------

GPUS = {"B200": ("NVIDIA B200", (10, 0)), "H200": ("NVIDIA H200", (9, 0))}


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("state", ["applied", "disabled", "skipped"])
def test_gpu_wording_where_a_gpu_is_visible(gpu, state):
    """fa4-compile-strides and fp8-ds-mla-reshape on a GLM fp8 line, their
    states as the plugin may give them on that GPU."""
    from vllm_mla_fixes.fixes import fa4_compile_strides, fp8_ds_mla_reshape

    reason = {"skipped": "cannot probe here: no FA4 extension", "disabled": "not selected"}
    fixes = (fa4_compile_strides, fp8_ds_mla_reshape)
    states = {f.INFO.name: {"state": state, "reason": reason.get(state, "probe")} for f in fixes}
    env = _environment(GPUS[gpu], states)
    serve = serve_of(["vllm", "serve", *GLM_FP8])
    findings = [finding for fix in fixes for finding in fix.diagnose(env, serve)]
    seen = _report_of(findings, GLM_FP8, env)
    assert seen.gpu_visible()
    assert not gpu_wording(seen), gpu_wording(seen)
    assert not commands_run_or_say_where(seen), commands_run_or_say_where(seen)


# -- the commands doctor prints, run ---------------------------------------------------


def _shell(command: str, **env: str) -> subprocess.CompletedProcess:
    """``command`` in bash, with this environment's commands first on PATH."""
    full = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_MLA_FIXES")}
    full.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(ROOT),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        **env,
    )
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        env=full,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )


@pytest.mark.vllm_release("0.25.1")
def test_offline_advice_runs_on_a_local_folder(reports, tmp_path):
    """The hub out of reach: doctor says so, not "correct the line", and its
    advice -- the same check on a local folder -- runs as printed."""
    report = reports["0.25.1 GLM hub name offline"]
    (offline,) = [f for f in report.findings if f["topic"] == "model"]
    assert offline["level"] == "warn"
    assert offline["message"].startswith(
        "cannot check the model's config: offline (HF_HUB_OFFLINE or no network); pass a local path"
    )
    assert "correct the line" not in json.dumps(report.json)
    command = offline["advice"].replace(
        LOCAL_MODEL_PLACEHOLDER, shlex.quote(str(MODELS / "tiny_glm_moe_dsa"))
    )
    done = _shell(command, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert done.returncode in (0, 1), done.stdout + done.stderr[-3000:]
    assert "config.json in the model folder" in done.stdout
    assert "cannot check the model's config" not in done.stdout


@pytest.mark.vllm_release(*covered_by("fp8-ds-mla-reshape")[-1:])
def test_enable_all_advice_applies_the_fixes(reports):
    """VLLM_MLA_FIXES=none: the advice doctor prints for a disabled fix, run as printed."""
    report = reports["0.25.1 GLM fp8, fixes off"]
    advice = {f["advice"] for f in report.findings if f["topic"] == "fp8-ds-mla-reshape"} - {""}
    (printed,) = advice
    command = printed.split("   (")[0]
    assert command == "export VLLM_MLA_FIXES=all"
    done = _shell(f"{command} && vllm-mla-fixes status --json", VLLM_MLA_FIXES="none")
    states = {fix["name"]: fix["state"] for fix in json.loads(done.stdout)["fixes"]}
    assert states["fp8-ds-mla-reshape"] == "applied", done.stdout


# -- vllm#56771: a DSpark line on SM12x ------------------------------------------------

DSPARK_CASES = [c for c in CASES if "DSpark tp" in c.name]


@pytest.mark.parametrize(
    "case_id", [pytest.param(c.id, marks=pytest.mark.vllm_release(c.release)) for c in DSPARK_CASES]
)
def test_a_dspark_sm12x_line_is_not_ready(reports, case_id):
    """Red before issue 42: doctor said READY for the issue's line (0.34.0,
    -tp 4, DSpark with 5 tokens), which the field reports crashing on long
    prompts.  With the fixes on or off, the line is not READY, and the
    warning names the report, the length and the ways out."""
    report = reports[case_id]
    assert report.json["verdict"] != "READY", report.text
    (warning,) = [f for f in report.findings if dspark_long_prompt.UPSTREAM_REPORT in f["message"]]
    assert warning["level"] == "warn"
    assert f"{dspark_long_prompt.REPORTED_PROMPT_TOKENS:,} tokens" in warning["message"]
    assert "--speculative-config" in warning["advice"]
    assert dspark_long_prompt.SHORT_PROMPTS_FLAG in warning["advice"]
    # the GPU check it names: placed on the GPU node, run by
    # tests/dsv41_sm120_geometry/gpu/test_dsv41_sm120_gpu.py::test_dspark_long_prefill_*
    assert dspark_long_prompt.SELFTEST_COMMAND in warning["advice"]
    assert "`vllm-mla-fixes selftest` runs on the GPU node" in warning["runs_elsewhere"]


@pytest.mark.vllm_release("0.34.0")
def test_dspark_short_prompt_advice_takes_the_warning_away(reports):
    """The advice, applied to the line as printed, is accepted by vLLM's
    parser (doctor's first finding) and leaves no vllm#56771 warning."""
    report = reports["0.34.0 DSV4.1 DSpark short prompts"]
    (parsed,) = [f for f in report.findings if f["topic"] == "serve line"]
    assert parsed["level"] == "ok", parsed  # vLLM's parser accepts the line
    (note,) = [f for f in report.findings if dspark_long_prompt.UPSTREAM_REPORT in f["message"]]
    assert note["level"] == "info", note
    assert report.json["verdict"] == "READY", report.text


@pytest.mark.vllm_release("0.34.0")
def test_no_dspark_finding_without_dspark(reports):
    report = reports["0.34.0 DSV4.1 block 64"]
    assert not any(dspark_long_prompt.UPSTREAM_REPORT in f["message"] for f in report.findings)


@pytest.mark.vllm_release("0.34.0")
@pytest.mark.parametrize("canonical, spelling", SPELLINGS, ids=lambda flags: " ".join(flags))
def test_a_spelling_vllm_accepts_gets_the_canonical_verdict(reports, canonical, spelling):
    """Red before issue 43: doctor's own argparse read ``-ac`` and
    ``--moe_backend`` as nothing and said READY.  The spelling now gets the
    canonical line's WILL FAIL, with the same findings."""
    judged = [reports[f"0.34.0 DSV4.1 {' '.join(flags)}"] for flags in (canonical, spelling)]
    assert judged[0].json["verdict"] == "WILL FAIL", judged[0].text
    assert [r.findings for r in judged[1:]] == [judged[0].findings]
    assert [r.json["reason"] for r in judged[1:]] == [judged[0].json["reason"]]


@pytest.mark.vllm_release("0.34.0")
def test_the_json_gives_the_figure_and_the_words_the_text_gives(reports):
    """--block-size 128 on 0.34.0 (issue 44): the text compares the fix with
    upstream's working --block-size 64 layout, and the JSON carries that
    figure; upstream's start error is vLLM's own exception text."""
    from vllm_mla_fixes.fixes.dsv41_sm120_geometry.reproductions.failures import SPLIT_ERROR

    report = reports["0.34.0 DSV4.1 block 128 DSpark"]
    facts = report.json["dsv41"]
    assert facts["upstream_start_error"] == SPLIT_ERROR
    assert facts["best_working_upstream_block_size"] == 64
    assert facts["vs_best_working_upstream"] is not None and facts["vs_upstream"] is None
    assert any("upstream's working --block-size 64 layout" in f["message"] for f in report.findings)
