from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Optional

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentloop._errors import ToolDefinitionError
from agentloop._json import FrozenDict, thaw
from agentloop._schema import (
    FunctionDescription,
    coerce_arguments,
    describe_function,
    parse_arguments,
    validate_arguments,
)


class Unit(enum.Enum):
    C = "c"
    F = "f"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@attrs.frozen
class Point:
    """A point on the map.

    Attributes:
        lat: degrees north.
        lon: degrees east.
    """

    lat: float
    lon: float
    label: str = "here"


@attrs.frozen
class Route:
    start: Point
    stops: tuple[Point, ...] = ()
    unit: Unit = Unit.C


def props(fn: Any) -> dict[str, Any]:
    schema = thaw(describe_function(fn).parameters)
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    return schema["properties"]  # type: ignore[no-any-return]


# --- schemas ---------------------------------------------------------------------------


def test_primitives_and_top_level_shape() -> None:
    def f(a: int, b: float, c: str, d: bool, e: None) -> None:
        """Do it."""

    desc = describe_function(f)
    assert isinstance(desc, FunctionDescription)
    assert desc.name == "f"
    assert desc.description == "Do it."
    assert isinstance(desc.parameters, FrozenDict)
    assert thaw(desc.parameters) == {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "number"},
            "c": {"type": "string"},
            "d": {"type": "boolean"},
            "e": {"type": "null"},
        },
        "required": ["a", "b", "c", "d", "e"],
        "additionalProperties": False,
    }
    json.dumps(desc.parameters)


def test_optional_and_unions() -> None:
    def f(a: int | None, b: Optional[str], c: int | str, d: Any, e: Point | None) -> None:  # noqa: UP045
        pass

    p = props(f)
    assert p["a"] == {"type": ["integer", "null"]}
    assert p["b"] == {"type": ["string", "null"]}
    assert p["c"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert p["d"] == {}
    assert p["e"]["type"] == ["object", "null"]
    assert p["e"]["required"] == ["lat", "lon"]


def test_literal_and_enums() -> None:
    def f(
        a: Literal["x", "y"],
        b: Literal[1, 2],
        c: Unit,
        d: Level,
        e: Literal["x", None],  # noqa: PYI061
        g: Unit | None = None,
    ) -> None:
        pass

    p = props(f)
    assert p["a"] == {"type": "string", "enum": ["x", "y"]}
    assert p["b"] == {"type": "integer", "enum": [1, 2]}
    assert p["c"] == {"type": "string", "enum": ["c", "f"]}
    assert p["d"] == {"type": "integer", "enum": [1, 2]}
    assert p["e"] == {"type": ["string", "null"], "enum": ["x", None]}
    assert p["g"] == {
        "anyOf": [{"type": "string", "enum": ["c", "f"]}, {"type": "null"}],
        "default": None,
    }


def test_containers() -> None:
    def f(
        a: list[int],
        b: Sequence[str],
        c: tuple[float, ...],
        d: tuple[int, str],
        e: dict[str, bool],
        g: Mapping[str, list[int]],
        h: list,  # type: ignore[type-arg]
        i: dict,  # type: ignore[type-arg]
    ) -> None:
        pass

    p = props(f)
    assert p["a"] == {"type": "array", "items": {"type": "integer"}}
    assert p["b"] == {"type": "array", "items": {"type": "string"}}
    assert p["c"] == {"type": "array", "items": {"type": "number"}}
    assert p["d"] == {
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "string"}],
        "minItems": 2,
        "maxItems": 2,
    }
    assert p["e"] == {"type": "object", "additionalProperties": {"type": "boolean"}}
    assert p["g"] == {
        "type": "object",
        "additionalProperties": {"type": "array", "items": {"type": "integer"}},
    }
    assert p["h"] == {"type": "array"}
    assert p["i"] == {"type": "object"}


def test_nested_attrs_classes() -> None:
    def f(route: Route) -> None:
        pass

    route = props(f)["route"]
    point = {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "description": "degrees north."},
            "lon": {"type": "number", "description": "degrees east."},
            "label": {"type": "string", "default": "here"},
        },
        "required": ["lat", "lon"],
        "additionalProperties": False,
    }
    assert route == {
        "type": "object",
        "properties": {
            "start": point,
            "stops": {"type": "array", "items": point, "default": []},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        },
        "required": ["start"],
        "additionalProperties": False,
    }


