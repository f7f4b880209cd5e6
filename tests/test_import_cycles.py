"""No import cycle inside sdk/: every module's imports (top-level and inside functions, read with `ast`) form a
graph with no circle, so the pipeline's layers (docs/ARCHITECTURE.md) import downwards only.

An edge goes from a module to each colibri_sdk module it names: `from .x import y` names `x`, and `x.y` too when
`y` is a submodule; `import colibri_sdk.a.b` names `a.b`. A package's `__init__` is a module like any other, except
that a module's own enclosing packages are not edges: Python has imported them before the module runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "sdk"
PACKAGE = "colibri_sdk"


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports}, for every .py file under `root` (the package's folder)."""
    files = {_module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]  # the package a relative import starts from
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target] + [f"{target}.{alias.name}" for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name and not name.startswith(t + "."))
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected component of more than one
    module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first within the component)."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"component {sorted(component)} has no cycle through {start}")


def test_sdk_has_no_import_cycle():
    graph = import_graph(SDK, PACKAGE)
    assert len(graph) > 50, f"only {len(graph)} modules found under {SDK}"
    cycles = [" -> ".join(cycle) for cycle in find_cycles(graph)]
    assert cycles == [], "import cycles in sdk/:\n" + "\n".join(cycles)


def test_a_function_level_import_cycle_is_found_and_named(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text("import pkg.a\n")  # into the cycle, not part of it
    cycles = find_cycles(import_graph(pkg, "pkg"))
    assert cycles == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_the_four_former_pairs_are_each_one_way():
    graph = import_graph(SDK, PACKAGE)
    pairs = [("format.header_v2", "format.header"), ("convert.source", "convert.gguf_model"),
             ("deploy.agent.pointers", "deploy.agent.bundles"), ("runtime.runtime", "runtime.pipeline")]
    for user, used in pairs:
        assert f"{PACKAGE}.{used}" in graph[f"{PACKAGE}.{user}"], (user, used)
        assert f"{PACKAGE}.{user}" not in graph[f"{PACKAGE}.{used}"], (used, user)
