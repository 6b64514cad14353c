"""JSON schemas for tool functions, and checking a model's arguments against them.

:func:`describe_function` reads a function's signature, type hints and docstring into a
:class:`FunctionDescription`. :func:`parse_arguments` and :func:`validate_arguments` turn a
model's raw output into problems worded so that the model can fix its call, and
:meth:`FunctionDescription.to_call_kwargs` rebuilds the Python values (enum members, attrs and
dataclass instances, ``UUID``, ``datetime``, tuples) the function expects.

A parameter may be annotated with the JSON scalars, ``Literal``, enums, unions and optionals,
lists, tuples, string-keyed dicts, attrs classes, dataclasses, ``TypedDict`` classes, ``UUID``
(a string with ``format: uuid``), ``datetime`` (``format: date-time``) and ``date``
(``format: date``). Formats are checked, so a malformed value goes back to the model as a
problem to fix instead of failing inside the tool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import functools
import inspect
import json
import re
import types
import typing
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Final, Literal, NoReturn, Union, get_args, get_origin

import attrs

from ._errors import InvalidContent, ToolDefinitionError
from ._json import FrozenDict, freeze

__all__ = [
    "FunctionDescription",
    "describe_function",
    "parse_arguments",
    "validate_arguments",
    "compile_validator",
    "Validator",
    "coerce_arguments",
    "schema_for_type",
    "coerce_value",
]

_NONE = type(None)
_MISSING = object()  # no annotation
_PRIMITIVES: dict[object, str] = {
    bool: "boolean", int: "integer", float: "number", str: "string", _NONE: "null", None: "null",
}  # fmt: skip
# Strings with a format: the schema, and the parser that checks and converts a value.
_FORMATS: dict[type, tuple[str, Callable[[str], Any]]] = {
    uuid.UUID: ("uuid", uuid.UUID),
    datetime.datetime: ("date-time", datetime.datetime.fromisoformat),
    datetime.date: ("date", datetime.date.fromisoformat),
}
_PARSERS: dict[str, Callable[[str], Any]] = dict(_FORMATS.values())
_SCALAR_KINDS = frozenset({"boolean", "integer", "number", "string", "null"})
# bool before int: True is an int to isinstance, but a boolean to JSON.
_KINDS: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (_NONE, "null"),
    (Mapping, "object"), ((list, tuple), "array"),
)  # fmt: skip


_ABSENT: Final = object()


@attrs.frozen
class FunctionDescription:
    """What a model needs to call a function, and how to turn its JSON back into arguments.

    Attributes:
        name: the function's ``__name__``.
        description: the docstring's text before its parameter section; ``""`` without one.
        parameters: the JSON schema of the arguments object.
    """

    name: str
    description: str
    parameters: FrozenDict
    _hints: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)
    # Per parameter, how its JSON value becomes the Python value, worked out once from the
    # annotation: a call of a tool pays a dict lookup per argument, not a walk of its type.
    # A parameter whose value is used as is has no entry.
    _coercers: Mapping[str, Callable[[Any], Any]] = attrs.field(
        init=False, eq=False, repr=False
    )

    def __attrs_post_init__(self) -> None:
        coercers = {}
        for name, tp in self._hints.items():
            coercer = _coercer_for(tp)
            if coercer is not None:
                coercers[name] = coercer
        object.__setattr__(self, "_coercers", coercers)

    def to_call_kwargs(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments for the function from arguments that passed validation."""
        coercers = self._coercers
        kwargs = dict(arguments)
        for key, coercer in coercers.items():
            value = kwargs.get(key, _ABSENT)
            # An int parameter's value is nearly always an int already, which its coercer
            # (``_int_value``) returns as is: the call is skipped for it.
            if value is not _ABSENT and not (coercer is _int_value and type(value) is int):
                kwargs[key] = coercer(value)
        return kwargs


# --- schemas ---------------------------------------------------------------------------


class _Unsupported(Exception):  # noqa: N818 - internal signal, never escapes
    """A type has no JSON schema; :func:`describe_function` adds the function and parameter."""


