"""What the in-tree session stores (``agentloop_sqlite``, ``agentloop_postgres``) share.

Not a plugin and not an API: the stored events' strict decoding and shape checks, and the
request objects by which a store's trio side calls into its worker thread. Each store keeps
what is its own (its schema, its transactions, its leases).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar, cast

import trio

from agentloop import FrozenDict

__all__ = [
    "ENCODER", "DECODER", "frozen_array", "shape_problem", "unicode_reason", "readable",
    "Request", "Flush", "Stop", "nothing", "process_identity",
]

ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def frozen_array(items: list[Any]) -> tuple[Any, ...]:
    return tuple([frozen_array(item) if type(item) is list else item for item in items])


def _frozen_object(pairs: list[tuple[str, Any]]) -> FrozenDict:
    return FrozenDict([(k, frozen_array(v)) if type(v) is list else (k, v) for k, v in pairs])


# Decodes straight to the value ``freeze(json.loads(text))`` would give, about twice as fast
# (resume time is dominated by decoding): the parser hands over objects innermost first, so
# each is frozen as it is built and only arrays need a pass of their own.
DECODER: Final = json.JSONDecoder(
    object_pairs_hook=_frozen_object, parse_float=_finite_float, parse_constant=_reject_constant
)


# The keys that readers of a loaded log (the history reducers, crash recovery, transcripts)
# index directly: a stored event without them is reported here, by session and seq, rather
# than as a KeyError wherever it is first read.
_REQUIRED_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "user/message": ("content",),
    "steering/message": ("content",),
    "tool/call": ("call_id",),
    "tool/result": ("call_id", "name", "content"),
}
_TOOL_CALL_KEYS: Final = ("id", "name", "arguments")


def shape_problem(type_: str, data: FrozenDict) -> str | None:
    """What a reader would trip over in an event's data, or None."""
    for key in _REQUIRED_KEYS.get(type_, ()):
        if key not in data:
            return f"lacks {key!r}"
    if type_ == "assistant/message":
        calls = data.get("tool_calls", ())
        if not isinstance(calls, tuple):
            return "has tool_calls that is not a list"
        for i, call in enumerate(calls):
            if not isinstance(call, FrozenDict):
                return f"has tool_calls[{i}] that is not an object"
            for key in _TOOL_CALL_KEYS:
                if key not in call:
                    return f"lacks {key!r} in tool_calls[{i}]"
    elif (
        type_ == "assistant/chunk"
        and data.get("kind") in ("text", "reasoning")
        and not isinstance(data.get("delta"), str)
    ):
        return "lacks a text 'delta'"
    return None


def unicode_reason(exc: UnicodeEncodeError, where: str = "") -> str:
    if "surrogate" in exc.reason:
        return f"lone surrogate {exc.object[exc.start : exc.end]!r}{where} is not valid UTF-8"
    return f"text{where} cannot be encoded as UTF-8: {exc}"


def readable(text: str) -> str:
    # An error message must itself be printable: escape what UTF-8 cannot carry.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_T = TypeVar("_T")


class Request(Generic[_T]):
    """One call into the worker thread, answered on the calling trio thread."""

    __slots__ = ("_delivered", "_done", "_error", "_fn", "_token", "_value")

    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn = fn
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        self._value: _T | None = None
        self._error: BaseException | None = None
        self._delivered = False

    def run(self) -> bool:
        """Run on the worker thread and answer; True when the call succeeded."""
        try:
            value = self._fn()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting task, which raises it
            self.fail(exc)
            return False
        self._deliver(value, None)
        return True

    def fail(self, error: BaseException) -> None:
        self._deliver(None, error)

    def _deliver(self, value: _T | None, error: BaseException | None) -> None:
        if self._delivered:
            return
        self._delivered = True
        self._value = value
        self._error = error
        # The caller's run may be over (a store leaked past trio.run); nobody is waiting then.
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._done.set)

    async def wait(self) -> _T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return cast("_T", self._value)


class Flush(Request[None]):
    __slots__ = ()


class Stop(Request[None]):
    __slots__ = ()


def nothing() -> None:
    return None


def process_identity(pid: int) -> tuple[str, str] | None:
    """A process's state letter and start time (clock ticks since boot), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2 :].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, ValueError, IndexError):
        return None
