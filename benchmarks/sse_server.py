"""An OpenAI-compatible chat server in a process of its own, for benchmarks over real HTTP.

    python benchmarks/sse_server.py STEPS CHUNKS

(or ``with sse_server.started(STEPS, CHUNKS) as base_url:`` from a benchmark).

Prints its port on the first line of stdout, then serves ``POST /v1/chat/completions`` until
stdin closes. Every request gets the same streamed reply, as a server streaming a model does
it: each server-sent event in a chunk of its own, written and flushed as it is made (with
``TCP_NODELAY``, so the kernel does not merge them). A reply is ``CHUNKS`` content deltas of
five characters, then, while the request carries fewer than ``STEPS - 1`` tool results, one
call of the ``noop`` tool; then the finish reason, usage and ``[DONE]``. In a process of its
own, the server's work is not on the CPU clock of the process it serves.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _event(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    payload = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
        "model": "bench", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def handler(steps: int, chunks: int) -> type[http.server.BaseHTTPRequestHandler]:
    text = [_event(_delta({"content": "abcde"})) for _ in range(chunks)]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a provider's API is used

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
            results = sum(1 for m in body["messages"] if m.get("role") == "tool")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            events = [_event(_delta({"role": "assistant", "content": ""})), *text]
            finish = "stop"
            if results < steps - 1:
                finish = "tool_calls"
                events.append(_event(_delta({"tool_calls": [{
                    "index": 0, "id": f"call_{results}", "type": "function",
                    "function": {"name": "noop", "arguments": "{}"},
                }]})))
            events.append(_event(_delta({}, finish)))
            usage = {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
            events.append(_event({**_delta({}), "choices": [], "usage": usage}))
            events.append(_event("[DONE]"))
            events.append(b"0\r\n\r\n")
            for event in events:
                self.wfile.write(event)
                self.wfile.flush()

    return Handler


@contextlib.contextmanager
def started(steps: int, chunks: int) -> Iterator[str]:
    """The base URL of this server running in a process of its own, until the block ends."""
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__)), str(steps), str(chunks)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)


def main() -> None:
    steps, chunks = int(sys.argv[1]), int(sys.argv[2])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(steps, chunks))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], flush=True)
    sys.stdin.read()  # until the benchmark closes it (or exits)
    server.shutdown()


if __name__ == "__main__":
    main()