def describe_function(fn: Callable[..., Any]) -> FunctionDescription:
    """Describe ``fn`` as a tool: its name, docstring text and the JSON schema of its parameters.

    Raises:
        ToolDefinitionError: a parameter has no annotation or one without a JSON schema, is
            variadic or positional-only; the message names the function and the parameter.
    """
    name: str = getattr(fn, "__name__", type(fn).__name__)
    where = f"cannot describe {name}()"
    try:
        signature = inspect.signature(fn)
        # A callable instance keeps its annotations on ``__call__``.
        source = fn if inspect.isroutine(fn) or inspect.isclass(fn) else type(fn).__call__
        hints = typing.get_type_hints(source, include_extras=True)
    except NameError as exc:
        names = getattr(source, "__annotations__", {})
        bad = [f"{k!r} ({v})" for k, v in names.items() if exc.name and exc.name in str(v)]
        culprit = ", ".join(bad) or "a parameter"
        raise ToolDefinitionError(
            f"{where}: cannot resolve the annotation of {culprit}: {exc}"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"{where}: {exc}") from exc
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ToolDefinitionError(
                f"{where}: parameter {param.name!r} is {param.kind.description}; "
                "a tool takes named JSON fields only"
            )
    summary, docs = _parse_docstring(inspect.getdoc(fn) or "")
    fields = [
        (p.name, hints.get(p.name, _MISSING), attrs.NOTHING if p.default is p.empty else p.default)
        for p in signature.parameters.values()
    ]
    try:
        parameters = freeze(_object_schema(fields, docs, frozenset(), "parameter"))
    except _Unsupported as exc:
        raise ToolDefinitionError(f"{where}: {exc}") from None
    assert isinstance(parameters, FrozenDict)
    return FunctionDescription(
        name=name,
        description=summary,
        parameters=parameters,
        hints={key: hints[key] for key in signature.parameters},
    )


def schema_for_type(tp: Any) -> FrozenDict:
    """The JSON schema of values of type ``tp`` (the annotation forms a tool parameter takes).

    Raises:
        ToolDefinitionError: ``tp`` has no JSON schema; the message says which part.
    """
    try:
        schema = freeze(_schema_for(tp))
    except _Unsupported as exc:
        raise ToolDefinitionError(f"{_fmt(tp)}: {exc}") from None
    assert isinstance(schema, FrozenDict)
    return schema


def coerce_value(tp: Any, value: Any) -> Any:
    """The Python value of type ``tp`` for JSON ``value`` that passed validation against
    :func:`schema_for_type` (instances for attrs classes and dataclasses, enum members,
    ``UUID``/``datetime``/``date`` objects, tuples)."""
    return _coerce(tp, value)


