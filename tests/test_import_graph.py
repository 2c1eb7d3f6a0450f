"""The package's import graph has no cycles.

A circle of imports works only as long as every module in it happens to be imported in an order
where the names it needs already exist; a function-level import hides the circle from a reader
but not from the interpreter, so those count too. Imports under `if TYPE_CHECKING:` never run and
do not count.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import loraplex

PACKAGE_DIR = Path(loraplex.__file__).parent


def _module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root` (a package's __init__.py is
    the package's own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in the tree (functions and methods included) except in the
    body of an `if TYPE_CHECKING:` (its else branch does run)."""
    found = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same package: line of the first such import}."""
    modules = _module_names(root, package)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    # relative to the importing module's package (a package's __init__ is its own)
                    anchor = name.split(".")
                    drop = node.level - 1 if is_package else node.level
                    anchor = anchor[: len(anchor) - drop]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component that has one, as a chain
    of module names that starts and ends on the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        # iterative Tarjan: a deep import chain must not hit the recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    cycles = []
    for component in components:
        members = set(component)
        first = component[0]
        # breadth-first from `first` back to itself, inside the component
        parents: dict[str, str] = {}
        queue = deque([first])
        end = None
        while queue and end is None:
            node = queue.popleft()
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == first:
                    end = node
                    break
                if child not in parents:
                    parents[child] = node
                    queue.append(child)
        chain = [first]
        node = end
        while node != first:
            chain.append(node)
            node = parents[node]
        chain.append(first)
        chain.reverse()
        cycles.append(chain)
    return cycles


def _describe(graph: dict[str, dict[str, int]], chain: list[str]) -> str:
    steps = [chain[0]]
    for a, b in zip(chain, chain[1:], strict=False):
        steps.append(f"  -> {b}  (line {graph[a][b]} of {a})")
    return "\n".join(steps)


def test_package_imports_are_acyclic() -> None:
    graph = import_graph(PACKAGE_DIR, "loraplex")
    # the walk found the package: a few edges every version of it has
    assert "loraplex.engine.scheduler" in graph["loraplex.engine.engine"]
    assert "loraplex.llm" in graph["loraplex"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in loraplex:\n\n" + "\n\n".join(_describe(graph, c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_graph_counts_the_imports_that_run(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "from .a import x\n",
            "a.py": "x = 1\n",
            "b.py": "def f():\n    from pkg import sub\n",
            "c.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    import pkg.a\n"
                "else:\n"
                "    import pkg.b\n"
            ),
            "sub/__init__.py": "from . import leaf\nfrom .. import a\n",
            "sub/leaf.py": "from ..sub import leaf2\nfrom pkg.sub import name_in_init\nimport os\n",
            "sub/leaf2.py": "import pkg.sub\nimport typing\nif typing.TYPE_CHECKING:\n    import pkg.c\n",
        },
    )
    assert import_graph(tmp_path, "pkg") == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {},
        "pkg.b": {"pkg.sub": 2},  # a subpackage by name: its __init__
        "pkg.c": {"pkg.b": 5},  # the else branch of TYPE_CHECKING runs
        "pkg.sub": {"pkg.sub.leaf": 1, "pkg.a": 2},
        "pkg.sub.leaf": {"pkg.sub.leaf2": 1, "pkg.sub": 2},
        "pkg.sub.leaf2": {"pkg.sub": 1},
    }


def test_cycles_are_reported_as_chains() -> None:
    graph = {
        "p.a": {"p.b": 1},
        "p.b": {"p.c": 1, "p.d": 1},
        "p.c": {"p.a": 1},
        "p.d": {},
        "p.e": {"p.f": 1},
        "p.f": {"p.e": 1},
    }
    assert find_cycles(graph) == [["p.a", "p.b", "p.c", "p.a"], ["p.e", "p.f", "p.e"]]
    assert find_cycles({"p.a": {"p.b": 1}, "p.b": {}}) == []
