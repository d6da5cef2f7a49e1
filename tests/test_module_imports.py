"""No two modules of kthrottle import each other, directly or through others:
every import, at module level or inside a function, read with ``ast``."""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "kthrottle"


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path, name, known):
    """The kthrottle modules ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from . import x`` may name a module x, else a name of base
            targets = [base + "." + alias.name if base + "." + alias.name in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # the deepest kthrottle module the import names
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: _imports(path, name, known) for name, path in paths.items()}


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph()
    assert "kthrottle.proxy.filter" in graph["kthrottle.proxy.filters.storage"]  # from ..filter
    assert "kthrottle.proxy.filters.storage" in graph["kthrottle.proxy.filters"]  # from . import
    assert "kthrottle.proxy.server" in graph["kthrottle.proxy"]  # a package's __init__


def test_no_two_modules_import_each_other():
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or through others):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_connection_knows_the_server_only_by_its_environment():
    graph = import_graph()
    assert "kthrottle.proxy.server" not in graph["kthrottle.proxy.connection"]
    for module in ("tls", "discovery", "acceptor"):
        assert "kthrottle.proxy.server" not in graph["kthrottle.proxy." + module], module