@attrs.define
class Box:
    items: list[int] = attrs.field(factory=list)
    _secret: int = 0
    derived: int = attrs.field(init=False, default=1)


def test_attrs_factories_and_private_fields() -> None:
    def f(box: Box) -> None:
        pass

    assert props(f)["box"]["properties"] == {
        "items": {"type": "array", "items": {"type": "integer"}},
        "secret": {"type": "integer", "default": 0},
    }
    assert props(f)["box"]["required"] == []
    box = describe_function(f).to_call_kwargs({"box": {"items": [1], "secret": 2}})["box"]
    assert (box.items, box._secret) == ([1], 2)


def test_annotated_description_wins_over_docstring() -> None:
    def f(
        a: Annotated[int, "from annotated"],
        b: Annotated[list[Annotated[str, "one tag"]], "tags", 42],
        c: int,
    ) -> None:
        """Do it.

        Args:
            a: from the docstring.
            c: only in the docstring.
        """

    p = props(f)
    assert p["a"] == {"type": "integer", "description": "from annotated"}
    assert p["b"] == {
        "type": "array",
        "items": {"type": "string", "description": "one tag"},
        "description": "tags",
    }
    assert p["c"] == {"type": "integer", "description": "only in the docstring."}


def test_defaults() -> None:
    def f(
        a: int,
        b: int = 3,
        c: str | None = None,
        d: Unit = Unit.F,
        e: tuple[int, int] = (1, 2),
        g: Point = Point(1.0, 2.0),
        h: float = float("nan"),
    ) -> None:
        pass

    desc = describe_function(f)
    p = thaw(desc.parameters["properties"])
    assert desc.parameters["required"] == ("a",)
    assert p["b"]["default"] == 3
    assert p["c"]["default"] is None
    assert p["d"]["default"] == "f"
    assert p["e"]["default"] == [1, 2]
    assert p["g"]["default"] == {"lat": 1.0, "lon": 2.0, "label": "here"}
    assert "default" not in p["h"]  # NaN is not JSON; the default still applies in Python


def test_string_annotations_resolve() -> None:
    # this module uses `from __future__ import annotations`
    def f(a: list[Unit], b: Point | None = None) -> None:
        pass

    assert f.__annotations__["a"] == "list[Unit]"
    p = props(f)
    assert p["a"] == {"type": "array", "items": {"type": "string", "enum": ["c", "f"]}}


def test_bound_methods_drop_self() -> None:
    class Tools:
        def lookup(self, key: str) -> str:
            """Look a key up."""
            return key

        @classmethod
        def make(cls, n: int) -> int:
            return n

    assert list(props(Tools().lookup)) == ["key"]
    assert list(props(Tools.make)) == ["n"]
    assert describe_function(Tools().lookup).description == "Look a key up."


def test_callable_instance() -> None:
    class Adder:
        def __call__(self, x: int) -> int:
            return x

    assert props(Adder()) == {"x": {"type": "integer"}}


# --- docstrings ------------------------------------------------------------------------


def test_google_docstring() -> None:
    def f(city: str, days: int = 1, *, unit: Unit = Unit.C) -> None:
        """Get the weather.

        Looks it up in the almanac.

        Args:
            city: the city's name,
                in English.
            days (int): how many days
            unit (Unit, optional):
                degrees C or F.

        Returns:
            Nothing useful.
        """

    desc = describe_function(f)
    assert desc.description == "Get the weather.\n\nLooks it up in the almanac."
    p = thaw(desc.parameters["properties"])
    assert p["city"]["description"] == "the city's name, in English."
    assert p["days"]["description"] == "how many days"
    assert p["unit"]["description"] == "degrees C or F."


def test_sphinx_docstring() -> None:
    def f(city: str, days: int) -> None:
        """Get the weather.

        :param city: the city's name,
            in English.
        :param int days: how many days
        :returns: nothing
        """

    desc = describe_function(f)
    assert desc.description == "Get the weather."
    p = thaw(desc.parameters["properties"])
    assert p["city"]["description"] == "the city's name, in English."
    assert p["days"]["description"] == "how many days"


