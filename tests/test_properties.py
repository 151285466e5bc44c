"""Bad input by properties, not by cases (issue 35).

Hypothesis generates command lines for every command (read from the real
parser, so a new option is generated too), values of every
``VLLM_MLA_FIXES*`` variable, ``config.json`` contents (wrong types,
encodings, nesting, missing fields) and ``vllm serve`` lines.  Each input
runs as a process of its own (``cli_worker.py`` forks one per input from a
process that imported vLLM once), and every outcome must keep the CLI's
contract:

* no traceback, and no "internal error" (the CLI's last-resort line);
* an exit status in the documented set, 0, 1 or 2, with one meaning in
  every command: 2 is input the command refuses (bad arguments, a setting
  that is not allowed, a line vLLM refuses), never 0 with an error line;
* at most one error line on stderr, and where there is one, it names the
  cause (a usage error is status 2, and says which argument);
* with ``--json``, one JSON document on stdout, an error included, whose
  ``exit_status`` is the process's.

And the properties of issue 35 itself: no setting turns off a fix that
would otherwise apply (the cache folder least of all: a folder that cannot be
used warns once, naming the variable); doctor never says READY for a line
the installed vLLM refuses to build an engine config for.

Examples are bounded (``EXAMPLES``) to keep the file near a minute where
fixes apply, and a quarter of that elsewhere; the example database is off, so nothing is written into
the checkout.  Each test records how many inputs it generated, and the
session's summary prints the total (``conftest.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from fix_releases import newest_covered, newest_of_earliest_fix
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from json_schemas import schema_problems

from vllm_mla_fixes import cli
from vllm_mla_fixes import settings as plugin_settings
from vllm_mla_fixes.fixes import ALL_FIXES, FIX_NAMES, SELECTION, SELFTEST_RELEASES, SETTINGS

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "cli_worker.py"
TINY_GLM = ROOT / "vllm_mla_fixes" / "models" / "tiny_glm_moe_dsa"
DOCUMENTED_EXIT = {0, 1, 2}
FULL_EXAMPLES = {"argv": 120, "settings": 20, "cache_dir": 30, "config": 25, "serve_line": 25}
# Every session runs the suite; the sessions of the 0.25 fixes and of the
# newest release a fix covers run it in full, the others a quarter of it (the
# contract is this package's; a release changes which fixes it meets).
FULL_ON = (newest_of_earliest_fix(), newest_covered())
SHARE = 1 if version("vllm") in FULL_ON else 4
EXAMPLES = {kind: max(5, count // SHARE) for kind, count in FULL_EXAMPLES.items()}
PROPERTY = settings(
    database=None,  # no .hypothesis folder in the checkout
    deadline=None,  # each example is a process; its time is the worker's timeout
    derandomize=True,  # the same examples in every session and CI run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# -- the worker -----------------------------------------------------------------------------


class Worker:
    def __init__(self, log: Path) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("VLLM_MLA_FIXES") and k not in ("VLLM_PLUGINS", "SOURCE_DATE_EPOCH")
        }
        # no network: a hub model is looked for in the hub cache only
        env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        self.stderr = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
            cwd=ROOT,
        )
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the worker stopped; its log: {self.stderr.name}"
        return line

    def run(self, request: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)
        self.stderr.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    running = Worker(tmp_path_factory.mktemp("worker") / "worker.log")
    yield running
    running.close()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Files and URLs the generated command lines refer to as {name}."""
    import socket

    root = tmp_path_factory.mktemp("inputs")
    garbage = root / "vllm-0.25.1-py3-none-any.whl"
    garbage.write_bytes(b"a truncated download, not a zip")
    small = root / "small" / "vllm-0.25.1-py3-none-any.whl"
    small.parent.mkdir()
    with zipfile.ZipFile(small, "w") as archive:
        archive.writestr("vllm/__init__.py", "")
        archive.writestr(
            "vllm-0.25.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.1\n"
        )
    text = root / "notes.txt"
    text.write_text("not a wheel\n")
    (root / "folder").mkdir()
    good_yaml = root / "serve.yaml"
    good_yaml.write_text("max-num-seqs: 8\n")
    bad_yaml = root / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n  tp: : 3\n")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return {
        "root": str(root),
        "garbage": str(garbage),
        "small": str(small),
        "text": str(text),
        "folder": str(root / "folder"),
        "good_yaml": str(good_yaml),
        "bad_yaml": str(bad_yaml),
        "closed": closed,
        "tiny": str(TINY_GLM),
    }


