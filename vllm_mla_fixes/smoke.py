"""``vllm-mla-fixes smoke URL``: is a running OpenAI-compatible server answering in text?

The check the DeepSeek-V4.1 report asks for after start-up, against a live
``vllm serve``: ``/health`` answers 200, the model is listed by ``/v1/models``,
and a chat and a completion of each prompt (:data:`PROMPTS`), streamed and not,
come back as non-empty text without U+FFFD (UTF-8 ``ef bf bd``), the
replacement character a wrong KV page turns every token into.  Standard
library only, so it runs anywhere an operator has Python.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import cast

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


REDACTED = "***"


@dataclass
class SmokeResult:
    url: str
    model: str | None = None
    problems: list[str] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    secrets: tuple[str, ...] = ()  # never shown: every text of the report is redacted

    @property
    def ok(self) -> bool:
        return not self.problems and all(e.problem is None for e in self.exchanges)

    def _redacted(self, text: str | None) -> str | None:
        for secret in self.secrets:
            if text is not None:
                text = text.replace(secret, REDACTED).replace(repr(secret)[1:-1], REDACTED)
        return text

    def as_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "model": self._redacted(self.model),
            "ok": self.ok,
            "problems": [self._redacted(p) for p in self.problems],
            "exchanges": [
                {
                    "kind": e.kind,
                    "prompt": e.prompt,
                    "stream": e.stream,
                    "text": self._redacted(e.text),
                    "problem": self._redacted(e.problem),
                }
                for e in self.exchanges
            ],
        }

    def text(self) -> str:
        lines = [f"smoke {self.url} model {self._redacted(self.model) or '?'}"]
        lines += [f"  FAIL {self._redacted(p)}" for p in self.problems]
        for e in self.exchanges:
            problem = self._redacted(e.problem)
            lines.append(
                f"  {'ok  ' if problem is None else 'FAIL'} {e.label}: "
                f"{problem + ': ' if problem else ''}{self._redacted(repr(e.text))}"
            )
        lines.append("verdict: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


class BadAnswer(ValueError):
    """The server answered, but not in the OpenAI wire format."""


class DeadlinePassed(Exception):
    """The overall deadline passed before or while a request ran."""


class _Watchdog:
    """Ends every connection still open when the overall deadline passes:
    a server that drips its headers or body a byte at a time never lets a
    per-read timeout fire, so the deadline is kept by shutting the socket
    down under the blocked read (which then returns at once)."""

    def __init__(self, seconds: float) -> None:
        self.expired = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        if self.expired.is_set():
            self._shut(sock)

    def _expire(self) -> None:
        self.expired.set()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed already: the request had ended
            sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._timer.cancel()


def _watched_handlers(watchdog: _Watchdog) -> list[urllib.request.BaseHandler]:
    """urllib's HTTP and HTTPS handlers, whose connections the watchdog sees
    (proxies from the environment still apply, as with plain urlopen)."""

    class WatchedHTTP(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            watchdog.watch(self.sock)

    class WatchedHTTPS(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            watchdog.watch(self.sock)

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(WatchedHTTP, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(WatchedHTTPS, req)

    return [HTTPHandler(), HTTPSHandler()]


class _Client:
    def __init__(self, base: str, api_key: str | None, timeout: float, deadline: float):
        parts = urllib.parse.urlsplit(base.rstrip("/"))
        # user:password in the URL is sent as HTTP basic auth, never in the URL
        self.base = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        elif parts.username is not None:
            user_password = f"{parts.username}:{parts.password or ''}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(
                urllib.parse.unquote(user_password).encode()
            ).decode("ascii")
        self.timeout = timeout
        self.deadline = deadline
        self.deadline_at = time.monotonic() + deadline
        self.watchdog = _Watchdog(deadline)
        self.opener = urllib.request.build_opener(*_watched_handlers(self.watchdog))
        self.waited = timeout  # the socket timeout of the latest request
        self.limit = "--timeout"  # which limit set it

    def check_deadline(self) -> None:
        if self.watchdog.expired.is_set() or time.monotonic() >= self.deadline_at:
            raise DeadlinePassed

    def request(self, path: str, body: dict[str, object] | None = None) -> http.client.HTTPResponse:
        self.check_deadline()
        left = self.deadline_at - time.monotonic()
        # every read waits at most this long; the watchdog bounds the whole
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
        # typeshed types open()'s answer Any; an http(s) URL's is an HTTPResponse
        return cast(http.client.HTTPResponse, self.opener.open(req, timeout=self.waited))

    def describe(self, exc: Exception) -> str:
        if isinstance(exc, DeadlinePassed) or self.watchdog.expired.is_set():
            return (
                f"stalled: the overall deadline ({self.deadline:g} s, --deadline) passed "
                "before the answer ended"
            )
        if isinstance(exc, urllib.error.HTTPError):
            try:
                detail = exc.read(300).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):  # the error's body broke off
                detail = ""
            return f"HTTP {exc.code}: {detail}"
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"stalled: no answer within {self.waited:.3g} s ({self.limit})"
        if isinstance(exc, urllib.error.URLError):
            return f"cannot connect: {exc.reason}"
        if isinstance(exc, BadAnswer):
            return str(exc)
        return f"{type(exc).__name__}: {exc}"


def _json(raw: bytes, what: str) -> object:
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


def _choices(payload: object) -> list[object]:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        raise BadAnswer(f"malformed answer: no list of choices in {payload!r:.80}")
    return choices


def _exchange(
    client: _Client, model: str, kind: str, prompt: str, stream: bool, max_tokens: int
) -> Exchange:
    exchange = Exchange(kind, prompt, stream)
    body: dict[str, object] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
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
        client.check_deadline()  # an answer that ended only after the deadline is not ok
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
    """Every check, within ``timeout`` seconds per read and ``deadline``
    seconds in all (a wall-clock bound: requests the deadline leaves no time
    for are not run, and one still running then is ended)."""
    client = _Client(url, api_key, timeout, deadline)
    result = SmokeResult(redact_url(url.rstrip("/")), secrets=_secrets(url, api_key))
    try:
        _check(client, result, model, max_tokens)
    finally:
        client.watchdog.stop()
    return result


def _check(client: _Client, result: SmokeResult, model: str | None, max_tokens: int) -> None:
    try:
        with client.request("/health") as response:
            if response.status != 200:
                result.problems.append(f"/health answered {response.status}, not 200")
        client.check_deadline()
    except Exception as exc:
        result.problems.append(f"/health: {client.describe(exc)}")
        return
    try:
        with client.request("/v1/models") as response:
            listed = _listed_models(_json(response.read(), "the answer"))
        client.check_deadline()
    except Exception as exc:
        result.problems.append(f"/v1/models: {client.describe(exc)}")
        return
    if model is None:
        if not listed:
            result.problems.append("/v1/models lists no model")
            return
        model = listed[0]
    elif model not in listed:
        result.problems.append(f"model {model!r} is not listed by /v1/models ({listed})")
        return
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
                f"the overall deadline ({client.deadline:g} s, --deadline) passed: "
                f"{len(planned) - done} of {len(planned)} requests not run, from {label} on"
            )
            break


def redact_url(url: str) -> str:
    """``url`` without the password (or token) its user part may carry."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    user, _, host = parts.netloc.rpartition("@")
    shown = user.partition(":")[0] + (":***" if ":" in user else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{shown}@{host}"))


def _secrets(url: str, api_key: str | None) -> tuple[str, ...]:
    """What no message or report may show: the API key and the URL's password,
    as given and as they travel (percent-encoded, in the header)."""
    password = urllib.parse.urlsplit(url).password
    found = {api_key, password, password and urllib.parse.unquote(password)}
    return tuple(sorted((s for s in found if s and s.strip()), key=len, reverse=True))
