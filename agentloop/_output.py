"""Structured output: the schema a run asks for, and checking what the model produced.

A run's output type is turned into an :class:`OutputSpec` when the run is entered; the agent
keeps it by message id until the turn that claims that message takes it (see
``_run.take_output``), so the driver never needs the caller's Python type, only its JSON schema.
Where the adapter declares ``supports_json_schema`` the schema travels on
``LLMRequest.output_schema`` and the reply text is the output; otherwise the model is given a
``final_result`` tool whose arguments are the output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn

import attrs

from ._errors import InvalidContent, ProviderError, ToolDefinitionError
from ._json import FrozenDict, freeze, thaw
from ._model import ToolCall, ToolSpec
from ._pydantic import OutputRefusedError, is_model, model_schema, model_value
from ._schema import (
    coerce_value,
    compile_validator,
    parse_arguments,
    schema_for_type,
    validate_arguments,
)

__all__ = [
    "FINAL_RESULT", "OutputSpec", "Verdict", "output_spec", "rebuild_output", "refuses_schema",
]

FINAL_RESULT: Final = "final_result"


@attrs.frozen(slots=True)
class OutputSpec:
    """The JSON schema a turn's output must satisfy, and the name providers show for it."""

    schema: FrozenDict
    name: str
    build: Callable[[Any], object] | None = attrs.field(default=None, eq=False, repr=False)
    """The caller's type built from a schema-valid value, so that what its own validators
    refuse (an attrs validator, ``__post_init__``) is a correction too; ``None`` for a
    schema mapping, or a spec rebuilt from the log."""

    def tool(self) -> ToolSpec:
        return ToolSpec(
            FINAL_RESULT,
            "Give the final answer: call this once, its arguments are the answer.",
            self.schema,
        )


@attrs.frozen(slots=True)
class Verdict:
    """What one step produced as output: ``found`` when it tried to give one at all."""

    found: bool
    value: Any = None
    problems: tuple[str, ...] = ()
    call: ToolCall | None = None

    @property
    def valid(self) -> bool:
        return self.found and not self.problems


def output_spec(output_type: object) -> OutputSpec:
    """The spec of a run's ``output_type``: a JSON-schema mapping, a type with a schema, or a
    pydantic ``BaseModel`` subclass (its ``model_json_schema()``, checked by ``model_validate``).

    Raises:
        ToolDefinitionError: the type has no JSON schema, or the mapping is not a valid
            schema of a JSON object (checked here, before any model call).
    """
    if isinstance(output_type, Mapping):
        try:
            schema = freeze(dict(output_type), path="output_type")
        except InvalidContent as exc:
            raise ToolDefinitionError(f"output_type: the schema is not JSON: {exc}") from None
        assert isinstance(schema, FrozenDict)
        _check_object_schema(schema)
        title = schema.get("title")
        return OutputSpec(schema, title if isinstance(title, str) and title else "output")
    if is_model(output_type):
        return _model_spec(output_type)
    schema = schema_for_type(output_type)
    if schema.get("type") != "object":
        # Both providers' formats and tool parameters must be objects.
        raise TypeError(f"output_type must describe a JSON object, got {output_type!r}")

    def build(value: object) -> object:
        return coerce_value(output_type, thaw(value))

    return OutputSpec(schema, getattr(output_type, "__name__", "output"), build)


