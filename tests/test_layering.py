"""The import graph of the project's packages, read from their source with ``ast`` (nothing is
imported): no import circles, and the layers of CONTRIBUTING.md (hlo_tools and solvers below
kiwi_jax, solvers free of jax, experiments on top of everything).

An import inside a function body is an edge of its own kind: it runs when the function is
called, so it hides a circle from the import system but not from the design. The first cycle
test reads only the imports that run when a module is imported; the second reports every
function-level import that closes a circle.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kiwi_jax", "hlo_tools", "solvers", "experiments")
JAX_FAMILY = ("jax", "jaxlib", "flax", "optax")


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's dependency of a project module on another module."""

    importer: str
    """Dotted name of the importing project module."""
    target: str
    """Dotted name of the imported module: a project module, or an outside one as written."""
    path: str
    """The importer's file, relative to the scanned root."""
    line: int
    """Line of the import statement."""
    function: str | None
    """Qualified name of the enclosing function for an import in a function body; None for an
    import that runs when the module is imported (module body, class body, ``try``, ``if``)."""

    def site(self) -> str:
        where = f"{self.path}:{self.line}"
        return where if self.function is None else f"{where}, in {self.function}()"


def project_modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every ``.py`` file of the packages."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    """The imports of one module, resolved against the set of project modules."""

    def __init__(self, module: str, is_package: bool, path: str, modules):
        self.module, self.is_package, self.path, self.modules = module, is_package, path, modules
        self.roots = {m.split(".")[0] for m in modules}
        self.scope: list[str] = []       # enclosing classes and functions, outermost first
        self.in_function = 0
        self.project: list[Import] = []
        self.outside: list[Import] = []

    def _nested(self, node, is_function: bool):
        self.scope.append(node.name)
        self.in_function += is_function
        self.generic_visit(node)
        self.in_function -= is_function
        self.scope.pop()

    def visit_FunctionDef(self, node):
        self._nested(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._nested(node, False)

    def visit_If(self, node):
        if _is_type_checking(node.test):         # never runs: not an import
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _record(self, target: str, node: ast.stmt, list_: list[Import]):
        function = ".".join(self.scope) if self.in_function else None
        list_.append(Import(self.module, target, self.path, node.lineno, function))

    def _add(self, name: str, node: ast.stmt, used: bool):
        """Record the modules that importing ``name`` runs: the packages on its dotted path and
        ``name`` itself. The importer's own packages are already running when it is imported,
        so they are no dependency, unless ``used`` says the statement takes names from that very
        module (``import pkg`` or ``from pkg import attr`` inside ``pkg``)."""
        if name.split(".")[0] not in self.roots:
            self._record(name, node, self.outside)
            return
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            own = self.module == prefix or self.module.startswith(prefix + ".")
            if prefix in self.modules and (not own or (used and i == len(parts))):
                self._record(prefix, node, self.project)

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node, used=True)

    def visit_ImportFrom(self, node):
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package = package[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module
        submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in self.modules]
        self._add(base, node, used=len(submodules) < len(node.names))
        for name in submodules:
            self._add(name, node, used=True)


@dataclasses.dataclass(frozen=True)
class ImportGraph:
    """Every import between the project's modules, and every import of an outside module."""

    modules: tuple[str, ...]
    """The project's modules, sorted."""
    imports: tuple[Import, ...]
    """Imports of project modules (several per edge when a module imports another twice)."""
    outside: tuple[Import, ...]
    """Imports of modules outside the project (jax, numpy, the standard library, ...)."""

    def edges(self, module_level_only: bool) -> dict[tuple[str, str], list[Import]]:
        """(importer, imported) -> the import statements behind it, module-level ones first."""
        edges: dict[tuple[str, str], list[Import]] = collections.defaultdict(list)
        for imp in sorted(self.imports, key=lambda i: (i.function is not None, i.path, i.line)):
            if imp.function is None or not module_level_only:
                edges[imp.importer, imp.target].append(imp)
        return dict(edges)


