"""pydantic ``BaseModel`` classes as output types, without importing pydantic.

pydantic is optional: a class can only be a ``BaseModel`` subclass if the module that defined
it imported pydantic first, so looking in ``sys.modules`` answers the question without an
import (and without the import's cost for everyone else).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["OutputRefusedError", "is_model", "model_schema", "model_value"]

_DEFS = "#/$defs/"


class OutputRefusedError(ValueError):
    """The caller's type refused a value; ``problems`` say where and why, one per line, in
    the words the schema check uses (``path: what is wrong``)."""

    def __init__(self, problems: tuple[str, ...]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def is_model(tp: object) -> bool:
    """Whether ``tp`` is a pydantic ``BaseModel`` subclass."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(tp, type):
        return False
    return issubclass(tp, pydantic.BaseModel)


def model_schema(tp: Any) -> dict[str, Any]:
    """The model's ``model_json_schema()`` with its ``$defs`` references inlined.

    Inlined, every nested field is checked by the runtime's own validator (so a mistake deep
    in the output is named by its path), and providers with partial ``$ref`` support (local
    grammar builders) see plain nesting. A recursive model keeps its self-references, and
    the ``$defs`` they point into; pydantic checks those parts.
    """
    raw = tp.model_json_schema()
    defs: Mapping[str, Any] = raw.get("$defs", {})
    kept: set[str] = set()

    def resolve(node: object, stack: tuple[str, ...]) -> object:
        if isinstance(node, list):
            return [resolve(item, stack) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS) and ref[len(_DEFS):] in defs:
            name = ref[len(_DEFS):]
            if name in stack:
                kept.add(name)
                return {key: resolve(value, stack) for key, value in node.items()}
            target = resolve(defs[name], (*stack, name))
            assert isinstance(target, dict)
            siblings = {k: resolve(v, stack) for k, v in node.items() if k != "$ref"}
            return {**target, **siblings}
        return {
            key: resolve(value, stack) for key, value in node.items() if key != "$defs"
        }

    schema = resolve(raw, ())
    assert isinstance(schema, dict)
    if kept:
        # What a kept reference points at, as pydantic wrote it (its references resolve there).
        schema["$defs"] = dict(defs)
    return schema


def model_value(tp: Any, value: object) -> object:
    """``tp.model_validate(value)``; a refusal is :class:`OutputRefusedError` with one problem per
    error pydantic reports, located by path."""
    pydantic = sys.modules["pydantic"]
    try:
        return tp.model_validate(value)
    except pydantic.ValidationError as exc:
        problems = tuple(
            _problem(error["loc"], error["msg"]) for error in exc.errors(include_url=False)
        )
        raise OutputRefusedError(problems or (str(exc),)) from None


def _problem(loc: tuple[object, ...], message: str) -> str:
    path = ".".join(str(part) for part in loc)
    return f"{path}: {message}" if path else message