# -- the contract every outcome keeps ---------------------------------------------------------


def _own(argv: list[str]) -> list[str]:
    return argv[: argv.index("--")] if "--" in argv else argv


def assert_contract(argv: list[str], outcome: dict) -> dict | None:
    """The CLI's contract for one run; returns the JSON document in a JSON mode."""
    out, err, status = outcome["stdout"], outcome["stderr"], outcome["status"]
    shown = f"argv={argv!r}\nstatus={status}\nstdout={out[-2000:]}\nstderr={err[-3000:]}"
    assert "Traceback" not in out + err and "internal error" not in err, shown
    assert status in DOCUMENTED_EXIT, shown
    errors = [
        ln for ln in err.splitlines() if ln.startswith("vllm-mla-fixes") and ": error: " in ln
    ]
    assert len(errors) <= 1, shown
    if errors:
        cause = errors[0].split(": error: ", 1)[1]
        assert status != 0 and len(cause.strip()) > 8, shown  # it names something
        if "(see vllm-mla-fixes" in cause:  # argparse's refusal: bad arguments
            assert status == 2, shown
    own = _own(argv)
    if {"-h", "--help", "--version"} & set(own) or not cli._json_mode(argv):
        if errors and status == 2:
            assert out == "", shown  # a refused command prints nothing but the line
        return None
    document = json.loads(out)  # exactly one document, errors included
    assert isinstance(document, dict), shown
    if "exit_status" in document:
        assert document["exit_status"] == status, shown
    if "error" in document:
        assert errors and document["error"] == errors[0].split(": error: ", 1)[1], shown
    command = next((word for word in own if not word.startswith("-")), "")
    if command in ("status", "doctor"):
        assert not schema_problems(command, document), (schema_problems(command, document), shown)
    return document


# -- command lines for every command ------------------------------------------------------------

JUNK = st.one_of(
    st.sampled_from(["", " ", "-", "--", "--bogus", "-x", "=", "\n", "é", "\udcff", "0", "-1"]),
    st.text(
        alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
        max_size=12,
    ),
)
NUMBERS = st.one_of(
    st.integers(-3, 70).map(str),
    st.sampled_from(["1.5", "1e309", "nan", "inf", "-inf", "0x10", "99999999999999999999", ""]),
    JUNK,
)
PATHS = ["", "{root}", "{folder}", "{text}", "{text}/sub", "/no/such/file", "/" + "a" * 300]


def pool(*values: str) -> st.SearchStrategy[str]:
    """Mostly the values given (good and bad ones), sometimes anything."""
    return st.sampled_from([*values, "<junk>"]).flatmap(
        lambda value: JUNK if value == "<junk>" else st.just(value)
    )


