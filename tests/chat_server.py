"""A local OpenAI-compatible chat completions server for the judge's tests, in a thread of the test process.

The first path segment picks its behaviour (base_url http://127.0.0.1:<port>/<mode>/v1):
- ok: answers "Score: <d>" with d a digit derived from the request's last message and seed (deterministic);
- flaky: answers HTTP 429 to the first two requests of each conversation, then as ok;
- slow: sleeps 2 s before answering (past a short client timeout);
- garbage: answers 200 with a body that is not JSON;
- babble: answers a valid completion with no number in it (an unparsable verdict);
- reject: answers HTTP 400.
Every request is recorded (mode, seed, temperature, last message) in ``requests``; ``max_in_flight`` is the most
answered at once. ``pause_at``: the pause_at-th ok request writes ``reached`` into ``pause_dir`` and is never answered
(a test kills the run there).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def verdict_for(content: str, seed: int) -> str:
    digit = hashlib.sha256(f"{seed}/{content}".encode()).digest()[0] % 10
    return f"The answer is considered. Score: {digit}"


class ChatServer:
    def __init__(self, *, delay_s: float = 0.0, pause_at: int | None = None, pause_dir: Path | None = None):
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.delay_s, self.pause_at, self.pause_dir = delay_s, pause_at, pause_dir
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{mode}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                mode = self.path.strip("/").split("/")[0]
                content = body["messages"][-1]["content"]
                with server.lock:
                    server.requests.append(
                        {"mode": mode, "seed": body.get("seed"), "temperature": body["temperature"], "content": content}
                    )
                    count = sum(r["mode"] == mode for r in server.requests)
                    tries = sum(r["content"] == content for r in server.requests)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    self._answer(mode, content, body, count=count, tries=tries)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, mode: str, content: str, body: dict, *, count: int, tries: int) -> None:
                time.sleep(server.delay_s)
                if mode == "ok" and server.pause_at is not None and count >= server.pause_at:
                    (server.pause_dir / "reached").write_text("")
                    time.sleep(3600)  # the test kills the run that waits here
                if mode == "slow":
                    time.sleep(2.0)
                if mode == "reject" or (mode == "flaky" and tries <= 2):
                    return self._send(400 if mode == "reject" else 429, b'{"error": "no"}')
                if mode == "garbage":
                    return self._send(200, b"<html>not json</html>")
                text = "I cannot say." if mode == "babble" else verdict_for(content, body.get("seed"))
                usage = {"prompt_tokens": 3, "completion_tokens": len(text.split())}
                payload = {"choices": [{"message": {"role": "assistant", "content": text}}], "usage": usage}
                self._send(200, json.dumps(payload).encode())

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

        return Handler