def _object_schema(
    fields: list[tuple[str, Any, object]],
    docs: Mapping[str, str],
    active: frozenset[type],
    what: str,
) -> dict[str, Any]:
    """The schema of an object with these ``(name, annotation, default)`` fields."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, tp, default in fields:
        if tp is _MISSING:
            raise _Unsupported(f"{what} {name!r} has no annotation")
        try:
            schema = properties[name] = _schema_for(tp, active)
        except _Unsupported as exc:
            raise _Unsupported(f"{what} {name!r}: {exc}") from None
        if docs.get(name):
            schema.setdefault("description", docs[name])
        if default is attrs.NOTHING:
            required.append(name)
        elif default is not _FACTORY:
            # A default the model cannot see (NaN, a factory, ...) still applies in Python.
            with contextlib.suppress(InvalidContent, RecursionError):
                schema["default"] = freeze(_to_json(default))
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _schema_for(tp: Any, active: frozenset[type] = frozenset()) -> dict[str, Any]:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        schema = _schema_for(args[0], active)
        notes = [note for note in tp.__metadata__ if isinstance(note, str)]
        if notes:
            schema["description"] = " ".join(notes)
        return schema
    if tp is Any:
        return {}
    if origin is typing.Required or origin is typing.NotRequired:
        return _schema_for(args[0], active)  # a TypedDict key's marker, read by its class
    if isinstance(tp, type) and tp in _FORMATS:
        return {"type": "string", "format": _FORMATS[tp][0]}
    if tp is None or (isinstance(tp, type) and tp in _PRIMITIVES):
        return {"type": _PRIMITIVES[tp]}
    if origin is Literal:
        return _enum_schema([_to_json(arg) for arg in args], tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_schema([member.value for member in tp], tp)
    if origin is Union or origin is types.UnionType:
        return _union_schema(args, active)
    base = origin if origin is not None else tp
    if base is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema_for(args[0], active)}
        items = [_schema_for(arg, active) for arg in args]
        return {
            "type": "array",
            "prefixItems": items,
            "minItems": len(items),
            "maxItems": len(items),
        }
    if base in (list, Sequence):
        return (
            {"type": "array", "items": _schema_for(args[0], active)} if args else {"type": "array"}
        )
    if base in (dict, Mapping):
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise _Unsupported(f"{_fmt(tp)} has keys that are not strings")
        return {"type": "object", "additionalProperties": _schema_for(args[1], active)}
    if isinstance(tp, type) and attrs.has(tp):
        return _attrs_schema(tp, active)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_schema(tp, active)
    if typing.is_typeddict(tp):
        return _typeddict_schema(tp, active)
    raise _Unsupported(f"{_fmt(tp)} has no JSON schema")


def _enum_schema(values: list[Any], tp: object) -> dict[str, Any]:
    kinds: list[str] = []
    for value in values:
        kind = _kind(value)
        if kind not in _SCALAR_KINDS:
            raise _Unsupported(f"{_fmt(tp)} has the value {value!r}, which is not a JSON scalar")
        if kind not in kinds:
            kinds.append(kind)
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _union_schema(args: tuple[Any, ...], active: frozenset[type]) -> dict[str, Any]:
    nullable = _NONE in args
    arms = [_schema_for(arg, active) for arg in args if arg is not _NONE]
    if nullable and len(arms) == 1:
        arm = arms[0]
        if not arm:
            return arm  # Any already admits null
        if isinstance(arm.get("type"), str) and "enum" not in arm:
            return {**arm, "type": [arm["type"], "null"]}
    return {"anyOf": [*arms, {"type": "null"}] if nullable else arms}


def _attrs_schema(cls: type, active: frozenset[type]) -> dict[str, Any]:
    if cls in active:
        raise _Unsupported(f"{cls.__qualname__} refers to itself")
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except NameError as exc:
        raise _Unsupported(f"{cls.__qualname__}: {exc}") from None
    _, docs = _parse_docstring(cls.__doc__ or "")
    fields = [
        (f.alias, hints.get(f.name, _MISSING), f.default) for f in attrs.fields(cls) if f.init
    ]
    docs = {f.alias: docs.get(f.name) or docs.get(f.alias, "") for f in attrs.fields(cls)}
    return _object_schema(fields, docs, active | {cls}, f"{cls.__qualname__} field")


def _class_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except NameError as exc:
        raise _Unsupported(f"{cls.__qualname__}: {exc}") from None


def _dataclass_schema(cls: type, active: frozenset[type]) -> dict[str, Any]:
    if cls in active:
        raise _Unsupported(f"{cls.__qualname__} refers to itself")
    hints = _class_hints(cls)
    _, docs = _parse_docstring(cls.__doc__ or "")
    fields = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default: object = f.default
        if default is dataclasses.MISSING:
            # A factory's value is made per call; the model only needs to know it may omit it.
            default = _FACTORY if f.default_factory is not dataclasses.MISSING else attrs.NOTHING
        fields.append((f.name, hints.get(f.name, _MISSING), default))
    return _object_schema(fields, docs, active | {cls}, f"{cls.__qualname__} field")


def _typeddict_schema(cls: Any, active: frozenset[type]) -> dict[str, Any]:
    if cls in active:
        raise _Unsupported(f"{cls.__qualname__} refers to itself")
    hints = _class_hints(cls)
    _, docs = _parse_docstring(cls.__doc__ or "")
    required: frozenset[str] = cls.__required_keys__
    fields = []
    for key, hint in hints.items():
        # The marker decides when present: with postponed annotations the class cannot see
        # it, and __required_keys__ then follows totality alone.
        marker = get_origin(hint)
        needed = (
            marker is typing.Required if marker in (typing.Required, typing.NotRequired)
            else key in required
        )
        fields.append((key, hint, attrs.NOTHING if needed else _FACTORY))
    return _object_schema(fields, docs, active | {cls}, f"{cls.__qualname__} key")


_FACTORY = object()  # optional, with no default the schema can show


def _to_json(value: object) -> Any:
    if isinstance(value, enum.Enum):
        return _to_json(value.value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime.date):
        return value.isoformat()
    cls = type(value)
    if attrs.has(cls):
        fields = attrs.fields(cls)
        return {f.alias: _to_json(getattr(value, f.name)) for f in fields if f.init}
    if dataclasses.is_dataclass(value):
        return {
            f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
    if isinstance(value, Mapping):
        return {key: _to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(item) for item in value]
    return value


def _fmt(tp: object) -> str:
    if isinstance(tp, type) and not get_args(tp):
        return tp.__qualname__
    return repr(tp).replace("typing.", "")


# --- docstrings ------------------------------------------------------------------------

_PARAM_SECTIONS = frozenset(
    {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments",
     "other parameters", "attributes"}
)  # fmt: skip
_SECTIONS = _PARAM_SECTIONS | {
    "returns", "return", "yields", "yield", "raises", "examples", "example", "note", "notes",
    "warning", "warnings", "see also", "references", "todo",
}  # fmt: skip
_GOOGLE_HEADER = re.compile(r"([A-Za-z][A-Za-z ]*):\s*")
_GOOGLE_ENTRY = re.compile(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")
_NUMPY_ENTRY = re.compile(r"(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?::.*)?")
_SPHINX_FIELD = re.compile(r":\w+[^:]*:")
_SPHINX_PARAM = re.compile(
    r":(?:param|parameter|arg|argument|key|keyword)\s+(?:[^:]*\s)?\**(\w+)\s*:\s*(.*)"
)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a docstring into its text before any section and per-parameter descriptions."""
    lines = inspect.cleandoc(doc).expandtabs().splitlines()
    found: dict[str, list[str]] = {}
    body_end: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        header = _GOOGLE_HEADER.fullmatch(line)
        if header and header[1].lower() in _SECTIONS:
            end = _block_end(lines, i + 1)
            if header[1].lower() in _PARAM_SECTIONS:
                _read_entries(lines[i + 1 : end], _GOOGLE_ENTRY, found)
        elif _is_numpy_header(lines, i):
            end = i + 2
            while end < len(lines) and not _is_numpy_header(lines, end):
                end += 1
            if line.strip().lower() in _PARAM_SECTIONS:
                _read_entries(lines[i + 2 : end], _NUMPY_ENTRY, found)
        elif _SPHINX_FIELD.match(line):
            end = _block_end(lines, i + 1)
            if entry := _SPHINX_PARAM.match(line):
                found[entry[1]] = [entry[2], *(part.strip() for part in lines[i + 1 : end])]
        else:
            i += 1
            continue
        if body_end is None:
            body_end = i
        i = end
    summary = "\n".join(lines[:body_end]).strip()
    return summary, {name: " ".join(" ".join(parts).split()) for name, parts in found.items()}


