"""Record a real provider exchange on loopback, and replay it byte for byte.

``record_stream(upstream, file)`` runs a proxy on 127.0.0.1: point an adapter at the URL it
yields and every exchange is forwarded to ``upstream`` and written to ``file`` (JSON), with
credentials scrubbed from headers and bodies. ``replay_stream(file)`` serves those responses
again, in order, in the chunks they arrived in, with nothing but the loopback interface.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http
import json
import os
import re
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

__all__ = ["record_stream", "replay_stream", "Recording", "Exchange", "LoopbackServer"]

SCRUBBED = "<scrubbed>"
# Headers whose values are credentials (lower-case); anything else is kept as sent.
SECRET_HEADERS = frozenset({
    "authorization", "x-api-key", "api-key", "cookie", "set-cookie", "proxy-authorization",
    "openai-organization", "openai-project", "anthropic-admin-key",
})
# Hop-by-hop and framing headers: the replay frames its own response.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


def _encode(data: bytes) -> dict[str, str]:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def _decode(obj: dict[str, str]) -> bytes:
    if "base64" in obj:
        return base64.b64decode(obj["base64"])
    return obj["text"].encode("utf-8")


@attrs.frozen
class Exchange:
    """One request and the response it got (``chunks``: the body as it arrived)."""

    method: str
    path: str
    request_headers: tuple[tuple[str, str], ...]
    request_body: bytes
    status: int
    response_headers: tuple[tuple[str, str], ...]
    chunks: tuple[bytes, ...]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {
            "request": {
                "method": self.method, "path": self.path,
                "headers": [list(h) for h in self.request_headers],
                "body": _encode(self.request_body),
            },
            "response": {
                "status": self.status,
                "headers": [list(h) for h in self.response_headers],
                "chunks": [_encode(c) for c in self.chunks],
            },
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Exchange:
        req, resp = obj["request"], obj["response"]
        return cls(
            req["method"], req["path"], tuple((k, v) for k, v in req["headers"]),
            _decode(req["body"]), int(resp["status"]),
            tuple((k, v) for k, v in resp["headers"]),
            tuple(_decode(c) for c in resp["chunks"]),
        )


@attrs.frozen
class Recording:
    """The exchanges of a recording file, in order."""

    exchanges: tuple[Exchange, ...]
    base_path: str = ""
    """The path of the recorded base URL (``/v1``): the replay serves under it too."""

    @classmethod
    def load(cls, file: str | os.PathLike[str]) -> Recording:
        doc = json.loads(Path(file).read_text(encoding="utf-8"))
        if doc.get("format") != "agentloop-stream/1":
            raise ValueError(f"{file} is not an agentloop stream recording")
        exchanges = tuple(Exchange.from_json(e) for e in doc["exchanges"])
        return cls(exchanges, doc.get("base_path", ""))

    def save(self, file: str | os.PathLike[str]) -> None:
        doc = {
            "format": "agentloop-stream/1",
            "base_path": self.base_path,
            "exchanges": [e.to_json() for e in self.exchanges],
        }
        Path(file).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n",
                              encoding="utf-8")


@attrs.define
class LoopbackServer:
    """A running loopback server: its base ``url`` and the exchanges seen so far."""

    url: str
    exchanges: list[Exchange] = attrs.field(factory=list)


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, list[tuple[str, str]],
                                                             bytes] | None:
    buffer = bytearray()
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    request_line, *lines = head.decode("latin-1").split("\r\n")
    method, target, _ = request_line.split(" ", 2)
    headers = []
    for line in lines:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
    body = bytearray(rest)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        body += chunk
    return method, target, headers, bytes(body[:length])


def _head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_phrase(status)}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _FRAMING]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


@contextlib.asynccontextmanager
async def _serve(handler: Any, prefix: str) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), handler, 0
        )
        port = listeners[0].socket.getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}{prefix}"
        finally:
            nursery.cancel_scope.cancel()


# A header is taken for a credential when its name says so: a provider's own key header
# (``x-goog-api-key``, ``X-Auth-Token``, ``x-subscription-key``...) is scrubbed without a
# list of every provider's spelling.
_CREDENTIAL_WORDS = ("auth", "key", "token", "secret", "password", "cookie", "credential",
                     "session", "signature")
# Query parameters that carry keys in the URL (``?key=...``, ``?api_key=...``).
_CREDENTIAL_PARAMS = frozenset({"key", "api_key", "apikey", "api-key", "token",
                                "access_token", "auth", "sig", "signature"})
# Shorter values are not looked for elsewhere: "1" or "yes" would garble every body.
_MIN_SECRET = 4


def _is_credential_header(name: str) -> bool:
    lower = name.lower()
    return lower in SECRET_HEADERS or any(word in lower for word in _CREDENTIAL_WORDS)


def _secrets_of(headers: Iterable[tuple[str, str]], path: str) -> set[bytes]:
    """The credential values a request carries, to be scrubbed wherever they appear."""
    found: set[bytes] = set()
    for name, value in headers:
        if not _is_credential_header(name):
            continue
        value = value.strip()
        found.add(value.encode())
        # A scheme-prefixed token (``Bearer sk-...``) is also echoed without its scheme.
        if " " in value:
            found.add(value.split(" ", 1)[1].strip().encode())
    query = httpx.URL(path).params
    for name, value in query.multi_items():
        if name.lower() in _CREDENTIAL_PARAMS:
            found.add(value.encode())
    return {s for s in found if len(s) >= _MIN_SECRET}


class _Scrubber:
    """Replaces every secret value in bytes or text, longest first so that a key that
    contains another is replaced whole."""

    def __init__(self, secrets: set[bytes]) -> None:
        ordered = sorted(secrets, key=len, reverse=True)
        self._pattern = (
            re.compile(b"|".join(re.escape(s) for s in ordered)) if ordered else None
        )

    def __call__(self, data: bytes) -> bytes:
        if self._pattern is None:
            return data
        return self._pattern.sub(SCRUBBED.encode(), data)

    def text(self, value: str) -> str:
        return self(value.encode()).decode("utf-8", "replace")

    def chunks(self, chunks: Iterable[bytes]) -> tuple[bytes, ...]:
        """The chunks scrubbed as one body, then cut where they were cut: a secret split
        across two reads is found whole. A cut that fell inside a secret moves to the end
        of its replacement."""
        parts = list(chunks)
        if self._pattern is None:
            return tuple(parts)
        joined = b"".join(parts)
        cuts: list[int] = []
        at = 0
        for part in parts:
            at += len(part)
            cuts.append(at)
        out = bytearray()
        # (end in the original, end in the output, shift after it) per match
        matches: list[tuple[int, int, int]] = []
        last = 0
        for m in self._pattern.finditer(joined):
            out += joined[last:m.start()]
            out += SCRUBBED.encode()
            matches.append((m.start(), m.end(), len(out) - m.end()))
            last = m.end()
        out += joined[last:]
        new_cuts: list[int] = []
        shift, i = 0, 0
        for cut in cuts:
            while i < len(matches) and matches[i][1] <= cut:
                shift = matches[i][2]
                i += 1
            if i < len(matches) and matches[i][0] < cut < matches[i][1]:
                new_cuts.append(matches[i][1] + matches[i][2])
            else:
                new_cuts.append(cut + shift)
        result: list[bytes] = []
        start = 0
        for cut in new_cuts:
            if cut > start:
                result.append(bytes(out[start:cut]))
                start = cut
        if start < len(out):
            result.append(bytes(out[start:]))
        return tuple(result)


@contextlib.asynccontextmanager
async def record_stream(
    upstream: str,
    file: str | os.PathLike[str],
    *,
    secrets: Iterable[str] = (),
    client: httpx.AsyncClient | None = None,
) -> AsyncIterator[LoopbackServer]:
    """Proxy ``upstream`` (a base URL) on loopback and record every exchange to ``file``.

    Yields a :class:`LoopbackServer` whose ``url`` replaces ``upstream`` in the adapter.
    Credentials are scrubbed by value: the values of credential headers (any whose name
    says so: ``Authorization``, ``x-api-key``, ``x-goog-api-key``, ``X-Auth-Token``, ...),
    of key parameters in the URL (``?key=``) and every string in ``secrets`` are replaced
    by ``<scrubbed>`` wherever they appear: every request and response header, the path,
    and both bodies, the response scrubbed as a whole so that a key split across two
    reads is found (the recorded chunks keep their cuts, moved out of a replaced key).
    Nothing is written before that; the file is written when the block exits.
    """
    target = httpx.URL(upstream)
    prefix = target.path.rstrip("/")
    server = LoopbackServer("")
    extra = {s.encode() for s in secrets if s}
    owned = client is None
    upstream_client = client or httpx.AsyncClient(timeout=httpx.Timeout(connect=10, read=300,
                                                             write=30, pool=30))

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request = await _read_request(stream)
            if request is None:
                return
            method, path, headers, body = request
            scrub = _Scrubber(_secrets_of(headers, path) | extra)
            url = target.copy_with(raw_path=path.encode("ascii"))
            forwarded = [(k, v) for k, v in headers if k.lower() not in (*_FRAMING, "host")]
            chunks: list[bytes] = []
            sent = upstream_client.stream(method, url, headers=forwarded, content=body)
            try:
                async with sent as response:
                    await stream.send_all(_head(response.status_code,
                                                response.headers.multi_items()))
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        async for chunk in response.aiter_raw():
                            chunks.append(chunk)
                            await stream.send_all(chunk)
            except httpx.HTTPError as exc:
                # Nothing is recorded: the client sees a gateway error that says why.
                reason = scrub(f"recording proxy could not reach {upstream}: {exc}".encode())
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(_head(502, [("Content-Type", "text/plain")]) + reason)
                return
            server.exchanges.append(Exchange(
                method, scrub.text(path),
                tuple((k, SCRUBBED if _is_credential_header(k) else scrub.text(v))
                      for k, v in headers),
                scrub(body), response.status_code,
                tuple((k, SCRUBBED if _is_credential_header(k) else scrub.text(v))
                      for k, v in response.headers.multi_items()),
                scrub.chunks(chunks),
            ))

    try:
        async with _serve(handle, prefix) as url:
            server.url = url
            yield server
    finally:
        if owned:
            await upstream_client.aclose()
        Recording(tuple(server.exchanges), prefix).save(file)


@contextlib.asynccontextmanager
async def replay_stream(
    recording: str | os.PathLike[str] | Recording, *, prefix: str | None = None
) -> AsyncIterator[LoopbackServer]:
    """Serve a recording on loopback: the n-th request gets the n-th recorded response,
    byte for byte and in the recorded chunks; a request beyond the recording gets a 599.

    ``url`` ends with the recorded base path (e.g. ``/v1``) unless ``prefix`` says
    otherwise; ``exchanges`` holds what the replay received (with the response it sent), so
    a test can compare the requests with the recorded ones.
    """
    rec = recording if isinstance(recording, Recording) else Recording.load(recording)
    if prefix is None:
        prefix = rec.base_path
    server = LoopbackServer("")
    queue = list(rec.exchanges)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request = await _read_request(stream)
            if request is None:
                return
            method, path, headers, body = request
            if not queue:
                await stream.send_all(_head(599, [("Content-Type", "text/plain")])
                                      + b"the recording has no more exchanges")
                return
            recorded = queue.pop(0)
            server.exchanges.append(attrs.evolve(
                recorded, method=method, path=path, request_headers=tuple(headers),
                request_body=body,
            ))
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(_head(recorded.status, recorded.response_headers))
                for chunk in recorded.chunks:
                    await stream.send_all(chunk)

    async with _serve(handle, prefix) as url:
        server.url = url
        yield server