# Every option of every command has its values here; a new option without
# one fails test_every_option_has_generated_values.
VALUES: dict[str, st.SearchStrategy[str]] = {
    "url": pool(
        "{closed}",
        "{closed}/",
        "http://op:secret@127.0.0.1:1",
        "localhost:8000",
        "ftp://127.0.0.1/",
        "http://",
        "http://127.0.0.1:0",
        "http://127.0.0.1:99999",
        "http://[::1",
        "http://127.0.0.1:http",
    ),
    "model": pool("deepseek-ai/DeepSeek-V4.1-Flash", "other/model"),
    "max_tokens": NUMBERS,
    "api_key": pool("sk-1", "sk-1\n", "sk 1", "sk-\x7f", "sk-é"),
    "timeout": NUMBERS,
    "deadline": NUMBERS,
    "jobs": NUMBERS,
    "geometry": pool("split", "fallback", "upstream", "control", "SPLIT"),
    "geometry_timeout": NUMBERS,
    "report": pool(*PATHS, "{folder}/report.json"),
    "vllm_wheel": pool("{garbage}", "{small}", "{text}", "/no/such/vllm-0.25.1-py3-none-any.whl"),
    "vllm": pool("0.25.1", "0.0.1", "latest", "abc", "1!2.0", "0.25.1+local"),
    "out": pool(*PATHS, "dist", "{root}/out/nested"),
    "build_number": NUMBERS,
    "index_url": pool(
        "{closed}/simple",
        "file:///no/such/index",
        "not-a-url",
        "ftp://127.0.0.1/simple",
        "https:///simple",
        "http://127.0.0.1:99999/simple",
    ),
    "against": pool("0.34.0", "0.33.0", "0.1.0", "newest"),
}
FLAGS_WITHOUT_VALUES = {"json", "no_timing", "truth_table", "help", "version"}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


SUBCOMMANDS = _subcommands()


def test_every_option_has_generated_values():
    for name, parser in SUBCOMMANDS.items():
        for action in parser._actions:
            if action.dest in FLAGS_WITHOUT_VALUES or action.dest == "serve_args":
                continue
            assert action.dest in VALUES, f"{name} {action.option_strings}: no generated values"


@st.composite
def serve_lines(draw, model: st.SearchStrategy[str] | None = None) -> list[str]:
    """A ``vllm serve`` line: a model, then flags with good and bad values."""
    line = ["vllm", "serve"] if draw(st.booleans()) else []
    line.append(
        draw(
            model
            if model is not None
            else st.sampled_from(["{tiny}", "Qwen/Qwen3-8B", "/no/such/model", "{text}"])
        )
    )
    for flag, values in draw(st.lists(st.sampled_from(sorted(SERVE_FLAGS.items())), max_size=3)):
        line.append(flag)
        if values is not None:
            line.append(draw(values))
    return line


JSON_OBJECTS = st.sampled_from(
    [
        "{}",
        "{bad json",
        "[]",
        '{"method": "bogus", "num_speculative_tokens": 1}',
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
        '{"method": "mtp", "num_speculative_tokens": "two"}',
        '{"a":' * 3000 + "1" + "}" * 3000,
        "null",
    ]
)
SERVE_FLAGS: dict[str, st.SearchStrategy[str] | None] = {
    "-tp": NUMBERS,
    "--tensor-parallel-size": st.sampled_from(["1", "2", "3", "4", "16", "32"]),
    "-dcp": st.sampled_from(["1", "2", "3"]),
    "--block-size": NUMBERS,
    "--kv-cache-dtype": pool("auto", "fp8", "fp8_e4m3", "bfloat16"),
    "--attention-backend": pool("FLASHMLA_SPARSE", "FLASHINFER_MLA", "TRITON_MLA"),
    "--max-num-seqs": NUMBERS,
    "--max-model-len": pool("1k", "4096", "0", "-1"),
    "--gpu-memory-utilization": NUMBERS,
    "--speculative-config": JSON_OBJECTS,
    "--kernel-config": JSON_OBJECTS,
    "--attention-config": JSON_OBJECTS,
    "--config": st.sampled_from(["{good_yaml}", "{bad_yaml}", "{text}", "/no/such.yaml"]),
    "--enforce-eager": None,
    "--enable-prefix-caching": None,
    "--no-such-flag": None,
}


def _rarely(draw, one_in: int) -> bool:
    # the rare case last: Hypothesis starts from, and shrinks to, the first
    return draw(st.sampled_from([False] * (one_in - 1) + [True]))


