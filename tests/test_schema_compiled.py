"""Compiled argument validation and coercion agree with the interpreting reference.

A tool's schema is compiled once per definition (``Tool.validate_arguments``) and a function's
annotations once per description (``FunctionDescription.to_call_kwargs``). The reference
below is the schema interpreter they replaced, kept here verbatim as the oracle: for any
schema and any value, the compiled validator must report exactly its problems, in its order.
"""

from __future__ import annotations

import datetime
import enum
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Optional

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agentloop import Tool
from agentloop._schema import (
    _PARSERS,
    _admits_type,
    _at,
    _coerce,
    _coercer_for,
    _is_type,
    _join,
    _literal,
    _same,
    _show,
    _types_of,
    compile_validator,
    describe_function,
    validate_arguments,
)

# Slow: hypothesis comparisons of the compiled validator and the reference.
pytestmark = pytest.mark.slow

# --- the reference interpreter ---------------------------------------------------------


def reference(schema: Mapping[str, Any] | bool, value: object) -> list[str]:
    out: list[str] = []
    _check(schema, value, "", out)
    return out


def _check(schema: object, value: object, path: str, out: list[str]) -> None:
    if isinstance(schema, bool):
        if not schema:
            out.append(_at(path, "no value is allowed here"))
        return
    if not isinstance(schema, Mapping):
        return
    if "type" in schema:
        wanted = _types_of(schema)
        if not any(_is_type(value, kind) for kind in wanted):
            out.append(_at(path, f"expected {' or '.join(wanted)}, got {_show(value)}"))
            return
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        options = ", ".join(_literal(option) for option in schema["enum"])
        out.append(_at(path, f"must be one of {options}, got {_literal(value)}"))
        return
    if "const" in schema and not _same(value, schema["const"]):
        out.append(_at(path, f"must be {_literal(schema['const'])}, got {_literal(value)}"))
        return
    if "anyOf" in schema:
        _check_any_of(schema["anyOf"], value, path, out)
    if isinstance(value, Mapping):
        _check_object(schema, value, path, out)
    elif isinstance(value, (list, tuple)):
        _check_array(schema, value, path, out)
    elif isinstance(value, str):
        parse = _PARSERS.get(schema.get("format", ""))
        if parse is not None:
            try:
                parse(value)
            except ValueError:
                wanted = schema["format"]
                out.append(_at(path, f"expected a {wanted} string, got {_literal(value)}"))
                return
        if len(value) < schema.get("minLength", 0):
            out.append(_at(path, f"must be at least {schema['minLength']} characters long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(_at(path, f"must be at most {schema['maxLength']} characters long"))
    elif _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(_at(path, f"must be at least {schema['minimum']}, got {value}"))
        if "maximum" in schema and value > schema["maximum"]:
            out.append(_at(path, f"must be at most {schema['maximum']}, got {value}"))


def _check_any_of(branches: Sequence[Any], value: object, path: str, out: list[str]) -> None:
    failures: list[tuple[object, list[str]]] = []
    for branch in branches:
        problems: list[str] = []
        _check(branch, value, path, problems)
        if not problems:
            return
        failures.append((branch, problems))
    # The problems of a branch of the right type say the most about what to fix.
    fitting = [problems for branch, problems in failures if _admits_type(branch, value)]
    if fitting:
        closest: list[str] = min(fitting, key=len)
        out.extend(closest)
    else:
        wanted = dict.fromkeys(kind for branch, _ in failures for kind in _types_of(branch))
        out.append(_at(path, f"expected {' or '.join(wanted)}, got {_show(value)}"))


def _check_object(
    schema: Mapping[str, Any], value: Mapping[Any, Any], path: str, out: list[str]
) -> None:
    properties: Mapping[str, Any] = schema.get("properties") or {}
    out.extend(
        f"{_join(path, name)}: missing required field"
        for name in schema.get("required", ())
        if name not in value
    )
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            _check(properties[key], item, _join(path, key), out)
        elif extra is False:
            allowed = ", ".join(properties) or "none"
            out.append(_at(path, f"unexpected field {key!r} (allowed: {allowed})"))
        else:
            _check(extra, item, _join(path, key), out)


def _check_array(
    schema: Mapping[str, Any], value: Sequence[Any], path: str, out: list[str]
) -> None:
    prefix: Sequence[Any] = schema.get("prefixItems") or ()
    items = schema.get("items")
    if isinstance(items, (list, tuple)):  # the draft-07 spelling of prefixItems
        prefix, items = items, schema.get("additionalItems")
    if len(value) < schema.get("minItems", 0):
        out.append(_at(path, f"expected at least {schema['minItems']} items, got {len(value)}"))
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        out.append(_at(path, f"expected at most {schema['maxItems']} items, got {len(value)}"))
    for index, item in enumerate(value):
        sub = prefix[index] if index < len(prefix) else items
        if sub is not None:
            _check(sub, item, f"{path}[{index}]", out)



# --- strategies ------------------------------------------------------------------------

KINDS = ["string", "integer", "number", "boolean", "null", "object", "array"]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(-5, 5, allow_nan=False),
    st.sampled_from(["", "a", "ab", "abcdef", "2026-12-01", "2026-12-01T10:00:00",
                     "123e4567-e89b-12d3-a456-426614174000", "x-y"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, max_size=4),
    ),
    max_leaves=12,
)


def schemas() -> st.SearchStrategy[Any]:
    def node(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
        keywords: dict[str, st.SearchStrategy[Any]] = {
            "type": st.one_of(st.sampled_from(KINDS),
                              st.lists(st.sampled_from(KINDS), min_size=1, max_size=3,
                                       unique=True)),
            "enum": st.lists(json_scalars, min_size=1, max_size=3),
            "const": json_scalars,
            "anyOf": st.lists(inner, min_size=1, max_size=3),
            "properties": st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
            "required": st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=2, unique=True),
            "additionalProperties": st.one_of(st.booleans(), inner),
            "items": st.one_of(inner, st.lists(inner, max_size=2)),
            "additionalItems": inner,
            "prefixItems": st.lists(inner, max_size=2),
            "minItems": st.integers(0, 3),
            "maxItems": st.integers(0, 3),
            "minimum": st.integers(-3, 3),
            "maximum": st.integers(-3, 3),
            "minLength": st.integers(0, 3),
            "maxLength": st.integers(0, 3),
            "format": st.sampled_from(["uuid", "date", "date-time", "email"]),
        }
        # Few keywords per node: with many, the type gate ends most checks before the rest.
        return st.lists(st.sampled_from(sorted(keywords)), max_size=3, unique=True).flatmap(
            lambda keys: st.fixed_dictionaries({key: keywords[key] for key in keys})
        )

    leaf = st.one_of(st.booleans(), st.just({}), node(st.just({})))
    return st.recursive(leaf, node, max_leaves=6)


# --- properties ------------------------------------------------------------------------


@settings(max_examples=600, deadline=None)
@given(schemas(), json_values)
def test_compiled_validator_reports_what_the_reference_reports(schema: Any, value: Any) -> None:
    assert compile_validator(schema)(value) == reference(schema, value)


objects = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), json_values, max_size=4)
arrays = st.lists(json_values, max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries({}, optional={
        "type": st.just("object"),
        "properties": st.dictionaries(st.sampled_from(["a", "b", "c"]), schemas(), max_size=3),
        "required": st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=3, unique=True),
        "additionalProperties": st.one_of(st.booleans(), schemas()),
    }),
    objects,
)
def test_compiled_object_checks_match_the_reference(schema: Any, value: Any) -> None:
    """Tool arguments are objects: the object keywords get their own, denser search."""
    assert compile_validator(schema)(value) == reference(schema, value)


