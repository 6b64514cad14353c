"""One model stream folded into the log: a chunk per delta, then the completion anchor.

The fold owns the state of one reply (text, reasoning, tool-call fragments, the seqs it
cites) and writes exactly one ``assistant/message`` for it: the final anchor, or, when the
stream is cancelled after the user saw something, an interrupted anchor citing exactly the
visible chunks (the crash-recovery anchor in ``_session`` has the same shape, from the same
builder).
"""

from __future__ import annotations

import dis
import functools
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, cast

import attrs
import trio

from . import _log
from ._errors import InvalidContent, ProviderError
from ._json import FrozenDict, freeze, freeze_repaired, parse_json, repair_text, text_problem
from ._llm import CLOSE_SECONDS
from ._model import Finish, ReasoningDelta, StreamPart, TextDelta, ToolCall, ToolCallDelta
from ._output import Verdict
from ._session import Session
from ._util import quick_init, stored_maker

__all__ = ["StepOutcome", "fold_stream"]



@quick_init
@attrs.frozen(slots=True, weakref_slot=False)
class StepOutcome:
    finish_reason: str
    text: str
    tool_calls: tuple[ToolCall, ...]
    verdict: Verdict | None = None


# Made once or more a step: StepOutcome(finish_reason, text, tool_calls, verdict), and
# ToolCall(id, name, arguments).
_outcome = stored_maker(StepOutcome)
_call = stored_maker(ToolCall)


def _same_call(index: int, acc: _CallParts, call_id: str | None, name: str | None) -> None:
    """Another name, or another id with a name (a new call's opening), at a call's index is
    another call: merging them would run one with the other's arguments, so the stream is
    refused instead. A bare fragment under a new id is taken as the same call: some
    servers stamp a fresh id on every chunk."""
    changed = [
        (what, had, got) for what, had, got in (("id", acc.id, call_id), ("name", acc.name, name))
        if had is not None and got is not None and had != got
    ]
    if changed and name is not None:
        what, had, got = changed[-1]
        raise ProviderError(
            f"tool call {index} changed its {what} from {had!r} to {got!r} mid-stream",
            code="invalid_stream",
        )


@attrs.define(slots=True, eq=False)
class _CallParts:
    """The fragments of one streamed tool call, by its index in the stream."""

    id: str | None
    name: str | None
    fragments: list[str]

    def build(self) -> ToolCall:
        raw = "".join(self.fragments)
        arguments: FrozenDict | str = raw
        if not raw.strip():
            arguments = FrozenDict()
        else:
            try:
                parsed = parse_json(raw)
            except (ValueError, RecursionError):
                pass  # kept as text; the scheduler answers it with INVALID_ARGUMENTS
            else:
                if isinstance(parsed, dict):
                    # A lone surrogate from a JSON escape is repaired like provider text;
                    # what cannot be stored at all (1e400, too deep) stays text.
                    try:
                        frozen = freeze_repaired(parsed)[0]
                    except InvalidContent:
                        pass
                    else:
                        assert isinstance(frozen, FrozenDict)
                        arguments = frozen
        return _call(self.id or f"call_{uuid.uuid4().hex[:24]}", self.name or "", arguments)


@attrs.define(slots=True, eq=False)
class _BlockParts:
    """One reasoning block of the reply: its text fragments and what the provider attached."""

    format: str | None = None
    signature: str | None = None
    fields: dict[str, Any] | None = None
    texts: list[str] = attrs.Factory(list)

    def note(self, part: ReasoningDelta) -> None:
        if part.format is not None:
            self.format = part.format
        if part.signature is not None:
            self.signature = _repaired(part.signature)
        if part.fields is not None:
            # Provider output, stored as is: a lone surrogate inside was repaired by the part.
            self.fields = {**(self.fields or {}), **part.fields}

    @property
    def kept(self) -> bool:
        """Whether a provider could need this block back verbatim."""
        return self.format is not None or self.signature is not None or bool(self.fields)

    def to_json(self) -> FrozenDict:
        block: dict[str, Any] = {"format": self.format, "text": "".join(self.texts)}
        if self.signature is not None:
            block["signature"] = self.signature
        if self.fields:
            block["fields"] = FrozenDict(self.fields)
        return FrozenDict(block)


