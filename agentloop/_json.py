"""Deep-frozen JSON values.

Content crosses the durable session boundary once: it is validated and frozen at the edge
(``send``, seed events, metadata) and then shared by reference, never copied again. Objects
become :class:`FrozenDict`, arrays become tuples; every mutation raises ``TypeError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn, TypeAlias

from ._errors import InvalidContent

__all__ = ["FrozenDict", "JSON", "freeze", "freeze_object", "thaw"]

JSON: TypeAlias = "bool | int | float | str | tuple[JSON, ...] | FrozenDict | None"


class FrozenDict(dict[str, Any]):
    """An immutable ``dict``: reads like a dict, serialises like a dict, refuses every write.

    Subclassing ``dict`` keeps ``json.dumps`` and equality with plain dicts fast and exact.
    """

    __slots__ = ("_hash",)
    _hash: int

    def _refuse(self, *_: object, **__: object) -> NoReturn:
        raise TypeError("FrozenDict is immutable")

    __setitem__ = _refuse
    __delitem__ = _refuse
    __ior__ = _refuse
    clear = _refuse
    pop = _refuse
    popitem = _refuse
    setdefault = _refuse
    update = _refuse

    def __hash__(self) -> int:  # type: ignore[override]
        try:
            return self._hash
        except AttributeError:
            h = hash(frozenset(self.items()))
            object.__setattr__(self, "_hash", h)
            return h

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: object) -> FrozenDict:
        return self

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[str, Any]]]:
        return (FrozenDict, (dict(self),))


def _fail(path: str, why: str) -> NoReturn:
    raise InvalidContent(f"{path or 'value'}: {why}")


def freeze(value: object, *, path: str = "") -> JSON:
    """Validate ``value`` as JSON and return a deep-frozen copy.

    Raises:
        InvalidContent: on NaN/Infinity, non-string keys, cycles or non-JSON types; the
            message names the path of the bad value.
    """
    return _freeze(value, path, set())


def _freeze(value: object, path: str, active: set[int]) -> JSON:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            _fail(path, f"{value!r} is not a finite number")
        return value
    if isinstance(value, FrozenDict):
        return value  # already validated when it was built
    if isinstance(value, Mapping):
        key = id(value)
        if key in active:
            _fail(path, "cycle detected")
        active.add(key)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                _fail(path, f"object key {k!r} is not a string")
            out[k] = _freeze(v, f"{path}.{k}" if path else k, active)
        active.discard(key)
        return FrozenDict(out)
    if isinstance(value, (list, tuple)):
        key = id(value)
        if key in active:
            _fail(path, "cycle detected")
        active.add(key)
        items = tuple(_freeze(v, f"{path}[{i}]", active) for i, v in enumerate(value))
        active.discard(key)
        return items
    _fail(path, f"{type(value).__name__} is not JSON-representable")


def freeze_object(value: object) -> FrozenDict:
    """Freeze a JSON object (a mapping); anything else raises ``InvalidContent``."""
    frozen = freeze(value)
    if not isinstance(frozen, FrozenDict):
        raise InvalidContent(f"expected a JSON object, got {type(value).__name__}")
    return frozen


def thaw(value: object) -> Any:
    """A plain mutable copy (dicts and lists) of a frozen JSON value."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [thaw(v) for v in value]
    return value


def _iter_text(parts: Iterable[object]) -> Iterable[str]:
    for part in parts:
        if isinstance(part, str):
            yield part
        elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
            yield part["text"]