def test_numpy_docstring() -> None:
    def f(city: str, days: int, a: int, b: int) -> None:
        """Get the weather.

        Parameters
        ----------
        city : str
            the city's name,
            in English.
        days : int, optional
            how many days
        a, b : int
            two numbers

        Returns
        -------
        None
        """

    desc = describe_function(f)
    assert desc.description == "Get the weather."
    p = thaw(desc.parameters["properties"])
    assert p["city"]["description"] == "the city's name, in English."
    assert p["days"]["description"] == "how many days"
    assert p["a"]["description"] == p["b"]["description"] == "two numbers"


def test_no_docstring_and_other_sections() -> None:
    def f(x: int) -> None:
        pass

    def g(x: int) -> None:
        """Summary only.

        Example:
            g(1)
        """

    assert describe_function(f).description == ""
    assert "description" not in props(f)["x"]
    assert describe_function(g).description == "Summary only."


# --- unsupported definitions -----------------------------------------------------------


class Opaque:
    pass


@attrs.frozen
class Node:
    child: Node | None = None


@attrs.frozen
class BadField:
    items: set[int]


def _no_annotation(x) -> None:  # type: ignore[no-untyped-def]
    pass


def _varargs(*items: int) -> None:
    pass


def _kwargs(**extra: int) -> None:
    pass


def _positional(x: int, /) -> None:
    pass


def _opaque(thing: Opaque) -> None:
    pass


def _set(tags: set[str]) -> None:
    pass


def _int_keys(m: dict[int, str]) -> None:
    pass


def _recursive(node: Node) -> None:
    pass


def _bad_field(value: BadField) -> None:
    pass


def _bad_literal(x: Literal[b"raw"]) -> None:
    pass


def _unresolvable(x: Missing) -> None:  # type: ignore[name-defined]  # noqa: F821
    pass


@pytest.mark.parametrize(
    ("fn", "fragments"),
    [
        (_no_annotation, ["_no_annotation", "'x'", "no annotation"]),
        (_varargs, ["_varargs", "'items'", "variadic positional"]),
        (_kwargs, ["_kwargs", "'extra'", "variadic keyword"]),
        (_positional, ["_positional", "'x'", "positional-only"]),
        (_opaque, ["_opaque", "'thing'", "Opaque"]),
        (_set, ["_set", "'tags'", "set[str]"]),
        (_int_keys, ["_int_keys", "'m'", "dict[int, str]", "keys"]),
        (_recursive, ["_recursive", "'node'", "Node", "refers to itself"]),
        (_bad_field, ["_bad_field", "'value'", "BadField", "'items'", "set[int]"]),
        (_bad_literal, ["_bad_literal", "'x'", "b'raw'"]),
        (_unresolvable, ["_unresolvable", "'x' (Missing)", "not defined"]),
    ],
)
def test_unsupported_definitions(fn: Any, fragments: list[str]) -> None:
    with pytest.raises(ToolDefinitionError) as info:
        describe_function(fn)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert isinstance(info.value, TypeError)


# --- validation ------------------------------------------------------------------------


def _weather(city: str, unit: Literal["c", "f"] = "c", count: int = 1) -> None:
    pass


WEATHER = describe_function(_weather).parameters


def test_validation_accepts_valid_arguments() -> None:
    assert validate_arguments(WEATHER, {"city": "Oslo"}) == []
    assert validate_arguments(WEATHER, {"city": "Oslo", "unit": "f", "count": 2}) == []
    assert validate_arguments(WEATHER, {"city": "Oslo", "count": 2.0}) == []


def test_validation_messages() -> None:
    assert validate_arguments(WEATHER, {}) == ["city: missing required field"]
    assert validate_arguments(WEATHER, {"city": "Oslo", "count": "three"}) == [
        "count: expected integer, got string 'three'"
    ]
    assert validate_arguments(WEATHER, {"city": "Oslo", "foo": 1}) == [
        "unexpected field 'foo' (allowed: city, unit, count)"
    ]
    assert validate_arguments(WEATHER, {"city": "Oslo", "unit": "k"}) == [
        "unit: must be one of 'c', 'f', got 'k'"
    ]
    assert validate_arguments(WEATHER, ["Oslo"]) == ["expected object, got array"]
    assert validate_arguments(WEATHER, {"city": None, "count": 1.5}) == [
        "city: expected string, got null",
        "count: expected integer, got number 1.5",
    ]