@st.composite
def command_lines(draw) -> list[str]:
    """Mostly a real command with its own options (values good and bad), now
    and then a stray word before or after it, or no command at all."""
    argv: list[str] = []
    if _rarely(draw, 6):
        argv.append(draw(st.sampled_from(["--json", "--verbose", "--help", "--version"])))
    names = sorted(SUBCOMMANDS)
    name = draw(JUNK) if _rarely(draw, 8) else draw(st.sampled_from(names))
    argv.append(name)
    parser = SUBCOMMANDS.get(name)
    actions = [a for a in parser._actions if a.dest not in ("serve_args", "help")] if parser else []
    for action in draw(st.lists(st.sampled_from(actions), max_size=4)) if actions else []:
        if action.option_strings:
            argv.append(draw(st.sampled_from(action.option_strings)))
        if action.dest not in FLAGS_WITHOUT_VALUES and not _rarely(draw, 10):
            argv.append(draw(VALUES[action.dest]))
    if _rarely(draw, 6):
        argv.append(draw(JUNK))
    if name == "doctor" and draw(st.booleans()):
        argv += ["--", *draw(serve_lines())]
    return argv


def _long_running(argv: list[str]) -> bool:
    """Commands that parse and then work for minutes (or reach a real index):
    verify, a self-test where the fix is covered, a truth table derived."""
    try:
        args = cli.build_parser().parse_args(argv)
    except (cli.UsageError, SystemExit):
        return False
    if args.command == "verify":
        return True
    from vllm_mla_fixes.patching import installed_vllm_version

    if args.command == "selftest" and installed_vllm_version() in SELFTEST_RELEASES:
        return True
    # --truth-table: a JSON-only status option a fix adds (DeepSeek-V4.1's), absent without it
    return (
        args.command == "status"
        and args.json
        and "--truth-table" in args.json_only
        and args.truth_table
    )


def _offline(argv: list[str], inputs: dict[str, str]) -> list[str]:
    """No generated line may reach PyPI: --vllm without --index-url gets a
    port nothing listens on."""
    own = _own(argv)
    if own[:1] and any(a == "--vllm" or a.startswith("--vllm=") for a in own):
        if not any(a.startswith("--index-url") for a in own):
            at = len(own)
            argv = [*argv[:at], "--index-url", f"{inputs['closed']}/simple", *argv[at:]]
    return argv


def _filled(argv: list[str], inputs: dict[str, str]) -> list[str]:
    filled = []
    for arg in argv:
        for name, value in inputs.items():
            arg = arg.replace("{" + name + "}", value)
        filled.append(arg)
    return filled


def test_every_command_line_keeps_the_contract(worker, inputs, tmp_path, record_property):
    seen: list[object] = []  # one entry per generated example

    @settings(PROPERTY, max_examples=EXAMPLES["argv"])
    @given(command_lines())
    def prop(argv):
        argv = _offline(_filled(argv, inputs), inputs)
        assume(not _long_running(argv))
        cwd = tmp_path / f"run-{len(seen)}"
        cwd.mkdir()
        outcome = worker.run({"argv": argv, "cwd": str(cwd), "timeout": 300})
        seen.append(outcome["seconds"])
        assert_contract(argv, outcome)

    prop()
    record_property("generated_examples", len(seen))


# -- settings: no value turns a fix off -----------------------------------------------------------

FIX_SELECTIONS = pool(
    "all", "none", "ALL", " all ", ",", "all,none", *FIX_NAMES, ",".join(FIX_NAMES)
)


