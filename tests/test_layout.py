"""The import graph of posttrain's own packages: no circles, and the layers DESIGN.md draws.

Every import counts, at a module's top or inside a function (a deferred import still ties the
two modules together; it only hides the circle until the function runs), except those under
`if TYPE_CHECKING:`, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "tasks", "flows", "deployments")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the posttrain modules it imports (a name imported from a package that is a module
    of it counts as that module)."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (owner(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                for a in node.names:
                    dep = owner(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else owner(base)
                    if dep:
                        deps.add(dep)
        deps.discard(name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_detector_finds_a_circle_around_a_loop(tmp_path):
    for pkg, body in {"trainer": {"a": "from trainer import b\n", "b": "def f():\n    import trainer.c\n",
                                  "c": "from trainer.a import x\n", "d": "from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from trainer.e import y\n", "e": "import trainer.d\n"},
                      "tasks": {}, "flows": {}, "deployments": {}}.items():
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        for mod, text in body.items():
            (tmp_path / pkg / f"{mod}.py").write_text(text)
    assert circles(imports(modules(tmp_path))) == [["trainer.a", "trainer.b", "trainer.c"]]


def test_no_module_imports_one_that_imports_it_back():
    graph = imports(modules())
    assert len(graph) > 60 and "tasks.stages" in graph["tasks.runner"]
    found = circles(graph)
    assert not found, "import circles (each a set of modules that import each other around a loop): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_layers_point_down():
    """trainer/ imports nothing of tasks/, flows/ or deployments/; tasks/ nothing of flows/ (DESIGN.md)."""
    graph = imports(modules())
    up = {("trainer", "tasks"), ("trainer", "flows"), ("trainer", "deployments"), ("tasks", "flows")}
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if (m.split(".")[0], d.split(".")[0]) in up)
    assert not wrong, wrong
