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
import math
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from . import _log
from ._approvals import Approvals, expired_answer
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
from ._lifecycle import Lifecycle
from ._model import ToolCall, ToolResult
from ._progress import begin_call
from ._schema import parse_arguments
from ._services import Services
from ._session import Session
from ._settings import APPROVAL_TIMEOUT, MAX_PARALLEL_TOOL_CALLS
from ._tools import Tool
from ._util import Latch, stored_maker

__all__ = [
    "run_tool_calls", "run_suspended_calls", "close_unanswered", "ToolRunner", "ToolTasks",
    "TurnCancel", "with_tool_tasks", "ABORTED_BEFORE_DISPATCH",
]

_T = TypeVar("_T")

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
    parked: bool = False  # awaiting an answer to its approval request
    deferred: bool = False  # was parked: its result is published whenever it is ready


class TurnCancel:
    """A turn's cancel: asked for from the turn's admission on, carried out by the cancel
    scope of the turn's tool nursery (:func:`with_tool_tasks`) once that is open.

    The nursery's own scope is the turn's: one scope a turn instead of two, each entered
    and left through trio's context managers. A cancel asked for before the nursery opens
    cancels it as it opens; one asked for after it closed is only recorded.
    """

    __slots__ = ("_scope", "cancel_called")

    def __init__(self) -> None:
        self.cancel_called = False
        self._scope: trio.CancelScope | None = None

    def cancel(self) -> None:
        self.cancel_called = True
        if self._scope is not None:
            self._scope.cancel()

    def carry_out(self, scope: trio.CancelScope) -> None:
        """Make ``scope`` the one this cancel cancels (and cancel it if asked already)."""
        self._scope = scope
        if self.cancel_called:
            scope.cancel()


@attrs.define(slots=True, eq=False)
class ToolTasks:
    """The nursery the tool tasks of the running turn start in, and the turn's cancel (both
    ``None`` between turns)."""

    nursery: trio.Nursery | None = None
    scope: TurnCancel | None = None


@attrs.frozen(slots=True, eq=False)
class ToolRunner:
    """What one agent's tool runs are given: its services, log, approvals, and its lifecycle
    (whether it is being disposed: parked calls then stay pending for a resume).

    None of it refers back to the agent, which holds the runner: a closed agent is freed
    as soon as nobody refers to it."""

    services: Services
    session: Session
    agent_id: str
    approvals: Approvals
    life: Lifecycle
    # Given by the agent, not defaulted here: mypyc compiles no attrs field defaults.
    tasks: ToolTasks

    def stopping(self) -> bool:
        # A call, not an attribute read, so type narrowing does not survive an await.
        return self.life.stopping

    def flush(self, seq: int) -> Awaitable[None] | None:
        """The commit of the log up to ``seq`` to await (the agent's flush barrier), or None
        when there is nothing to commit to (no store)."""
        return self.services.flush(self.agent_id, seq)


async def with_tool_tasks(
    runner: ToolRunner, cancel: TurnCancel, body: Callable[..., Awaitable[_T]], *args: Any
) -> _T | None:
    """Run ``body(*args)`` (a turn) with one nursery for all its steps' tool tasks, whose
    cancel scope is the turn's: ``cancel`` cancels the body and the tasks together. Returns
    what ``body`` returns, or None when the turn's cancel ended it. (The arguments are
    passed through rather than bound in a closure: one tuple a turn, not a function and a
    cell per variable.)

    A nursery per step cost a scope, a schedule point at its exit and a wake-up; the steps
    still wait for every task they start (``_Run.run``). What ``body`` raises (a cancel
    aside) leaves as it is, not wrapped in the nursery's exception group.
    """
    failure: BaseException | None = None
    value: _T | None = None
    tasks = runner.tasks
    async with trio.open_nursery() as nursery:
        cancel.carry_out(nursery.cancel_scope)
        tasks.nursery, tasks.scope = nursery, cancel
        try:
            value = await body(*args)
        except trio.Cancelled:
            # To the nursery: its scope catches the turn's own cancel, as trio decides, and
            # lets an outer one (disposal's grace running out) through.
            raise
        except BaseException as exc:  # noqa: BLE001, ASYNC103 - raised below, unwrapped
            failure = exc
        finally:
            tasks.nursery = tasks.scope = None
    if failure is not None:
        try:
            if isinstance(failure, BaseExceptionGroup) and cancel.cancel_called and (
                trio.current_effective_deadline() != -math.inf
            ):
                # A nursery of the turn's own code (a hook's, an adapter's) cut short by the
                # turn's cancel: its Cancelled leave the group, by the rule trio's scope
                # applies to what reaches it (an outer cancel, when there is one, keeps
                # them). Raised into the nursery, the group would come out wrapped.
                failure = failure.split(trio.Cancelled)[1]
                if failure is None:
                    return None
            raise failure
        finally:
            failure = None  # the frame would hold its own traceback: a cycle per failed turn
    return value


