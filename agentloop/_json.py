"""Deep-frozen JSON values.

Content crosses the durable session boundary once: it is validated and frozen at the edge
(``send``, seed events, metadata) and then shared by reference, never copied again. Objects
become :class:`FrozenDict`, arrays become tuples; every mutation raises ``TypeError``.

What is frozen can always be written as UTF-8 JSON text, by every store and on every wire: a
string holding a lone surrogate, an integer longer than Python's int-to-text limit and nesting
deeper than :data:`MAX_DEPTH` are refused (or, with ``repair=True``, for text that comes from
tools and providers rather than from the user, surrogates become U+FFFD).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Final, NoReturn, TypeAlias, cast

from ._errors import InvalidContent
from ._frozen import FrozenDict

__all__ = [
    "FrozenDict", "JSON", "MAX_DEPTH", "freeze", "freeze_object", "freeze_repaired",
    "parse_json", "repair_text", "text_problem", "thaw",
]

MAX_DEPTH: Final = 200
"""Deepest nesting accepted: well inside what ``json`` and ``sqlite3`` handle (about 1,000)."""

# Built from chr(): mypyc, which compiles this module in the opt-in build, takes no
# surrogate in a string literal.
_SURROGATE: Final = re.compile(f"[{chr(0xD800)}-{chr(0xDFFF)}]")

JSON: TypeAlias = "bool | int | float | str | tuple[JSON, ...] | FrozenDict | None"


# json.loads walks three Python functions and two regular expressions around its C scanner;
# a streamed tool call's arguments are parsed on every step that has one.
_scan: Final[Any] = cast("Any", json.JSONDecoder()).scan_once


def parse_json(text: str) -> Any:
    """``json.loads(text)``: the same value, or the same error.

    Text that is one JSON value with nothing around it goes to the scanner alone; anything
    else (whitespace around the value, text after it, every error) takes ``json.loads``'s
    own way, so what it raises and says is unchanged.
    """
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    if end != len(text):
        return json.loads(text)
    return value


def _fail(path: str, why: str) -> NoReturn:
    raise InvalidContent(f"{path or 'value'}: {why}")


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (``"lone surrogate at 14"``), or ``None``."""
    if text.isascii():
        return None  # the common case, answered without scanning in Python
    found = _SURROGATE.search(text)
    return None if found is None else f"lone surrogate at {found.start()}"


def repair_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD."""
    if text.isascii():
        return text
    return _SURROGATE.sub("\ufffd", text)


class _Freezer:
    __slots__ = ("active", "repair", "repaired")

    def __init__(self, repair: bool) -> None:
        self.active: set[int] = set()
        self.repair = repair
        self.repaired = False

    def text(self, value: str, path: str) -> str:
        problem = text_problem(value)
        if problem is None:
            return value
        if not self.repair:
            _fail(path, problem)
        self.repaired = True
        return repair_text(value)

    def freeze(self, value: object, path: str, depth: int) -> JSON:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return self.text(value, path)
        if isinstance(value, int):
            if value.bit_length() > _INT_BITS and _too_long(value):
                _fail(path, f"an integer of more than {sys.get_int_max_str_digits()} digits "
                      "cannot be written as JSON text")
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                _fail(path, f"{value!r} is not a finite number")
            return value
        if depth >= MAX_DEPTH:
            _fail(path, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, FrozenDict):
            return value  # already validated when it was built
        if isinstance(value, Mapping):
            key = id(value)
            if key in self.active:
                _fail(path, "cycle detected")
            self.active.add(key)
            out: dict[str, Any] = {}
            # Paths are built only for a value that needs a closer look: most values are
            # ASCII strings and small numbers, and this runs on every step's data.
            for k, v in value.items():
                if type(k) is not str or not k.isascii():
                    if not isinstance(k, str):
                        _fail(path, f"object key {k!r} is not a string")
                    k = self.text(k, f"{path}.{k!r}" if path else repr(k))
                out[k] = v if _plain(v) else self.freeze(
                    v, f"{path}.{k}" if path else k, depth + 1
                )
            self.active.discard(key)
            return FrozenDict(out)
        if isinstance(value, (list, tuple)):
            key = id(value)
            if key in self.active:
                _fail(path, "cycle detected")
            self.active.add(key)
            items = tuple(
                v if _plain(v) else self.freeze(v, f"{path}[{i}]", depth + 1)
                for i, v in enumerate(value)
            )
            self.active.discard(key)
            return items
        _fail(path, f"{type(value).__name__} is not JSON-representable")


# Below this many bits an int has fewer than 4,300 digits, so the exact check is skipped.
_INT_BITS: Final = 14_000


def _plain(value: Any) -> bool:
    """Whether ``value`` freezes to itself with nothing to check: None, a bool, an ASCII
    ``str``, a short ``int``, a finite ``float`` (exact types: a subclass takes the long way)."""
    cls = type(value)
    plain: bool
    if cls is str:
        plain = value.isascii()
    elif value is None or cls is bool:
        plain = True
    elif cls is int:
        plain = value.bit_length() <= _INT_BITS
    elif cls is float:
        plain = math.isfinite(value)
    else:
        plain = False
    return plain


def _too_long(value: int) -> bool:
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        return False
    try:
        str(value)
    except ValueError:
        return True
    return False


def _flat(value: dict[Any, Any]) -> FrozenDict | None:
    """``value`` (an exact ``dict``) frozen at once when it is flat: ASCII keys and plain
    values (most tool arguments and usage counters); ``None`` when it needs the walk."""
    for k, v in value.items():
        if type(k) is not str or not k.isascii():
            return None
        # The usual values (short ints, ASCII strings) without a call each.
        cls = type(v)
        if cls is int:
            if v.bit_length() > _INT_BITS:
                return None
        elif cls is str:
            if not v.isascii():
                return None
        elif not _plain(v):
            return None
    return FrozenDict(value)


def freeze(value: object, *, path: str = "") -> JSON:
    """Validate ``value`` as JSON and return a deep-frozen copy.

    Raises:
        InvalidContent: on NaN/Infinity, non-string keys, cycles, non-JSON types, strings with
            lone surrogates, integers too long for JSON text or nesting deeper than
            :data:`MAX_DEPTH`; the message names the path of the bad value
            (``content[2].text: lone surrogate at 14``).
    """
    if type(value) is dict:
        flat = _flat(value)
        if flat is not None:
            return flat
    elif _plain(value):
        return cast("JSON", value)  # None, a bool, an ASCII string, a number: itself
    return _Freezer(False).freeze(value, path, 0)


def freeze_repaired(value: object, *, path: str = "") -> tuple[JSON, bool]:
    """Like :func:`freeze`, but lone surrogates become U+FFFD; also says whether any did.

    For text agentloop did not write and cannot refuse (tool results, provider output).
    """
    if type(value) is dict:
        flat = _flat(value)
        if flat is not None:
            return flat, False
    elif _plain(value):
        return cast("JSON", value), False
    freezer = _Freezer(True)
    return freezer.freeze(value, path, 0), freezer.repaired


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
