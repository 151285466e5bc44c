"""``vllm-mla-fixes smoke URL``: is a running OpenAI-compatible server answering in text?

The check the DeepSeek-V4.1 report asks for after start-up, against a live
``vllm serve``: ``/health`` answers 200, the model is listed by ``/v1/models``,
and a chat and a completion of each prompt (:data:`PROMPTS`), streamed and not,
come back as non-empty text without U+FFFD (UTF-8 ``ef bf bd``), the
replacement character a wrong KV page turns every token into.  Standard
library only, so it runs anywhere an operator has Python.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

PROMPTS = ("Hello", "What is 17*19?")
DEFAULT_DEADLINE = 300.0  # seconds for the whole check
REPLACEMENT = "\ufffd"
REPLACEMENT_BYTES = REPLACEMENT.encode()  # b"\xef\xbf\xbd"


@dataclass
class Exchange:
    kind: str  # "chat" or "completion"
    prompt: str
    stream: bool
    text: str = ""
    problem: str | None = None

    @property
    def label(self) -> str:
        return f"{self.kind}{' (stream)' if self.stream else ''} {self.prompt!r}"


@dataclass
class SmokeResult:
    url: str
    model: str | None = None
    problems: list[str] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(e.problem is None for e in self.exchanges)

    def as_json(self) -> dict:
        return {
            "url": self.url,
            "model": self.model,
            "ok": self.ok,
            "problems": self.problems,
            "exchanges": [
                {
                    "kind": e.kind,
                    "prompt": e.prompt,
                    "stream": e.stream,
                    "text": e.text,
                    "problem": e.problem,
                }
                for e in self.exchanges
            ],
        }

    def text(self) -> str:
        lines = [f"smoke {self.url} model {self.model or '?'}"]
        lines += [f"  FAIL {p}" for p in self.problems]
        for e in self.exchanges:
            lines.append(
                f"  {'ok  ' if e.problem is None else 'FAIL'} {e.label}: "
                f"{e.problem + ': ' if e.problem else ''}{e.text!r}"
            )
        lines.append("verdict: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


class BadAnswer(ValueError):
    """The server answered, but not in the OpenAI wire format."""


class DeadlinePassed(Exception):
    """The overall deadline passed before or while a request ran."""


class _Client:
    def __init__(self, base: str, api_key: str | None, timeout: float, deadline: float):
        self.base = base.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.deadline = deadline
        self.deadline_at = time.monotonic() + deadline
        self.waited = timeout  # the socket timeout of the latest request
        self.limit = "--timeout"  # which limit set it

    def check_deadline(self) -> None:
        if time.monotonic() >= self.deadline_at:
            raise DeadlinePassed

    def request(self, path: str, body: dict | None = None):
        left = self.deadline_at - time.monotonic()
        if left <= 0:
            raise DeadlinePassed
        self.waited, self.limit = (
            (self.timeout, "--timeout") if self.timeout <= left else (left, "--deadline")
        )
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path,
            data=data,
            headers=self.headers,
            method="GET" if body is None else "POST",
        )
        return urllib.request.urlopen(req, timeout=self.waited)

    def describe(self, exc: Exception) -> str:
        if isinstance(exc, urllib.error.HTTPError):
            detail = exc.read().decode("utf-8", "replace")[:300]
            return f"HTTP {exc.code}: {detail}"
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"stalled: no answer within {self.waited:.3g} s ({self.limit})"
        if isinstance(exc, DeadlinePassed):
            return (
                f"stalled: the overall deadline ({self.deadline:g} s, --deadline) passed "
                "before the answer ended"
            )
        if isinstance(exc, urllib.error.URLError):
            return f"cannot connect: {exc.reason}"
        if isinstance(exc, BadAnswer):
            return str(exc)
        return f"{type(exc).__name__}: {exc}"


def _json(raw: bytes, what: str):
    try:
        return json.loads(raw)
    except ValueError:
        raise BadAnswer(f"{what} is not JSON: {raw[:80]!r}") from None


def _text_of(choice: object, kind: str, stream: bool) -> str:
    if not isinstance(choice, dict):
        raise BadAnswer(f"malformed answer: a choice is {choice!r:.60}, not an object")
    if kind == "completion":
        parts = [choice.get("text")]
    else:
        part = choice.get("delta" if stream else "message") or {}
        if not isinstance(part, dict):
            raise BadAnswer(f"malformed answer: a choice's message is {part!r:.60}")
        # A reasoning parser moves the thinking into reasoning_content: count it too.
        parts = [part.get("reasoning_content"), part.get("content")]
    if not all(p is None or isinstance(p, str) for p in parts):
        raise BadAnswer(f"malformed answer: a choice's text is not a string: {choice!r:.80}")
    return "".join(p or "" for p in parts)


def _choices(payload: object) -> list:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        raise BadAnswer(f"malformed answer: no list of choices in {payload!r:.80}")
    return choices


def _exchange(
    client: _Client, model: str, kind: str, prompt: str, stream: bool, max_tokens: int
) -> Exchange:
    exchange = Exchange(kind, prompt, stream)
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    try:
        response = client.request(path, body)
    except DeadlinePassed:
        raise  # not started: the caller counts what was not run
    except Exception as exc:
        exchange.problem = client.describe(exc)
        return exchange
    raw = b""
    try:
        with response:
            if stream:
                parts = []
                for line in response:
                    client.check_deadline()  # a server that trickles bytes is stalling too
                    raw += line
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[len(b"data:") :].strip()
                    if payload == b"[DONE]":
                        break
                    event = _json(payload, "a streamed event")
                    if isinstance(event, dict) and "error" in event:
                        raise BadAnswer(f"error event: {event['error']}")
                    parts += [_text_of(c, kind, True) for c in _choices(event)]
                else:  # vLLM ends every stream with this event
                    raise BadAnswer(f"the stream ended without 'data: [DONE]': {raw[:80]!r}")
                exchange.text = "".join(parts)
            else:
                raw = response.read()
                choices = _choices(_json(raw, "the answer"))
                exchange.text = "".join(_text_of(c, kind, False) for c in choices)
    except Exception as exc:  # DeadlinePassed too: it stalled part-way
        exchange.problem = client.describe(exc)
        return exchange
    if REPLACEMENT_BYTES in raw or REPLACEMENT in exchange.text:
        exchange.problem = "U+FFFD (bytes ef bf bd) in the output: the KV cache is being misread"
    elif not exchange.text.strip():
        exchange.problem = "empty output"
    return exchange


def _listed_models(payload: object) -> list[str]:
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise BadAnswer(f"malformed answer: no list of models ('data') in {payload!r:.80}")
    for i, entry in enumerate(data):
        if not (isinstance(entry, dict) and isinstance(entry.get("id"), str)):
            raise BadAnswer(f"malformed answer: data[{i}] is {entry!r:.60}, not a model with an id")
    return [entry["id"] for entry in data]


def run(
    url: str,
    model: str | None = None,
    max_tokens: int = 32,
    api_key: str | None = None,
    timeout: float = 120.0,
    deadline: float = DEFAULT_DEADLINE,
) -> SmokeResult:
    """Every check, within ``timeout`` seconds per request and ``deadline``
    seconds in all: requests the deadline leaves no time for are not run."""
    client = _Client(url, api_key, timeout, deadline)
    result = SmokeResult(client.base)
    try:
        with client.request("/health") as response:
            if response.status != 200:
                result.problems.append(f"/health answered {response.status}, not 200")
    except Exception as exc:
        result.problems.append(f"/health: {client.describe(exc)}")
        return result
    try:
        with client.request("/v1/models") as response:
            listed = _listed_models(_json(response.read(), "the answer"))
    except Exception as exc:
        result.problems.append(f"/v1/models: {client.describe(exc)}")
        return result
    if model is None:
        if not listed:
            result.problems.append("/v1/models lists no model")
            return result
        model = listed[0]
    elif model not in listed:
        result.problems.append(f"model {model!r} is not listed by /v1/models ({listed})")
        return result
    result.model = model
    planned = [
        (kind, prompt, stream)
        for prompt in PROMPTS
        for kind in ("chat", "completion")
        for stream in (False, True)
    ]
    for done, (kind, prompt, stream) in enumerate(planned):
        try:
            result.exchanges.append(_exchange(client, model, kind, prompt, stream, max_tokens))
        except DeadlinePassed:
            label = Exchange(kind, prompt, stream).label
            result.problems.append(
                f"the overall deadline ({deadline:g} s, --deadline) passed: "
                f"{len(planned) - done} of {len(planned)} requests not run, from {label} on"
            )
            break
    return result
