"""Who may import whom: the layering written at the top of ``agentloop/__init__.py``.

The test reads every module's imports (those that run: ``if TYPE_CHECKING:`` blocks are
skipped) and fails when one reaches up a layer. For example, adding ``from ._runtime import
Runtime`` at the top of ``agentloop/_agent.py`` fails it with::

    agentloop/_agent.py imports _runtime (layer 'runtime' is above 'driver')

Plugins and the command line may import only the public modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {
    "agentloop", "agentloop.events", "agentloop.llm", "agentloop.testing",
    "agentloop.testing.strategies",
}

# From the top down; a module may import its own layer and any layer below it.
LAYERS: list[tuple[str, set[str]]] = [
    ("app", {"__main__", "_cli", "_cli_render", "_cli_screen"}),
    ("public", {"__init__", "events", "testing", "_catalog"}),
    ("runtime", {"_runtime"}),
    ("plugin", {"_plugin"}),
    ("context", {"_context"}),
    ("supervisor", {"_agents", "_subagents"}),
    ("driver", {"_agent"}),
    ("parts", {"_inbox", "_reply", "_run", "_scheduler"}),
    ("services", {
        "_session", "_llm", "_tools", "_settings", "_persistence", "_config", "_output",
        "_inputs",
    }),
    ("bus", {"_bus", "_schema"}),
    ("values", {"_log", "_events", "_model", "_json", "_errors", "_http", "_util"}),
]
LLM = "llm"  # the adapters: beside the core, over values only
RANK = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
LAYER_OF = {name: layer for layer, names in LAYERS for name in names}
LLM_MAY_IMPORT = {"_model", "_errors", "_http", "_json", "_util"}
TESTING = "testing"  # a package: every module in it sits in the public layer


def layer_name(path: Path) -> str:
    """The name ``path`` has in LAYERS: its stem, or ``testing`` for the testing package."""
    return TESTING if path.parent.name == TESTING else path.stem


def runtime_imports(path: Path) -> list[tuple[int, str | None, list[str]]]:
    """``(level, module, names)`` of every import that executes at import or call time."""
    found: list[tuple[int, str | None, list[str]]] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.extend((0, alias.name, []) for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            found.append((node.level, node.module, [a.name for a in node.names]))

    Visitor().visit(ast.parse(path.read_text()))
    return found


def core_targets(path: Path) -> list[str]:
    """The ``agentloop`` modules ``path`` (inside ``agentloop/``) imports, as short names."""
    in_llm = path.parent.name == "llm"
    in_testing = path.parent.name == TESTING
    out: list[str] = []
    for level, module, names in runtime_imports(path):
        if level == 0:
            if module and module.startswith("agentloop."):
                out.append(module.split(".")[1])
            continue
        if in_llm and level == 1:
            out.append(LLM)
            continue
        if in_testing and level == 1:
            out.append(TESTING)
            continue
        base = module.split(".")[0] if module else None
        out.extend([base] if base else names)
    return out


def core_modules() -> list[Path]:
    return sorted((ROOT / "agentloop").rglob("*.py"))


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_point_down(path: Path) -> None:
    if path.parent.name == "llm":
        bad = [t for t in core_targets(path) if t != LLM and t not in LLM_MAY_IMPORT]
        where = path.relative_to(ROOT)
        assert not bad, f"{where} imports {bad}: llm/ may use only {LLM_MAY_IMPORT}"
        return
    me = layer_name(path)
    assert me in RANK, f"{me} has no layer: add it to LAYERS here and in agentloop/__init__.py"
    for target in core_targets(path):
        if target in (LLM, me):
            continue
        assert target in RANK, f"{path.relative_to(ROOT)} imports {target}, which has no layer"
        assert RANK[target] >= RANK[me], (
            f"{path.relative_to(ROOT)} imports {target} (layer {LAYER_OF[target]!r} is above "
            f"{LAYER_OF[me]!r})"
        )


OUTSIDE = [
    *sorted((ROOT / "plugins").rglob("*.py")), *sorted((ROOT / "agentloop").glob("_cli*.py")),
]


@pytest.mark.parametrize("path", OUTSIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_and_the_command_line_use_only_public_modules(path: Path) -> None:
    is_cli = path.parent.name == "agentloop"
    for level, module, _ in runtime_imports(path):
        if level > 0:
            # A plugin's own modules; the command line's own (_cli*), never the core's.
            assert not is_cli or (module or "").startswith("_cli"), (
                f"{path.relative_to(ROOT)} uses a relative import of the core"
            )
            continue
        if module and module.split(".")[0] == "agentloop":
            assert module in PUBLIC, f"{path.relative_to(ROOT)} imports private {module}"


def test_the_layering_is_written_where_it_is_enforced() -> None:
    header = (ROOT / "agentloop" / "__init__.py").read_text()
    docs = (ROOT / "docs" / "architecture.md").read_text()
    for layer, _ in LAYERS:
        assert layer in header, f"agentloop/__init__.py does not name the layer {layer!r}"
    assert "## Layering" in docs