def values_around(setting: plugin_settings.Setting) -> st.SearchStrategy[str]:
    """A fix's own setting: each value it allows, as written, upper-cased and
    space-padded, and a near miss of each (its first half)."""
    allowed = setting.allowed.split(" or ")
    return pool(
        *allowed,
        *(v.upper() for v in allowed),
        *(f" {v} " for v in allowed),
        *(v[: len(v) // 2] for v in allowed),
    )


SETTING_VALUES = {
    SELECTION.name: FIX_SELECTIONS,
    **{s.name: values_around(s) for fix in ALL_FIXES for s in fix.SETTINGS},
}
CACHE_SEGMENT = st.one_of(
    st.sampled_from(["screens", "..", ".", "~", "x" * 300, " ", "ünï", "\udcff", "new\nline"]),
    st.text(
        alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="/\x00"),
        min_size=1,
        max_size=12,
    ),
)
CACHE_DIRS = st.one_of(
    st.sampled_from(
        [
            "/" + "a" * 300,
            "/tmp/" + "b/" * 3000,
            "/etc/passwd/sub",
            "/etc/passwd",
            "/proc/1/screens",
            "relative/screens",
            "~nosuchuser/screens",
            "{text}/screens",
            "{text}",
            "",
            " ",
        ]
    ),
    # under a folder of the test's own, so a valid value creates nothing elsewhere
    st.lists(CACHE_SEGMENT, min_size=1, max_size=5).map(lambda p: "{root}/cache/" + "/".join(p)),
)


def _expected_states(baseline: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """What no setting may change: each fix's state without any setting,
    except a fix a valid VLLM_MLA_FIXES leaves out, which is disabled."""
    selected = plugin_settings.value(SELECTION, env)
    return {
        name: "disabled" if selected is not None and name not in selected else state
        for name, state in baseline.items()
    }


@pytest.fixture(scope="module")
def baseline(worker, tmp_path_factory) -> dict[str, str]:
    outcome = worker.run({"argv": ["status", "--json"], "cwd": str(tmp_path_factory.mktemp("b"))})
    document = assert_contract(["status", "--json"], outcome)
    assert document is not None and outcome["status"] == 0, outcome
    return {fix["name"]: fix["state"] for fix in document["fixes"]}


def _check_settings(worker, env: dict[str, str], baseline: dict[str, str], cwd: Path) -> None:
    outcome = worker.run({"argv": ["status", "--json"], "env": env, "cwd": str(cwd)})
    document = assert_contract(["status", "--json"], outcome)
    assert document is not None
    invalid = [r for r in plugin_settings.readings(SETTINGS, env) if r.setting and not r.valid]
    assert outcome["status"] == (2 if invalid else 0), (env, outcome)
    states = {fix["name"]: fix["state"] for fix in document["fixes"]}
    assert states == _expected_states(baseline, env), (env, document["fixes"])
    for reading in invalid:
        said = [ln for ln in outcome["stderr"].splitlines() if f"{reading.name}=" in ln]
        assert len(said) == 1 and "is not allowed (" in said[0], (env, outcome["stderr"][-3000:])
        assert reading.problem and reading.problem in said[0]


def test_no_setting_turns_a_fix_off_and_each_invalid_one_warns_once(
    worker, inputs, baseline, tmp_path, record_property
):
    seen: list[object] = []  # one entry per generated example

    @settings(PROPERTY, max_examples=EXAMPLES["settings"])
    @given(
        st.fixed_dictionaries({}, optional=dict(SETTING_VALUES)),
        st.one_of(st.none(), CACHE_DIRS),
        st.sampled_from(["", "VLLM_MLA_FIXES_GEOMETRY", "VLLM_MLA_FIXES_BOGUS"]),
    )
    def prop(env, cache_dir, unknown):
        env = dict(env)
        if cache_dir is not None:
            env[plugin_settings.CACHE_DIR.name] = _filled([cache_dir], inputs)[0]
        if unknown:
            env[unknown] = "1"
        cwd = tmp_path / f"run-{len(seen)}"
        cwd.mkdir()
        seen.append(env)
        _check_settings(worker, env, baseline, cwd)
        doctor = worker.run({"argv": ["doctor", "--json"], "env": env, "cwd": str(cwd)})
        report = assert_contract(["doctor", "--json"], doctor)
        assert report is not None
        warned = [f["message"] for f in report["findings"] if f["level"] == "warn"]
        for reading in plugin_settings.readings(SETTINGS, env):
            if reading.setting and not reading.valid:
                assert reading.describe() in warned, (env, report["findings"])

    prop()
    record_property("generated_examples", len(seen))


def test_a_cache_folder_of_any_value_turns_no_fix_off(
    worker, inputs, baseline, tmp_path, record_property
):
    seen: list[object] = []  # one entry per generated example

    @settings(PROPERTY, max_examples=EXAMPLES["cache_dir"])
    @given(CACHE_DIRS)
    def prop(cache_dir):
        env = {plugin_settings.CACHE_DIR.name: _filled([cache_dir], inputs)[0]}
        cwd = tmp_path / f"run-{len(seen)}"
        cwd.mkdir()
        seen.append(env)
        _check_settings(worker, env, baseline, cwd)

    prop()
    record_property("generated_examples", len(seen))


# -- doctor: config.json contents and serve lines -----------------------------------------------

GLM_CONFIG = json.loads((TINY_GLM / "config.json").read_text())
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


@st.composite
def config_files(draw) -> bytes:
    """The tiny GLM's config with fields changed, of other types, or dropped,
    in an encoding; or something that is hardly a config at all."""
    kind = draw(st.sampled_from(["changed", "changed", "changed", "nested", "bytes"]))
    if kind == "nested":
        depth = draw(st.integers(50, 200_000))
        return (
            b'{"architectures": ["GlmMoeDsaForCausalLM"], "x": '
            + b"[" * depth
            + b"]" * depth
            + b"}"
        )
    if kind == "bytes":
        return draw(st.binary(max_size=48))
    keys = sorted(GLM_CONFIG) + ["text_config", "unknown_field"]
    config = {
        k: v
        for k, v in GLM_CONFIG.items()
        if k not in draw(st.sets(st.sampled_from(keys), max_size=2))
    }
    config.update(draw(st.dictionaries(st.sampled_from(keys), JSON_VALUES, max_size=2)))
    text = json.dumps(config)
    encoding = draw(st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "latin-1", "cut"]))
    if encoding == "cut":
        return text.encode()[: draw(st.integers(0, len(text) - 1))]
    if encoding == "latin-1":
        return text.replace("GlmMoeDsa", "GlmMoéDsa").encode("latin-1", "replace")
    return text.encode(encoding)