class _Run:
    def __init__(
        self, runner: ToolRunner, turn: int, calls: Sequence[ToolCall], *, parked: bool = False
    ) -> None:
        self.runner = runner
        self.rt = runner.services
        self.session = runner.session
        self.agent_id = runner.agent_id
        self.approvals = runner.approvals
        self.turn = turn
        # Calls that were parked in an earlier turn start parked, already logged. (A loop,
        # not a comprehension: one would close over ``parked``, a cell and a function a step.)
        slots: list[_Slot] = []
        for c in calls:
            slots.append(  # noqa: PERF401
                _Slot(c, logged=parked, parked=parked, deferred=parked, arguments=None)
            )
        self.slots = slots
        self.parked = len(calls) if parked else 0  # slots awaiting an answer
        self.next_emit = 0
        self.emitted = 0
        self.deferred: list[_Slot] = []
        self.ready: deque[_Slot] = deque()  # approved, waiting for their turn to dispatch
        self.in_flight = 0
        self.changed = Latch()
        self.bound: int | None = None
        self.stored = False  # the step's anchor is flushed (write-ahead of its calls)

    def notify(self) -> None:
        """An answer arrived (from ``agent.approve``/``deny``): wake the dispatcher."""
        self.changed.set()

    # --- ordered parts -------------------------------------------------------------------

    def _log_call(self, slot: _Slot) -> None:
        self.session.append_tool_call(slot.call, self.turn)
        slot.logged = True

    async def _prelude(self, slot: _Slot) -> None:
        """Log the call and decide whether it may run; sets ``slot.result`` when it may not,
        or parks it when it needs an answer nobody gave yet."""
        if not slot.logged:
            self._log_call(slot)
        if not self._check(slot):
            return
        tool = slot.tool
        assert tool is not None
        if tool.requires_approval or self.rt.bus.has_handlers(ToolPreExecute) \
                or self.rt.tools.has_guards():
            await self._decide(slot)
        else:
            # Nobody to ask and nothing to wait for: the common call is decided inline.
            self._ready_kwargs(slot)

    async def _decide(self, slot: _Slot) -> None:
        """The pre-execute hook, an approval and the guards, for a call that passed its
        check."""
        call, tool, bus = slot.call, slot.tool, self.rt.bus
        assert tool is not None
        assert slot.arguments is not None
        decision = None
        if bus.has_handlers(ToolPreExecute):
            decision = await bus.emit(ToolPreExecute(self.agent_id, call, tool.spec))
        if tool.requires_approval and not isinstance(decision, (Ask, Deny)):
            decision = Ask(f"run {tool.name}?")
        if isinstance(decision, Ask):
            answer = None
            if bus.has_handlers(ToolApproval):
                answer = await bus.emit(ToolApproval(self.agent_id, call, decision.prompt))
            if isinstance(answer, Deny):
                slot.result = ToolResult.error("DENIED", f"call denied: {answer.reason}")
                return
            if not isinstance(answer, Allow):
                self._park(slot, decision.prompt)
                return
        elif isinstance(decision, Deny):
            slot.result = ToolResult.error("DENIED", f"call denied: {decision.reason}")
            return
        await self._guard(slot)

    def _check(self, slot: _Slot) -> bool:
        """Look the tool up and validate the arguments; False (with a result) when it fails."""
        call, agent_id = slot.call, self.agent_id
        tool = slot.tool
        if tool is None:
            tool = self.rt.tools.lookup(call.name, agent_id)
        if tool is None:
            names = ", ".join(t.name for t in self.rt.tools.visible(agent_id)) or "none"
            slot.result = ToolResult.error(
                "UNKNOWN_TOOL", f"unknown tool {call.name!r} (available tools: {names})"
            )
            return False
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
                return False
            try:
                arguments = freeze(parsed)
            except InvalidContent as exc:
                slot.result = ToolResult.error(
                    "INVALID_ARGUMENTS",
                    f"the arguments for {call.name!r} cannot be used ({exc}); "
                    "send a JSON object that fits the tool's parameters",
                )
                return False
        else:
            arguments = raw
        assert isinstance(arguments, FrozenDict)
        problems = tool.validate_arguments(arguments)
        if problems:
            slot.result = ToolResult.error(
                "INVALID_ARGUMENTS",
                f"invalid arguments for {call.name!r}: " + "; ".join(problems)
                + ". Fix them and call the tool again.",
            )
            return False
        slot.arguments = arguments
        return True

    async def _guard(self, slot: _Slot) -> None:
        """Every owner guard may still deny; otherwise the call is ready to dispatch."""
        call, tool, arguments = slot.call, slot.tool, slot.arguments
        assert tool is not None
        assert arguments is not None
        for policy in self.rt.tools.guards_for(self.agent_id):
            verdict = policy(call, tool)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            if isinstance(verdict, Deny):
                slot.result = ToolResult.error("DENIED", f"call denied: {verdict.reason}")
                return
        self._ready_kwargs(slot)

    @staticmethod
    def _ready_kwargs(slot: _Slot) -> None:
        tool, arguments = slot.tool, slot.arguments
        assert tool is not None
        assert arguments is not None
        slot.kwargs = tool.to_kwargs(arguments) if tool.to_kwargs else dict(arguments)

    # --- approvals -----------------------------------------------------------------------

    def _park(self, slot: _Slot, prompt: str) -> None:
        # Durable first: everything the call needs to run after a restart is in this event.
        assert slot.arguments is not None
        self.session.append(
            _log.TOOL_APPROVAL_REQUESTED,
            _log.approval_requested(slot.call, slot.arguments, prompt),
            self.turn,
        )
        slot.parked = slot.deferred = True
        self.parked += 1
        self.approvals.park(slot.call.id, trio.current_time())

    def _timeout(self) -> float | None:
        value: float | None = self.rt.settings.get(APPROVAL_TIMEOUT)
        return value

    def _deadline(self) -> float:
        timeout = self._timeout() if self.parked else None
        if timeout is None:
            return math.inf
        approvals = self.approvals
        return min(
            (approvals.parked_since(s.call.id, math.inf) + timeout
             for s in self.slots if s.parked),
            default=math.inf,
        )

    def _take_answers(self) -> bool:
        """Apply the answers given so far (and expired approvals); True if any applied."""
        if not self.parked:
            return False
        approvals = self.approvals
        timeout = self._timeout()
        now = trio.current_time()
        took = False
        for slot in self.slots:
            if not slot.parked:
                continue
            call_id = slot.call.id
            answer = approvals.take(call_id)
            if answer is None and timeout is not None \
                    and now >= approvals.parked_since(call_id, now) + timeout:
                answer = expired_answer(timeout)
            if answer is None:
                continue
            took = True
            slot.parked = False
            self.parked -= 1
            approvals.unpark(call_id)
            if answer.abort:
                slot.result = ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)
                continue
            self.session.append(
                _log.TOOL_APPROVAL_ANSWERED,
                _log.approval_answered(call_id, approved=answer.approved, reason=answer.reason),
                self.turn,
            )
            if answer.approved:
                self.ready.append(slot)
            else:
                slot.result = ToolResult.error(
                    "DENIED", f"call denied: {answer.reason or 'denied'}"
                )
        return took

    async def _dispatch_ready(self, nursery: trio.Nursery) -> None:
        """Dispatch the calls approved since the last look, in the order they were answered."""
        while self.ready:
            slot = self.ready.popleft()
            if slot.tool is None:
                # Parked in an earlier turn: the tool and its arguments come from the log.
                self._check(slot)
            if slot.result is None:
                await self._guard(slot)
            if slot.result is None:
                await self._dispatch(nursery, slot)
            await self._emit_ready()

    async def _emit(self, slot: _Slot, *, hooks: bool = True) -> None:
        result = slot.result
        assert result is not None
        call, bus, agent_id = slot.call, self.rt.bus, self.agent_id
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
        content = result.content
        if isinstance(content, str) and content.isascii():
            # The common result: text stored as it is (what result_data finds first).
            self.session.append_tool_result(
                slot.call, content, result.is_error, result.error_code, self.turn
            )
        else:
            self.session.append(_log.TOOL_RESULT, result_data(slot.call, result), self.turn)
        slot.emitted = True
        self.emitted += 1

    def _emittable(self) -> bool:
        """Whether :meth:`_emit_ready` has anything to do: it is awaited about four times a
        step, mostly for nothing."""
        if self.deferred:
            return True
        slots, i = self.slots, self.next_emit
        if i == len(slots):
            return False
        slot = slots[i]
        return slot.deferred or (
            slot.result is not None and (slot.finished or not slot.started)
        )

    async def _emit_ready(self) -> None:
        slots = self.slots
        while self.next_emit < len(slots):
            slot = slots[self.next_emit]
            if slot.deferred:
                # A call waiting for a person holds up nobody: its siblings' results go on.
                self.deferred.append(slot)
                self.next_emit += 1
                continue
            if slot.result is None or (slot.started and not slot.finished):
                break
            await self._emit(slot)
            self.next_emit += 1
        deferred = self.deferred
        i = 0
        while i < len(deferred):
            slot = deferred[i]
            if slot.result is None or (slot.started and not slot.finished):
                i += 1
                continue
            del deferred[i]
            await self._emit(slot)

    # --- concurrent part -----------------------------------------------------------------

    async def _execute(self, slot: _Slot) -> None:
        assert slot.tool is not None
        assert slot.kwargs is not None
        assert slot.arguments is not None
        tool, bus = slot.tool, self.rt.bus
        try:
            # Exact and cheap: a cancel of any enclosing scope, even one called after this
            # task was started (approve() then cancel() in one tick), is seen here.
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            # The body never ran, so nothing happened that the result should claim.
            slot.result = ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)
            slot.finished = True
            self.in_flight -= 1
            self.changed.set()
            raise
        # The body (or a handler running it) reports progress as this call.
        progress = begin_call(bus, self.agent_id, slot.call.id)
        try:
            result: ToolResult | None = None
            if bus.has_handlers(ToolExecute):
                result = await bus.emit(ToolExecute(self.agent_id, slot.call, slot.arguments))
            if result is None:
                if tool.timeout is not None:
                    with trio.move_on_after(tool.timeout) as timer:
                        value = await tool.run(**slot.kwargs)
                    if timer.cancelled_caught:
                        result = ToolResult.error(
                            "TIMEOUT", f"{tool.name!r} did not finish within {tool.timeout:g} s"
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
            progress.close()
            slot.finished = True
            self.in_flight -= 1
            self.changed.set()

    def _start(self, nursery: trio.Nursery, slot: _Slot) -> None:
        scope = self.runner.tasks.scope
        if scope is not None and scope.cancel_called:
            # A cancel from a synchronous handler leaves no checkpoint between it and here:
            # no body starts once its turn's cancel has been called. (A cancel of a scope
            # around the turn is caught by the task itself, before the body.)
            slot.result = ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)
            return
        slot.started = True
        self.in_flight += 1
        # Every tool body runs in a task of its own under the agent's task, named for its
        # call, so a task-tree walk (or a debugger) shows what each agent is running.
        nursery.start_soon(self._execute, slot, name=f"agentloop.tool:{slot.call.id}")

    async def _wait_until(self, predicate: Any) -> None:
        while not predicate():
            await self._wait_once()

    async def _wait_once(self) -> None:
        """Wait for a call to finish, an answer or an approval deadline; then apply it."""
        if not (self.parked and self._take_answers()):
            # Waited on about once per call: an unset event is kept, and without an approval
            # deadline there is no cancel scope to build.
            if self.changed.is_set():
                self.changed = Latch()
            # Waiting only for a person: the agent counts as settled for wait_idle().
            blocked = self.parked > 0 and self._only_answers_missing()
            if blocked:
                # Durable before anyone is told: an application that sees the turn blocked
                # (wait_idle returned, pending_approvals listed) may stop the process at once.
                pending = self.runner.flush(self.session.last_seq)
                if pending is not None:
                    await pending
                blocked = not self.changed.is_set() and self._only_answers_missing()
            # A turn whose cancel was called (by a handler deciding one of these calls, say)
            # waits for no answer: it ends at this wait, and wait_idle() waits for that.
            cancel = self.runner.tasks.scope
            if blocked and not (cancel is not None and cancel.cancel_called):
                self.approvals.set_blocked(True)
            else:
                blocked = False
            try:
                deadline = self._deadline() if self.parked else math.inf
                if deadline == math.inf:
                    await self.changed.wait()
                else:
                    with trio.move_on_at(deadline):
                        await self.changed.wait()
            finally:
                if blocked:
                    self.approvals.set_blocked(False)
            if self.parked:
                self._take_answers()
        if self._emittable():
            await self._emit_ready()

    def _only_answers_missing(self) -> bool:
        return self.in_flight == 0 and not self.ready and self.parked > 0

    async def run(self) -> None:
        nursery = self.runner.tasks.nursery
        if nursery is None:
            raise RuntimeError("a step's tool calls run inside its turn's with_tool_tasks")
        failure: Exception | None = None
        self.approvals.waiter = self
        try:
            try:
                if self._plain():
                    await self._run_plain(nursery)
                else:
                    await self._dispatch_all(nursery)
            except Exception as exc:  # noqa: BLE001 - reported after the drain
                # An internal failure stops new dispatches; started calls finish.
                failure = exc
                await self._wait_until(lambda: self.in_flight == 0)
        except BaseException as exc:
            # The turn's nursery outlives the step: its started bodies are stopped and waited
            # for here, as a nursery of the step's own did at its exit, so a body cut short
            # reports ABORTED (not ABORTED_BEFORE_DISPATCH) before the rest is closed.
            if not isinstance(exc, trio.Cancelled):
                nursery.cancel_scope.cancel()  # a cancel has reached the bodies already
            with trio.CancelScope(shield=True):
                while self.in_flight:
                    self.changed = Latch()
                    await self.changed.wait()
            self._abort_rest()
            raise
        finally:
            self.approvals.waiter = None
        if failure is not None:
            self._abort_rest()
            raise failure
        # The plain step's yields see no cancel, and any wait may have ended before one: a
        # cancel that came while the calls ran (a body cancelling its own turn, or another
        # task between the calls' end and this task running again) stops the turn here, with
        # every result logged, and not after the hooks and the inbox claim that follow a
        # tool step.
        await trio.lowlevel.checkpoint_if_cancelled()

    def _plain(self) -> bool:
        """Whether this step's calls can take the plain way: a fresh step whose calls all
        run in parallel within the bound, with nobody to ask (no approval, pre- or
        post-execute hook, result listener or guard). Their tools are looked up once: the
        slots keep them only when the step goes the plain way."""
        rt, slots = self.rt, self.slots
        bus = rt.bus
        handled = bus.handled()
        if (
            self.parked or ToolPreExecute in handled or ToolPostExecute in handled
            or bus.has_listeners(ToolResultEvent) or rt.tools.has_guards()
        ):
            return False
        if len(slots) > 1:
            self.bound = rt.settings.get(MAX_PARALLEL_TOOL_CALLS)
            if len(slots) > self.bound:
                return False
        registry, agent_id = rt.tools, self.agent_id
        tools = []
        for slot in slots:
            if slot.logged or slot.result is not None:
                return False
            tool = registry.lookup(slot.call.name, agent_id)
            if tool is not None and (
                tool.requires_approval or tool.classify is not None
                or tool.concurrency != "parallel"
            ):
                return False
            tools.append(tool)
        for slot, tool in zip(slots, tools, strict=True):
            slot.tool = tool
        return True

    async def _run_plain(self, nursery: trio.Nursery) -> None:
        """The plain step: what :meth:`_dispatch_all` does for such calls, in one pass.

        Every call is logged and checked, then (after the write-ahead flush, if one is
        due) every valid one starts; the results are logged in model order, each as soon as
        it and those before it are done: a call refused by its check before any call ran is
        answered at once, after its own ``tool/call``, as the general dispatcher does.
        """
        slots = self.slots
        flush = False
        for slot in slots:
            self._log_call(slot)
            if self._check(slot):
                self._ready_kwargs(slot)
                tool = slot.tool
                assert tool is not None
                flush = flush or not tool.idempotent
            elif slots[self.next_emit] is slot:
                result = slot.result
                assert result is not None
                self._append_result(slot, result)
                self.next_emit += 1
        if flush and not self.stored:
            # Write-ahead, as in _dispatch: the anchor (and the calls) before any body.
            pending = self.runner.flush(self.session.last_seq)
            if pending is not None:
                await pending
            self.stored = True
        for slot in slots:
            if slot.kwargs is not None:
                self._start(nursery, slot)
        if self.in_flight:
            # The calls' tasks run in trio's next pass, and so does this task if it yields
            # now rather than park: when it comes after them there (trio picks either order)
            # and they did not wait, it finds them done, a pass and a wake-up sooner. When
            # it came first, one more yield finds them done as soon as parking would, without
            # the park and the wake-up; calls that wait for something are then waited for.
            await trio.lowlevel.cancel_shielded_checkpoint()
            if self.in_flight:
                await trio.lowlevel.cancel_shielded_checkpoint()
        for slot in slots[self.next_emit:]:
            while slot.started and not slot.finished:
                if self.changed.is_set():
                    self.changed = Latch()
                await self.changed.wait()
            result = slot.result
            assert result is not None
            self._append_result(slot, result)
            self.next_emit += 1

    async def _run_alone(self, nursery: trio.Nursery, slot: _Slot) -> None:
        self._start(nursery, slot)
        await self._wait_until(lambda: self.in_flight == 0)

    async def _dispatch(self, nursery: trio.Nursery, slot: _Slot) -> None:
        assert slot.tool is not None
        assert slot.arguments is not None
        if not slot.tool.idempotent and not self.stored:
            # Write-ahead: a crash after the body starts finds the call (in its step's
            # anchor) in the log, and crashed_turn="continue" answers it rather than let the
            # model's step run it a second time. Once per run: the anchor holds every call.
            pending = self.runner.flush(self.session.last_seq)
            if pending is not None:
                await pending
            self.stored = True
        mode = slot.tool.mode_for(slot.arguments)
        if mode == "parallel":
            if self.bound is None:
                self.bound = self.rt.settings.get(MAX_PARALLEL_TOOL_CALLS)
            bound = self.bound
            if self.in_flight >= bound:
                await self._wait_until(lambda: self.in_flight < bound)
                # Classification is decided right before the call starts.
                mode = slot.tool.mode_for(slot.arguments)
        if mode == "exclusive":
            await self._wait_until(lambda: self.in_flight == 0)
            await self._emit_ready()  # earlier results go out before the barrier
            self.bound = None  # the next parallel call opens a new group
            await self._run_alone(nursery, slot)
        else:
            self._start(nursery, slot)

    async def _dispatch_all(self, nursery: trio.Nursery) -> None:
        for slot in self.slots:
            if self.parked:
                self._take_answers()  # answers given while the previous prelude ran
            if self.ready:
                await self._dispatch_ready(nursery)
            if slot.parked or slot.deferred:
                continue  # parked in an earlier turn: answered through the ready queue
            if slot.result is None:
                await self._prelude(slot)
            if slot.result is None and not slot.parked:
                await self._dispatch(nursery, slot)
            if self._emittable():
                await self._emit_ready()
        while True:
            if self.ready:
                await self._dispatch_ready(nursery)
            if self._emittable():
                await self._emit_ready()
            if self.emitted == len(self.slots):
                return
            await self._wait_once()

    def _abort_rest(self) -> None:
        """Close every remaining call synchronously, in order, so history stays valid.

        At a disposal, calls still awaiting approval are left without a result: the turn
        ends ``suspended`` and they are pending again once the session is resumed.
        """
        keep_parked = self.runner.stopping()
        for slot in self.slots:
            if slot.emitted:
                continue
            if slot.result is None:
                if slot.parked and keep_parked:
                    continue
                slot.result = ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)
            self._append_result(slot, slot.result)
        self.next_emit = len(self.slots)
        self.deferred.clear()


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


