"""``vllm-mla-fixes smoke URL`` against a real HTTP server process (issue 17).

The server (``servers/openai_stub.py``) is a separate process on loopback that
speaks vLLM's OpenAI wire format; a CPU cannot run vLLM's own inference.  The
command must pass a server that answers in text, and fail, saying why, on
U+FFFD output (what the untranslated split serves), empty output, an HTTP
error, an unhealthy server, a model that is not listed, and no server at all.
"""

from __future__ import annotations

import json
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
