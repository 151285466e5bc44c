"""Every command against the bad inputs a careful operator tries (issue 29).

Each case runs the command as a process and asserts its exit status (2 for
bad arguments, 1 for a failure), exactly one error line on stderr that names
the cause, no traceback anywhere, and in a JSON mode one JSON document on
stdout, the error included.  ``build-wheel`` is also stopped by SIGTERM,
SIGINT and SIGHUP at several points of a real build: the output folder must stay exactly
as it was.

Only the status and build-wheel cases need vLLM or its wheel; all run in the
0.25.1 session (the cheapest), once.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from bad_input_runs import Case, assert_one_error, case, cli, operator_env

import vllm_mla_fixes
from vllm_mla_fixes import wheel
from vllm_mla_fixes.fixes import ALL_FIXES, FIX_NAMES

pytestmark = pytest.mark.vllm_release("0.25.1")
STUB = Path(__file__).resolve().parent / "servers" / "openai_stub.py"


def _fixes_cases() -> list[ModuleType]:
    """The cases each fix's own test folder adds, in ``bad_input_cases.py``:
    its commands, their bad arguments, its settings' invalid values."""
    tests = Path(__file__).resolve().parent
    folders = (fix.INFO.name.replace("-", "_") for fix in ALL_FIXES)  # their test folders
    return [
        importlib.import_module(f"{folder}.bad_input_cases")
        for folder in folders
        if (tests / folder / "bad_input_cases.py").exists()
    ]


FIXES_CASES = _fixes_cases()
COMMANDS = (
    "status",
    "verify",
    "doctor",
    "smoke",
    "build-wheel",
    "review",
    *(command for table in FIXES_CASES for command in table.COMMANDS),
)
CACHE_DIR = "VLLM_MLA_FIXES_CACHE_DIR"


# -- the files and servers the cases name --------------------------------------------------


