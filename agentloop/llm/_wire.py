"""What the HTTP model adapters share: SSE decoding, the request loop and error mapping."""

from __future__ import annotations

import codecs
import contextlib
import email.utils
import functools
import json
import math
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, Protocol, cast

import attrs
import httpx
import trio

from .._errors import ConfigError, ProviderError
from .._http import client_for
from .._model import CallConfig, Finish, HistorySnapshot, LLMRequest, Message, StreamPart
from ._base import AdapterDefaults, ModelAdapter, check_retry
from ._efforts import AllowedEfforts, allowed_efforts, effort_problem
from ._retry import RetryPolicy
from ._secrets import Secrets, check_api_key, check_headers, shown_url

__all__ = [
    "SSEEvent",
    "SSEDecoder",
    "PartDecoder",
    "HTTPStreamAdapter",
    "dumps",
    "encode_body",
    "repair_surrogates",
    "parse_event_json",
    "error_fields",
    "int_counters",
]

_LINE_END = re.compile(r"\r\n|\r|\n")
_SNIPPET = 300
_DRAIN_SECONDS = 1.0


def dumps(value: object) -> str:
    """Compact, deterministic JSON: the same value always gives the same text."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def repair_surrogates(text: str) -> str:
    """``text`` made encodable as UTF-8: a surrogate pair is joined, a lone one becomes U+FFFD."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def encode_body(value: object) -> bytes:
    """The UTF-8 request body for ``value`` (see :func:`dumps`).

    A lone surrogate (which a JSON escape such as ``"\\ud83d"`` in a provider's stream decodes
    to) cannot be encoded as UTF-8; it is sent as U+FFFD, so that one such string kept in a
    history does not make every later request of the session fail.
    """
    return encode_text(dumps(value))


def encode_text(text: str) -> bytes:
    """``text`` as UTF-8, a lone surrogate sent as U+FFFD (see :func:`encode_body`)."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return repair_surrogates(text).encode()


class MessageEncoder:
    """Each history message's wire JSON, encoded once per history rather than once per call.

    A request's body holds the whole conversation, so encoding it afresh would cost every
    step in proportion to the history. Messages of a :class:`HistorySnapshot` are encoded
    as the history grows and kept in its memo (with the session's history, and gone with
    it); other sequences are encoded whole. ``wire`` gives the JSON items a message is sent
    as (none, one or more) from the message alone, never from its place or its neighbours.
    """

    __slots__ = ("_wire",)

    def __init__(self, wire: Callable[[Message], list[Any]]) -> None:
        self._wire = wire

    def _encoded(self, message: Message) -> bytes:
        return b",".join([encode_text(dumps(item)) for item in self._wire(message)])

    def fragments(self, messages: Sequence[Message]) -> list[bytes]:
        """One fragment per message: its items encoded and joined by commas (``b""`` for
        none); join the non-empty ones for the list of items."""
        if not isinstance(messages, HistorySnapshot):
            return [self._encoded(m) for m in messages]
        n = len(messages)
        done: list[bytes] = messages.memo(self, list)
        done.extend(self._encoded(messages[i]) for i in range(len(done), n))
        return done if n == len(done) else done[:n]


@functools.cache
def _splices(cls: type[HTTPStreamAdapter]) -> bool:
    """Whether ``cls`` builds its body as the base does, from ``_fragments`` at least as
    derived as its ``_items`` (a subclass that changes its items alone is encoded whole)."""
    mro = cls.__mro__

    def owner(name: str) -> int:
        return next(i for i, c in enumerate(mro) if name in c.__dict__)

    return mro[owner("_body")] is HTTPStreamAdapter and owner("_fragments") <= owner("_items")


# Stands for the spliced list while the rest of a body is encoded; random, so that no value
# in a request can be mistaken for it.
_SPLICE: Final = f"agentloop-splice-{uuid.uuid4().hex}"
_SPLICE_JSON: Final = json.dumps(_SPLICE)


def splice_body(body: dict[str, Any], key: str, fragments: Iterable[bytes]) -> bytes:
    """``encode_body(body)`` with ``body[key]`` the JSON list whose items are already encoded
    as ``fragments`` (empty ones stand for no item): the same bytes, the list joined rather
    than encoded again. ``body`` is changed only while this runs."""
    value = body[key]
    body[key] = _SPLICE
    try:
        before, *after = dumps(body).split(_SPLICE_JSON)
    finally:
        body[key] = value
    if len(after) != 1:
        raise AssertionError(f"the splice marker appears {len(after)} times in the body")
    return b"".join((
        encode_text(before), b"[", b",".join(filter(None, fragments)), b"]",
        encode_text(after[0]),
    ))


@attrs.frozen(slots=True)
class SSEEvent:
    """One server-sent event: its ``event`` name (``"message"`` when unnamed) and ``data``."""

    event: str
    data: str


class SSEDecoder:
    """An incremental server-sent-events parser over text chunks split anywhere.

    Unlike the SSE specification (and httpx-sse, which this replaces), :meth:`close`
    dispatches a final event that was not followed by a blank line: real provider streams
    end that way.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._event = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[SSEEvent]:
        """The events completed by ``text``."""
        # Rescan only from the end of what was already searched (minus a held-back "\r").
        scan_from = max(len(self._buffer) - 1, 0)
        self._buffer += text
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(self._buffer, scan_from):
            if match.group() == "\r" and match.end() == len(self._buffer):
                break  # maybe the first half of "\r\n": wait for the next chunk
            self._line(self._buffer[start : match.start()], events)
            start = match.end()
        self._buffer = self._buffer[start:]
        return events

    def close(self) -> list[SSEEvent]:
        """The events left at the end of the stream, including an unterminated last one."""
        events = self.feed("\n") if self._buffer else []
        self._line("", events)
        return events

    def _line(self, line: str, events: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                events.append(SSEEvent(self._event or "message", "\n".join(self._data)))
            self._event = ""
            self._data = []
            return
        if line.startswith(":"):
            return
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)


