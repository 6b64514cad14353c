"""Credentials of the HTTP adapters: refused when malformed, masked wherever they could show."""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any

import httpx
import loopback
import pytest
import trio
from conftest import of_type, turn_ends

import agentloop
from agentloop import AgentOptions, ConfigError
from agentloop._errors import ProviderError
from agentloop.llm import AnthropicAdapter, OpenAIChatAdapter
from agentloop.llm._secrets import Secrets, is_secret_header, shown_url
from agentloop.llm._wire import HTTPStreamAdapter

KEY = "sk-live-7f3a9c01-SECRET-b2e4"
TOKEN = "tok-9d8c7b6a-PROXY-SECRET"
BASIC = "dXNlcjpQUk9YWS1TRUNSRVQtcGFzcw=="
SECRETS = (KEY, TOKEN, BASIC)
URL = "https://api.example/v1"

ADAPTERS = pytest.mark.parametrize(
    ("cls", "kind"), [(OpenAIChatAdapter, "openai"), (AnthropicAdapter, "anthropic")]
)
SECRET_HEADERS = {"X-Proxy-Token": TOKEN, "Proxy-Authorization": f"Basic {BASIC}"}


def fragments(secret: str, size: int = 5) -> set[str]:
    return {secret[i : i + size] for i in range(len(secret) - size + 1)}


def assert_hidden(*texts: str) -> None:
    """No text shows a secret, or any five characters of one."""
    for text in texts:
        for secret in SECRETS:
            shown = [part for part in fragments(secret) if part in text]
            assert not shown, (shown, text)


def chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__]
    return seen


def every_view(exc: ProviderError) -> list[str]:
    texts = [str(exc), repr(exc), exc.message, json.dumps(exc.to_json())]
    texts.append("".join(traceback.format_exception(exc)))
    for linked in chain(exc):
        texts += [str(linked), repr(linked), repr(linked.args)]
    return texts


async def failure(cls: type[HTTPStreamAdapter], handler: loopback.Handler) -> ProviderError:
    with trio.fail_after(10):
        async with loopback.serve(handler) as server:
            adapter = cls(
                server.url, api_key=KEY, headers={**SECRET_HEADERS, "X-Trace": "trace-visible"}
            )
            with pytest.raises(ProviderError) as info:
                await loopback.collect(adapter, loopback.make_request())
    # The secrets did go over the wire.
    [sent] = server.requests
    assert f"Bearer {KEY}" == sent.headers.get("authorization") or sent.headers["x-api-key"] == KEY
    assert sent.headers["x-proxy-token"] == TOKEN
    return info.value


# --- 1. refused at construction ---------------------------------------------------------------

BAD_KEYS = [
    (KEY + "\n", "contains a line break at its end (a trailing newline from a key file?)"),
    (KEY + "\r\n", "contains a line break at its end (a trailing newline from a key file?)"),
    (KEY[:9] + "\n" + KEY[9:], "contains a line break inside it"),
    (KEY + "\u00a0", "contains whitespace (U+00A0 NO-BREAK SPACE) at its end"),
    (KEY + " ", "contains whitespace (U+0020 SPACE) at its end"),
    ("\t" + KEY, "contains whitespace (U+0009) at its start"),
    (KEY[:4] + "\u200b" + KEY[4:], "contains an invisible control character (U+200B"),
    (KEY + "\x00", "contains an invisible control character (U+0000) at its end"),
    ("\ufeff" + KEY, "contains a byte-order mark at its start"),
    (KEY[:6] + "\u00e9" + KEY[6:], "contains a non-ASCII character inside it"),
    ("Bearer " + KEY, "the adapter adds the 'Bearer' scheme itself"),
]


