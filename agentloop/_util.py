"""Small helpers with no dependencies inside agentloop."""

from __future__ import annotations

from typing import Any, TypeVar

import trio

__all__ = ["Latch", "NoPublicConstructor", "construct", "fixup_module_metadata"]

T = TypeVar("T")


class NoPublicConstructor(type):
    """A metaclass for handles only the runtime may make (trio's pattern for ``Nursery``).

    ``Cls(...)`` raises ``TypeError``; the runtime builds instances with ``Cls._create(...)``.
    """

    def __call__(cls, *args: object, **kwargs: object) -> Any:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; obtain one from "
            "the runtime (ctx.agents.create, ctx.agent_loop.create, ...)"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]


def construct(cls: type[T], *args: Any, **kwargs: Any) -> T:
    """Build an instance of a :class:`NoPublicConstructor` class: the runtime's way in."""
    maker: Any = cls
    return maker._create(*args, **kwargs)  # type: ignore[no-any-return]


def fixup_module_metadata(module_name: str, namespace: dict[str, object]) -> None:
    """Make public exceptions report the public module, so tracebacks read ``agentloop.X``.

    Only exceptions: attrs and cattrs resolve other classes' string annotations through
    their ``__module__``.
    """
    for name, value in namespace.items():
        if name.startswith("_") or not (isinstance(value, type) and issubclass(value, Exception)):
            continue
        if getattr(value, "__module__", "").startswith(f"{module_name}._"):
            value.__module__ = module_name


class Latch:
    """A one-shot event that allocates a ``trio.Event`` only if someone has to wait.

    Idle agents are numerous; most latches are set before anyone waits on them.
    """

    __slots__ = ("_done", "_event")

    def __init__(self) -> None:
        self._done = False
        self._event: trio.Event | None = None

    def set(self) -> None:
        self._done = True
        if self._event is not None:
            self._event.set()

    def is_set(self) -> bool:
        return self._done

    async def wait(self) -> None:
        if self._done:
            await trio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()