def _closes_without_running(stream: types.AsyncGeneratorType[Any, Any]) -> bool:
    """Whether closing ``stream`` runs none of its code: it has finished, or its code has no
    handler at all (``finally``, ``with``, ``except``) that a close could run."""
    frame = stream.ag_frame
    return frame is None or _no_handlers(frame.f_code)


# Handlers the compiler adds to every coroutine body (3.12+); none runs user code when a
# suspended generator is closed.
_IMPLICIT = frozenset(
    {("CLEANUP_THROW", ""), ("CALL_INTRINSIC_1", "INTRINSIC_STOPITERATION_ERROR")}
)


@functools.lru_cache(maxsize=256)
def _no_handlers(code: types.CodeType) -> bool:
    instructions = {i.offset: (i.opname, i.argrepr) for i in dis.get_instructions(code)}
    return all(
        instructions.get(entry.target) in _IMPLICIT
        # Untyped in typeshed: dis.Bytecode has had the code's handler table since 3.11.
        for entry in cast("Any", dis.Bytecode(code)).exception_entries
    )


def _reasoning_text(blocks: dict[int, _BlockParts] | None) -> str | None:
    if not blocks:
        return None  # most replies have no reasoning
    # Blocks in the order they opened; one provider's blocks never interleave.
    return "".join(piece for b in blocks.values() for piece in b.texts) or None


def _blocks_json(blocks: dict[int, _BlockParts] | None) -> tuple[FrozenDict, ...]:
    if not blocks or not any(b.kept for b in blocks.values()):
        return ()  # plain reasoning text: ``reasoning`` says it all
    return tuple(b.to_json() for _, b in sorted(blocks.items()))


def _repaired(value: str | None) -> str | None:
    return None if value is None else repair_text(value)


