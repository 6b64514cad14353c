"""The value types made on every step keep attrs's constructor, only quicker."""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import pytest

from agentloop import _llm, _model, _reply, _request, _scheduler, _session
from agentloop._util import quick_init, stored_maker
from agentloop.events import SessionEventAppended

QUICK = [
    _model.ToolCall, _model.Message, _model.SessionEvent, _model.LLMRequest,
    _model.TextDelta, _model.ToolCallDelta, _model.Finish, _model.ToolResult,
    _model.InboxMessage, SessionEventAppended, _llm.PreparedCall, _reply.StepOutcome,
]


def _attrs_twin(cls: type) -> Any:
    """The same fields in a class whose ``__init__`` is attrs's own."""
    these = {
        f.name: attrs.field(
            default=f.default, kw_only=f.kw_only, converter=f.converter, alias=f.alias
        )
        for f in attrs.fields(cls)
    }
    return attrs.make_class(f"{cls.__name__}Twin", these, frozen=True, slots=True)


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_the_parameters_are_attrs_own(cls: type) -> None:
    ours = inspect.signature(cls).parameters
    theirs = inspect.signature(_attrs_twin(cls)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_values_defaults_and_converters_are_set_as_attrs_sets_them() -> None:
    finish = _model.Finish("end_turn")
    assert finish.reason == "stop"  # the converter ran
    assert finish.usage is None
    request = _model.LLMRequest(system="s", messages=(), tools=(), config=_model.CallConfig())
    assert (request.turn, request.output_name) == (0, "output")
    message = _model.Message("user", "hi")
    assert message == _model.Message(role="user", content="hi", tool_calls=())
    with pytest.raises(ValueError, match="unknown finish reason 'nope'"):
        _model.Finish("nope")
    with pytest.raises(TypeError):
        _model.TextDelta()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _model.LLMRequest("s", (), (), _model.CallConfig())  # type: ignore[misc]


def test_later_writes_are_still_refused() -> None:
    event = _model.SessionEvent(1, "turn/start", 1, _model.FrozenDict(turn=1))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.seq = 2  # type: ignore[misc]
    assert attrs.evolve(event, seq=2).seq == 2


def test_a_class_quick_init_cannot_serve_is_refused() -> None:
    @attrs.frozen(slots=True)
    class Checked:
        n: int = attrs.field(validator=attrs.validators.instance_of(int))

    @attrs.frozen(slots=True)
    class Hooked:
        n: int

        def __attrs_post_init__(self) -> None:
            pass

    for cls in (Checked, Hooked):
        with pytest.raises(TypeError, match=f"quick_init: {cls.__qualname__}"):
            quick_init(cls)


# The makers the hot paths use, with the class each makes.
MAKERS = [
    (_session._event, _model.SessionEvent),
    (_session._message_of, _model.Message),
    (_session._call, _model.ToolCall),
    (_session._appended, SessionEventAppended),
    (_reply._call, _model.ToolCall),
    (_reply._outcome, _reply.StepOutcome),
    (_llm._prepared, _llm.PreparedCall),
    (_request._request_of, _model.LLMRequest),
    (_scheduler._result, _model.ToolResult),
]


@pytest.mark.parametrize(("maker", "cls"), MAKERS, ids=lambda m: getattr(m, "__name__", ""))
def test_a_stored_maker_makes_what_the_constructor_makes(maker: Any, cls: type) -> None:
    fields = attrs.fields(cls)
    values = [f"value {i}" for i in range(len(fields))]
    made = maker(*values)
    assert type(made) is cls
    assert made == cls(**{f.alias: v for f, v in zip(fields, values, strict=True)})
    assert [getattr(made, f.name) for f in fields] == values
    assert repr(made).startswith(f"{cls.__name__}(")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(made, fields[0].name, "changed")
    assert attrs.evolve(made, **{fields[0].alias: "changed"}) != made


def test_a_class_stored_maker_cannot_serve_is_refused() -> None:
    @attrs.frozen(slots=True)
    class Weak:
        n: int

    @attrs.frozen(slots=True, weakref_slot=False)
    class Converted:
        n: int = attrs.field(converter=int)

    with pytest.raises(TypeError, match="Weak has a weakref or dict slot"):
        stored_maker(Weak)
    with pytest.raises(TypeError, match=r"Converted\.n needs attrs's __init__"):
        stored_maker(Converted)


def test_a_stored_maker_of_a_class_whose_base_constructs_does_not_run_that_base() -> None:
    # The twin is then filled from object.__new__, as before; calling it would run the base's
    # __init__ (here: raise) or make something else.
    class Base:
        __slots__ = ()

        def __init__(self) -> None:
            raise AssertionError("the base's __init__ ran")

    @attrs.frozen(slots=True, weakref_slot=False, init=True)
    class Child(Base):
        n: int
        s: str

    made = stored_maker(Child)(1, "a")
    assert type(made) is Child
    assert (made.n, made.s) == (1, "a")