def test_validation_rejects_bools_as_numbers() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "i": {"type": "integer"}}}
    assert validate_arguments(schema, {"n": True, "i": False}) == [
        "n: expected number, got boolean true",
        "i: expected integer, got boolean false",
    ]
    assert validate_arguments({"enum": [1, 2]}, True) == ["must be one of 1, 2, got true"]
    assert validate_arguments({"enum": [True]}, 1) == ["must be one of true, got 1"]


def test_validation_nested_paths() -> None:
    def f(route: Route, points: list[Point], pair: tuple[int, str]) -> None:
        pass

    schema = describe_function(f).parameters
    args = {
        "route": {"start": {"lat": 1, "lon": "x"}, "stops": [{"lat": 1}], "unit": "k"},
        "points": [{"lat": 1, "lon": 2, "extra": 0}],
        "pair": [1, 2, 3],
    }
    assert validate_arguments(schema, args) == [
        "route.start.lon: expected number, got string 'x'",
        "route.stops[0].lon: missing required field",
        "route.unit: must be one of 'c', 'f', got 'k'",
        "points[0]: unexpected field 'extra' (allowed: lat, lon, label)",
        "pair: expected at most 2 items, got 3",
        "pair[1]: expected string, got integer 2",
    ]
    assert validate_arguments(schema["properties"]["pair"], [1]) == [
        "expected at least 2 items, got 1"
    ]


def test_validation_nullable_and_any_of() -> None:
    def f(a: int | None, b: Unit | None, c: int | Point, d: dict[str, int]) -> None:
        pass

    schema = describe_function(f).parameters
    ok: dict[str, Any] = {"a": None, "b": None, "c": 3, "d": {}}
    assert validate_arguments(schema, ok) == []
    assert validate_arguments(schema, {**ok, "c": {"lat": 1, "lon": 2}, "b": "f"}) == []
    assert validate_arguments(schema, {**ok, "a": "x"}) == [
        "a: expected integer or null, got string 'x'"
    ]
    assert validate_arguments(schema, {**ok, "b": "k"}) == ["b: must be one of 'c', 'f', got 'k'"]
    assert validate_arguments(schema, {**ok, "b": 3}) == [
        "b: expected string or null, got integer 3"
    ]
    # the branch of the right type explains what is wrong
    assert validate_arguments(schema, {**ok, "c": {"lat": 1}}) == ["c.lon: missing required field"]
    assert validate_arguments(schema, {**ok, "c": "x"}) == [
        "c: expected integer or object, got string 'x'"
    ]
    assert validate_arguments(schema, {**ok, "d": {"k": "v"}}) == [
        "d.k: expected integer, got string 'v'"
    ]


def test_validation_of_hand_written_schemas() -> None:
    schema = {
        "type": "object",
        "title": "ignored",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 3, "pattern": "ignored"},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "kind": {"const": "x"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "pair": {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]},
        },
        "required": ["name"],
    }
    assert validate_arguments(schema, {"name": "ab", "other": object()}) == []
    assert validate_arguments(
        schema,
        {"name": "a", "n": 10, "kind": "y", "tags": ["a", 1], "pair": ["1", "b"]},
    ) == [
        "name: must be at least 2 characters long",
        "n: must be at most 9, got 10",
        "kind: must be 'x', got 'y'",
        "tags[1]: expected string, got integer 1",
        "pair[0]: expected integer, got string '1'",
    ]
    assert validate_arguments({"properties": {"a": False}}, {"a": 1}) == [
        "a: no value is allowed here"
    ]
    assert validate_arguments({}, {"anything": [1, {"x": None}]}) == []


# --- parsing ---------------------------------------------------------------------------


def test_parse_arguments() -> None:
    assert parse_arguments('{"city": "Oslo"}') == ({"city": "Oslo"}, None)
    assert parse_arguments("") == ({}, None)
    assert parse_arguments("  \n") == ({}, None)
    assert parse_arguments(FrozenDict(a=1)) == ({"a": 1}, None)


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ('{"city": "Oslo"', ["not valid JSON", "line 1 column 16", "char 15"]),
        ("{'city': 1}", ["not valid JSON", "property name", "column 2"]),
        ('{"a": NaN}', ["not valid JSON", "NaN"]),
        ("[1, 2]", ["must be a JSON object, got array"]),
        ('"hi"', ["must be a JSON object, got string 'hi'"]),
        ("null", ["must be a JSON object, got null"]),
    ],
)
def test_parse_arguments_problems(raw: str, fragments: list[str]) -> None:
    value, problem = parse_arguments(raw)
    assert value is None
    assert problem is not None
    for fragment in fragments:
        assert fragment in problem