def _doctor_keeps_vllms_word(worker, serve: list[str], cwd: Path, env: dict | None = None) -> dict:
    """doctor --json on the line: the contract, and WILL FAIL wherever the
    installed vLLM refuses to build the line's engine config -- except where
    vLLM could not read the model's config for want of the hub (offline is a
    state, not a line error: a warning naming it, issue 36)."""
    argv = ["doctor", "--json", "--", *serve]
    outcome = worker.run({"argv": argv, "cwd": str(cwd), "env": env or {}, "timeout": 300})
    report = assert_contract(argv, outcome)
    assert report is not None and "verdict" in report, outcome
    vllm = worker.run({"engine_config": serve, "cwd": str(cwd), "env": env or {}, "timeout": 300})
    assert vllm["status"] in (0, 2), vllm
    offline = any(
        "cannot check the model's config: offline" in f["message"] for f in report["findings"]
    )
    if vllm["status"] == 2 and offline:
        assert report["verdict"] == "READY WITH WARNINGS", (serve, report["reason"])
    elif vllm["status"] == 2:
        assert report["verdict"] == "WILL FAIL", (serve, vllm["stderr"][-2000:], report["reason"])
    return report


def test_doctor_on_any_config_json_keeps_the_contract(worker, tmp_path, record_property):
    seen: list[object] = []  # one entry per generated example

    @settings(PROPERTY, max_examples=EXAMPLES["config"])
    @given(config_files())
    def prop(config):
        model = tmp_path / f"model-{len(seen)}"
        model.mkdir()
        (model / "config.json").write_bytes(config)
        seen.append(config)
        _doctor_keeps_vllms_word(worker, ["vllm", "serve", str(model)], tmp_path)

    prop()
    record_property("generated_examples", len(seen))


def test_doctor_on_any_serve_line_keeps_the_contract(worker, inputs, tmp_path, record_property):
    seen: list[object] = []  # one entry per generated example

    @settings(PROPERTY, max_examples=EXAMPLES["serve_line"])
    @given(serve_lines(st.sampled_from(["{tiny}", "{tiny}", "Qwen/Qwen3-8B", "/no/such/model"])))
    def prop(line):
        seen.append(line)
        _doctor_keeps_vllms_word(worker, _filled(line, inputs), tmp_path)

    prop()
    record_property("generated_examples", len(seen))
