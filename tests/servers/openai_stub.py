"""An OpenAI-compatible HTTP server on loopback, standing in for ``vllm serve``
(a CPU cannot run vLLM's inference).  It speaks the wire format vLLM's API
server speaks: JSON replies, and server-sent events ending in ``data: [DONE]``
for ``"stream": true``.

    python openai_stub.py MODE   # prints the port, then serves until killed

MODE: ``good`` (text replies), ``fffd`` (every token U+FFFD, as a misread KV
cache decodes), ``empty`` (no text), ``error`` (HTTP 500 on generation),
``unhealthy`` (/health answers 503); and answers a client must survive:
``stall`` (generation requests never answer), ``stall-health`` (/health never
answers), ``trickle`` (streamed answers never end: one event every 0.2 s),
``models-not-json`` and ``models-null`` (/v1/models answers ``not json`` or
``{"data": [null]}``), ``answers-not-json`` and ``choices-null`` (generation
answers ``not json`` or ``{"choices": [null]}``), ``drip-headers`` (every
answer's status line and headers one byte every 0.3 s), ``drip-body``
(generation answers whole and correct, one byte every 0.05 s: each takes
seconds), ``echo-auth`` (/v1/models answers 401 quoting the Authorization
header it was sent, as a careless proxy does).
"""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
MODE = sys.argv[1]


def reply(prompt: str) -> str:
    if MODE == "fffd":
        return "\ufffd" * 6
    if MODE == "empty":
        return ""
    return "17*19 = 323." if "17" in prompt else "Hello! How can I help?"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        if MODE == "drip-headers":
            head = f"HTTP/1.1 {status} OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            return self.drip(head + body, 0.3)
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if MODE == "drip-body" and self.command == "POST":
            return self.drip(body, 0.05)
        self.wfile.write(body)

    def drip(self, data: bytes, seconds: float) -> None:
        try:
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(seconds)
        except OSError:  # the client gave up
            return

    def stall(self) -> None:
        time.sleep(3600)  # the test kills the server long before

    def do_GET(self):
        if self.path == "/health":
            if MODE == "stall-health":
                return self.stall()
            self.send(503 if MODE == "unhealthy" else 200, b"")
        elif self.path == "/v1/models":
            if MODE == "echo-auth":
                said = f"invalid key: {self.headers.get('Authorization')}"
                return self.send(401, json.dumps({"error": said}).encode())
            if MODE == "models-not-json":
                return self.send(200, b"not json")
            listed = [None] if MODE == "models-null" else [{"id": MODEL, "object": "model"}]
            self.send(200, json.dumps({"object": "list", "data": listed}).encode())
        else:
            self.send(404, b'{"error": "not found"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            return self.send(404, b'{"error": "not found"}')
        if MODE == "error":
            return self.send(500, b'{"error": {"message": "EngineCore died"}}')
        if MODE == "stall":
            return self.stall()
        if MODE == "answers-not-json":
            return self.send(200, b"not json")
        if MODE == "choices-null":
            return self.send(200, b'{"choices": [null]}')
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        text = reply(prompt)
        if not body.get("stream"):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            return self.send(
                200, json.dumps({"model": MODEL, "choices": [choice]}, ensure_ascii=False).encode()
            )
        events = []
        for piece in [text[i : i + 3] for i in range(0, len(text), 3)] or [""]:
            choice = (
                {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            )
            events.append(
                b"data: " + json.dumps({"choices": [choice]}, ensure_ascii=False).encode() + b"\n\n"
            )
        if MODE == "trickle":  # a stream that never ends: one event every 0.2 s
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(events[0])
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the client gave up
                return
        events.append(b"data: [DONE]\n\n")
        self.send(200, b"".join(events), "text/event-stream")


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