class _Fold:
    """The state of one reply being folded, and the parts of the fold off the per-chunk path.

    ``fold_stream`` binds the lists to locals and handles text chunks inline; everything
    rarer (reasoning, a tool-call fragment, the stream's close, the anchors) is a method here,
    so the loop stays one short frame.
    """

    __slots__ = (
        "block", "block_no", "blocks", "calls", "calls_at", "seqs", "session", "signature", "step",
        "stream", "text", "turn",
    )

    def __init__(
        self, session: Session, turn: int, step: int, stream: AsyncIterator[StreamPart]
    ) -> None:
        self.session = session
        self.turn = turn
        self.step = step
        self.stream = stream
        self.text: list[str] = []
        self.seqs: list[int] = []
        # The tool-call chunks (the user saw all the others); made by the first.
        self.calls_at: list[int] | None = None
        self.blocks: dict[int, _BlockParts] | None = None  # made by the first reasoning part
        self.block_no = -1
        self.block: _BlockParts | None = None  # the open reasoning block (of ``block_no``)
        self.signature: str | None = None
        self.calls: dict[int, _CallParts] = {}

    def reasoning(self, part: ReasoningDelta) -> None:
        """Log a reasoning part (opening its block, or noting the data the provider
        attaches) and keep its text with its block's."""
        block = self.block
        if (
            block is None or part.block != self.block_no or part.signature is not None
            or part.format is not None or part.fields is not None
        ):
            self.block_no = part.block
            blocks = self.blocks
            if blocks is None:
                blocks = self.blocks = {}
            block = blocks.get(part.block)
            if block is None:
                block = blocks[part.block] = _BlockParts()
            block.note(part)
            self.signature = block.signature or self.signature
            self.block = block
        delta = part.text
        if not delta:
            return
        repaired = not delta.isascii() and text_problem(delta) is not None
        if repaired:
            delta = repair_text(delta)
        chunk = _log.text_chunk(self.step, "reasoning", delta, repaired=repaired)
        self.seqs.append(self.session.append(_log.ASSISTANT_CHUNK, chunk, self.turn).seq)
        block.texts.append(delta)

    def note_call(self, part: ToolCallDelta) -> None:
        call_id, name, fragment = part.id, part.name, part.arguments
        repaired = False
        if not (fragment.isascii() and (name is None or name.isascii())
                and (call_id is None or call_id.isascii())):
            fixed = (_repaired(call_id), _repaired(name), repair_text(fragment))
            repaired = fixed != (call_id, name, fragment)
            call_id, name, fragment = fixed
        acc = self.calls.get(part.index)
        if acc is None:
            acc = self.calls[part.index] = _CallParts(call_id, name, [])
        else:
            _same_call(part.index, acc, call_id, name)
            acc.id = acc.id or call_id
            acc.name = acc.name or name
        acc.fragments.append(fragment)
        if repaired:
            chunk = _log.tool_call_chunk(
                self.step, part.index, call_id, name, fragment, repaired=True
            )
            seq = self.session.append(_log.ASSISTANT_CHUNK, chunk, self.turn).seq
        else:
            seq = self.session.append_call_chunk(part.index, call_id, name, fragment)
        self.seqs.append(seq)
        if self.calls_at is None:
            self.calls_at = []
        self.calls_at.append(seq)

    def closed_now(self) -> bool:
        """Close the stream at once if nothing of it runs when it is closed (a finished
        generator, or one whose code has no handler); whether it did. Nothing can wait or
        see a cancel then: the shielded scope of :meth:`close`, the costliest part of a
        step's close, is skipped, and so is its coroutine."""
        stream = self.stream
        if type(stream) is types.AsyncGeneratorType and _closes_without_running(stream):
            try:
                stream.aclose().send(None)
            except StopIteration:  # how such a close ends, at once
                return True
        return False

    async def close(self) -> None:
        # Shielded and bounded: a cancelled turn still lets the adapter release its
        # connection, but never waits on it for long.
        if self.closed_now():
            return
        stream = self.stream
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with trio.move_on_after(CLOSE_SECONDS, shield=True):
                await aclose()

    def interrupted(self) -> None:
        """On cancel: what the user already saw stays, as an interrupted anchor citing
        exactly it (nothing is written when nothing was seen)."""
        calls_at = set(self.calls_at or ())
        visible = [seq for seq in self.seqs if seq not in calls_at] if calls_at else self.seqs
        if not visible:
            return
        self.session.append(
            _log.ASSISTANT_MESSAGE,
            _log.assistant_message(
                step=self.step, content="".join(self.text),
                reasoning=_reasoning_text(self.blocks), reasoning_signature=self.signature,
                tool_calls=(), source_event_seqs=tuple(visible), finish_reason=None,
                usage=None, interrupted=True, reasoning_blocks=_blocks_json(self.blocks),
            ),
            self.turn,
        )

    def finished(
        self, finish: Finish | None,
        judge: Callable[[str, tuple[ToolCall, ...]], Verdict] | None,
        cost: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    ) -> StepOutcome:
        """Anchor the completed reply (judged first, when ``judge`` is given), with its
        cost in its usage (when ``cost`` prices the route)."""
        if finish is None:
            raise ProviderError(
                "the model stream ended without a finish", code="incomplete_stream"
            )
        calls = self.calls
        if len(calls) == 1:
            # The usual reply with a call has one: no generator for it.
            tool_calls: tuple[ToolCall, ...] = (next(iter(calls.values())).build(),)
        else:
            tool_calls = tuple(acc.build() for _, acc in sorted(calls.items()))
        renamed: tuple[FrozenDict, ...] = ()
        if tool_calls:
            tool_calls, renamed = _unique_ids(self.session, tool_calls)
        reason = finish.reason  # adapters and Finish itself normalise it
        content = "".join(self.text)
        counters = finish.usage
        if counters and cost is not None:
            counters = cost(counters)
        usage = freeze(dict(counters)) if counters else None
        assert usage is None or isinstance(usage, FrozenDict)
        verdict = None if judge is None else judge(content, tool_calls)
        output = freeze(verdict.value) if verdict is not None and verdict.valid else None
        blocks = self.blocks  # None for most replies: no call for their reasoning
        self.session.append_reply(
            self.turn, self.step, content, _reasoning_text(blocks) if blocks else None,
            self.signature, tool_calls, tuple(self.seqs), reason, usage, renamed,
            _blocks_json(blocks) if blocks else (), output,
        )
        return _outcome(reason, content, tool_calls, verdict)


