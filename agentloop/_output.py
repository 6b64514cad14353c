"""Structured output: the schema a run asks for, and checking what the model produced.

A run's output type is turned into an :class:`OutputSpec` when the run is entered; the agent
keeps it by message id until the turn that claims that message takes it (see
``Agent._outputs``), so the driver never needs the caller's Python type, only its JSON schema.
Where the adapter declares ``supports_json_schema`` the schema travels on
``LLMRequest.output_schema`` and the reply text is the output; otherwise the model is given a
``final_result`` tool whose arguments are the output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._json import FrozenDict, freeze, thaw
from ._model import ToolCall, ToolSpec
from ._schema import coerce_value, parse_arguments, schema_for_type, validate_arguments

__all__ = ["FINAL_RESULT", "OutputSpec", "Verdict", "output_spec", "rebuild_output"]

FINAL_RESULT: Final = "final_result"


@attrs.frozen(slots=True)
class OutputSpec:
    """The JSON schema a turn's output must satisfy, and the name providers show for it."""

    schema: FrozenDict
    name: str

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
    """The spec of a run's ``output_type``: a JSON-schema mapping, or a type with a schema.

    Raises:
        ToolDefinitionError: the type has no JSON schema.
    """
    if isinstance(output_type, Mapping):
        schema = freeze(dict(output_type))
        assert isinstance(schema, FrozenDict)
        title = schema.get("title")
        return OutputSpec(schema, title if isinstance(title, str) and title else "output")
    schema = schema_for_type(output_type)
    if schema.get("type") != "object":
        # Both providers' formats and tool parameters must be objects.
        raise TypeError(f"output_type must describe a JSON object, got {output_type!r}")
    return OutputSpec(schema, getattr(output_type, "__name__", "output"))


def check(spec: OutputSpec, native: bool, text: str, calls: tuple[ToolCall, ...]) -> Verdict:
    """Judge one step's reply against ``spec`` (``native``: the text is the output)."""
    if native:
        if calls and not text.strip():
            return Verdict(False)  # a tool step on the way to the answer
        try:
            value = json.loads(text)
        except ValueError as exc:
            return Verdict(True, problems=(f"the reply is not valid JSON: {exc}",))
        return Verdict(True, value, tuple(validate_arguments(spec.schema, value)))
    for call in calls:
        if call.name == FINAL_RESULT:
            parsed, problem = parse_arguments(call.arguments)
            if problem is not None:
                return Verdict(True, problems=(problem,), call=call)
            return Verdict(
                True, parsed, tuple(validate_arguments(spec.schema, parsed)), call=call
            )
    return Verdict(False)


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
    return coerce_value(output_type, plain)