class PartDecoder(Protocol):
    """Turns one provider's events into stream parts; one instance per call."""

    @property
    def done(self) -> bool:
        """True once the provider said the response is complete; nothing more is read."""
        ...

    def feed(self, event: SSEEvent) -> list[StreamPart]:
        """The parts carried by ``event``; raises :class:`ProviderError` on an error event."""
        ...

    def finish(self) -> Finish:
        """The final part, or :class:`ProviderError` when the stream stopped short."""
        ...


class MalformedEventError(ProviderError):
    """An event whose data is not a JSON object.

    The adapter turns it into a plain :class:`ProviderError` quoting the start of ``data``
    once its secrets are masked: masking after the cut could miss a secret cut in half.
    """

    def __init__(self, problem: str, data: str) -> None:
        super().__init__(problem, code="malformed_stream")
        self.data = data


def parse_event_json(data: str) -> dict[str, Any]:
    """The JSON object of an event's data, or ``ProviderError(code="malformed_stream")``."""
    try:
        value = json.loads(data)
    except ValueError:
        raise MalformedEventError("malformed JSON in the event stream", data) from None
    if not isinstance(value, dict):
        raise MalformedEventError("expected a JSON object in the event stream", data)
    return value


def error_fields(payload: object) -> tuple[str | None, str | None]:
    """The provider's ``(message, code)`` from an error body or an in-stream error object.

    Handles ``{"error": {"message", "type", "code"}}`` (OpenAI, Anthropic and most
    compatible servers), ``{"error": "text"}`` and a top-level ``message``/``detail``.
    """
    if not isinstance(payload, Mapping):
        return None, None
    error = payload.get("error", payload)
    if isinstance(error, str):
        return error, None
    if not isinstance(error, Mapping):
        return None, None
    message = error.get("message", error.get("detail"))
    code = error.get("code")
    if not isinstance(code, str) or not code:
        kind = error.get("type")
        if isinstance(kind, str) and kind and kind != "error":
            code = kind
        elif isinstance(code, int) and not isinstance(code, bool):
            code = str(code)
        else:
            code = None
    return (message if isinstance(message, str) and message else None), code


def int_counters(usage: object) -> dict[str, int]:
    """The integer counters of a usage object, nested detail objects flattened one level."""
    counters: dict[str, int] = {}
    if not isinstance(usage, Mapping):
        return counters
    nested: dict[str, int] = {}
    for key, value in usage.items():
        if isinstance(value, int) and not isinstance(value, bool):
            counters[key] = value
        elif isinstance(value, Mapping):
            for inner, count in value.items():
                if isinstance(count, int) and not isinstance(count, bool):
                    nested.setdefault(inner, count)
    for key, value in nested.items():
        counters.setdefault(key, value)
    return counters


def _retry_after(headers: httpx.Headers) -> float | None:
    millis = headers.get("retry-after-ms")
    if millis is not None:
        with contextlib.suppress(ValueError):
            value = float(millis) / 1000.0
            if math.isfinite(value) and value >= 0:
                return value
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        return max(when.timestamp() - time.time(), 0.0)
    return value if math.isfinite(value) and value >= 0 else None