@pytest.fixture(scope="module")
def upstream_wheel() -> Path:
    """vLLM 0.25.1's wheel from PyPI, sha256 checked, cached outside the checkout."""
    return wheel.download_verified("0.25.1")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Paths the cases refer to as {name}."""
    root = tmp_path_factory.mktemp("inputs")
    garbage = root / "vllm-0.25.1-py3-none-any.whl"
    garbage.write_bytes(b"a truncated download, not a zip")
    patched = root / f"vllm-0.25.1+mlafixes.{vllm_mla_fixes.__version__}-py3-none-any.whl"
    patched.write_bytes(b"")
    other = root / "torch-2.11.0-py3-none-any.whl"
    other.write_bytes(b"")
    text = root / "notes.txt"
    text.write_text("not a wheel\n")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    return {
        "root": str(root),
        "garbage": str(garbage),
        "patched": str(patched),
        "other": str(other),
        "text": str(text),
        "closed": f"http://127.0.0.1:{closed}",
    }


@pytest.fixture
def stub_server():
    started = []

    def start(mode: str) -> str:
        proc = subprocess.Popen(
            [sys.executable, str(STUB), mode], stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        assert proc.stdout is not None
        return f"http://127.0.0.1:{int(proc.stdout.readline())}"

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


# -- arguments and files: no vLLM needed ---------------------------------------------------


ARGUMENT_CASES = [
    # the program itself
    case("", 2, "the following arguments are required: COMMAND"),
    case("bogus", 2, "invalid choice: 'bogus'"),
    case("--json", 2, "the following arguments are required: COMMAND"),
    case("--verbose status", 2, "unrecognized arguments: --verbose"),
    # status
    case("status --bogus", 2, "unrecognized arguments: --bogus"),
    case("status --json extra", 2, "unrecognized arguments: extra"),
    # verify
    case("verify --bogus", 2, "unrecognized arguments: --bogus"),
    case("verify 0.25.1", 2, "unrecognized arguments: 0.25.1"),
    # doctor (its serve-line checks are doctor's own tests)
    case("doctor --bogus", 2, "unrecognized arguments: --bogus"),
    case("doctor --json --bogus", 2, "unrecognized arguments: --bogus"),
    case("doctor -- vllm serve", 2, "the serve line names no model"),
    case("doctor --json -- vllm serve", 2, "the serve line names no model"),
    # smoke
    case("smoke", 2, "the following arguments are required: url"),
    case("smoke http://127.0.0.1:99999", 2, "'http://127.0.0.1:99999' has an invalid port"),
    case("smoke http://127.0.0.1:0", 2, "'http://127.0.0.1:0' has an invalid port"),
    case("smoke http://127.0.0.1:http", 2, "has an invalid port (allowed: 1 to 65535)"),
    case("smoke --json http://127.0.0.1:99999", 2, "has an invalid port"),
    case("smoke localhost:8000", 2, "'localhost:8000' is not an http:// or https:// URL"),
    case("smoke ftp://localhost/", 2, "'ftp://localhost/' is not an http:// or https:// URL"),
    case("smoke http://", 2, "'http://' names no host"),
    Case(("smoke", "http://local host"), 2, "'local host' is not a host name or address"),
    case("smoke {closed} --timeout -1", 2, "argument --timeout: -1 is not a positive"),
    case("smoke {closed} --timeout 0", 2, "argument --timeout: 0 is not a positive"),
    case("smoke {closed} --timeout soon", 2, "argument --timeout: 'soon' is not a number"),
    case("smoke {closed} --timeout nan", 2, "argument --timeout: nan is not a positive, finite"),
    case("smoke {closed} --timeout inf", 2, "argument --timeout: inf is not a positive, finite"),
    case("smoke --json {closed} --timeout -1", 2, "argument --timeout: -1 is not a positive"),
    case("smoke {closed} --deadline 0", 2, "argument --deadline: 0 is not a positive"),
    case("smoke {closed} --max-tokens 0", 2, "argument --max-tokens: 0 is not positive"),
    # build-wheel: every argument checked before any download
    case("build-wheel", 2, "one of the arguments --vllm-wheel --vllm is required"),
    case("build-wheel --vllm latest", 2, "argument --vllm: 'latest' is not a release number"),
    case("build-wheel --vllm abc", 2, "argument --vllm: 'abc' is not a release number"),
    case("build-wheel --vllm 0.25.1 --vllm-wheel {garbage}", 2, "not allowed with argument"),
    case(
        "build-wheel --vllm 0.25.1 --index-url not-a-url",
        2,
        "argument --index-url: 'not-a-url' is not an http://, https:// or file:// URL",
    ),
    case("build-wheel --vllm 0.25.1 --index-url ftp://pypi.org/simple", 2, "is not an http://"),
    case("build-wheel --vllm 0.25.1 --index-url https:///simple", 2, "names no host"),
    case(
        "build-wheel --vllm 0.25.1 --index-url http://127.0.0.1:99999/simple",
        2,
        "has an invalid port",
    ),
    case(
        "build-wheel --vllm 0.25.1 --build-number -3",
        2,
        "argument --build-number: -3 is negative (allowed: 0 to 999999)",
    ),
    case("build-wheel --vllm 0.25.1 --build-number two", 2, "'two' is not a whole number"),
    case("build-wheel --vllm 0.25.1 --build-number 1.5", 2, "'1.5' is not a whole number"),
    case(
        "build-wheel --vllm-wheel /no/such/vllm.whl", 2, "--vllm-wheel /no/such/vllm.whl: no such"
    ),
    case("build-wheel --vllm-wheel {text}", 2, "notes.txt is not a wheel file name"),
    case(
        "build-wheel --vllm-wheel {other}", 2, "torch-2.11.0-py3-none-any.whl is not a vLLM wheel"
    ),
    case("build-wheel --vllm-wheel {patched}", 2, "is already patched; start from upstream's"),
    case("build-wheel --vllm-wheel {garbage} --out {text}", 2, "exists and is not a folder"),
    case("build-wheel --vllm-wheel {garbage} --out {text}/dist", 2, "notes.txt' is a file"),
    case(
        "build-wheel --vllm-wheel {garbage} --out {root}/new/dist",
        1,
        "is not a valid wheel (zip) file",
    ),
    case(
        "build-wheel --vllm 0.25.1 --index-url {closed}/simple",
        1,
        "cannot read the package index at http://127.0.0.1:",
    ),
    case(
        "build-wheel --vllm 0.25.1 --index-url file:///no/such/index",
        1,
        "cannot read the package index at file:///no/such/index/vllm/",
    ),
    # review
    case("review", 2, "one of the arguments --vllm --vllm-wheel is required"),
    case("review --vllm abc", 2, "argument --vllm: 'abc' is not a release number (e.g. 0.34.0)"),
    case("review --vllm 0.34.0 --against newest", 2, "argument --against: 'newest' is not"),
    case("review --vllm latest --index-url not-a-url", 2, "argument --index-url: 'not-a-url'"),
    case("review --vllm latest --index-url http://h:0/simple", 2, "has an invalid port"),
    case("review --vllm-wheel /no/such/vllm.whl", 2, "no such wheel: /no/such/vllm.whl"),
    case("review --vllm-wheel {garbage}", 2, "cannot read"),
    case(
        "review --vllm 0.34.0 --index-url {closed}/simple",
        2,
        "cannot read the package index at http://127.0.0.1:",
    ),
    *(bad for table in FIXES_CASES for bad in table.ARGUMENT_CASES),
]


@pytest.mark.parametrize("bad", ARGUMENT_CASES, ids=str)
def test_bad_argument(bad: Case, files, tmp_path):
    argv = [arg.format(**files) for arg in bad.argv]
    proc = cli(*argv, cwd=tmp_path)
    assert_one_error(proc, bad.status, bad.says.format(**files))
    if "{root}/new/dist" in bad.argv:  # a failed build leaves no folder it created
        assert not Path(files["root"], "new").exists()
    assert not list(tmp_path.iterdir())  # nothing written where it ran


# -- smoke against servers that misbehave ---------------------------------------------------

SERVER_CASES = [
    # (stub mode, extra arguments, what the report must say, at most seconds)
    (
        "stall",
        ("--timeout", "1", "--deadline", "3"),
        "stalled: no answer within 1 s (--timeout)",
        8,
    ),
    ("stall", ("--timeout", "1", "--deadline", "3"), "the overall deadline (3 s, --deadline)", 8),
    ("trickle", ("--timeout", "1", "--deadline", "3"), "passed before the answer ended", 8),
    (
        "stall-health",
        (
            "--timeout",
            "1",
        ),
        "/health: stalled: no answer within 1 s",
        8,
    ),
    ("models-not-json", (), "/v1/models: the answer is not JSON: b'not json'", 8),
    ("models-null", (), "/v1/models: malformed answer: data[0] is None", 8),
    ("answers-not-json", (), "the answer is not JSON: b'not json'", 8),
    ("answers-not-json", (), "the stream ended without 'data: [DONE]'", 8),
    ("choices-null", (), "malformed answer: a choice is None, not an object", 8),
]


@pytest.mark.parametrize(("mode", "extra", "says", "seconds"), SERVER_CASES)
def test_smoke_names_what_the_server_did_wrong(stub_server, tmp_path, mode, extra, says, seconds):
    url = stub_server(mode)
    started = time.monotonic()
    proc = cli("smoke", url, *extra, "--json", cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["ok"] and says in json.dumps(report), report
    assert elapsed < seconds + 5  # start-up included; bounded by --deadline, not 8 x --timeout


def test_smoke_where_nothing_listens_says_so_in_both_modes(files, tmp_path):
    proc = cli("smoke", files["closed"], cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert "FAIL /health: cannot connect: [Errno 111] Connection refused" in proc.stdout
    assert proc.stdout.rstrip().endswith("verdict: FAIL")


# -- settings: status, and the plugin as it loads -----------------------------------------

# Each run sets several invalid variables at once (each status run loads vLLM);
# every case asserts on its own variable.
SHARED_STATUS_RUNS = {
    "human-1": {"VLLM_MLA_FIXES": "all,bogus"},
    "json-1": {"VLLM_MLA_FIXES": ",", CACHE_DIR: "relative/screens"},
    "human-2": {
        "VLLM_MLA_FIXES": f"none,{FIX_NAMES[0]}",
        CACHE_DIR: "/etc/passwd/sub",  # issue 35: shown as valid before, and never written
    },
    "json-plugins": {"VLLM_PLUGINS": "someother"},
}
STATUS_RUNS = {
    run: {
        **env,
        **{k: v for t in FIXES_CASES for k, v in t.STATUS_RUN_SETTINGS.get(run, {}).items()},
    }
    for run, env in SHARED_STATUS_RUNS.items()
}
SETTING_CASES = [
    # (run, variable, what its one warning must say besides its name, value and allowed values)
    ("human-1", "VLLM_MLA_FIXES", "'all' must stand alone; unknown fix name 'bogus'"),
    ("json-1", "VLLM_MLA_FIXES", "it names no fix"),
    ("json-1", CACHE_DIR, "a relative path would differ between vLLM's processes"),
    ("human-2", "VLLM_MLA_FIXES", "'none' must stand alone"),
    ("human-2", CACHE_DIR, "'/etc/passwd' is a file"),
    *(case for table in FIXES_CASES for case in table.SETTING_CASES),
]


@pytest.fixture(scope="module")
def status_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every status run, started at once: each spends its time importing vLLM."""
    started = {}
    for name, env in STATUS_RUNS.items():
        args = ["status", "--json"] if name.startswith("json") else ["status"]
        started[name] = subprocess.Popen(
            [sys.executable, "-m", "vllm_mla_fixes", *args],
            cwd=tmp_path_factory.mktemp(name),
            env=operator_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finished = {}
    for name, proc in started.items():
        stdout, stderr = proc.communicate(timeout=900)
        finished[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return finished


@pytest.mark.parametrize(("run", "variable", "problem"), SETTING_CASES)
def test_invalid_setting_warns_once_and_status_flags_it(status_runs, run, variable, problem):
    from vllm_mla_fixes.fixes import SETTINGS

    value = STATUS_RUNS[run][variable]
    proc = status_runs[run]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    allowed = next(s for s in SETTINGS if s.name == variable).allowed
    # the plugin, as vLLM loads it: one warning naming the variable, its value and what is allowed
    warnings = [line for line in proc.stderr.splitlines() if f"{variable}=" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"{variable}={value!r} is not allowed ({problem}); allowed: {allowed}" in warnings[0]
    assert "ignored, so the default applies" in warnings[0]
    if run.startswith("json"):
        document = json.loads(proc.stdout)
        assert document["exit_status"] == 2
        (entry,) = [s for s in document["settings"] if s["name"] == variable]
        assert entry == {
            "name": variable,
            "value": value,
            "known": True,
            "valid": False,
            "problem": problem,
            "allowed": allowed,
            "default": entry["default"],
        }
    else:
        flagged = [line for line in proc.stdout.splitlines() if f"{variable}=" in line]
        assert flagged == [f"  [WARN] {warnings[0].split('vllm-mla-fixes: ', 1)[1]}"]


def test_invalid_selection_is_treated_as_unset(status_runs):
    """VLLM_MLA_FIXES=all,bogus, =, and =none,... select every fix (the default)."""
    for run in ("human-1", "human-2"):
        assert "disabled" not in status_runs[run].stdout
    document = json.loads(status_runs["json-1"].stdout)
    assert not [f for f in document["fixes"] if f["state"] == "disabled"]


def test_vllm_plugins_without_this_plugin_is_named_as_the_cause(status_runs):
    proc = status_runs["json-plugins"]
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    document = json.loads(proc.stdout)
    for fix in document["fixes"]:
        assert fix["state"] == "skipped"
        assert fix["reason"].startswith(
            "not loaded: VLLM_PLUGINS='someother' does not name mla_fixes"
        ), fix


# -- help and version ---------------------------------------------------------------------


def test_version(tmp_path):
    proc = cli("--version", cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, f"vllm-mla-fixes {vllm_mla_fixes.__version__}\n")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_says_what_the_command_does_and_its_exit_codes(tmp_path, command):
    proc = cli(command, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "`" not in proc.stdout  # plain text, not reStructuredText
    assert proc.stdout.startswith(f"usage: vllm-mla-fixes {command} ")
    exit_codes = proc.stdout[proc.stdout.index("exit status") :]
    for status in ("0", "1", "2"):
        assert re.search(rf"(^|\s){status}(\s|$)", exit_codes), (status, exit_codes)


# -- build-wheel stopped part-way ---------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``folder``: inode, size, mtime.  (The folder's own
    mtime moves whenever a file is created in it, the temporary one too.)"""
    return {
        str(path.relative_to(folder)): (
            path.stat().st_ino,
            path.stat().st_size,
            path.stat().st_mtime_ns,
        )
        for path in sorted(folder.rglob("*"))
    }


def _temporary(folder: Path) -> Path | None:
    return next(iter(folder.rglob(".vllm-*.tmp")), None)


def _zip_closed(path: Path) -> bool:
    """The build has written the end of the zip's central directory: it is checking it now."""
    try:
        with open(path, "rb") as f:
            f.seek(-22, os.SEEK_END)
            return f.read(4) == b"PK\x05\x06"
    except OSError:
        return False


KILL_POINTS = {
    "temporary file created": lambda tmp: True,
    "32 MiB written": lambda tmp: tmp.stat().st_size > 32 << 20,
    "zip written, being checked": _zip_closed,
}


@pytest.fixture(scope="module")
def earlier_wheel(upstream_wheel, tmp_path_factory) -> tuple[Path, str]:
    """A whole wheel already under the name the build writes (an earlier build's)."""
    version = f"0.25.1+mlafixes.{vllm_mla_fixes.__version__}.build7"
    target = tmp_path_factory.mktemp("earlier") / upstream_wheel.name.replace(
        "vllm-0.25.1-", f"vllm-{version}-"
    )
    shutil.copyfile(upstream_wheel, target)
    return target, hashlib.sha256(target.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("signals", "point", "folder"),
    [
        ((signal.SIGTERM,), "temporary file created", "holds an earlier wheel"),
        ((signal.SIGINT,), "32 MiB written", "holds an earlier wheel"),
        ((signal.SIGTERM, signal.SIGTERM), "32 MiB written", "holds an earlier wheel"),
        ((signal.SIGTERM,), "zip written, being checked", "holds an earlier wheel"),
        # SIGHUP: a closed terminal or ssh session (issue 43)
        ((signal.SIGHUP,), "temporary file created", "does not exist yet"),
    ],
)
def test_build_wheel_stopped_leaves_the_folder_as_it_was(
    upstream_wheel, earlier_wheel, tmp_path, signals, point, folder
):
    earlier, earlier_sha = earlier_wheel
    out = tmp_path / "dist"
    if folder == "holds an earlier wheel":
        out.mkdir()
        os.link(earlier, out / earlier.name)
        before = _snapshot(out)
    else:
        out = out / "nested"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_mla_fixes",
            "build-wheel",
            "--vllm-wheel",
            str(upstream_wheel),
            "--out",
            str(out),
            "--build-number",
            "7",
        ],
        cwd=tmp_path,
        env=operator_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a terminal starts it: under nohup (a background CI job) SIGHUP is
        # ignored, and the command rightly leaves an ignored SIGHUP ignored
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        temporary = _temporary(tmp_path)
        if temporary is not None and KILL_POINTS[point](temporary):
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the build ended before {point}: {proc.communicate()}"
    for signum in signals:
        proc.send_signal(signum)
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signals[0], stderr
    assert "Traceback" not in stdout + stderr and stdout == ""
    name = signal.Signals(signals[0]).name
    assert stderr.splitlines() == [
        f"vllm-mla-fixes build-wheel: error: interrupted by {name}; nothing was left half-written"
    ]
    if folder == "holds an earlier wheel":
        assert _snapshot(out) == before  # no file under any name, no temporary file
        assert hashlib.sha256((out / earlier.name).read_bytes()).hexdigest() == earlier_sha
    else:
        assert list(tmp_path.iterdir()) == []  # the folders it created are gone too


# -- output paths: checked before any long work, results printed before written (issue 35) --


def _read_only(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    """``argv`` run where ``folder`` is a read-only file system: a read-only
    bind mount of it, in a mount namespace of the command's own."""
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, str(folder), *argv],
        env=operator_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            ("build-wheel", "--vllm-wheel", "{garbage}", "--out", "{folder}/dist"),
            id="build-wheel --out",
        ),
        *(
            pytest.param(argv, id=name)
            for table in FIXES_CASES
            for name, argv in table.READ_ONLY_OUTPUTS.items()
        ),
    ],
)
def test_an_output_on_a_read_only_file_system_is_refused_at_once(files, tmp_path, command):
    folder = tmp_path / "read-only"
    folder.mkdir()
    argv = [arg.format(folder=folder, **files) for arg in command]
    started = time.monotonic()
    proc = _read_only(folder, sys.executable, "-m", "vllm_mla_fixes", *argv)
    assert_one_error(proc, 2, f"cannot write in '{folder}': Read-only file system")
    assert time.monotonic() - started < 30
