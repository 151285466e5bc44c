"""``vllm-mla-fixes smoke URL`` against a real HTTP server process (issue 17).

The server (``servers/openai_stub.py``) is a separate process on loopback that
speaks vLLM's OpenAI wire format; a CPU cannot run vLLM's own inference.  The
command must pass a server that answers in text, and fail, saying why, on
U+FFFD output (what the untranslated split serves), empty output, an HTTP
error, an unhealthy server, a model that is not listed, and no server at all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parent / "servers" / "openai_stub.py"
# Needs no vLLM: run once, in one release's session.
pytestmark = pytest.mark.vllm_release("0.34.0")
MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"


@pytest.fixture
def server(request):
    proc = subprocess.Popen(
        [sys.executable, str(STUB), request.param], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None  # stdout=PIPE
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def smoke(*args: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "smoke", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    human = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "smoke", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, json.loads(proc.stdout), human.stdout


@pytest.mark.parametrize("server", ["good"], indirect=True)
def test_smoke_passes_a_server_that_answers_in_text(server):
    status, report, human = smoke(server)
    assert status == 0 and report["ok"] and report["model"] == MODEL, report
    assert len(report["exchanges"]) == 8  # 2 prompts x chat/completion x streamed/not
    assert {e["text"] for e in report["exchanges"]} == {"Hello! How can I help?", "17*19 = 323."}
    assert "'17*19 = 323.'" in human and human.rstrip().endswith("verdict: PASS")


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ("fffd", "U+FFFD (bytes ef bf bd) in the output"),
        ("empty", "empty output"),
        ("error", "HTTP 500: "),
    ],
    indirect=["server"],
)
def test_smoke_fails_each_exchange_that_is_not_text(server, problem):
    status, report, human = smoke(server)
    assert status == 1 and not report["ok"]
    assert all(e["problem"] and e["problem"].startswith(problem) for e in report["exchanges"]), (
        report
    )
    assert human.rstrip().endswith("verdict: FAIL")


@pytest.mark.parametrize("server", ["unhealthy"], indirect=True)
def test_smoke_fails_an_unhealthy_server(server):
    status, report, _ = smoke(server)
    assert status == 1 and report["problems"] == ["/health: HTTP 503: "] and not report["exchanges"]


@pytest.mark.parametrize("server", ["good"], indirect=True)
def test_smoke_fails_a_model_that_is_not_served(server):
    status, report, _ = smoke(server, "--model", "other/model")
    assert status == 1
    assert report["problems"] == [f"model 'other/model' is not listed by /v1/models (['{MODEL}'])"]


def test_smoke_fails_where_no_server_listens():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    status, report, _ = smoke(f"http://127.0.0.1:{port}")
    assert status == 1 and report["problems"][0].startswith("/health: cannot connect")


# -- the deadline is a wall-clock bound; secrets are never shown (issue 35) ----------------


@pytest.mark.parametrize("server", ["drip-headers", "drip-body"], indirect=True)
def test_a_dripping_server_ends_within_the_deadline_and_is_not_ok(server):
    """Each byte comes within --timeout, so no read times out: the overall
    watchdog must end the check, and an answer cut by it is not ok."""
    import time

    from vllm_mla_fixes import smoke as smoke_module

    started = time.monotonic()
    result = smoke_module.run(server, timeout=1, deadline=3)
    elapsed = time.monotonic() - started
    assert elapsed < 3 + 2, elapsed
    assert not result.ok
    said = json.dumps(result.as_json())
    assert "the overall deadline (3 s, --deadline) passed" in said, said
    assert not [e for e in result.exchanges if e.problem is None], result.as_json()


@pytest.mark.parametrize("server", ["echo-auth"], indirect=True)
def test_the_api_key_is_never_printed_even_with_a_trailing_newline(server):
    key = "sk-secret-0123456789"
    for mode in ((), ("--json",)):
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_mla_fixes", "smoke", server, *mode],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "VLLM_API_KEY": key + "\n"},
        )
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr and key not in proc.stdout + proc.stderr
        assert "invalid key: Bearer ***" in proc.stdout, proc.stdout  # the server echoed it


def test_a_key_a_header_cannot_carry_is_refused_without_showing_it():
    key = "sk-secret\nX-Injected: 1"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "smoke", "http://127.0.0.1:9", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_API_KEY": key},
    )
    assert proc.returncode == 2 and "sk-secret" not in proc.stdout + proc.stderr
    assert "holds a character an HTTP header cannot carry at position 10" in proc.stderr
    assert json.loads(proc.stdout)["exit_status"] == 2


@pytest.mark.parametrize("server", ["echo-auth"], indirect=True)
def test_a_password_in_the_url_is_sent_as_basic_auth_and_never_shown(server):
    url = server.replace("http://", "http://operator:pa%3Ass@")
    status, report, human = smoke(url)
    assert report["url"] == server.replace("http://", "http://operator:***@")
    assert "pa%3Ass" not in json.dumps(report) + human and "pa:ss" not in human
    assert "invalid key: Basic " in report["problems"][0], report


def test_a_password_in_a_bad_url_is_not_shown():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_mla_fixes", "smoke", "http://op:hunter2@127.0.0.1:99999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "hunter2" not in proc.stderr, proc.stderr
    assert "'http://op:***@127.0.0.1:99999' has an invalid port" in proc.stderr


def test_a_report_that_stdout_cannot_take_is_one_line_on_stderr():
    """``smoke --json > /dev/full``: no traceback, exit status 1, the cause named."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "vllm_mla_fixes", "smoke", "--json", "http://127.0.0.1:9"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        "vllm-mla-fixes smoke: error: the output could not be written to stdout "
        "(No space left on device)"
    ]
