"""The opt-in compiled build (pyproject.toml's build hook): what its modules must not contain,
and, in the pass that runs the suite over it, that the package under test is compiled."""

from __future__ import annotations

import ast
import importlib
import os
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compiled_modules() -> list[str]:
    """The modules the compiled build compiles, as pyproject.toml names them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    hook = config["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"]
    return [path.removesuffix(".py").replace("/", ".") for path in hook["include"]]


def awaits_in_finally(source: str) -> list[int]:
    """Lines of an ``await`` (or ``async with``/``async for``) inside a ``finally`` block."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Try, ast.TryStar)):
            for statement in node.finalbody:
                for inner in ast.walk(statement):
                    if isinstance(inner, (ast.Await, ast.AsyncWith, ast.AsyncFor)):
                        lines.append(inner.lineno)
    return lines


def test_the_build_compiles_the_modules_a_step_runs_through() -> None:
    modules = compiled_modules()
    assert "agentloop._session" in modules and "agentloop._reply" in modules
    for name in modules:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


def test_no_compiled_module_awaits_in_finally() -> None:
    # mypyc compiles an await in ``finally`` so that, once an exception has passed through
    # it, every later call raises that exception again (mypyc/mypyc#1114): a retried model
    # call then never answers. ``except BaseException: await ...; raise`` compiles right.
    found = {
        name: lines
        for name in compiled_modules()
        if (lines := awaits_in_finally((ROOT / (name.replace(".", "/") + ".py")).read_text()))
    }
    assert not found, f"await inside finally in compiled modules (module: lines): {found}"


def test_the_check_finds_an_await_in_finally() -> None:
    source = "async def f():\n    try:\n        pass\n    finally:\n        await g()\n"
    assert awaits_in_finally(source) == [5]
    rewritten = (
        "async def f():\n    try:\n        pass\n    except BaseException:\n"
        "        await g()\n        raise\n    await g()\n"
    )
    assert awaits_in_finally(rewritten) == []


@pytest.mark.skipif(not os.environ.get("AGENTLOOP_EXPECT_COMPILED"),
                    reason="the pass over the compiled build sets AGENTLOOP_EXPECT_COMPILED")
def test_the_package_under_test_is_the_compiled_build() -> None:
    pure = [
        name for name in compiled_modules()
        if str(importlib.import_module(name).__file__).endswith(".py")
    ]
    assert not pure, f"expected the compiled build, but these modules are pure Python: {pure}"


def test_frozen_objects_compare_as_dicts_in_every_build() -> None:
    # A dict subclass compiled by mypyc no longer compares equal to another instance of
    # itself, so FrozenDict lives in a module the build leaves pure.
    from agentloop._json import FrozenDict, freeze

    assert "agentloop._frozen" not in compiled_modules()
    frozen, built = freeze({"type": "thinking"}), FrozenDict(type="thinking")
    assert frozen == built and hash(frozen) == hash(built) and built == {"type": "thinking"}