def _block_end(lines: list[str], start: int) -> int:
    """The index of the first non-blank unindented line from ``start`` (or the end)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end][0].isspace()):
        end += 1
    return end


def _is_numpy_header(lines: list[str], i: int) -> bool:
    return (
        i + 1 < len(lines)
        and bool(lines[i].strip())
        and not lines[i][0].isspace()
        and set(lines[i + 1].strip()) == {"-"}
    )


def _read_entries(block: list[str], entry: re.Pattern[str], found: dict[str, list[str]]) -> None:
    """Read ``name: text`` entries; more-indented lines continue the entry above them."""
    indent = min((len(line) - len(line.lstrip()) for line in block if line.strip()), default=0)
    current: list[str] | None = None
    for line in block:
        if not line.strip():
            continue
        if len(line) - len(line.lstrip()) > indent:
            if current is not None:
                current.append(line.strip())
            continue
        match = entry.fullmatch(line.strip())
        if match is None:
            current = None
            continue
        # NumPy puts the type after the colon and the description below it.
        current = [match[2]] if entry is _GOOGLE_ENTRY else []
        for name in match[1].split(","):
            found[name.strip().lstrip("*")] = current


# --- validation ------------------------------------------------------------------------


Validator = Callable[[object], list[str]]
"""``validator(arguments) -> problems``: a schema compiled by :func:`compile_validator`."""

# A compiled schema node: ``check(value, path, out)`` appends the problems at ``path``.
_Check = Callable[[object, str, list[str]], None]


def validate_arguments(schema: Mapping[str, Any], arguments: object) -> list[str]:
    """Check ``arguments`` against a JSON schema; return the problems, ``[]`` when valid.

    Covers ``type``, ``enum``, ``const``, ``anyOf``, ``properties``, ``required``,
    ``additionalProperties``, ``items``, ``prefixItems``, ``minItems``/``maxItems``,
    ``minimum``/``maximum``, ``minLength``/``maxLength`` and the string formats ``uuid``,
    ``date`` and ``date-time``; other keywords are ignored.
    Each problem names the path of the bad value and says what was expected, so that it can
    be handed back to the model as is. Compiles ``schema`` on every call: to check many values
    against one schema, compile it once with :func:`compile_validator`.
    """
    return compile_validator(schema)(arguments)


def compile_validator(schema: Mapping[str, Any] | bool) -> Validator:
    """``schema`` turned into a function that checks a value, as :func:`validate_arguments` does.

    Every keyword is read once, here: a tool's arguments are checked on every call, and
    re-reading the schema each time (with ABC ``isinstance`` checks on every node) was most of
    a small call's cost. The schema must not change after compiling; a tool's parameters are
    frozen, so a changed definition is a new tool with a new validator.
    """
    check = _compile(schema)

    def validate(value: object) -> list[str]:
        problems: list[str] = []
        check(value, "", problems)
        return problems

    return validate


def _accept(value: object, path: str, out: list[str]) -> None:
    return


def _refuse_any(value: object, path: str, out: list[str]) -> None:
    out.append(_at(path, "no value is allowed here"))


def _compile(schema: object) -> _Check:
    return _compile_node(schema)[0]


# The exact classes a value of each JSON kind arrives as (bool is not an integer here).
_EXACT: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,),
    "null": (type(None),), "object": (dict, FrozenDict), "array": (list, tuple),
}
_EVERY_EXACT = frozenset(t for kinds in _EXACT.values() for t in kinds)


def _compile_node(schema: object) -> tuple[_Check, frozenset[type]]:
    """The check of ``schema``, and the exact classes of the values it admits whatever
    they hold: an object's check does not call a field's check for those."""
    if isinstance(schema, bool):
        return (_accept, _EVERY_EXACT) if schema else (_refuse_any, frozenset())
    if not isinstance(schema, Mapping):
        return _accept, _EVERY_EXACT
    gates = _compile_gates(schema)
    any_of = _compile_any_of(schema["anyOf"]) if "anyOf" in schema else None
    on_object = _compile_object(schema)
    on_array = _compile_array(schema)
    on_string = _compile_string(schema)
    on_number = _compile_number(schema)
    # The classes every gate admits whatever the value: those of the kinds a type gate
    # names (an integer gate tests a float's value), none when there is another gate.
    passing = _EVERY_EXACT if not gates else frozenset()
    if len(gates) == 1 and "type" in schema:
        passing = frozenset(t for kind in _types_of(schema) for t in _EXACT.get(kind, ()))
    left = {str: on_string, int: on_number, float: on_number, dict: on_object,
            FrozenDict: on_object, list: on_array, tuple: on_array}
    sure = frozenset() if any_of is not None else frozenset(
        t for t in passing if left.get(t) is None
    )

    def check(value: object, path: str, out: list[str]) -> None:
        cls = type(value)
        if cls not in passing:
            for gate in gates:
                problem = gate(value)
                if problem is not None:
                    out.append(_at(path, problem))
                    return
        if any_of is not None:
            any_of(value, path, out)
        # Exact JSON types first: none of them is two kinds at once, and the ABC check
        # below costs more than the rest of a small node's checking.
        if cls is str:
            if on_string is not None:
                on_string(value, path, out)
        elif cls is dict or cls is FrozenDict:
            if on_object is not None:
                on_object(value, path, out)
        elif cls is list or cls is tuple:
            if on_array is not None:
                on_array(value, path, out)
        elif isinstance(value, Mapping):
            if on_object is not None:
                on_object(value, path, out)
        elif isinstance(value, (list, tuple)):
            if on_array is not None:
                on_array(value, path, out)
        elif isinstance(value, str):
            if on_string is not None:
                on_string(value, path, out)
        elif on_number is not None and _is_type(value, "number"):
            on_number(value, path, out)

    if any_of is None and not (on_object or on_array or on_string or on_number):
        # A leaf (most of a tool's parameters): its gates alone, without the dispatch.
        if not gates:
            return _accept, sure
        return _leaf(gates), sure
    return check, sure


def _leaf(gates: list[Callable[[object], str | None]]) -> _Check:
    if len(gates) == 1:
        [gate] = gates

        def check_one(value: object, path: str, out: list[str]) -> None:
            problem = gate(value)
            if problem is not None:
                out.append(_at(path, problem))

        return check_one

    def check(value: object, path: str, out: list[str]) -> None:
        for gate in gates:
            problem = gate(value)
            if problem is not None:
                out.append(_at(path, problem))
                return

    return check


def _compile_gates(schema: Mapping[str, Any]) -> list[Callable[[object], str | None]]:
    """The checks that end a node's checking when they fail: type, enum, const."""
    gates: list[Callable[[object], str | None]] = []
    if "type" in schema:
        wanted = _types_of(schema)
        admits = _type_test(wanted)
        expected = " or ".join(wanted)

        def type_gate(value: object) -> str | None:
            return None if admits(value) else f"expected {expected}, got {_show(value)}"

        gates.append(type_gate)
    if "enum" in schema:
        options = list(schema["enum"])
        # A string equals a string option exactly when _same says so: the common case is one
        # set lookup.
        strings = frozenset(o for o in options if type(o) is str)

        def enum_gate(value: object) -> str | None:
            if type(value) is str and value in strings:
                return None
            if any(_same(value, option) for option in options):
                return None
            shown = ", ".join(_literal(option) for option in options)
            return f"must be one of {shown}, got {_literal(value)}"

        gates.append(enum_gate)
    if "const" in schema:
        const = schema["const"]

        def const_gate(value: object) -> str | None:
            if _same(value, const):
                return None
            return f"must be {_literal(const)}, got {_literal(value)}"

        gates.append(const_gate)
    return gates


