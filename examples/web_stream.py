"""A small trio web service that streams an agent's answer to the browser as it is written.

    python examples/web_stream.py [PORT]
    curl -N 'http://127.0.0.1:8000/ask?q=hello'

``GET /ask?q=...`` answers with ``text/event-stream``: one ``data:`` event per text delta (a
JSON string), then ``event: done`` with the turn's reason and usage, or ``event: error`` when
the turn failed. Each request gets an agent of its own. A client that hangs up leaves the run
block, which cancels that turn and nothing else. Plain trio sockets, no web framework: the
point is the run handle, not the HTTP.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

import agentloop
from agentloop.llm import LLMRequest
from agentloop.testing import Finish, FunctionModel, TextDelta

MAX_HEAD = 16384
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
)


def sse(data: object, event: str | None = None) -> bytes:
    """One server-sent event, framed as one HTTP chunk."""
    text = (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"
    body = text.encode()
    return b"%x\r\n%s\r\n" % (len(body), body)


async def read_head(stream: trio.SocketStream) -> bytes | None:
    buffer = bytearray()
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > MAX_HEAD:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        buffer += chunk
    return bytes(buffer.split(b"\r\n\r\n", 1)[0])


async def respond(stream: trio.SocketStream, status: str, text: str) -> None:
    body = text.encode()
    await stream.send_all(
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )


async def watch_hangup(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    # Reading is the only way to notice a client that left while the model is still thinking.
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    scope.cancel()


async def stream_answer(
    stream: trio.SocketStream, agent: agentloop.Agent, question: str
) -> None:
    await stream.send_all(SSE_HEAD)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_hangup, stream, nursery.cancel_scope)
        async with agent.run(question, source={"via": "http"}) as run:
            async for delta in run.text():
                await stream.send_all(sse(delta))
        try:
            result = await run.result()
            tail = sse({"reason": result.reason, "turn": result.turn, "usage": result.usage},
                       "done")
        except agentloop.TurnFailed as failed:
            tail = sse({"turn": failed.turn, "message": str(failed)}, "error")
        await stream.send_all(tail + b"0\r\n\r\n")
        nursery.cancel_scope.cancel()
    # After a hang-up the run block was left by the cancel: wait for the turn it cancelled to
    # close, so the agent's log ends with that turn's own turn/end before it is disposed.
    with trio.move_on_after(5), contextlib.suppress(agentloop.TurnFailed):
        await run.result()


async def handle(
    stream: trio.SocketStream, ctx: agentloop.Context, options: agentloop.AgentOptions
) -> None:
    async with stream:
        try:
            head = await read_head(stream)
            if head is None:
                return
            try:
                method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            except ValueError:
                await respond(stream, "400 Bad Request", "malformed request line\n")
                return
            url = urllib.parse.urlsplit(target)
            question = urllib.parse.parse_qs(url.query).get("q", [""])[0]
            if url.path != "/ask":
                await respond(stream, "404 Not Found", "try GET /ask?q=...\n")
            elif method != "GET":
                await respond(stream, "405 Method Not Allowed", "GET only\n")
            elif not question.strip():
                await respond(stream, "400 Bad Request", "the q parameter is empty\n")
            else:
                session_id = f"web-{uuid.uuid4().hex[:12]}"
                async with await ctx.agents.create(
                    session_id=session_id, agent_options=options
                ) as handle_:
                    await stream_answer(stream, handle_.agent, question)
        except trio.BrokenResourceError:
            pass  # the client left mid-write; its turn was cancelled on the way out


def app(
    ctx: agentloop.Context, options: agentloop.AgentOptions
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """The connection handler to pass to ``trio.serve_tcp``."""
    return functools.partial(handle, ctx=ctx, options=options)


async def echo(request: LLMRequest) -> AsyncIterator[Any]:
    """A stand-in model that answers by repeating the question, a word at a time."""
    question = request.messages[-1].text
    for word in f"You asked: {question}".split(" "):
        await trio.sleep(0.05)
        yield TextDelta(word + " ")
    yield Finish("stop")


async def main(port: int) -> None:
    async with agentloop.open_runtime() as rt:
        rt.llm.register("echo", FunctionModel(echo))
        options = agentloop.AgentOptions(provider="echo", model="echo")
        print(f"serving http://127.0.0.1:{port}/ask?q=hello", flush=True)
        await trio.serve_tcp(app(rt, options), port, host="127.0.0.1")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