@ADAPTERS
@pytest.mark.parametrize(("key", "problem"), BAD_KEYS, ids=lambda v: ascii(v)[-12:])
def test_a_malformed_api_key_is_refused_without_quoting_it(
    cls: type[HTTPStreamAdapter], kind: str, key: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        cls(URL, api_key=key)
    message = str(info.value)
    assert message.startswith(f"api_key for the {kind} adapter at {URL} contains ")
    assert problem in message
    assert_hidden(message, repr(info.value))


BAD_HEADERS: list[tuple[dict[str, Any], str]] = [
    ({"X-Api-Key": KEY + "\n"}, "header 'X-Api-Key' for the {kind} adapter at {url}: its value"),
    ({"X-Api-Key": KEY + "\n"}, "its value contains a line break at its end"),
    (
        {"Authorization": f" Bearer {KEY}"},
        "its value contains whitespace (U+0020 SPACE) at its start",
    ),
    ({"X-Note": f"{TOKEN}\r\nX-Injected: 1"}, "its value contains a line break inside it"),
    ({"X-Note": f"caf\u00e9 {TOKEN}"}, "its value contains a non-ASCII character inside it"),
    ({"X-Note": f"{TOKEN}\x7f"}, "invisible control character (U+007F) at its end"),
    (
        {f"Authorization: Bearer {TOKEN}": "x"},
        "header #1 for the {kind} adapter at {url} has a name that is not a valid HTTP field name",
    ),
    ({"X-Note": 3}, "header 'X-Note' for the {kind} adapter at {url} must have a string value"),
]


@ADAPTERS
@pytest.mark.parametrize(("headers", "problem"), BAD_HEADERS, ids=lambda v: ascii(v)[:20])
def test_an_invalid_header_is_refused_without_quoting_it(
    cls: type[HTTPStreamAdapter], kind: str, headers: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        cls(URL, api_key="sk-fine", headers=headers)
    assert problem.format(kind=kind, url=URL) in str(info.value)
    assert_hidden(str(info.value), repr(info.value))


def test_a_password_in_the_base_url_is_not_quoted_in_the_error() -> None:
    with pytest.raises(ConfigError) as info:
        OpenAIChatAdapter(f"https://bob:{TOKEN}@proxy.example/v1", api_key=KEY + "\n")
    assert "at https://***@proxy.example/v1 contains a line break" in str(info.value)
    assert_hidden(str(info.value))


@ADAPTERS
def test_valid_credentials_are_accepted_unchanged(cls: type[HTTPStreamAdapter], kind: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Empty": "", "X-Tabbed": "a\tb  c"}
    adapter = cls(URL, api_key=KEY, headers=headers)
    sent = adapter._request_headers()
    assert sent["Authorization"] == f"Bearer {TOKEN}" and sent["X-Tabbed"] == "a\tb  c"
    assert cls(URL, api_key="")._request_headers() == cls(URL)._request_headers()


async def test_a_configured_provider_with_a_bad_key_fails_open_runtime() -> None:
    config = {"providers": {"p": {"kind": "anthropic", "base_url": URL, "api_key": KEY + "\n"}}}
    with trio.fail_after(10), pytest.raises(ConfigError) as info:
        async with agentloop.open_runtime(config):
            pass
    assert "api_key for the anthropic adapter at https://api.example/v1 contains a line break" in (
        str(info.value)
    )
    assert_hidden(
        str(info.value), repr(info.value), "".join(traceback.format_exception(info.value))
    )


# --- 2. masked in everything raised -----------------------------------------------------------


def test_secret_header_names() -> None:
    secret = [
        "Authorization",
        "proxy-authorization",
        "API-Key",
        "x-api-key",
        "X-Goog-Api-Key",
        "X-Auth-Token",
        "x-client-secret",
        "Cf-Access-Token",
        "x-authn",
    ]
    plain = ["X-Trace", "anthropic-beta", "anthropic-version", "OpenAI-Organization", "Accept"]
    assert all(is_secret_header(name) for name in secret)
    assert not any(is_secret_header(name) for name in plain)


def test_escaped_forms_are_masked_and_short_values_left_alone() -> None:
    odd = "sk-a'b\\c/d\"e-SECRET"
    secrets = Secrets([odd, "abc"])
    for form in (
        odd,
        json.dumps(odd)[1:-1],
        repr(odd)[1:-1],
        repr(odd.encode())[2:-1],
        "sk-a%27b%5Cc%2Fd%22e-SECRET",
    ):
        assert secrets.scrub(f"<{form}>") == "<***>", form
    assert secrets.scrub("abc") == "abc"
    assert "SECRET" not in repr(secrets)


@ADAPTERS
@pytest.mark.parametrize("status", [400, 401])
async def test_an_error_body_echoing_the_headers_is_masked(
    cls: type[HTTPStreamAdapter], kind: str, status: int
) -> None:
    exc = await failure(cls, loopback.echo_headers(status))
    assert exc.status == status
    assert "x-proxy-token: ***" in exc.message
    assert "proxy-authorization: ***" in exc.message
    assert "x-trace: trace-visible" in exc.message  # other headers are left alone
    assert_hidden(*every_view(exc))


@ADAPTERS
async def test_a_protocol_error_quoting_the_headers_is_masked_down_the_chain(
    cls: type[HTTPStreamAdapter], kind: str
) -> None:
    exc = await failure(cls, loopback.echo_headers_in_status_line())
    assert exc.code == "connection_error"
    assert "illegal status line" in exc.message and "***" in exc.message
    # The transport error stays the cause, masked like the message.
    assert isinstance(exc.__cause__, httpx.RemoteProtocolError)
    assert "***" in str(exc.__cause__)
    assert len(chain(exc)) >= 3
    assert_hidden(*every_view(exc))


def test_an_exception_that_stays_unsafe_is_cut_from_the_chain() -> None:
    secrets = Secrets([KEY])
    inner = OSError(13, f"denied for {KEY}")  # formats from its attributes, not its args
    outer = RuntimeError(f"wrapping {KEY}")
    outer.__cause__ = inner
    assert secrets.scrub_chain(outer) is outer
    assert str(outer) == "wrapping ***"
    assert outer.__cause__ is None
    assert secrets.scrub_chain(inner) is None


@ADAPTERS
async def test_an_error_body_is_masked_before_it_is_cut(
    cls: type[HTTPStreamAdapter], kind: str
) -> None:
    # The 300-character snippet would end inside the key.
    body = "x" * (300 - 10) + KEY + " trailing"
    exc = await failure(cls, loopback.plain_error(502, body))
    assert "x***" in exc.message
    assert_hidden(*every_view(exc))


@ADAPTERS
async def test_a_malformed_event_is_masked_before_it_is_cut(
    cls: type[HTTPStreamAdapter], kind: str
) -> None:
    data = '{"broken": "' + "y" * (300 - 20) + KEY + " tail"
    exc = await failure(cls, loopback.sse_body(f"data: {data}\n\n".encode()))
    assert exc.code == "malformed_stream"
    assert exc.message.startswith('malformed JSON in the event stream: \'{"broken"')
    assert_hidden(*every_view(exc))


@ADAPTERS
async def test_a_password_in_the_base_url_is_masked(
    cls: type[HTTPStreamAdapter], kind: str
) -> None:
    with trio.fail_after(10):
        port = await loopback.unused_port()
        adapter = cls(f"http://bob:{TOKEN}@127.0.0.1:{port}/v1", api_key=KEY)
        with pytest.raises(ProviderError) as info:
            await loopback.collect(adapter, loopback.make_request())
    assert info.value.code == "connection_error"
    assert f"connection to http://***@127.0.0.1:{port}/v1/" in info.value.message
    assert repr(adapter) == f"{cls.__name__}(base_url='http://***@127.0.0.1:{port}/v1')"
    assert_hidden(*every_view(info.value), repr(adapter))


def test_shown_url() -> None:
    assert shown_url("https://u:p@h/v1") == "https://***@h/v1"
    assert shown_url("https://ghp_token@h/v1") == "https://***@h/v1"
    assert shown_url("http://127.0.0.1:8080/v1?x=a@b") == "http://127.0.0.1:8080/v1?x=a@b"


@ADAPTERS
def test_repr_shows_no_secret(cls: type[HTTPStreamAdapter], kind: str) -> None:
    adapter = cls(f"{URL}?api-key={TOKEN}", api_key=KEY, headers=SECRET_HEADERS)
    assert repr(adapter) == f"{cls.__name__}(base_url='{URL}?api-key=***')"
    assert_hidden(repr(adapter), str(adapter))
    with pytest.raises(ConfigError) as info:
        cls(f"{URL}?api-key={TOKEN}", api_key=KEY + "\n")
    assert f"at {URL}?api-key=*** contains a line break" in str(info.value)


@ADAPTERS
async def test_a_failed_turn_records_and_logs_no_secret(
    cls: type[HTTPStreamAdapter], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    with trio.fail_after(10):
        async with loopback.serve(loopback.echo_headers(401)) as server:
            provider = {
                "kind": kind,
                "base_url": server.url,
                "api_key": KEY,
                "headers": {"X-Proxy-Token": TOKEN},
            }
            async with agentloop.open_runtime({"providers": {"p": provider}}) as rt:
                handle = await rt.agents.create(
                    session_id="keyed", agent_options=AgentOptions(provider="p", model="m")
                )
                agent = handle.agent
                agent.followup("hello")
                await agent.wait_idle()
                assert turn_ends(agent) == ["error"]
                [end] = of_type(agent, "turn/end")
                error = end.data["error"]
                assert error["status"] == 401 and "x-proxy-token: ***" in error["message"]
                texts += [json.dumps(e.data) for e in agent.session.events]
                texts += [repr(e) for e in agent.session.events]
                texts.append(repr(rt.llm.adapter("p")))
    assert len(server.requests) == 1
    texts += [record.getMessage() for record in caplog.records]
    texts += [logging.Formatter().format(record) for record in caplog.records]
    assert any("***" in record.getMessage() for record in caplog.records)  # the error was logged
    assert_hidden(*texts)