def read_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> ImportGraph:
    """Parse every module of ``packages`` under ``root`` and collect its imports."""
    modules = project_modules(root, packages)
    project, outside = [], []
    for module, path in modules.items():
        collector = _Collector(module, path.name == "__init__.py",
                               path.relative_to(root).as_posix(), modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        project += collector.project
        outside += collector.outside
    return ImportGraph(tuple(sorted(modules)), tuple(project), tuple(outside))


def strongly_connected(nodes, edges) -> list[list[str]]:
    """Tarjan's strongly connected components of the directed graph (nodes, edges).

    References: R. Tarjan, "Depth-first search and linear graph algorithms", SIAM J. Comput.
    1(2), 1972.
    """
    successors = collections.defaultdict(list)
    for u, v in edges:
        successors[u].append(v)
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(u):
        index[u] = low[u] = len(index)
        stack.append(u)
        on_stack.add(u)
        for v in successors[u]:
            if v not in index:
                visit(v)
                low[u] = min(low[u], low[v])
            elif v in on_stack:
                low[u] = min(low[u], index[v])
        if low[u] == index[u]:
            component = []
            while True:
                v = stack.pop()
                on_stack.discard(v)
                component.append(v)
                if v == u:
                    break
            components.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return components


def _shortest_path(edges, start: str, goal: str) -> list[str]:
    """Nodes of a shortest path from ``start`` to ``goal`` (breadth-first; ties by name)."""
    successors = collections.defaultdict(list)
    for u, v in sorted(edges):
        successors[u].append(v)
    parent, frontier = {start: None}, collections.deque([start])
    while frontier:
        u = frontier.popleft()
        if u == goal:
            break
        for v in successors[u]:
            if v not in parent:
                parent[v] = u
                frontier.append(v)
    path = [goal]
    while path[-1] != start:
        path.append(parent[path[-1]])
    return path[::-1]


def circles(graph: ImportGraph, module_level_only: bool) -> list[tuple[str, ...]]:
    """The import circles of the graph, one per import edge that lies on a circle: that edge
    followed by a shortest way back. With ``module_level_only`` the graph has only the imports
    that run when a module is imported; without it, every import counts and only circles closed
    by an edge made of function-level imports alone are reported (the others are module-level
    circles). Each circle is rotated to start at its smallest module, and listed once."""
    edges = graph.edges(module_level_only)
    component_of = {}
    for k, component in enumerate(strongly_connected(graph.modules, edges)):
        for module in component:
            component_of[module] = k
    found = set()
    for (u, v), imports in edges.items():
        if component_of[u] != component_of[v]:
            continue
        if not module_level_only and imports[0].function is None:
            continue
        cycle = [u] + (_shortest_path(edges, v, u) if u != v else [u])
        ring = cycle[:-1]
        k = ring.index(min(ring))
        ring = ring[k:] + ring[:k]
        found.add(tuple(ring + ring[:1]))
    return sorted(found, key=lambda c: (len(c), c))


def describe(graph: ImportGraph, cycles, module_level_only: bool) -> str:
    """One block per circle: the modules, then the import statement behind each step."""
    edges = graph.edges(module_level_only)
    blocks = []
    for cycle in cycles:
        steps = [f"    {u} -> {v}: {edges[u, v][0].site()}" for u, v in zip(cycle, cycle[1:])]
        blocks.append("  " + " -> ".join(cycle) + "\n" + "\n".join(steps))
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return read_graph()


def test_no_import_circle_among_module_level_imports(graph):
    found = circles(graph, module_level_only=True)
    assert not found, ("import circles among the imports that run when a module is imported "
                       "(move the shared code into a module both can import, or invert one "
                       "import):\n" + describe(graph, found, True))


def test_no_function_level_import_closes_a_circle(graph):
    found = circles(graph, module_level_only=False)
    assert not found, ("import circles closed by an import inside a function (it only hides "
                       "the circle from the import system; move the shared code so the "
                       "dependency runs one way):\n" + describe(graph, found, False))


@pytest.mark.parametrize("lower, upper", [
    ("hlo_tools", ("kiwi_jax", "experiments")),
    ("solvers", ("kiwi_jax", "experiments")),
    ("kiwi_jax", ("experiments",)),
])
def test_lower_layer_imports_nothing_from_above(graph, lower, upper):
    wrong = [imp for imp in graph.imports if imp.importer.split(".")[0] == lower
             and imp.target.split(".")[0] in upper]
    assert not wrong, f"{lower} must not import from {', '.join(upper)}:\n" + "\n".join(
        f"  {imp.importer} imports {imp.target}: {imp.site()}" for imp in wrong)


def test_solvers_reach_no_jax(graph):
    # Every project module that importing or calling solvers can load, with the path to it.
    edges = graph.edges(module_level_only=False)
    reached = {m: [m] for m in graph.modules if m.split(".")[0] == "solvers"}
    frontier = collections.deque(sorted(reached))
    while frontier:
        u = frontier.popleft()
        for (a, b) in sorted(edges):
            if a == u and b not in reached:
                reached[b] = reached[u] + [b]
                frontier.append(b)
    wrong = [imp for imp in graph.outside
             if imp.importer in reached and imp.target.split(".")[0] in JAX_FAMILY]
    assert not wrong, "solvers must run without jax, flax or optax:\n" + "\n".join(
        f"  {' -> '.join(reached[imp.importer])} imports {imp.target}: {imp.site()}"
        for imp in wrong)


# --- the reader and the circle finder on a small package with known answers ----------------

_TOY = {
    "pkg/__init__.py": "from pkg.a import f\nfrom pkg import c\n",
    "pkg/a.py": "import os\nfrom . import b\n\ndef f():\n    from pkg.c import g\n    return g\n",
    "pkg/b.py": "import pkg.a\nimport jax.numpy as jnp\n",
    "pkg/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
                 "class C:\n    import pkg.d\n    def m(self):\n        from .d import h\n"),
    "pkg/d.py": "import pkg\n",
    "other/__init__.py": "",
    "other/e.py": "from pkg.b import jnp\n",
}