# --- coercion --------------------------------------------------------------------------


def test_to_call_kwargs() -> None:
    def f(
        route: Route,
        unit: Unit,
        level: Level,
        pair: tuple[int, Unit],
        many: tuple[int, ...],
        units: list[Unit],
        by_name: dict[str, Point],
        maybe: Unit | None,
        either: int | Point,
        count: int,
        tag: Annotated[Literal["a", "b"], "a tag"],
        raw: Any,
    ) -> None:
        pass

    desc = describe_function(f)
    args = {
        "route": {"start": {"lat": 1.0, "lon": 2.0}, "stops": [{"lat": 3, "lon": 4, "label": "x"}]},
        "unit": "f",
        "level": 2,
        "pair": [1, "c"],
        "many": [1, 2],
        "units": ("c", "f"),
        "by_name": {"home": {"lat": 0, "lon": 0}},
        "maybe": None,
        "either": {"lat": 5, "lon": 6},
        "count": 3.0,
        "tag": "b",
        "raw": [1, {"x": 2}],
        "unknown": "kept",
    }
    assert (
        validate_arguments(desc.parameters, {k: v for k, v in args.items() if k != "unknown"}) == []
    )
    kwargs = desc.to_call_kwargs(args)
    assert kwargs == {
        "route": Route(Point(1.0, 2.0), (Point(3, 4, "x"),)),
        "unit": Unit.F,
        "level": Level.HIGH,
        "pair": (1, Unit.C),
        "many": (1, 2),
        "units": [Unit.C, Unit.F],
        "by_name": {"home": Point(0, 0)},
        "maybe": None,
        "either": Point(5, 6),
        "count": 3,
        "tag": "b",
        "raw": [1, {"x": 2}],
        "unknown": "kept",
    }
    assert type(kwargs["count"]) is int
    assert type(kwargs["route"].stops) is tuple
    assert kwargs == coerce_arguments({k: desc._hints[k] for k in desc._hints}, args)
    assert desc.to_call_kwargs({"either": 4, "maybe": "c"}) == {"either": 4, "maybe": Unit.C}


def test_description_equality_ignores_hints() -> None:
    def a(x: int) -> None:
        pass

    def b(x: Annotated[int, 1]) -> None:
        pass

    b.__name__ = "a"
    assert describe_function(a) == describe_function(b)
    assert hash(describe_function(a)) == hash(describe_function(b))


# --- property: the validator agrees with schema-directed generation --------------------

KINDS = ["string", "integer", "number", "boolean", "null", "array", "object"]
SCALARS = {
    "string": st.text(max_size=5),
    "integer": st.integers(-(10**6), 10**6),
    "number": st.floats(allow_nan=False, allow_infinity=False, width=32),
    "boolean": st.booleans(),
    "null": st.none(),
}
ANY_JSON = st.recursive(
    st.one_of(*SCALARS.values()),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def of_kind(kind: str) -> st.SearchStrategy[Any]:
    if kind == "array":
        return st.lists(ANY_JSON, max_size=3)
    if kind == "object":
        return st.dictionaries(st.text(max_size=3), ANY_JSON, max_size=3)
    return SCALARS[kind]


def matching(schema: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    """Values that match ``schema``, built from the schema's structure alone."""
    if "enum" in schema:
        return st.sampled_from(list(schema["enum"]))
    if "anyOf" in schema:
        return st.one_of(*(matching(branch) for branch in schema["anyOf"]))
    kinds = schema.get("type")
    if kinds is None:
        return ANY_JSON
    if not isinstance(kinds, str):
        return st.one_of(*(matching({**schema, "type": kind}) for kind in kinds))
    if kinds == "array":
        if "prefixItems" in schema:
            return st.tuples(*(matching(s) for s in schema["prefixItems"])).map(list)
        return st.lists(matching(schema.get("items", {})), max_size=3)
    if kinds == "object":
        return _matching_object(schema)
    return SCALARS[kinds]


def _matching_object(schema: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    props_ = schema.get("properties", {})
    required = set(schema.get("required", ()))
    extra = schema.get("additionalProperties", True)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out = {
            name: draw(matching(sub))
            for name, sub in props_.items()
            if name in required or draw(st.booleans())
        }
        if isinstance(extra, Mapping):
            keys = st.text(max_size=3).filter(lambda k: k not in props_)
            out.update(draw(st.dictionaries(keys, matching(extra), max_size=2)))
        return out

    return build()


def admitted_kinds(schema: Mapping[str, Any]) -> set[str]:
    """A coarse oracle: the JSON kinds a schema lets through at its top level."""
    if "anyOf" in schema:
        return set().union(*(admitted_kinds(branch) for branch in schema["anyOf"]))
    kinds = schema.get("type", KINDS)
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    return kinds | {"integer"} if "number" in kinds else kinds


def _everything(
    a: int,
    b: float | None,
    c: list[str],
    d: tuple[int, Unit],
    e: dict[str, bool],
    f: Route,
    g: Literal["x", "y"] = "x",
    h: Level | str = Level.LOW,
    i: Any = None,
) -> None:
    pass


SCHEMAS = [
    describe_function(_everything).parameters,
    describe_function(_weather).parameters,
    {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "integer"}}},
    {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"x": {"type": "null"}}}]},
]