def _type_test(kinds: list[str]) -> Callable[[object], bool]:
    tests = [_KIND_TESTS.get(kind) or _kind_is(kind) for kind in kinds]
    if len(tests) == 1:
        return tests[0]
    return lambda value: any(test(value) for test in tests)


def _kind_is(kind: str) -> Callable[[object], bool]:
    return lambda value: _is_type(value, kind)


def _is_object(value: object) -> bool:
    cls = type(value)
    return cls is dict or cls is FrozenDict or _kind(value) == "object"


def _is_array(value: object) -> bool:
    cls = type(value)
    return cls is list or cls is tuple or _kind(value) == "array"


def _is_integer(value: object) -> bool:
    return type(value) is int or _is_type(value, "integer")  # an exact int: the usual case


def _is_number(value: object) -> bool:
    cls = type(value)
    return cls is int or cls is float or _is_type(value, "number")


_KIND_TESTS: dict[str, Callable[[object], bool]] = {
    "integer": _is_integer,
    "number": _is_number,
    "string": lambda value: isinstance(value, str),
    "boolean": lambda value: isinstance(value, bool),
    "null": lambda value: value is None,
    "object": _is_object,
    "array": _is_array,
}


def _compile_any_of(branches: Sequence[Any]) -> _Check:
    compiled = [(_compile(branch), branch) for branch in branches]

    def check(value: object, path: str, out: list[str]) -> None:
        failures: list[tuple[object, list[str]]] = []
        for branch_check, branch in compiled:
            problems: list[str] = []
            branch_check(value, path, problems)
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

    return check


