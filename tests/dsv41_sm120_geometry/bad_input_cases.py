"""The DeepSeek-V4.1 fix's part of ``tests/test_bad_inputs.py``: its command
(``selftest``), that command's bad arguments, and its settings' invalid values
(set in the shared status runs, which load vLLM once each)."""

from __future__ import annotations

from bad_input_runs import case

COMMANDS = ("selftest",)
ARGUMENT_CASES = [
    case("selftest --jobs 0", 2, "argument --jobs: 0 is not positive (allowed: 1 to 256)"),
    case("selftest --jobs -1", 2, "argument --jobs: -1 is not positive"),
    case("selftest --jobs many", 2, "argument --jobs: 'many' is not a whole number"),
    case("selftest --json --jobs 0", 2, "argument --jobs: 0 is not positive"),
    case("selftest --geometry bogus", 2, "argument --geometry: invalid choice: 'bogus'"),
    case("selftest --report", 2, "argument --report: expected one argument"),
    case(
        "selftest --json --report /no/such/folder/selftest.json",
        2,
        "--report '/no/such/folder/selftest.json': its folder does not exist",
    ),
    case("selftest --bogus", 2, "unrecognized arguments: --bogus"),
    case("selftest --json --report {root}", 2, "--report '{root}': it is a folder; give a file"),
    case("selftest --report {text}/report.json", 2, "its folder does not exist"),
    case("status --truth-table", 2, "--truth-table adds to the JSON document: give --json too"),
]
GEOMETRY = "VLLM_MLA_FIXES_DSV41_GEOMETRY"
DRAFTER = "VLLM_MLA_FIXES_DSV41_DRAFTER_SWA_ROWS"
# What each shared status run sets besides the shared settings.
STATUS_RUN_SETTINGS = {
    "human-1": {GEOMETRY: "garbage", DRAFTER: "7"},
    "json-1": {DRAFTER: "-1"},
    "human-2": {DRAFTER: "abc", GEOMETRY: "split"},
}
SETTING_CASES = [
    ("human-1", GEOMETRY, "not a geometry name"),
    ("human-1", DRAFTER, "not a page size a drafter's pages can take"),
    ("json-1", DRAFTER, "not a page size a drafter's pages can take"),
    ("human-2", DRAFTER, "not a page size a drafter's pages can take"),
    ("human-2", GEOMETRY, "not a geometry name"),
]
READ_ONLY_OUTPUTS = {
    "selftest --report": ("selftest", "--json", "--report", "{folder}/selftest.json")
}
