"""One step's tool calls: the guarded pipeline and the ordered, bounded scheduler.

Calls keep the model's order. Exclusive calls are barriers (everything before finishes first,
nothing after starts until they finish); parallel-safe calls share a rolling pool whose bound is
read from settings at the start of each parallel group. Only dispatch and tool bodies overlap:
the prelude (``tool/call``, validation, ``tools/pre-execute``, guards) and the postlude
(``tools/post-execute``, ``finalize_content``, ``tool/result``) run on the driver task in
model order.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from . import _log
from ._errors import InvalidContent
from ._events import (
    Allow,
    Ask,
    Deny,
    ToolApproval,
    ToolExecute,
    ToolPostExecute,
    ToolPreExecute,
    ToolResultEvent,
)
from ._json import JSON, FrozenDict, freeze, freeze_repaired
from ._model import ToolCall, ToolResult
from ._schema import parse_arguments, validate_arguments
from ._session import Session
from ._settings import MAX_PARALLEL_TOOL_CALLS
from ._tools import Tool

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = ["run_tool_calls", "ABORTED_BEFORE_DISPATCH"]

ABORTED_BEFORE_DISPATCH = "ABORTED_BEFORE_DISPATCH"
_ABORTED_TEXT = "tool call aborted before dispatch"


@attrs.define(slots=True, eq=False)
class _Slot:
    call: ToolCall
    logged: bool = False
    tool: Tool | None = None
    kwargs: dict[str, Any] | None = None
    arguments: FrozenDict | None = None
    started: bool = False
    finished: bool = False
    emitted: bool = False
    result: ToolResult | None = None


class _Run:
    def __init__(self, agent: Agent, turn: int, calls: Sequence[ToolCall]) -> None:
        self.agent = agent
        self.rt = agent._rt
        self.session = agent.session
        self.turn = turn
        self.slots = [_Slot(c) for c in calls]
        self.next_emit = 0
        self.in_flight = 0
        self.changed = trio.Event()
        self.peak = 0

    # --- ordered parts -------------------------------------------------------------------

    def _log_call(self, slot: _Slot) -> None:
        call = slot.call
        self.session.append(_log.TOOL_CALL, _log.tool_call(call), self.turn)
        slot.logged = True

    async def _prelude(self, slot: _Slot) -> None:
        """Log the call and decide whether it may run; sets ``slot.result`` when it may not."""
        self._log_call(slot)
        call, agent_id, bus = slot.call, self.agent.id, self.rt.bus
        tool = self.rt.tools.lookup(call.name, agent_id)
        if tool is None:
            names = ", ".join(t.name for t in self.rt.tools.visible(agent_id)) or "none"
            slot.result = ToolResult.error(
                "UNKNOWN_TOOL", f"unknown tool {call.name!r} (available tools: {names})"
            )
            return
        slot.tool = tool
        raw = call.arguments
        if isinstance(raw, str):
            parsed, problem = parse_arguments(raw)
            if parsed is None:
                slot.result = ToolResult.error(
                    "INVALID_ARGUMENTS",
                    f"the arguments for {call.name!r} are not a JSON object ({problem}); "
                    "send a JSON object that fits the tool's parameters",
                )
                return
            try:
                arguments = freeze(parsed)
            except InvalidContent as exc:
                slot.result = ToolResult.error(
                    "INVALID_ARGUMENTS",
                    f"the arguments for {call.name!r} cannot be used ({exc}); "
                    "send a JSON object that fits the tool's parameters",
                )
                return
        else:
            arguments = raw
        assert isinstance(arguments, FrozenDict)
        problems = validate_arguments(tool.parameters, arguments)
        if problems:
            slot.result = ToolResult.error(
                "INVALID_ARGUMENTS",
                f"invalid arguments for {call.name!r}: " + "; ".join(problems)
                + ". Fix them and call the tool again.",
            )
            return
        if bus.has_handlers(ToolPreExecute):
            decision = await bus.emit(ToolPreExecute(agent_id, call, tool.spec))
            if isinstance(decision, Ask):
                answer = None
                if bus.has_handlers(ToolApproval):
                    answer = await bus.emit(ToolApproval(agent_id, call, decision.prompt))
                if not isinstance(answer, Allow):
                    reason = (
                        answer.reason if isinstance(answer, Deny)
                        else f"approval required ({decision.prompt}) and nobody approved"
                    )
                    slot.result = ToolResult.error("DENIED", f"call denied: {reason}")
                    return
            elif isinstance(decision, Deny):
                slot.result = ToolResult.error("DENIED", f"call denied: {decision.reason}")
                return
        for policy in self.rt.tools.guards_for(agent_id):
            verdict = policy(call, tool)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            if isinstance(verdict, Deny):
                slot.result = ToolResult.error("DENIED", f"call denied: {verdict.reason}")
                return
        slot.arguments = arguments
        slot.kwargs = tool.to_kwargs(arguments) if tool.to_kwargs else dict(arguments)

    async def _emit(self, slot: _Slot, *, hooks: bool = True) -> None:
        result = slot.result
        assert result is not None
        call, bus, agent_id = slot.call, self.rt.bus, self.agent.id
        if hooks and bus.has_handlers(ToolPostExecute):
            result = await bus.emit(ToolPostExecute(agent_id, call, result))
        self._append_result(slot, result)
        if hooks and bus.has_listeners(ToolResultEvent):
            await bus.emit(ToolResultEvent(agent_id, call, result))

    def _append_result(self, slot: _Slot, result: ToolResult) -> None:
        if slot.tool is not None and slot.tool.finalize_content is not None:
            result = attrs.evolve(result, content=slot.tool.finalize_content(result.content))
        if not slot.logged:
            self._log_call(slot)
        self.session.append(_log.TOOL_RESULT, result_data(slot.call, result), self.turn)
        slot.emitted = True

    async def _emit_ready(self) -> None:
        slots = self.slots
        while self.next_emit < len(slots):
            slot = slots[self.next_emit]
            if slot.result is None or (slot.started and not slot.finished):
                return
            await self._emit(slot)
            self.next_emit += 1

    # --- concurrent part -----------------------------------------------------------------

    async def _execute(self, slot: _Slot) -> None:
        assert slot.tool is not None
        assert slot.kwargs is not None
        assert slot.arguments is not None
        tool, bus = slot.tool, self.rt.bus
        try:
            result: ToolResult | None = None
            if bus.has_handlers(ToolExecute):
                result = await bus.emit(ToolExecute(self.agent.id, slot.call, slot.arguments))
            if result is None:
                if tool.timeout is not None:
                    with trio.move_on_after(tool.timeout) as timer:
                        value = await tool.run(**slot.kwargs)
                    if timer.cancelled_caught:
                        result = ToolResult.error(
                            "TIMEOUT", f"{tool.name!r} did not finish within {tool.timeout} s"
                        )
                    else:
                        result = _to_result(value)
                else:
                    result = _to_result(await tool.run(**slot.kwargs))
            slot.result = result
        except trio.Cancelled:
            slot.result = ToolResult.error("ABORTED", "tool call aborted while running")
            raise
        except Exception as exc:  # noqa: BLE001 - a failing tool is a result, not a crash
            slot.result = ToolResult(
                f"Error: {type(exc).__name__}: {exc}", is_error=True, error_code="TOOL_ERROR"
            )
        finally:
            slot.finished = True
            self.in_flight -= 1
            self.changed.set()

    def _start(self, nursery: trio.Nursery, slot: _Slot) -> None:
        slot.started = True
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        # Every tool body runs in a task of its own under the agent's task, named for its
        # call, so a task-tree walk (or a debugger) shows what each agent is running.
        nursery.start_soon(self._execute, slot, name=f"agentloop.tool:{slot.call.id}")

    async def _wait_until(self, predicate: Any) -> None:
        while not predicate():
            self.changed = trio.Event()
            await self.changed.wait()
            await self._emit_ready()

    async def run(self) -> None:
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                try:
                    await self._dispatch_all(nursery)
                except Exception as exc:  # noqa: BLE001 - reported after the drain
                    # An internal failure stops new dispatches; started calls finish.
                    failure = exc
                    await self._wait_until(lambda: self.in_flight == 0)
        except BaseException:
            self._abort_rest()
            raise
        if failure is not None:
            self._abort_rest()
            raise failure

    async def _run_alone(self, nursery: trio.Nursery, slot: _Slot) -> None:
        self._start(nursery, slot)
        await self._wait_until(lambda: self.in_flight == 0)

    async def _dispatch_all(self, nursery: trio.Nursery) -> None:
        bound: int | None = None
        for slot in self.slots:
            await self._prelude(slot)
            if slot.result is None:
                assert slot.tool is not None
                assert slot.arguments is not None
                mode = slot.tool.mode_for(slot.arguments)
                if mode == "parallel":
                    if bound is None:
                        bound = self.rt.settings.get(MAX_PARALLEL_TOOL_CALLS)
                    if self.in_flight >= bound:
                        await self._wait_until(lambda b=bound: self.in_flight < b)
                        # Classification is decided right before the call starts.
                        mode = slot.tool.mode_for(slot.arguments)
                if mode == "exclusive":
                    await self._wait_until(lambda: self.in_flight == 0)
                    await self._emit_ready()  # earlier results go out before the barrier
                    bound = None  # the next parallel call opens a new group
                    await self._run_alone(nursery, slot)
                else:
                    self._start(nursery, slot)
            await self._emit_ready()
        await self._wait_until(lambda: self.next_emit == len(self.slots))

    def _abort_rest(self) -> None:
        """Close every remaining call synchronously, in order, so history stays valid."""
        for slot in self.slots[self.next_emit:]:
            if slot.emitted:
                continue
            if slot.result is None:
                slot.result = ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)
            self._append_result(slot, slot.result)
        self.next_emit = len(self.slots)


def result_data(call: ToolCall, result: ToolResult) -> FrozenDict:
    """The ``tool/result`` payload. A tool's text is not ours to refuse: a lone surrogate (a
    file name from ``os.fsdecode``) becomes U+FFFD and ``repaired`` says so; content that is
    not JSON at all turns the result into an ``INVALID_RESULT`` error."""
    content: JSON
    try:
        if isinstance(result.content, str) and result.content.isascii():
            content, repaired = result.content, False  # the common case, without a walk
        else:
            content, repaired = freeze_repaired(result.content, path="content")
    except InvalidContent as exc:
        text = f"Error: the tool returned content that is not JSON ({exc})"
        content, repaired = text, False
        result = ToolResult(text, is_error=True, error_code="INVALID_RESULT")
    return _log.tool_result(
        call, content, is_error=result.is_error, error_code=result.error_code, repaired=repaired
    )


def close_unanswered(session: Session, turn: int) -> None:
    """Answer every call of the session still without a result (``ABORTED_BEFORE_DISPATCH``)."""
    for call, logged in session.unanswered:
        if not logged:
            session.append(_log.TOOL_CALL, _log.tool_call(call), turn)
        session.append(
            _log.TOOL_RESULT,
            result_data(call, ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)),
            turn,
        )


def _to_result(value: object) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult("")
    if isinstance(value, str):
        return ToolResult(value)
    try:
        text = json.dumps(freeze_repaired(value)[0], ensure_ascii=False, separators=(",", ":"))
    except (InvalidContent, ValueError) as exc:
        return ToolResult.error(
            "INVALID_RESULT", f"the tool returned a value that is not JSON ({exc})"
        )
    return ToolResult(text)


async def run_tool_calls(agent: Agent, turn: int, calls: Sequence[ToolCall]) -> int:
    """Run one step's calls; returns the peak number of calls that ran at once."""
    run = _Run(agent, turn, calls)
    await run.run()
    return run.peak