def _check_base_url(base_url: object, kind: str) -> str:
    """``base_url`` without its trailing slash, or ``ConfigError`` saying what is wrong with
    it (userinfo masked): a URL httpx cannot parse would otherwise fail every call later,
    as a bare ``ValueError``."""
    if not isinstance(base_url, str):
        raise ConfigError(f"the {kind} adapter: base_url must be a string, got "
                          f"{type(base_url).__name__}")
    try:
        url = httpx.URL(base_url)
        scheme, host = url.scheme, url.host
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        shown = shown_url(base_url)
        raise ConfigError(f"the {kind} adapter: base_url {shown!r} is not a valid URL: "
                          f"{exc}") from None
    if scheme not in ("http", "https") or not host:
        shown = shown_url(base_url)
        raise ConfigError(f"the {kind} adapter: base_url {shown!r} must be an http:// or "
                          "https:// URL with a host")
    return base_url.rstrip("/")


class HTTPStreamAdapter(ModelAdapter):
    """Common machinery of the streaming HTTP adapters (subclasses give the wire format).

    The API key and ``headers`` are checked when the adapter is built: a value that is not a
    valid HTTP header value raises :class:`agentloop.ConfigError` naming the adapter and what
    is wrong, never the value. Such a value is refused, not cleaned up, because a key silently
    stripped of its trailing newline hides a broken key file.

    The key, the values of secret-looking headers (``Authorization``, ``X-Api-Key``, any name
    containing ``key``, ``token``, ``secret`` or ``auth``) and a password in ``base_url`` are
    masked as ``***`` in everything the adapter raises (messages, codes, the chained causes)
    and in its ``repr``.

    ``reasoning_effort`` is the adapter's to judge (see :mod:`agentloop.llm._efforts`): a
    value it does not support raises :class:`agentloop.ConfigError` naming the provider, the
    field and the allowed values, when the adapter is built (for ``defaults``) and in
    :meth:`validate` (for a call). ``retry`` is the provider's retry policy, captured when
    the adapter is registered.
    """

    _path: ClassVar[str]
    _kind: ClassVar[str] = "HTTP"
    _raises_provider_errors: ClassVar[bool] = True
    _default_defaults: ClassVar[AdapterDefaults] = AdapterDefaults()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "stream" in cls.__dict__:
            # A stream of its own makes no promise about its failures: the runtime guards it.
            cls._raises_provider_errors = False

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        defaults: AdapterDefaults | None = None,
        retry: RetryPolicy | None = None,
        reasoning_efforts: AllowedEfforts = None,
    ) -> None:
        self.base_url = _check_base_url(base_url, self._kind)
        self.defaults = _with_fallback(defaults, self._default_defaults)
        # The URL can hold secrets of its own (userinfo, an ``api-key`` query parameter).
        shown = Secrets.of(None, {}, self.base_url).scrub(shown_url(self.base_url))
        where = f"the {self._kind} adapter at {shown}"
        self._where = where
        check_api_key(api_key, where=where)
        check_headers(headers, where=where)
        check_retry(type(self).__name__, retry)
        self.retry = retry
        try:
            self._efforts = allowed_efforts(reasoning_efforts, self.base_url)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        problem = self._effort_problem(self.defaults.reasoning_effort)
        if problem is not None:
            raise ConfigError(f"{where}: defaults: {problem}")
        self._api_key = api_key or None
        self._headers = dict(headers or {})
        self._client = client
        self._secrets = Secrets.of(self._api_key, self._headers, self.base_url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self._clean(shown_url(self.base_url))!r})"

    def validate(self, config: CallConfig) -> None:
        """Refuse a call that cannot be made: no model (``ProviderError(code=
        "invalid_config")``), or a ``reasoning_effort`` this adapter does not support
        (:class:`agentloop.ConfigError`, which the runtime reports as ``invalid_config``).

        The runtime calls it once per call, before :meth:`stream`, with defaults filled in.
        """
        if config.model is None:
            raise ProviderError(
                f"{type(self).__name__}: no model configured", code="invalid_config"
            )
        problem = self._effort_problem(config.reasoning_effort)
        if problem is not None:
            raise ConfigError(f"provider {config.provider!r} ({self._where}): {problem}")

    def _effort_problem(self, effort: str | None) -> str | None:
        """What is wrong with ``effort`` for this adapter, or ``None`` when it is accepted."""
        return effort_problem(effort, self._efforts)

    def _auth_headers(self, api_key: str) -> dict[str, str]:
        raise NotImplementedError

    def _static_headers(self) -> dict[str, str]:
        return {}

    # The body's key for the conversation's list (messages, input items): see _content.
    _history_key: ClassVar[str] = ""

    def _body(self, request: LLMRequest) -> dict[str, Any]:
        """The request body, built whole: what ``_content`` must encode to."""
        return self._envelope(request, self._items(request))

    def _items(self, request: LLMRequest) -> list[Any]:
        """The conversation's list as the body carries it at ``_history_key``."""
        raise NotImplementedError

    def _envelope(self, request: LLMRequest, items: list[Any]) -> dict[str, Any]:
        """The body around the conversation's ``items``."""
        raise NotImplementedError

    def _fragments(self, request: LLMRequest) -> list[bytes] | None:
        """The items of ``_items(request)``, each encoded (``b""`` for none), mostly from
        what earlier calls encoded; ``None`` when only building them whole will do."""
        return None

    def _content(self, request: LLMRequest) -> bytes:
        """The request body's bytes: those of ``encode_body(self._body(request))``, with the
        conversation's items spliced in as ``_fragments`` has them encoded, so that a step
        does not encode the whole history again."""
        key = self._history_key
        if not key or not _splices(type(self)):
            return encode_body(self._body(request))  # a subclass's own body or items
        placeholder: list[Any] = []
        body = self._envelope(request, placeholder)
        if body.get(key) is not placeholder:
            return encode_body(body)  # the config's extra replaced the list
        fragments = self._fragments(request)
        if fragments is None:
            body[key] = self._items(request)
            return encode_body(body)
        return splice_body(body, key, fragments)

    def _decoder(self) -> PartDecoder:
        raise NotImplementedError

    def _clean(self, text: str) -> str:
        # Error text is recorded (events, the session file, logs), so it must also encode.
        return self._secrets.scrub(repair_surrogates(text))

    def _url(self) -> str:
        return f"{self.base_url}{self._path}"

    def _request_headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            # Proxies must not cache or buffer a stream (what SSE clients send).
            "Cache-Control": "no-store",
            **self._static_headers(),
        }
        if self._api_key is not None:
            headers.update(self._auth_headers(self._api_key))
        headers.update(self._headers)
        return headers

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamPart]:
        """Stream one model call: text, reasoning and tool-call deltas, then one Finish.

        ``request.config`` is sent as it is: filling defaults and :meth:`validate` are the
        runtime's job, done once before the call.

        Text is passed on as the provider sent it: a lone surrogate from a JSON escape stays
        (its other half may come in the next delta), and is repaired where the reply is put
        together; only the request body and error messages are repaired here.

        Raises:
            ProviderError: on an HTTP error status, a transport failure or timeout, an error
                reported inside the stream, or a stream that is malformed or stops short.
        """
        url = self._url()
        failure: ProviderError | None = None
        try:
            content = self._content(request)
        except ProviderError as exc:
            failure = exc
        except Exception as exc:  # noqa: BLE001 - every adapter failure is a provider failure
            failure = _adapter_error(exc, "building the request")
        if failure is not None:
            raise self._cleaned(failure)
        decoder = self._decoder()
        # An exit stack instead of nested `async with` blocks keeps every yield outside a
        # context manager (flake8-async ASYNC119). The runtime acloses this generator when it
        # stops early (ModelAdapter contract); the finally below then releases the connection.
        stack = contextlib.AsyncExitStack()
        try:
            client = await stack.enter_async_context(client_for(self._client))
            response = await stack.enter_async_context(
                client.stream("POST", url, headers=self._request_headers(), content=content)
            )
            if not response.is_success:
                raise await self._http_error(response)
            if response.headers.get("content-type", "").lower().startswith("application/json"):
                raise await self._json_instead_of_stream(response)
            # httpx types it as an iterator, but it is an async generator that needs closing.
            body = cast("AsyncGenerator[bytes, None]", response.aiter_bytes())
            chunks = await stack.enter_async_context(contextlib.aclosing(body))
            events = await stack.enter_async_context(contextlib.aclosing(_sse_events(chunks)))
            async for event in events:
                try:
                    parts = decoder.feed(event)
                except ProviderError as exc:
                    failure = exc
                    break
                for part in parts:
                    yield part
                if decoder.done:
                    break
            await _drain(chunks)
            if failure is None:
                finish = decoder.finish()
        except ProviderError as exc:
            failure = exc
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError) as exc:
            failure = self._converted(exc, shown_url(url))
        except Exception as exc:  # noqa: BLE001 - every adapter failure is a provider failure
            # A decoder that trips over an unforeseen payload is this adapter's bug, but the
            # caller's recovery (retry, hooks) must still see it as a failed call.
            failure = _adapter_error(exc, "reading the stream")
        finally:
            await stack.aclose()
        if failure is not None:
            # Raised here, outside the handlers, so that nothing unscrubbed rides along as
            # the implicit __context__.
            raise self._cleaned(failure)
        yield finish

    def _converted(self, exc: Exception, url: str) -> ProviderError:
        if isinstance(exc, httpx.TimeoutException):
            message, code = f"timed out talking to {url} ({type(exc).__name__})", "timeout"
        elif isinstance(exc, httpx.TransportError):
            detail = str(exc) or type(exc).__name__
            message, code = f"connection to {url} failed: {detail}", "connection_error"
        elif isinstance(exc, httpx.DecodingError):
            message, code = f"undecodable response body from {url}: {exc}", "malformed_stream"
        elif isinstance(exc, httpx.InvalidURL):
            message, code = f"cannot call {url}: {exc}", "invalid_config"
        else:
            message, code = f"HTTP failure talking to {url}: {exc!r}", "http_error"
        error = ProviderError(message, code=code)
        error.__cause__ = exc
        return error

    def _cleaned(self, error: ProviderError) -> ProviderError:
        """``error`` (in place) with its secrets masked and its text made encodable."""
        if isinstance(error, MalformedEventError):
            shown = self._clean(error.data)
            if len(shown) > _SNIPPET:
                shown = shown[:_SNIPPET] + "\N{HORIZONTAL ELLIPSIS}"
            error = ProviderError(f"{error.message}: {shown!r}", code=error.code)
        # Its facts are read-only for everyone who sees it; nobody has yet.
        object.__setattr__(error, "message", self._clean(error.message))
        object.__setattr__(error, "code", self._clean(error.code) if error.code else error.code)
        error.args = (error.message,)
        suppress = error.__suppress_context__
        for link in ("__cause__", "__context__"):
            linked = getattr(error, link)
            if linked is not None and self._secrets.scrub_chain(linked) is None:
                setattr(error, link, None)
        error.__suppress_context__ = suppress
        return error

    async def _http_error(self, response: httpx.Response) -> ProviderError:
        body = await response.aread()
        text = body.decode("utf-8", errors="replace")
        try:
            payload: object = json.loads(text)
        except ValueError:
            payload = None
        message, code = error_fields(payload)
        if message is None:
            # Masked before the cut, so no part of a secret survives at the edge.
            snippet = self._clean(text.strip())[:_SNIPPET]
            message = f"HTTP {response.status_code}" + (f": {snippet}" if snippet else "")
        return ProviderError(
            message,
            status=response.status_code,
            code=code,
            retry_after=_retry_after(response.headers),
        )

    async def _json_instead_of_stream(self, response: httpx.Response) -> ProviderError:
        body = await response.aread()
        try:
            payload: object = json.loads(body)
        except ValueError:
            payload = None
        message, code = error_fields(payload)
        if message is not None:
            return ProviderError(message, status=response.status_code, code=code)
        return ProviderError(
            "expected an event stream, got a JSON document", code="malformed_stream"
        )