def _compile_object(schema: Mapping[str, Any]) -> _Check | None:
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = tuple(schema.get("required", ()))
    required_keys = frozenset(required)
    extra = schema.get("additionalProperties", True)
    nodes = {name: _compile_node(sub) for name, sub in properties.items()}
    checks = {name: check for name, (check, _) in nodes.items()}
    # Per field, the exact classes its check admits whatever the value: a tool's arguments
    # are mostly such scalars, checked with one set lookup instead of a call.
    sure = {name: classes for name, (_, classes) in nodes.items()}
    extra_check = None if extra is False else _compile(extra)
    if not required and extra_check is _accept and all(c is _accept for c in checks.values()):
        return None
    allowed = ", ".join(properties) or "none"
    # The paths of the known fields under the last path seen: a node is nearly always checked
    # at the same path (the top, for a tool's arguments), and building them is most of a
    # valid object's cost.
    cached: list[Any] = [None, {}]

    def check(value: object, path: str, out: list[str]) -> None:
        assert isinstance(value, (dict, Mapping))  # dict first: no ABC check for JSON
        if required and not value.keys() >= required_keys:
            out.extend(
                f"{_join(path, name)}: missing required field" for name in required
                if name not in value
            )
        if cached[0] != path:
            cached[0], cached[1] = path, {name: _join(path, name) for name in checks}
        paths: dict[str, str] = cached[1]
        for key, item in value.items():
            if type(item) in sure.get(key, ()):
                continue
            sub = checks.get(key)
            if sub is not None:
                sub(item, paths[key], out)
            elif extra_check is None:
                out.append(_at(path, f"unexpected field {key!r} (allowed: {allowed})"))
            else:
                extra_check(item, _join(path, key), out)

    return check