@settings(max_examples=300, deadline=None)
@example({"minLength": 2}, "a")
@given(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["array", "string", "number", "integer"]),
        "items": st.one_of(schemas(), st.lists(schemas(), max_size=2)),
        "additionalItems": schemas(),
        "prefixItems": st.lists(schemas(), max_size=2),
        "minItems": st.integers(0, 3), "maxItems": st.integers(0, 3),
        "minimum": st.integers(-3, 3), "maximum": st.integers(-3, 3),
        "minLength": st.integers(0, 3), "maxLength": st.integers(0, 3),
        "format": st.sampled_from(["uuid", "date", "date-time", "email"]),
    }),
    st.one_of(arrays, json_scalars),
)
def test_compiled_array_and_scalar_checks_match_the_reference(schema: Any, value: Any) -> None:
    assert compile_validator(schema)(value) == reference(schema, value)


@settings(max_examples=200, deadline=None)
@given(schemas(), st.lists(json_values, min_size=1, max_size=5))
def test_one_compiled_validator_serves_many_values(schema: Any, values: list[Any]) -> None:
    validate = compile_validator(schema)
    assert [validate(v) for v in values] == [reference(schema, v) for v in values]
    assert [validate_arguments(schema, v) for v in values] == [validate(v) for v in values]


def test_a_changed_tool_definition_gets_a_new_validator() -> None:
    async def run(**_: Any) -> str:
        return "ok"

    tool = Tool("t", "", {"type": "object", "properties": {"n": {"type": "integer"}}}, run)
    assert tool.validate_arguments({"n": 1}) == []
    assert tool.validate_arguments({"n": "x"}) == ["n: expected integer, got string 'x'"]
    changed = attrs.evolve(
        tool, parameters={"type": "object", "properties": {"n": {"type": "string"}}}
    )
    assert changed.validate_arguments({"n": "x"}) == []
    assert changed.validate_arguments({"n": 1}) == ["n: expected string, got integer 1"]
    # The old definition keeps its own.
    assert tool.validate_arguments({"n": "x"}) == ["n: expected integer, got string 'x'"]


