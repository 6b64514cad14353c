"""Small helpers with no dependencies inside agentloop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
import trio

__all__ = [
    "Latch", "NoPublicConstructor", "construct", "fixup_module_metadata", "quick_init",
    "stored_maker",
]

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


C = TypeVar("C", bound=type)

_FACTORY: type = type(attrs.Factory(list))


def quick_init(cls: C) -> C:
    """Give a frozen, slotted attrs class an ``__init__`` that sets each field through its
    slot's descriptor, for the value types made on every step (log events, stream parts).

    attrs's frozen ``__init__`` sets each field with ``object.__setattr__``, which looks the
    field's name up on the class every time; the slot's descriptor is what that lookup
    finds, so it is bound once here. Same parameters, defaults and converters; later writes
    are still refused. Fields with a validator or a factory default are refused here.
    """
    if hasattr(cls, "__attrs_pre_init__") or hasattr(cls, "__attrs_post_init__"):
        raise TypeError(f"quick_init: {cls.__qualname__} has an init hook")
    fields = attrs.fields(cls)
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    namespace: dict[str, Any] = {}
    for f in fields:
        if f.validator is not None or isinstance(f.default, _FACTORY) or not f.init:
            raise TypeError(f"quick_init: {cls.__qualname__}.{f.name} needs attrs's __init__")
        name, param = f.name, f.alias  # a private field's parameter has no underscore
        value = param
        if f.default is not attrs.NOTHING:
            namespace[f"_default_{name}"] = f.default
            param += f"=_default_{name}"
        (keyword if f.kw_only else positional).append(param)
        namespace[f"_set_{name}"] = getattr(cls, name).__set__
        if f.converter is not None:
            namespace[f"_convert_{name}"] = f.converter
            value = f"_convert_{name}({value})"
        body.append(f"    _set_{name}(self, {value})")
    params = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({params}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(compile(source, f"<quick_init {cls.__qualname__}>", "exec"), namespace)  # noqa: S102
    init = namespace["__init__"]
    generated: Any = cls.__dict__["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(generated.__annotations__)
    init.__doc__ = generated.__doc__
    setattr(cls, "__init__", init)  # noqa: B010 - a type checker refuses the plain form
    return cls


def stored_maker(cls: type[T]) -> Callable[..., T]:
    """A maker of ``cls`` (a frozen, slotted attrs class without a weakref slot, every field
    plain) taking every field positionally, in order, for the value types a step makes by
    the dozen.

    A frozen instance can only be filled through its slots' descriptors, a wrapped call
    per field (about a thousand instructions each). The maker fills an instance of a twin
    class with the same slots by plain stores and then makes it a ``cls``: the same object
    ``cls(...)`` builds, equal to it and as frozen. The class switch costs about as much as
    one descriptor call, so the gain grows with the fields: against :func:`quick_init`'s
    ``__init__``, 3,000 instructions instead of 3,500 for two fields, 3,400 instead of
    5,000 for four, 3,700 instead of 9,100 for ten. Checked once here, so a class it cannot
    serve fails at import.
    """
    fields = attrs.fields(cast("Any", cls))
    for f in fields:
        if f.validator is not None or f.converter is not None or not f.init:
            raise TypeError(f"stored_maker: {cls.__qualname__}.{f.name} needs attrs's __init__")
    slots: tuple[str, ...] = cls.__dict__.get("__slots__", ())
    if "__weakref__" in slots or "__dict__" in slots:
        # CPython refuses to switch the class of an instance with either.
        raise TypeError(f"stored_maker: {cls.__qualname__} has a weakref or dict slot")
    # The same bases: CPython switches classes only between the same slots on the same base.
    twin = type(f"_{cls.__name__}Stored", cls.__bases__, {"__slots__": slots})
    names = [f.name for f in fields]
    body = "".join(f"    o.{name} = {name}\n" for name in names)
    # Calling the twin, when neither it nor its bases construct anything of their own, makes
    # the empty instance without the argument tuple ``object.__new__(twin)`` packs.
    plain = all(getattr(twin, name) is getattr(object, name) for name in ("__new__", "__init__"))
    source = (
        f"def make({', '.join(names)}):\n    o = {'_twin()' if plain else '_new(_twin)'}\n"
        f"{body}    o.__class__ = _cls\n    return o\n"
    )
    namespace: dict[str, Any] = {"_new": object.__new__, "_twin": twin, "_cls": cls}
    exec(compile(source, f"<stored_maker {cls.__qualname__}>", "exec"), namespace)  # noqa: S102
    make: Callable[..., T] = namespace["make"]
    probe = tuple(object() for _ in names)
    if make(*probe) != cls(**{f.alias: v for f, v in zip(fields, probe, strict=True)}):
        raise TypeError(f"stored_maker: {cls.__qualname__} is not made alike")
    return make