def _compile_array(schema: Mapping[str, Any]) -> _Check | None:
    prefix_schemas: Sequence[Any] = schema.get("prefixItems") or ()
    items = schema.get("items")
    if isinstance(items, (list, tuple)):  # the draft-07 spelling of prefixItems
        prefix_schemas, items = items, schema.get("additionalItems")
    prefix = [_compile(sub) for sub in prefix_schemas]
    rest = None if items is None else _compile(items)
    min_items = schema.get("minItems", 0)
    max_items = schema.get("maxItems")
    if (not min_items and max_items is None and all(c is _accept for c in prefix)
            and rest in (None, _accept)):
        return None

    def check(value: object, path: str, out: list[str]) -> None:
        assert isinstance(value, (list, tuple))
        if len(value) < min_items:
            out.append(_at(path, f"expected at least {min_items} items, got {len(value)}"))
        if max_items is not None and len(value) > max_items:
            out.append(_at(path, f"expected at most {max_items} items, got {len(value)}"))
        for index, item in enumerate(value):
            sub = prefix[index] if index < len(prefix) else rest
            if sub is not None:
                sub(item, f"{path}[{index}]", out)

    return check


def _compile_string(schema: Mapping[str, Any]) -> _Check | None:
    fmt = schema.get("format", "")
    parse = _PARSERS.get(fmt)
    min_length = schema.get("minLength", 0)
    max_length = schema.get("maxLength")
    if parse is None and not min_length and max_length is None:
        return None

    def check(value: object, path: str, out: list[str]) -> None:
        assert isinstance(value, str)
        if parse is not None:
            try:
                parse(value)
            except ValueError:
                out.append(_at(path, f"expected a {fmt} string, got {_literal(value)}"))
                return
        if len(value) < min_length:
            out.append(_at(path, f"must be at least {min_length} characters long"))
        if max_length is not None and len(value) > max_length:
            out.append(_at(path, f"must be at most {max_length} characters long"))

    return check


def _compile_number(schema: Mapping[str, Any]) -> _Check | None:
    has_min, has_max = "minimum" in schema, "maximum" in schema
    if not has_min and not has_max:
        return None
    minimum, maximum = schema.get("minimum"), schema.get("maximum")

    def check(value: Any, path: str, out: list[str]) -> None:
        if has_min and value < minimum:
            out.append(_at(path, f"must be at least {minimum}, got {value}"))
        if has_max and value > maximum:
            out.append(_at(path, f"must be at most {maximum}, got {value}"))

    return check


def _types_of(schema: object) -> list[str]:
    kinds = schema.get("type", []) if isinstance(schema, Mapping) else []
    return [kinds] if isinstance(kinds, str) else list(kinds)


def _admits_type(schema: object, value: object) -> bool:
    if not isinstance(schema, Mapping):
        return schema is True
    return "type" not in schema or any(_is_type(value, kind) for kind in _types_of(schema))


def _is_type(value: object, kind: str) -> bool:
    if kind == "integer":
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return _kind(value) == kind


def _kind(value: object) -> str:
    for cls, kind in _KINDS:
        if isinstance(value, cls):
            return kind
    return type(value).__name__


def _same(value: object, option: object) -> bool:
    # JSON keeps true and 1 apart; Python's == does not.
    if isinstance(value, bool) or isinstance(option, bool):
        return value is option
    return value == option


def _literal(value: object) -> str:
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "…")
    if isinstance(value, (bool, type(None))):
        return json.dumps(value)
    if isinstance(value, (Mapping, list, tuple)):
        text = json.dumps(value, default=repr)
        return text if len(text) <= 60 else text[:60] + "…"
    return repr(value)


def _show(value: object) -> str:
    kind = _kind(value)
    return kind if kind in ("null", "object", "array") else f"{kind} {_literal(value)}"


def _at(path: str, message: str) -> str:
    return f"{path}: {message}" if path else message


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


# --- parsing and coercion --------------------------------------------------------------


