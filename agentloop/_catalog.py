"""Generate ``docs/events.md`` from the event classes.

    python -m agentloop._catalog           # (re)write docs/events.md
    python -m agentloop._catalog --check   # exit 1 when docs/events.md is stale
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ForwardRef, cast

import attrs

from . import _log
from ._bus import Lagged
from ._events import ALL_EVENTS, Allow, Ask, Deny, Event, Kind, Reject, Replace, Retry, Stop

__all__ = ["render_catalog", "main", "DOCS_PATH"]

DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "events.md"
COMMAND = "python -m agentloop._catalog"

DECISIONS: tuple[type[Any], ...] = (Reject, Replace, Stop, Retry, Deny, Ask, Allow)

_HEADER = f"""\
# Event catalog

<!-- Generated from agentloop/_events.py by `{COMMAND}`. Do not edit by hand. -->

Every event is a frozen attrs class, importable from `agentloop.events`. Its class attributes
say how it travels: `name` (the seed name used in this catalog), `kind` (`durable`,
`control` or `hook`) and `mode` (`notify`, `waterfall` or `decision`; what a handler's return
value means). Register a handler with `ctx.events.on(Cls, handler, priority=0)`: handlers run
by descending `priority`, then in registration order, and the returned `Disposer` (or the
closing of the registering context) removes it. A handler registered through an agent's own
context (in its `setup`) only sees events about that agent: those whose `agent_id` is its id,
and the `session/*` events of its own session (a session's id is its agent's); events about no
agent (`plugin/failed`, `settings/changed`) do not reach it. Such a handler on
`session/event` costs the other sessions nothing: only its own makes and announces its events.

The runtime checks for listeners before it even builds an event, so an event nobody listens
to costs next to nothing.
"""

_SUMMARY_INTRO = """\
## Summary

| Name | Kind | Mode | Class |
| --- | --- | --- | --- |
"""

_KIND_TITLES: dict[Kind, str] = {
    "durable": "Durable events",
    "control": "Control events",
    "hook": "Hooks",
}

_KIND_INTROS: dict[Kind, str] = {
    "durable": """\
