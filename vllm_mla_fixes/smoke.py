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
import urllib.error
import urllib.request
from dataclasses import dataclass, field

PROMPTS = ("Hello", "What is 17*19?")
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


class _Client:
    def __init__(self, base: str, api_key: str | None, timeout: float):
        self.base = base.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def request(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path,
            data=data,
            headers=self.headers,
            method="GET" if body is None else "POST",
        )
        return urllib.request.urlopen(req, timeout=self.timeout)


def _describe(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        detail = exc.read().decode("utf-8", "replace")[:300]
        return f"HTTP {exc.code}: {detail}"
    if isinstance(exc, urllib.error.URLError):
        return f"cannot connect: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def _text_of(choice: dict, kind: str, stream: bool) -> str:
    if kind == "completion":
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    # A reasoning parser moves the thinking into reasoning_content: count it too.
    return (part.get("reasoning_content") or "") + (part.get("content") or "")


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
    raw = b""
    try:
        with client.request(path, body) as response:
            if stream:
                parts = []
                for line in response:
                    raw += line
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[len(b"data:") :].strip()
                    if payload == b"[DONE]":
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        raise ValueError(f"error event: {event['error']}")
                    parts += [_text_of(c, kind, True) for c in event.get("choices", [])]
                exchange.text = "".join(parts)
            else:
                raw = response.read()
                choices = json.loads(raw).get("choices") or []
                exchange.text = "".join(_text_of(c, kind, False) for c in choices)
    except Exception as exc:
        exchange.problem = _describe(exc)
        return exchange
    if REPLACEMENT_BYTES in raw or REPLACEMENT in exchange.text:
        exchange.problem = "U+FFFD (bytes ef bf bd) in the output: the KV cache is being misread"
    elif not exchange.text.strip():
        exchange.problem = "empty output"
    return exchange


def run(
    url: str,
    model: str | None = None,
    max_tokens: int = 32,
    api_key: str | None = None,
    timeout: float = 120.0,
) -> SmokeResult:
    client = _Client(url, api_key, timeout)
    result = SmokeResult(client.base)
    try:
        with client.request("/health") as response:
            if response.status != 200:
                result.problems.append(f"/health answered {response.status}, not 200")
    except Exception as exc:
        result.problems.append(f"/health: {_describe(exc)}")
        return result
    try:
        with client.request("/v1/models") as response:
            listed = [m.get("id") for m in json.loads(response.read()).get("data", [])]
    except Exception as exc:
        result.problems.append(f"/v1/models: {_describe(exc)}")
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
    for prompt in PROMPTS:
        for kind in ("chat", "completion"):
            for stream in (False, True):
                result.exchanges.append(_exchange(client, model, kind, prompt, stream, max_tokens))
    return result
