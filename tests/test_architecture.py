"""The house's shape, held by its imports: no module of eyas imports itself back through others (every import
counted, lazy and type-only ones too), and the layers point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "eyas"


def module_imports() -> dict[str, set[str]]:
    """{module: eyas modules it imports}, module names dotted (``eyas.engine.scheduler``)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            targets |= {owner(n) for n in names if n.split(".")[0] == "eyas"} - {None, module}
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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


GRAPH = module_imports()


def test_no_import_circles():
    assert len(GRAPH) > 50  # the walk found the package
    assert circles(GRAPH) == []


def test_circles_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("lower, upper", [
    ("eyas.core", ("eyas.engine", "eyas.runner", "eyas.spec_decode", "eyas.llm", "eyas.server")),
    ("eyas.runner", ("eyas.engine", "eyas.llm", "eyas.server")),
    ("eyas.spec_decode", ("eyas.engine", "eyas.runner", "eyas.llm", "eyas.server", "eyas.jobs")),
    ("eyas.model", ("eyas.engine", "eyas.runner", "eyas.spec_decode", "eyas.llm", "eyas.server", "eyas.jobs")),
    ("eyas.kernels", ("eyas.model", "eyas.engine", "eyas.runner", "eyas.spec_decode")),
    ("eyas.engine", ("eyas.train", "eyas.jobs", "eyas.server")),
])
def test_layers_point_one_way(lower, upper):
    wrong = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if m == lower or m.startswith(lower + ".")
                   for t in targets if any(t == u or t.startswith(u + ".") for u in upper))
    assert not wrong, wrong