def close_unanswered(session: Session, turn: int, *, keep_awaiting: bool = False) -> None:
    """Answer every call of the session still without a result (``ABORTED_BEFORE_DISPATCH``);
    with ``keep_awaiting``, calls awaiting approval stay unanswered (a suspended turn)."""
    awaiting = {p.call_id for p in session.awaiting_approval} if keep_awaiting else ()
    for call, logged in session.unanswered:
        if call.id in awaiting:
            continue
        if not logged:
            session.append(_log.TOOL_CALL, _log.tool_call(call), turn)
        session.append(
            _log.TOOL_RESULT,
            result_data(call, ToolResult.error(ABORTED_BEFORE_DISPATCH, _ABORTED_TEXT)),
            turn,
        )


# ToolResult(content, is_error, error_code), for the result of every call that returns.
_result = stored_maker(ToolResult)

# One encoder for every result: ``json.dumps`` with options builds a new one per call.
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _to_result(value: object) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult("")
    if isinstance(value, str):
        return _result(value, False, None)
    if type(value) is int and value.bit_length() < 64:
        return _result(str(value), False, None)  # what the encoder writes, without the walk
    try:
        text = _ENCODE(freeze_repaired(value)[0])
    except (InvalidContent, ValueError) as exc:
        return ToolResult.error(
            "INVALID_RESULT", f"the tool returned a value that is not JSON ({exc})"
        )
    return ToolResult(text)


def run_tool_calls(
    runner: ToolRunner, turn: int, calls: Sequence[ToolCall], *,
    logged: Collection[str] = (), answered: Mapping[str, ToolResult] | None = None,
) -> Awaitable[None]:
    """Run one step's calls (await what this returns). Calls named in ``logged`` already
    have their ``tool/call``, those in ``answered`` are not run and get that result (a
    crashed turn's calls, taken up again), in order with the others.

    Not a coroutine itself: the run's own is awaited directly, one level less in the chain
    every yield of the step to its tools passes through."""
    run = _Run(runner, turn, calls)
    if logged or answered:
        for slot in run.slots:
            slot.logged = slot.call.id in logged
            if answered is not None:
                slot.result = answered.get(slot.call.id)
    return run.run()


async def run_suspended_calls(runner: ToolRunner, turn: int) -> None:
    """Answer the calls a suspended turn left awaiting approval: approved ones run (tool and
    arguments taken from the log), denied ones get ``DENIED``, unanswered ones park again."""
    pending = runner.session.awaiting_approval
    calls = [ToolCall(p.call_id, p.name, p.arguments) for p in pending]
    if calls:
        await _Run(runner, turn, calls, parked=True).run()