Durable events mirror the session's append-only log: `session/event` is emitted once for
every appended event, in `seq` order, at the moment of the append. Dispatch is synchronous:
a plain function registered with `ctx.events.on` runs right there, on the agent's hot path, so
it should only record or queue what it needs (a persistence backend queues the event and
writes it at the next `session/flush`); its return value is ignored, and if it raises, the
error is logged and dispatch goes on. An `async def` handler registered with `ctx.events.on`
becomes an observer task that receives the events in order without holding up the emitter;
the same is available directly with `ctx.events.subscribe` (see
[Subscriptions](#subscriptions-and-lagged)).
""",
    "control": """\
Control events report what happened: status changes, creation and disposal, inbox changes,
retries, failing plugins, settings. They are dispatched synchronously, at the moment they
happen and before the emitting code goes on, to plain functions (return values are ignored; a
handler that raises is logged and skipped). An `async def` handler registered with
`ctx.events.on` becomes an observer task that receives them in order without holding up the
emitter, like a subscriber of `ctx.events.subscribe` (see
[Subscriptions](#subscriptions-and-lagged)). The bare `EventBus.on` refuses async handlers.
""",
    "hook": """\
Hooks are awaited at the loop's checkpoints: the emitter waits until every handler has run.
Handlers may be plain functions or `async def`, and run one after another. The mode says what
a handler's return value means:

- **notify**: the return value is ignored.
- **waterfall**: a non-`None` return value replaces the event's *waterfall field* (named
  below); the next handler sees the event with the replaced value, and the emitter uses the
  final value. Returning `None` keeps the current value.
- **decision**: the first non-`None` return value is the decision and ends dispatch; `None`
  leaves the choice to the next handler. With no decision the default applies. The decision
  types are listed under [Decisions](#decisions).

Subscribers also receive hook events (before the handlers run), but cannot influence them.
""",
}

_DECISIONS_INTRO = """\
## Decisions

Values that `decision` hook handlers return, importable from `agentloop` and
`agentloop.events`; each hook's description says which it takes. `llm/stream` and
`tools/execute` take the served value itself instead (a stream of parts, a `ToolResult`).
Whatever the value, the first handler that returns something other than `None` ends dispatch.
"""

_SUBSCRIPTIONS = """\
## Subscriptions and `Lagged`

`ctx.events.subscribe(classes, capacity=65536)` is an async context manager that yields a
trio receive channel of the events of the given classes (one class or a tuple), in emission
order across all of them, until the block exits:

```python
from agentloop.events import AgentStatus, SessionEventAppended

async with ctx.events.subscribe((AgentStatus, SessionEventAppended)) as received:
    agent.followup("hello")
    async for event in received:
        print(type(event).name, getattr(event, "status", ""))
        if isinstance(event, AgentStatus) and event.status == "idle":
            break
```

The channel is a `trio.MemoryReceiveChannel`, typed by the classes subscribed to. Delivery
never blocks the emitter: it appends to the subscription's own queue, or hands the event to
the reader parked longest in `receive` and reschedules it. The channel object reads that
queue: its
`receive` (and so `async for`) takes what is queued with a cancel check but no schedule point
per event, passing one after every 64 so that a long backlog still lets other tasks run;
`receive_nowait`, `statistics()` and `clone()` read the same queue, and closing the channel
(or the last of its clones) ends the subscription at once. Order, cancellation, the end of
the channel and a closed channel's errors are trio's. Any kind of
event can be subscribed to, and an async task is the place to await something in response to
a control or durable event. A subscription made through an agent's own context only receives
events whose `agent_id` is that agent's (so none of the `session/*` events).

Durable events (`session/event`) are never dropped, however slow the subscriber: its memory
grows with its backlog, one queue slot per event. Control and hook events are bounded: a
subscriber with `capacity` of them not yet received falls behind; further ones are counted,
and the next thing it receives is one `Lagged` marker saying how many it missed, followed by
what came after. To catch up on a large backlog, draining with `receive_nowait` until
`trio.WouldBlock` is cheaper still (no cancel check per event).
"""


def _markdown(text: str) -> str:
    """Docstring reST to Markdown: roles and double backquotes become code spans."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _doc(cls: type[Any]) -> str:
    return _markdown(inspect.cleandoc(cls.__doc__ or "")).strip()


def _cell(text: str) -> str:
    """A table cell: a code span, with the pipes of union types escaped."""
    return f"`{text}`".replace("|", "\\|")


def _type_name(annotation: object) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, ForwardRef):
        return annotation.__forward_arg__
    return getattr(annotation, "__name__", repr(annotation))


def _default(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        factory = cast("Any", default).factory
        return _cell(f"{getattr(factory, '__name__', repr(factory))}()")
    return _cell(repr(default))


def _fields_table(cls: type[Any], waterfall: str | None = None) -> list[str]:
    fields = [
        f for f in attrs.fields(cast("type[attrs.AttrsInstance]", cls))
        if not f.metadata.get("internal")
    ]
    if not fields:
        return ["No fields."]
    lines = ["| Field | Type | Default |", "| --- | --- | --- |"]
    for field in fields:
        name = _cell(field.name)
        if field.name == waterfall:
            name += " (waterfall)"
        lines.append(f"| {name} | {_cell(_type_name(field.type))} | {_default(field)} |")
    return lines


def _event_section(cls: type[Event]) -> list[str]:
    mode: str = cls.mode
    if cls.waterfall_field is not None:
        mode += f" (field `{cls.waterfall_field}`)"
    return [
        f"### `{cls.name}`",
        "",
        f"- Class: `agentloop.events.{cls.__name__}`",
        f"- Kind: {cls.kind}",
        f"- Mode: {mode}",
        "",
        _doc(cls),
        "",
        *_fields_table(cls, cls.waterfall_field),
        "",
    ]


def _value_section(cls: type[Any], module: str) -> list[str]:
    return [
        f"### `{cls.__name__}`",
        "",
        f"- Class: `{module}.{cls.__name__}`",
        "",
        _doc(cls),
        "",
        *_fields_table(cls),
        "",
    ]


def render_catalog() -> str:
    """The Markdown of ``docs/events.md``, generated from ``ALL_EVENTS`` and the decisions."""
    lines = [_HEADER, _SUMMARY_INTRO.rstrip("\n")]
    kinds: tuple[Kind, ...] = ("durable", "control", "hook")
    by_kind = {kind: [cls for cls in ALL_EVENTS if cls.kind == kind] for kind in kinds}
    for kind in kinds:
        for cls in by_kind[kind]:
            mode = cls.mode + (f" (`{cls.waterfall_field}`)" if cls.waterfall_field else "")
            lines.append(
                f"| `{cls.name}` | {kind} | {mode} | `agentloop.events.{cls.__name__}` |"
            )
    lines.append("")
    for kind in kinds:
        lines += [f"## {_KIND_TITLES[kind]}", "", _KIND_INTROS[kind]]
        for cls in by_kind[kind]:
            lines += _event_section(cls)
    lines += [_DECISIONS_INTRO]
    for decision in DECISIONS:
        lines += _value_section(decision, "agentloop.events")
    lines += [_SUBSCRIPTIONS]
    lines += _value_section(Lagged, "agentloop.events")
    lines += _log_sections()
    return "\n".join(lines).rstrip("\n") + "\n"


_LOG_INTRO = """\
## The durable log

Every `SessionEvent` agentloop appends has one of these types; `data` holds the keys below
(generated from `agentloop/_log.py`, the one module that writes and types them). Optional
keys (`repaired`, `usage`, `cause`, ...) appear only when they say something.
"""


def _log_sections() -> list[str]:
    lines = [_LOG_INTRO]
    for type_, payload, when in _log.SCHEMA:
        lines += [f"### `{type_}`", "", f"Written when {when}.", "",
                  "| Key | Type |", "| --- | --- |"]
        for key, annotation in payload.__annotations__.items():
            lines.append(f"| {_cell(key)} | {_cell(_type_name(annotation))} |")
        lines.append("")
    return lines


def main(argv: Sequence[str] | None = None, *, path: Path = DOCS_PATH) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Generate the event catalog (docs/events.md)."
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the file is missing or stale"
    )
    args = parser.parse_args(argv)
    text = render_catalog()
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            state = "missing" if current is None else "stale"
            print(f"{path} is {state}: run `{COMMAND}` and commit the result", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