async def fold_stream(
    session: Session, turn: int, step: int, stream: AsyncIterator[StreamPart],
    judge: Callable[[str, tuple[ToolCall, ...]], Verdict] | None = None,
    *, failure: Callable[[Exception], ProviderError] | None = None,
    cost: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> StepOutcome:
    """Log every part of ``stream`` for ``step`` of ``turn`` and anchor the reply.

    ``judge`` checks a structured-output turn's reply before it is anchored, so that a valid
    output is recorded on the anchor itself. With ``failure`` (from ``PreparedCall.serve``),
    an exception of the stream other than a ``ProviderError`` is raised as ``failure(exc)``;
    the guard is this loop, not a wrapper around the stream, so nothing stands between a
    part (or a checkpoint) and the driver. The stream is closed shielded and bounded.
    ``cost`` (the route's pricing) adds the call's cost to the usage its anchor records.
    """
    fold = _Fold(session, turn, step, stream)
    # The per-chunk path reads locals only: the fold's lists, bound once.
    write = session.text_writer(step, turn)
    text, seqs = fold.text, fold.seqs
    finish: Finish | None = None
    try:
        # Parts are dispatched on their exact class (one identity test each, on the per-chunk
        # path), which a type checker cannot follow: hence Any.
        next_part: Callable[[], Awaitable[Any]] = stream.__anext__
        try:
            while True:
                try:
                    part = await next_part()
                except StopAsyncIteration:
                    break
                except ProviderError:
                    raise
                except Exception as exc:
                    if failure is None:
                        raise
                    raise failure(exc) from exc
                cls = type(part)
                if cls is TextDelta:
                    delta = part.text
                    if not delta:
                        continue
                    if delta.isascii() or text_problem(delta) is None:
                        seqs.append(write(delta))
                    else:
                        # A provider's lone surrogate (a JSON "\ud83d" escape) could never be
                        # stored or sent again: repaired, and the repair noted.
                        delta = repair_text(delta)
                        chunk = _log.text_chunk(step, "text", delta, repaired=True)
                        seqs.append(session.append(_log.ASSISTANT_CHUNK, chunk, turn).seq)
                    text.append(delta)
                elif cls is ReasoningDelta:
                    fold.reasoning(part)
                elif cls is ToolCallDelta:
                    fold.note_call(part)
                elif cls is Finish:
                    finish = part
                    break
                else:
                    raise ProviderError(
                        f"the adapter yielded {part!r}, which is not a stream part",
                        code="invalid_stream",
                    )
        except BaseException:
            # Not ``finally``: mypyc, which compiles this module in the opt-in build, compiles
            # an ``await`` there so that every later call raises this exception again.
            await fold.close()  # noqa: ASYNC102 - the close shields and bounds itself
            raise
        if not fold.closed_now():
            await fold.close()
    except trio.Cancelled:
        fold.interrupted()
        raise
    return fold.finished(finish, judge, cost)


def _unique_ids(
    session: Session, calls: tuple[ToolCall, ...]
) -> tuple[tuple[ToolCall, ...], tuple[FrozenDict, ...]]:
    """Calls with ids no earlier call of the session (or this step) has: providers refuse a
    history that repeats one; and the renames, which keep the model's id on record."""
    if len(calls) == 1 and session.unique_call_id(calls[0].id, _NONE_TAKEN) == calls[0].id:
        return calls, ()  # the usual reply with a call: nothing to rename, nothing made
    taken: set[str] = set()
    out: list[ToolCall] = []
    renamed: list[FrozenDict] = []
    for call in calls:
        unique = session.unique_call_id(call.id, taken)
        if unique != call.id:
            renamed.append(FrozenDict(id=unique, original_id=call.id))
            call = attrs.evolve(call, id=unique)
        taken.add(unique)
        out.append(call)
    return tuple(out), tuple(renamed)


_NONE_TAKEN: frozenset[str] = frozenset()
