"""The package's import graph, read from the source: no circles and no import from a higher layer
(models -> tree/verify/constrain -> drafting -> engine -> planner -> serve/bench/cli -> the package's front door).
Function-local imports count like module-level ones; only `if TYPE_CHECKING:` imports are left out."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specwood"

# Lowest first; a module belongs to the layer of its longest matching prefix. The prompt sets
# (bench.workload: data and their reader, no engine) sit at the bottom: the planner calibrates on them.
LAYERS: list[tuple[str, ...]] = [
    ("specwood.errors", "specwood.sampling", "specwood.version", "specwood.heap", "specwood.bench.workload"),
    ("specwood.models",),
    ("specwood.tree", "specwood.verify", "specwood.constrain"),
    ("specwood.drafting", "specwood.drafter_data"),
    ("specwood.engine", "specwood.methods"),
    ("specwood.planner",),
    ("specwood.serve", "specwood.bench", "specwood.cli", "specwood.train_drafter"),
    ("specwood",),
]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target.split(".")[0] != top:
                    continue
                while target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    graph[name].add(target)
    return graph


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) < 0] == []


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "specwood"
    (pkg / "models").mkdir(parents=True)
    (pkg / "engine").mkdir()
    for init in (pkg, pkg / "models", pkg / "engine"):
        (init / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from specwood.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from specwood.models.a import f\n")
    graph = import_graph(pkg)
    assert circles(graph) == [["specwood.engine.b", "specwood.models.a"]]
    assert upward_imports(graph) == ["specwood.models.a (layer 1) imports specwood.engine.b (layer 4)"]


@pytest.mark.parametrize("name", ["specwood.engine.api", "specwood.models.loader"])
def test_layers_are_assigned_by_longest_prefix(name):
    assert 0 < layer_of(name) < len(LAYERS) - 1
