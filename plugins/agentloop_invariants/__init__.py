"""The invariant companion: every request the loop sends is checked against the log.

Load it from the config (``plugins = ["invariants"]``) or in code with
``open_runtime(plugins=[agentloop_invariants.plugin])``.

The companion keeps its own fold of each session's durable log (``session/event``): the
message boundary (its own derived history, replacements included) and the latest
``request/header``. It records each exact request the loop sends, by identity, as the
``llm/stream`` dispatch sees it (process-local; direct one-shot adapter calls are outside the
contract), and compares it with what the log says: the header's config and message count, and,
unless the header marks the messages ``rewritten``, the messages at both ends of the boundary
(a constant amount of work per step). A mismatch emits ``invariant/violated``
(:class:`agentloop.events.InvariantViolated`) with a diff and logs an error
(``agentloop.invariants``).

:func:`companion` returns the :class:`Companion` of a context the plugin was installed on.
"""

from __future__ import annotations

import logging
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any, Final

import attrs
import trio

from agentloop import Context, FrozenDict, Message, SessionEvent
from agentloop.events import (
    InvariantViolated,
    LlmStream,
    SessionDisposed,
    SessionEventAppended,
)
from agentloop.llm import LLMRequest

__all__ = ["Companion", "install", "plugin", "companion", "EDGE"]

log = logging.getLogger("agentloop.invariants")

EDGE: Final = 3
"""Messages compared at each end of the boundary."""


def _key(
    role: str, content: object, call_id: object = None, calls: object = ()
) -> tuple[Any, ...]:
    return (role, content, call_id, calls)


def _message_key(m: Message) -> tuple[Any, ...]:
    return _key(m.role, m.content, m.tool_call_id, tuple(c.id for c in m.tool_calls))


@attrs.define(slots=True, eq=False)
class _Fold:
    """One session's log, folded independently of the session's own reducers."""

    keys: list[tuple[Any, ...]] = attrs.Factory(list)
    origins: list[int] = attrs.Factory(list)
    header: FrozenDict | None = None
    header_seq: int = 0
    seen: int = 0

    def apply(self, event: SessionEvent) -> None:
        self.seen = event.seq
        data, kind = event.data, event.type
        if kind in ("user/message", "steering/message"):
            self._add(event.seq, _key("user", data["content"]))
        elif kind == "assistant/message":
            calls = tuple(c["id"] for c in data.get("tool_calls", ()))
            if data.get("content") or calls or data.get("reasoning") or data.get(
                "reasoning_blocks"
            ):
                self._add(event.seq, _key("assistant", data.get("content") or "", None, calls))
        elif kind == "tool/result":
            self._add(event.seq, _key("tool", data["content"], data["call_id"]))
        elif kind == "history/replaced":
            first, last = data["first_seq"], data["last_seq"]
            i, j = bisect_left(self.origins, first), bisect_right(self.origins, last)
            new = [
                _key(m["role"], m.get("content", ""), m.get("tool_call_id"),
                     tuple(c["id"] for c in m.get("tool_calls", ())))
                for m in data["messages"]
            ]
            self.keys[i:j] = new
            self.origins[i:j] = [last] * len(new)
        elif kind == "request/header":
            self.header, self.header_seq = data, event.seq

    def _add(self, seq: int, key: tuple[Any, ...]) -> None:
        self.keys.append(key)
        self.origins.append(seq)


@attrs.define(slots=True, eq=False)
class Companion:
    """What the companion checked: ``checked`` requests, the ``violations`` found."""

    ctx: Context
    checked: int = 0
    violations: list[InvariantViolated] = attrs.Factory(list)
    _folds: dict[str, _Fold] = attrs.Factory(dict)
    _sent: dict[str, LLMRequest] = attrs.Factory(dict)

    def on_event(self, event: SessionEventAppended) -> None:
        fold = self._folds.get(event.session_id)
        if fold is None:
            if event.event.seq > 1:
                # A resumed session: its stored log was loaded without being announced. Its
                # crash recovery appends before it is published; the fold is built from the
                # whole log at the first event after publication.
                session = self.ctx.sessions.get(event.session_id)
                if session is None:
                    return
                fold = self._folds[event.session_id] = _Fold()
                for earlier in session.events[: event.event.seq - 1]:
                    fold.apply(earlier)
            else:
                fold = self._folds[event.session_id] = _Fold()
        fold.apply(event.event)

    def on_stream(self, event: LlmStream) -> None:
        request = event.request
        self._sent[event.agent_id] = request  # the exact object, by identity
        fold = self._folds.get(request.session_id)
        if fold is None or fold.header is None:
            return  # not a loop step: outside the contract
        self.checked += 1
        problems = self.compare(fold, request)
        if problems:
            diff = "; ".join(problems)
            violation = InvariantViolated(event.agent_id, fold.header_seq, diff)
            self.violations.append(violation)
            SEEN.append(violation)
            log.error("agent %s: the request of seq %d differs from the log: %s",
                      event.agent_id, fold.header_seq, diff)
            self.ctx.events.emit_nowait(violation)
        fold.header = None  # one request per header

    def forget(self, event: SessionDisposed) -> None:
        # A disposed session's last request holds its whole history: the companion must
        # not keep what the runtime released.
        self._folds.pop(event.session_id, None)
        self._sent.pop(event.session_id, None)

    def last_request(self, agent_id: str) -> LLMRequest | None:
        """The exact request last sent for ``agent_id`` while it lives (process-local)."""
        return self._sent.get(agent_id)

    @staticmethod
    def compare(fold: _Fold, request: LLMRequest) -> list[str]:
        header = fold.header
        assert header is not None
        problems: list[str] = []
        config = request.config.to_json()
        if config != header["config"]:
            problems.append(f"config {dict(config)!r} != header {dict(header['config'])!r}")
        messages: Sequence[Message] = request.messages
        count = header.get("messages")
        if count is not None and count != len(messages):
            problems.append(f"{len(messages)} messages sent, header says {count}")
        if header.get("rewritten"):
            return problems
        if len(fold.keys) != len(messages):
            problems.append(
                f"{len(messages)} messages sent, the log's history has {len(fold.keys)}"
            )
            return problems
        n = len(messages)
        edges = sorted({*range(min(EDGE, n)), *range(max(0, n - EDGE), n)})
        problems.extend(
            f"message #{i} {_message_key(messages[i])!r} != log {fold.keys[i]!r}"
            for i in edges
            if _message_key(messages[i]) != fold.keys[i]
        )
        return problems


_COMPANIONS: dict[int, Companion] = {}

SEEN: list[InvariantViolated] = []
"""Every violation any companion of this process found (a test run checks it stays empty)."""


def install(ctx: Context) -> Companion:
    """Start checking every request on ``ctx`` (undone with its scope)."""
    found = Companion(ctx)
    ctx.events.on(SessionEventAppended, found.on_event)
    ctx.events.on(LlmStream, found.on_stream, priority=1_000_000)
    ctx.events.on(SessionDisposed, found.forget)
    if ctx.invariants is None:
        ctx.provide("invariants", found)
    _COMPANIONS[id(ctx)] = found
    return found


def companion(ctx: Context) -> Companion | None:
    """The companion :func:`install` (or the plugin) put on ``ctx``."""
    return _COMPANIONS.get(id(ctx))


async def plugin(
    ctx: Context, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The configured form (``plugins = ["invariants"]``)."""
    await trio.lowlevel.checkpoint()
    install(ctx)
    task_status.started()
    try:
        await trio.sleep_forever()
    finally:
        _COMPANIONS.pop(id(ctx), None)