@pytest.fixture
def toy(tmp_path) -> ImportGraph:
    for name, source in _TOY.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(source))
    return read_graph(tmp_path, ("pkg", "other"))


def test_reader_resolves_relative_submodule_and_function_imports(toy):
    found = {(i.importer, i.target, i.line, i.function) for i in toy.imports}
    assert found == {
        ("pkg", "pkg.a", 1, None),
        ("pkg", "pkg.c", 2, None),                       # from pkg import <submodule>
        ("pkg.a", "pkg.b", 2, None),                     # relative
        ("pkg.a", "pkg.c", 5, "f"),
        ("pkg.b", "pkg.a", 1, None),                     # pkg itself is already running
        ("pkg.c", "pkg.d", 5, None),                     # class bodies run on import
        ("pkg.c", "pkg.d", 7, "C.m"),                    # TYPE_CHECKING import skipped
        ("pkg.d", "pkg", 1, None),                       # takes names from its own package
        ("other.e", "pkg", 1, None),                     # runs pkg/__init__ first
        ("other.e", "pkg.b", 1, None),
    }
    assert {(i.importer, i.target) for i in toy.outside} == {
        ("pkg.a", "os"), ("pkg.b", "jax.numpy"), ("pkg.c", "typing")}


def test_circles_are_found_and_printed_with_their_import_lines(toy):
    assert circles(toy, module_level_only=True) == [
        ("pkg.a", "pkg.b", "pkg.a"),
        ("pkg", "pkg.c", "pkg.d", "pkg"),
    ]
    assert circles(toy, module_level_only=False) == [("pkg", "pkg.a", "pkg.c", "pkg.d", "pkg")]
    text = describe(toy, circles(toy, module_level_only=False), False)
    assert "pkg.a -> pkg.c: pkg/a.py:5, in f()" in text
    assert "pkg.d -> pkg: pkg/d.py:1" in text
    assert strongly_connected(["x", "y", "z"], [("x", "y"), ("y", "x"), ("y", "z")]) == [
        ["z"], ["x", "y"]]


def test_the_project_graph_is_read(graph):
    edges = graph.edges(module_level_only=True)
    assert ("kiwi_jax", "kiwi_jax.optimize") in edges
    assert ("solvers", "solvers.solve") in edges
    assert any(imp.importer == "hlo_tools.lower" and imp.target == "jax" for imp in graph.outside)