def _adapter_error(exc: Exception, doing: str) -> ProviderError:
    error = ProviderError(
        f"the adapter failed {doing}: {type(exc).__name__}: {exc}", code="adapter_error"
    )
    error.__cause__ = exc
    return error


def _with_fallback(given: AdapterDefaults | None, fallback: AdapterDefaults) -> AdapterDefaults:
    # A provider entry that sets only reasoning_effort must not lose the adapter's own
    # max_tokens fallback (Anthropic cannot be called without one).
    if given is None:
        return fallback
    return AdapterDefaults(
        reasoning_effort=(
            given.reasoning_effort if given.reasoning_effort is not None
            else fallback.reasoning_effort
        ),
        max_tokens=given.max_tokens if given.max_tokens is not None else fallback.max_tokens,
    )


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    # Reading the body to its end lets a pooled connection be reused, and runs httpx's nested
    # generators to completion instead of leaving them to the garbage collector (which warns).
    # A server that keeps the body open after its final event only costs a short wait.
    with trio.move_on_after(_DRAIN_SECONDS), contextlib.suppress(httpx.HTTPError):
        async for _ in chunks:
            pass


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncGenerator[SSEEvent, None]:
    # SSE is UTF-8 by definition, whatever the Content-Type says.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder = SSEDecoder()
    async for chunk in chunks:
        for event in decoder.feed(text.decode(chunk)):
            yield event
    for event in decoder.feed(text.decode(b"", final=True)) + decoder.close():
        yield event
