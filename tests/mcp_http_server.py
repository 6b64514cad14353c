"""An MCP server over streamable HTTP on 127.0.0.1, built with the ``mcp`` package's server API.

    python tests/mcp_http_server.py PORT_FILE [--port N] [--token T]

It binds ``--port`` (default: any free port), writes the port to ``PORT_FILE``, then prints
``READY``. With ``--token`` every request must carry ``Authorization: Bearer T`` (else 401),
as a hosted server's would.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer

app = MCPServer("http-test")


@app.tool()
def echo(text: str) -> str:
    """Say ``text`` back."""
    return f"echo: {text}"


@app.tool()
async def hang() -> str:
    """Never answers."""
    await anyio.sleep_forever()
    return "unreachable"


@app.tool()
def crash() -> str:
    """Kills this server in the middle of the call."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@app.resource("note://greeting", name="greeting", mime_type="text/plain")
def greeting() -> str:
    """A short note."""
    return "hello from a resource"


def _guard(inner: Any, token: str | None) -> Any:
    expected = f"Bearer {token}".encode()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if token is not None and scope["type"] == "http":
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != expected:
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await inner(scope, receive, send)

    return guarded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port_file")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(16)
    starlette = app.streamable_http_app()
    config = uvicorn.Config(_guard(starlette, args.token), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    with open(args.port_file, "w") as f:
        f.write(str(sock.getsockname()[1]))
    print("READY", flush=True)
    sys.stdout.flush()
    anyio.run(lambda: server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