def _model_spec(model: Any) -> OutputSpec:
    try:
        frozen = freeze(model_schema(model), path="output_type")
    except Exception as exc:  # noqa: BLE001 - pydantic refuses some types a schema cannot show
        raise ToolDefinitionError(
            f"output_type {model.__name__}: pydantic cannot give its JSON schema: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    assert isinstance(frozen, FrozenDict)
    _check_object_schema(frozen, f"output_type {model.__name__}")

    def build(value: object) -> object:
        return model_value(model, thaw(value))

    return OutputSpec(frozen, model.__name__, build)


def _check_object_schema(schema: FrozenDict, where: str = "output_type") -> None:
    def bad(problem: str) -> NoReturn:
        raise ToolDefinitionError(f"{where}: {problem}")

    if schema.get("type") != "object":
        bad(f"the schema must describe a JSON object (\"type\": \"object\"), got type "
            f"{schema.get('type')!r}")
    properties = schema.get("properties", FrozenDict())
    if not isinstance(properties, Mapping):
        bad(f"\"properties\" must be an object, got {properties!r}")
    for key, sub in properties.items():
        if not isinstance(sub, (Mapping, bool)):
            bad(f"\"properties\".{key} must be a schema (an object), got {sub!r}")
    required = schema.get("required", ())
    if not isinstance(required, tuple) or not all(isinstance(r, str) for r in required):
        bad(f"\"required\" must be a list of property names, got {required!r}")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, (Mapping, bool)):
        bad(f"\"additionalProperties\" must be a boolean or a schema, got {extra!r}")
    try:
        compile_validator(schema)
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as exc:
        bad(f"the schema is malformed: {type(exc).__name__}: {exc}")


def _judge(spec: OutputSpec, value: object, call: ToolCall | None = None) -> Verdict:
    """Schema problems first; then whether the value can be stored (JSON holds no 1e400 and
    no 5,000-deep nesting) and whether the caller's own type accepts it."""
    problems = tuple(validate_arguments(spec.schema, value))
    if not problems:
        try:
            freeze(value, path="output")
        except InvalidContent as exc:
            problems = (f"the output cannot be stored as JSON: {exc}",)
        except RecursionError:
            problems = ("the output is nested too deeply to be stored; flatten it",)
    if not problems and spec.build is not None:
        try:
            spec.build(value)
        except OutputRefusedError as exc:
            problems = exc.problems
        except Exception as exc:  # noqa: BLE001 - any refusal of the type is a correction
            problems = (f"{spec.name} refused the output: {type(exc).__name__}: {exc}",)
    return Verdict(True, value, problems, call=call)


def check(spec: OutputSpec, native: bool, text: str, calls: tuple[ToolCall, ...]) -> Verdict:
    """Judge one step's reply against ``spec`` (``native``: the text is the output)."""
    if native:
        if calls and not text.strip():
            return Verdict(False)  # a tool step on the way to the answer
        parsed, problem = parse_arguments(text) if text.strip() else (
            None, "the reply is empty, not a JSON object")
        if problem is not None:
            problem = problem.replace("arguments are", "the reply is", 1)
            return Verdict(True, problems=(problem.replace("arguments must", "the reply must", 1),))
        return _judge(spec, parsed)
    for call in calls:
        if call.name == FINAL_RESULT:
            parsed, problem = parse_arguments(call.arguments)
            if problem is not None:
                return Verdict(True, problems=(problem,), call=call)
            return _judge(spec, parsed, call)
    return Verdict(False)


_SCHEMA_WORDS: Final = ("response_format", "response format", "json_schema", "json schema")


def refuses_schema(error: ProviderError) -> bool:
    """Whether a failed call was the server refusing the JSON-schema response format: HTTP
    400 or 422 whose message names it (llama.cpp answers 422, others 400 naming
    ``response_format``)."""
    if error.status not in (400, 422):
        return False
    message = error.message.lower()
    return any(word in message for word in _SCHEMA_WORDS)


def correction(verdict: Verdict) -> str:
    """What the model is told when its output did not fit, in words it can act on."""
    if not verdict.found:
        return f"Give the final answer by calling the {FINAL_RESULT} tool."
    listed = "\n".join(f"- {p}" for p in verdict.problems)
    return f"The output does not match the required schema:\n{listed}\nSend it again, fixed."


def rebuild_output(output_type: object, value: object) -> object:
    """A stored output as the caller's type (a plain dict for a schema mapping)."""
    plain = thaw(value)
    if isinstance(output_type, Mapping):
        return plain
    if is_model(output_type):
        return model_value(output_type, plain)
    return coerce_value(output_type, plain)