@given(st.data())
def test_generated_values_validate(data: st.DataObject) -> None:
    schema = data.draw(st.sampled_from(SCHEMAS))
    value = data.draw(matching(schema))
    assert validate_arguments(schema, value) == []


@given(st.data())
def test_one_wrong_field_is_reported(data: st.DataObject) -> None:
    schema = data.draw(st.sampled_from(SCHEMAS[:2]))
    value = data.draw(matching(schema))
    field = data.draw(st.sampled_from(sorted(schema["properties"])))
    allowed = admitted_kinds(schema["properties"][field])
    wrong_kind = data.draw(st.sampled_from([k for k in KINDS if k not in allowed] or ["skip"]))
    if wrong_kind == "skip":
        return
    wrong = of_kind(wrong_kind)
    if wrong_kind == "number" and "integer" in allowed:
        wrong = wrong.filter(lambda x: not x.is_integer())
    value[field] = data.draw(wrong)
    problems = validate_arguments(schema, value)
    assert problems
    assert all(problem.startswith(f"{field}: expected ") for problem in problems)


@given(st.data())
def test_generated_arguments_coerce_to_a_call(data: st.DataObject) -> None:
    desc = describe_function(_everything)
    value = data.draw(matching(desc.parameters))
    kwargs = desc.to_call_kwargs(value)
    _everything(**kwargs)
    assert isinstance(kwargs["d"][1], Unit)
    assert isinstance(kwargs["f"], Route)
    assert all(isinstance(stop, Point) for stop in kwargs["f"].stops)
    if "h" in kwargs and not isinstance(kwargs["h"], str):
        assert isinstance(kwargs["h"], Level)


# --- dataclasses, TypedDict, UUID, datetime, date ---------------------------------------------

import dataclasses
import datetime
import uuid
from typing import NotRequired, TypedDict

from agentloop._schema import coerce_value, schema_for_type


@dataclasses.dataclass(frozen=True)
class Booking:
    """A room booking.

    Attributes:
        room: the room's id.
        day: the day booked.
    """

    room: uuid.UUID
    day: datetime.date
    guests: int = 1
    notes: list[str] = dataclasses.field(default_factory=list)


class Window(TypedDict):
    """A time window."""

    start: datetime.datetime
    end: NotRequired[datetime.datetime]


def _book(booking: Booking, window: Window, by: uuid.UUID | None = None) -> None:
    """Book a room.

    Args:
        booking: what to book.
        window: when.
        by: who books it.
    """


ROOM = "6f1c0c9e-5a43-4d1e-9a3e-5d6b1f7c2a10"
ROOM_ID = uuid.UUID(ROOM)
NEW_YEAR = datetime.date(2026, 1, 1)