def parse_arguments(raw: str | Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """Parse a model's raw arguments into an object: ``(arguments, None)`` or ``(None, problem)``.

    A mapping is taken as already parsed; an empty or blank string means ``{}``. The problem
    says where the JSON broke, or what came instead of an object.
    """
    if isinstance(raw, Mapping):
        return dict(raw), None
    if not raw.strip():
        return {}, None
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno} (char {exc.pos})"
        return None, f"arguments are not valid JSON: {exc.msg} at {where}"
    except (ValueError, RecursionError) as exc:
        return None, f"arguments are not valid JSON: {exc}"
    if not isinstance(value, dict):
        return None, f"arguments must be a JSON object, got {_show(value)}"
    return value, None


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def coerce_arguments(
    fn_description_or_hints: FunctionDescription | Mapping[str, Any],
    arguments: Mapping[str, Any],
) -> dict[str, Any]:
    """Turn validated JSON arguments into the Python values a function expects.

    Enum values become members, objects become attrs or dataclass instances (``TypedDict``
    values stay dicts, their fields coerced), formatted strings become ``UUID``, ``datetime``
    and ``date`` objects, arrays become tuples where the annotation says tuple (and lists
    where it says list); other values are left alone.
    ``fn_description_or_hints`` is a :class:`FunctionDescription` or a mapping of parameter
    names to annotations.
    """
    hints = (
        fn_description_or_hints._hints
        if isinstance(fn_description_or_hints, FunctionDescription)
        else fn_description_or_hints
    )
    return {
        key: _coerce(hints[key], value) if key in hints else value
        for key, value in arguments.items()
    }


def _coerce(tp: Any, value: Any) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _coerce(args[0], value)
    if value is None:
        return None
    if origin is Union or origin is types.UnionType:
        arms = [arg for arg in args if arg is not _NONE]
        arm = next((arm for arm in arms if len(arms) == 1 or _fits(arm, value)), None)
        return value if arm is None else _coerce(arm, value)
    if origin is Literal:
        return next((arg for arg in args if _same(_to_json(arg), value)), value)
    if origin is typing.Required or origin is typing.NotRequired:
        return _coerce(args[0], value)
    if isinstance(tp, type):
        if tp in _FORMATS and isinstance(value, str):
            try:
                return _FORMATS[tp][1](value)
            except ValueError:
                return value
        if issubclass(tp, enum.Enum):
            try:
                return tp(value)
            except ValueError:
                return value
        if attrs.has(tp) and isinstance(value, Mapping):
            hints = typing.get_type_hints(tp, include_extras=True)
            fields = [f for f in attrs.fields(tp) if f.init and f.alias in value]
            return tp(**{f.alias: _coerce(hints.get(f.name, Any), value[f.alias]) for f in fields})
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            hints = typing.get_type_hints(tp, include_extras=True)
            return tp(**{
                f.name: _coerce(hints.get(f.name, Any), value[f.name])
                for f in dataclasses.fields(tp) if f.init and f.name in value
            })
        if typing.is_typeddict(tp) and isinstance(value, Mapping):
            hints = typing.get_type_hints(tp, include_extras=True)
            return {key: _coerce(hints.get(key, Any), item) for key, item in value.items()}
        if tp is int and isinstance(value, float) and value.is_integer():
            return int(value)
    base = origin if origin is not None else tp
    if isinstance(value, (list, tuple)):
        if base is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_coerce(args[0], item) for item in value)
            if len(args) == len(value):
                return tuple(_coerce(arg, item) for arg, item in zip(args, value, strict=True))
            return tuple(value)
        if base in (list, Sequence):
            return [_coerce(args[0] if args else Any, item) for item in value]
    if isinstance(value, Mapping) and base in (dict, Mapping) and len(args) == 2:
        return {key: _coerce(args[1], item) for key, item in value.items()}
    return value


# Annotations whose validated JSON value is already the Python value.
_AS_IS: frozenset[object] = frozenset({str, bool, float, Any, object, _NONE})


def _coercer_for(tp: Any) -> Callable[[Any], Any] | None:
    """What :func:`_coerce` does for ``tp``, or None when it returns every valid value as is."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _coercer_for(args[0])
    if origin is Union or origin is types.UnionType:
        arms = [arg for arg in args if arg is not _NONE]
        if len(arms) == 1:
            # One arm and None: _coerce passes None through and coerces the rest to the arm.
            return _coercer_for(arms[0])
    with contextlib.suppress(TypeError):  # an unhashable annotation takes the general path
        if tp in _AS_IS:
            return None
    if tp is int:
        return _int_value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return functools.partial(_enum_value, tp)
    return functools.partial(_coerce, tp)


def _enum_value(tp: type[enum.Enum], value: Any) -> Any:
    try:
        return tp(value)
    except ValueError:
        return value


def _int_value(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _fits(tp: Any, value: object) -> bool:
    try:
        return not validate_arguments(_schema_for(tp), value)
    except _Unsupported:
        return False
