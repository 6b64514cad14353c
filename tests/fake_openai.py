"""A fake OpenAI-compatible chat server on a thread, for the command-line tests.

It runs on a thread (stdlib ``http.server``), so it serves both ``main()`` called in-process
(which runs its own ``trio.run``) and ``python -m agentloop`` subprocesses in a pty. The
``fake`` fixture is made available to every test by ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

ANSWER = ["Hello", " from", " the", " fake", " model."]
REFUSAL = 'response_format: unsupported type "json_schema"'


@attrs.define
class Reply:
    """One scripted response: text chunks, or an HTTP error; ``gate`` pauses after chunk 1."""

    chunks: list[str] = attrs.field(factory=lambda: list(ANSWER))
    status: int = 200
    error: str = ""
    gate: threading.Event | None = None
    tool: tuple[str, dict[str, Any]] | None = None
    reasoning: list[str] = attrs.field(factory=list)


@attrs.define
class FakeOpenAI:
    url: str = ""
    replies: list[Reply] = attrs.field(factory=list)
    requests: list[dict[str, Any]] = attrs.field(factory=list)
    headers: list[dict[str, str]] = attrs.field(factory=list)
    refuse_response_format: int = 0
    """When set, a request carrying ``response_format`` is answered with this status and an
    error naming it (as servers without JSON-schema support answer), no scripted reply used."""

    def next_reply(self) -> Reply:
        return self.replies.pop(0) if self.replies else Reply()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _handler(fake: FakeOpenAI) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            fake.requests.append(json.loads(body))
            fake.headers.append({k.lower(): v for k, v in self.headers.items()})
            if fake.refuse_response_format and "response_format" in fake.requests[-1]:
                reply = Reply(status=fake.refuse_response_format, error=REFUSAL)
            else:
                reply = fake.next_reply()
            if reply.status != 200:
                payload = json.dumps({"error": {"message": reply.error, "type": "auth"}})
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(_chunk({"role": "assistant", "content": None}))
                for thought in reply.reasoning:
                    self.wfile.write(_chunk({"reasoning_content": thought}))
                for i, text in enumerate(reply.chunks):
                    self.wfile.write(_chunk({"content": text}))
                    self.wfile.flush()
                    if i == 0 and reply.gate is not None:
                        reply.gate.wait(30)
                if reply.tool is not None:
                    name, arguments = reply.tool
                    call = {"index": 0, "id": "call-1", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}
                    self.wfile.write(_chunk({"tool_calls": [call]}))
                    self.wfile.write(_chunk({}, "tool_calls"))
                else:
                    self.wfile.write(_chunk({}, "stop"))
                usage = {"prompt_tokens": 5, "completion_tokens": len(reply.chunks)}
                tail = json.dumps({"choices": [], "usage": usage})
                self.wfile.write(f"data: {tail}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    state = FakeOpenAI()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        for reply in state.replies:
            if reply.gate is not None:
                reply.gate.set()
        server.shutdown()
        server.server_close()