def test_dataclass_typeddict_and_formats_have_schemas() -> None:
    params = thaw(describe_function(_book).parameters)
    assert params["required"] == ["booking", "window"]
    booking = params["properties"]["booking"]
    assert booking["description"] == "what to book."
    assert booking["properties"]["room"] == {
        "type": "string", "format": "uuid", "description": "the room's id.",
    }
    assert booking["properties"]["day"] == {
        "type": "string", "format": "date", "description": "the day booked.",
    }
    assert booking["properties"]["guests"] == {"type": "integer", "default": 1}
    assert booking["properties"]["notes"] == {"type": "array", "items": {"type": "string"}}
    assert booking["required"] == ["room", "day"]
    assert booking["additionalProperties"] is False
    window = params["properties"]["window"]
    assert window["properties"]["start"] == {"type": "string", "format": "date-time"}
    assert window["properties"]["end"] == {"type": "string", "format": "date-time"}
    assert window["required"] == ["start"]
    assert window["additionalProperties"] is False
    by = params["properties"]["by"]
    assert (by["type"], by["format"]) == (["string", "null"], "uuid")
    assert validate_arguments(by, None) == []
    assert validate_arguments(by, "x") == ["expected a uuid string, got 'x'"]


def test_formatted_values_are_checked_and_coerced() -> None:
    desc = describe_function(_book)
    good = {
        "booking": {"room": ROOM, "day": "2026-12-24", "guests": 2},
        "window": {"start": "2026-12-24T15:00:00+01:00"},
        "by": ROOM,
    }
    assert validate_arguments(desc.parameters, good) == []
    kwargs = desc.to_call_kwargs(good)
    assert kwargs["booking"] == Booking(uuid.UUID(ROOM), datetime.date(2026, 12, 24), 2)
    start = kwargs["window"]["start"]
    assert start == datetime.datetime(
        2026, 12, 24, 15, tzinfo=datetime.timezone(datetime.timedelta(hours=1))
    )
    assert kwargs["by"] == uuid.UUID(ROOM)
    bad = {
        "booking": {"room": "room-1", "day": "24/12/2026"},
        "window": {"start": "soon", "extra": 1},
    }
    assert validate_arguments(desc.parameters, bad) == [
        "booking.room: expected a uuid string, got 'room-1'",
        "booking.day: expected a date string, got '24/12/2026'",
        "window.start: expected a date-time string, got 'soon'",
        "window: unexpected field 'extra' (allowed: start, end)",
    ]


def test_schema_for_type_and_coerce_value_for_output_types() -> None:
    assert thaw(schema_for_type(Window))["required"] == ["start"]
    value = coerce_value(list[Booking], [{"room": ROOM, "day": "2026-01-02"}])
    assert value == [Booking(uuid.UUID(ROOM), datetime.date(2026, 1, 2))]
    assert coerce_value(datetime.date, "2026-01-02") == datetime.date(2026, 1, 2)
    with pytest.raises(ToolDefinitionError, match="has no JSON schema"):
        schema_for_type(set[int])


def test_defaults_of_these_types_are_shown_as_json() -> None:
    def f(
        when: datetime.date = NEW_YEAR,
        who: uuid.UUID = ROOM_ID,
        booking: Booking | None = None,
    ) -> None:
        """F."""

    props = thaw(describe_function(f).parameters)["properties"]
    assert props["when"]["default"] == "2026-01-01"
    assert props["who"]["default"] == ROOM


async def test_a_tool_receives_coerced_values_and_a_bad_format_goes_back_to_the_model(
    rt, model
) -> None:
    from conftest import OPTIONS, of_type

    from agentloop.testing import reply

    got: list[object] = []

    @rt.tools.tool
    async def book(booking: Booking, window: Window) -> str:
        """Book a room."""
        got.append((booking, window))
        return "booked"

    model.add(
        reply("", tool_calls=[
            ("book", {"booking": {"room": "nope", "day": "2026-12-24"},
                      "window": {"start": "2026-12-24T10:00:00"}}),
            ("book", {"booking": {"room": ROOM, "day": "2026-12-24"},
                      "window": {"start": "2026-12-24T10:00:00"}}),
        ]),
        reply("ok"),
    )
    handle = await rt.agents.create(session_id="s", agent_options=OPTIONS)
    handle.agent.followup("book it")
    await handle.agent.wait_idle()
    first, second = (e.data for e in of_type(handle.agent, "tool/result"))
    assert first["error_code"] == "INVALID_ARGUMENTS"
    assert "booking.room: expected a uuid string, got 'nope'" in first["content"]
    assert second["content"] == "booked"
    [(booking, window)] = got
    assert booking == Booking(uuid.UUID(ROOM), datetime.date(2026, 12, 24))
    assert window == {"start": datetime.datetime(2026, 12, 24, 10)}
