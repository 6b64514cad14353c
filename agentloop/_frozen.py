"""The immutable mapping every frozen JSON object is (:mod:`agentloop._json` makes them).

A module of its own so that it stays an ordinary Python class in every build: the opt-in
compiled build compiles ``_json``, and a ``dict`` subclass compiled by mypyc no longer
compares equal to another instance of itself.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["FrozenDict"]


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