# --- coercion --------------------------------------------------------------------------


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@attrs.frozen
class Point:
    x: int
    y: float = 0.0


ANNOTATED: list[tuple[Any, st.SearchStrategy[Any]]] = [
    (str, st.text(max_size=5)),
    (int, st.one_of(st.integers(), st.integers(-10**6, 10**6).map(float))),
    (float, st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False))),
    (bool, st.booleans()),
    (Any, json_values),
    (Optional[int], st.one_of(st.none(), st.integers(), st.just(3.0))),  # noqa: UP045
    (int | None, st.one_of(st.none(), st.integers(), st.just(-2.0))),
    (str | None, st.one_of(st.none(), st.text(max_size=3))),
    (Annotated[int, "doc"], st.integers().map(float)),
    (Annotated[str, "doc"], st.text(max_size=3)),
    (Colour, st.sampled_from(["red", "blue"])),
    (Colour | None, st.sampled_from(["red", None])),
    (uuid.UUID, st.uuids().map(str)),
    (datetime.date, st.dates().map(str)),
    (list[int], st.lists(st.integers().map(float), max_size=3)),
    (tuple[int, str], st.tuples(st.integers(), st.text(max_size=2)).map(list)),
    (dict[str, int], st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)),
    (Literal["a", "b"], st.sampled_from(["a", "b"])),
    (Literal[1, 2], st.sampled_from([1, 2, 1.0])),
    (Point, st.fixed_dictionaries({"x": st.integers()}, optional={"y": st.integers()})),
    (int | str, st.one_of(st.integers(), st.text(max_size=2))),
]


@pytest.mark.parametrize(("tp", "values"), ANNOTATED, ids=lambda v: getattr(v, "__name__", None))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_compiled_coercion_matches_the_general_walk(
    tp: Any, values: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    value = data.draw(values)
    coercer = _coercer_for(tp)
    got = value if coercer is None else coercer(value)
    want = _coerce(tp, value)
    assert got == want
    assert type(got) is type(want)


def test_a_described_function_coerces_through_its_compiled_parameters() -> None:
    def f(n: int, colour: Colour, when: datetime.date, note: str = "", p: Point | None = None,
          ) -> str:
        """F."""
        return ""

    described = describe_function(f)
    kwargs = described.to_call_kwargs(
        {"n": 3.0, "colour": "red", "when": "2026-12-01", "note": "x", "p": {"x": 1}}
    )
    assert kwargs == {"n": 3, "colour": Colour.RED, "when": datetime.date(2026, 12, 1),
                      "note": "x", "p": Point(1)}
    assert type(kwargs["n"]) is int
    # Arguments outside the annotations pass through.
    assert described.to_call_kwargs({"extra": [1]}) == {"extra": [1]}
