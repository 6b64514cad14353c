"""Who may import whom: the layering written at the top of ``agentloop/__init__.py``.

The test reads every import of every module, at module level, inside functions and under
``if TYPE_CHECKING:``, and resolves each to the module it names (``from agentloop import
_runtime`` is ``_runtime``; ``import agentloop`` and ``from agentloop import Agent`` are the
public layer). It fails when a module reaches up a layer. For example, adding ``from ._runtime
import open_runtime`` inside a function of ``agentloop/_agent.py`` fails it with::

    agentloop/_agent.py imports _runtime (layer 'runtime' is above 'driver')

A type-only import may point up only where ``UPWARD_TYPE_ONLY`` lists it (a list that can only
shrink: a lower layer that must name a higher type declares a ``Protocol`` of its own). The core
never imports a plugin; ``llm/`` uses values only; plugins and the command line import only the
public modules, and no private name of them (the command line's own ``_cli*`` modules aside).
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
    ("app", {"__main__", "_cli", "_cli_render", "_cli_screen", "_cli_agents", "_cli_mcp_serve",
             "_cli_acp", "_cli_ui", "_cli_main", "_cli_serve", "_cli_tail"}),
    ("public", {"__init__", "events", "testing", "_catalog", "_front"}),
    ("runtime", {"_runtime"}),
    ("plugin", {"_plugin"}),
    ("context", {"_context"}),
    ("supervisor", {"_agents", "_subagents"}),
    ("driver", {"_agent"}),
    ("parts", {
        "_inbox", "_reply", "_run", "_scheduler", "_request", "_lifecycle", "_approvals", "_tail",
    }),
    ("services", {
        "_services", "_session", "_llm", "_tools", "_settings", "_persistence", "_config",
        "_output", "_inputs",
    }),
    ("bus", {"_bus", "_schema", "_pydantic", "_limits", "_progress", "_report"}),
    ("values", {"_log", "_events", "_model", "_json", "_frozen", "_errors", "_http", "_util",
                "_prices"}),
]
LLM = "llm"  # the adapters: beside the core, over values only
RANK = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
LAYER_OF = {name: layer for layer, names in LAYERS for name in names}
LLM_MAY_IMPORT = {"_model", "_errors", "_http", "_json", "_util"}
TESTING = "testing"  # a package: every module in it sits in the public layer
MODULES = {p.stem for p in (ROOT / "agentloop").glob("*.py")} | {LLM, TESTING}

# Type-only imports that point up a layer, each with why it cannot name a Protocol instead.
# This list may only shrink.
UPWARD_TYPE_ONLY: set[tuple[str, str]] = set()

Import = tuple[int, str | None, list[str], bool]  # level, module, names, type-only


def imports(path: Path) -> list[Import]:
    """Every import of ``path``, with whether it is type-only (under ``TYPE_CHECKING``)."""
    found: list[Import] = []

    class Visitor(ast.NodeVisitor):
        type_only = False

        def visit_If(self, node: ast.If) -> None:
            test = node.test
            checking = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            )
            if not checking:
                self.generic_visit(node)
                return
            before, self.type_only = self.type_only, True
            for child in node.body:
                self.visit(child)
            self.type_only = before
            for child in node.orelse:
                self.visit(child)

        def visit_Import(self, node: ast.Import) -> None:
            found.extend((0, alias.name, [], self.type_only) for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            found.append((node.level, node.module, [a.name for a in node.names], self.type_only))

    Visitor().visit(ast.parse(path.read_text()))
    return found


def _package_names(names: list[str]) -> list[str]:
    # ``from agentloop import _runtime`` names a module; ``from agentloop import Agent`` the
    # public package itself.
    return [n if n in MODULES else "__init__" for n in names]


def targets(path: Path, level: int, module: str | None, names: list[str]) -> list[str]:
    """The ``agentloop`` modules one import of ``path`` names, as short names."""
    in_pkg = path.parent.name in (LLM, TESTING)
    if level == 0:
        if module == "agentloop":
            return _package_names(names) if names else ["__init__"]
        if module and module.startswith("agentloop."):
            return [module.split(".")[1]]
        return []
    if in_pkg and level == 1:
        return [path.parent.name]  # within llm/ or testing/
    if module:
        return [module.split(".")[0]]
    return _package_names(names)


def core_modules() -> list[Path]:
    return sorted((ROOT / "agentloop").rglob("*.py"))


def layer_name(path: Path) -> str:
    """The name ``path`` has in LAYERS: its stem, or ``testing`` for the testing package."""
    return TESTING if path.parent.name == TESTING else path.stem


def upward(path: Path, *, type_only: bool, rel: Path | None = None) -> list[str]:
    """The imports of ``path`` (type-only or executing ones) that point up a layer; ``rel``
    is where it stands in the repository (a probe's copy stands elsewhere)."""
    where = rel or path.relative_to(ROOT)
    me = layer_name(where)
    out: list[str] = []
    for level, module, names, is_type_only in imports(path):
        if is_type_only != type_only:
            continue
        for target in targets(where, level, module, names):
            if target in (LLM, me):
                continue
            assert target in RANK, f"{where} imports {target}, which has no layer"
            if RANK[target] < RANK[me]:
                out.append(
                    f"{where} imports {target} (layer {LAYER_OF[target]!r} is above "
                    f"{LAYER_OF[me]!r})"
                )
    return out


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_point_down(path: Path) -> None:
    where = path.relative_to(ROOT)
    if path.parent.name == LLM:
        bad = [
            t for level, module, names, _ in imports(path)
            for t in targets(path, level, module, names) if t != LLM and t not in LLM_MAY_IMPORT
        ]
        assert not bad, f"{where} imports {bad}: llm/ may use only {LLM_MAY_IMPORT}"
        return
    assert layer_name(path) in RANK, (
        f"{layer_name(path)} has no layer: add it to LAYERS here and in agentloop/__init__.py"
    )
    bad = upward(path, type_only=False)
    assert not bad, bad[0]


def test_upward_type_only_imports_are_few_and_listed() -> None:
    found = {
        (str(path.relative_to(ROOT)), line.split(" imports ")[1].split(" ")[0])
        for path in core_modules() if path.parent.name != LLM
        for line in upward(path, type_only=True)
    }
    assert found <= UPWARD_TYPE_ONLY, f"new upward type-only imports: {found - UPWARD_TYPE_ONLY}"
    assert len(UPWARD_TYPE_ONLY) <= 2
    assert found >= UPWARD_TYPE_ONLY, (
        f"gone, so drop them from UPWARD_TYPE_ONLY: {UPWARD_TYPE_ONLY - found}"
    )


@pytest.mark.parametrize(
    "path", [p for p in core_modules() if layer_name(p) != "__main__" and
             not p.name.startswith("_cli")],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_core_never_imports_a_plugin(path: Path) -> None:
    for _, module, _, _ in imports(path):
        assert not (module or "").startswith("agentloop_"), (
            f"{path.relative_to(ROOT)} imports the plugin {module}: plugins build on the core"
        )


OUTSIDE = [
    *sorted((ROOT / "plugins").rglob("*.py")), *sorted((ROOT / "agentloop").glob("_cli*.py")),
]


def outside_violations(path: Path, rel: Path | None = None) -> list[str]:
    """What a plugin or command-line module imports of the core that is not public."""
    where = rel or path.relative_to(ROOT)
    is_cli = where.parent.name == "agentloop"
    bad: list[str] = []
    for level, module, names, _ in imports(path):
        if level > 0:
            # A plugin's own modules; the command line's own (_cli*), never the core's.
            if is_cli and not (module or "").startswith("_cli"):
                bad.append(f"{where} uses a relative import of the core ({module or names})")
            continue
        if not module or module.split(".")[0] != "agentloop":
            continue
        if module not in PUBLIC:
            bad.append(f"{where} imports private {module}")
        private = [n for n in names if n.startswith("_") and not n.endswith("__")]
        if private:
            bad.append(f"{where} imports private names {private} from {module}")
    return bad


@pytest.mark.parametrize("path", OUTSIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_and_the_command_line_use_only_public_modules(path: Path) -> None:
    bad = outside_violations(path)
    assert not bad, bad[0]


def import_graph() -> dict[str, set[str]]:
    """Every import among ``agentloop/`` modules (``llm/`` and ``testing/`` as one node each),
    type-only and function-local ones included."""
    graph: dict[str, set[str]] = {}
    for path in core_modules():
        node = path.parent.name if path.parent.name in (LLM, TESTING) else path.stem
        edges = graph.setdefault(node, set())
        for level, module, names, _ in imports(path):
            edges.update(t for t in targets(path, level, module, names) if t != node)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_agentloop_modules() -> None:
    assert cycles(import_graph()) == []


# --- the test fails for what it forbids -------------------------------------------------------

PROBES = [
    # (file, line appended, which check)
    ("agentloop/_agent.py", "def _probe():\n    from ._runtime import open_runtime\n", "down"),
    ("agentloop/_agent.py", "def _probe():\n    from agentloop import open_runtime\n", "down"),
    ("agentloop/_json.py", "def _probe():\n    import agentloop\n", "down"),
    ("agentloop/_scheduler.py", "from . import _agent\n", "down"),
    ("agentloop/_model.py", "if TYPE_CHECKING:\n    from ._agent import Agent\n", "type"),
    ("agentloop/_session.py", "def _probe():\n    import agentloop_sqlite\n", "plugin"),
    ("plugins/agentloop_budget/__init__.py", "from agentloop import _runtime\n", "outside"),
    ("plugins/agentloop_budget/__init__.py", "import agentloop._runtime\n", "outside"),
    ("plugins/agentloop_budget/__init__.py", "from agentloop.llm import _wire\n", "outside"),
    ("plugins/agentloop_budget/__init__.py", "from agentloop._agent import Agent\n", "outside"),
    ("agentloop/_cli.py", "from agentloop import _runtime\n", "outside"),
    ("agentloop/_cli.py", "from ._agent import Agent\n", "outside"),
    ("agentloop/llm/_wire.py", "def _probe():\n    from agentloop import Agent\n", "llm"),
    ("agentloop/llm/_wire.py", "def _probe():\n    from .._agent import Agent\n", "llm"),
]


@pytest.mark.parametrize(
    ("file", "line", "check"), PROBES, ids=[f"{p[0]}:{p[1]!r}" for p in PROBES]
)
def test_each_forbidden_import_is_caught(tmp_path: Path, file: str, line: str, check: str) -> None:
    source = ROOT / file
    probe = tmp_path / file
    probe.parent.mkdir(parents=True)
    probe.write_text(source.read_text() + "\n" + line)
    rel = Path(file)
    if check == "down":
        bad = upward(probe, type_only=False, rel=rel)
    elif check == "type":
        bad = [b for b in upward(probe, type_only=True, rel=rel)
               if (file, b.split(" imports ")[1].split(" ")[0]) not in UPWARD_TYPE_ONLY]
    elif check == "plugin":
        bad = [m for _, m, _, _ in imports(probe) if (m or "").startswith("agentloop_")]
    elif check == "outside":
        bad = outside_violations(probe, rel)
    else:
        bad = [
            t for level, module, names, _ in imports(probe)
            for t in targets(rel, level, module, names) if t != LLM and t not in LLM_MAY_IMPORT
        ]
    assert bad, f"{line!r} in {file} was not caught"


def test_the_layering_is_written_where_it_is_enforced() -> None:
    header = (ROOT / "agentloop" / "__init__.py").read_text()
    docs = (ROOT / "docs" / "architecture.md").read_text()
    for layer, names in LAYERS:
        row = next((ln for ln in header.splitlines() if ln.strip().startswith(layer + " ")), "")
        assert row, f"agentloop/__init__.py does not name the layer {layer!r}"
        for name in names - {"__init__", "__main__", "events", "testing", "_cli_render",
                             "_cli_screen"}:
            listed = name in row or (name.startswith("_cli") and "_cli*" in row)
            assert listed, f"agentloop/__init__.py's {layer!r} row does not list {name}"
            assert name in docs or name.startswith("_cli"), (
                f"docs/architecture.md does not mention {name}"
            )
    assert "## Layering" in docs
