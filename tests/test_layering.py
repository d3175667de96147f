"""linmem's import graph: no circles between modules, no import from a higher layer.

Every module of ``linmem/`` is parsed with :mod:`ast`; its ``import`` and ``from ... import`` statements,
at module level and inside functions (relative ones resolved, ``from pkg import submodule`` read as an
import of the submodule), are the edges of a graph between modules. Each module belongs to the layer of
its top-level package (:data:`LAYERS`, lowest first); a module may import its own layer and those below.

``python tests/test_layering.py`` prints the circles and upward imports it finds and their counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "linmem"

#: Layers, lowest first: the top-level packages and modules of linmem in each. A module imports from its
#: own layer and the layers below, never from one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("settings",),
    ("ops",),
    ("layers",),
    ("models", "generation"),
    ("data", "tokenizer"),
    ("distributed",),
    ("train", "linearize"),
    ("eval", "bench"),
    ("demo",),
    ("cli",),
)

#: Imports left out of the circle check, each with why it stays: (importer, imported) -> reason.
DEFERRED: dict[tuple[str, str], str] = {
    ("linmem.models.config", "linmem.models"): "a LinmemConfig registers the Auto model classes when it is built "
                                               "(every Auto path to a model goes through a config), inside __init__; "
                                               "the model imports its config",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of linmem by dotted name (a package by its own name)."""
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """The dotted names ``name`` (at ``path``) imports anywhere in its body: a module, or a name of one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the linmem modules it imports (less :data:`DEFERRED`)."""
    found = modules()
    known = set(found)
    return {name: {target for target in imported_names(name, path, known)
                   if target in known and target != name and (name, target) not in DEFERRED}
            for name, path in found.items()}


def missing_imports() -> list[str]:
    """``importer -> name`` for every import of a linmem module that does not exist."""
    found = modules()
    known = set(found)
    return [f"{name} -> {target}" for name, path in found.items()
            for target in sorted(imported_names(name, path, known))
            if target.split(".")[0] == "linmem" and target not in known]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int:
    """The rank of ``module``'s layer in :data:`LAYERS` (the linmem package itself: -1, below all)."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    for rank, names in enumerate(LAYERS):
        if parts[1] in names:
            return rank
    raise AssertionError(f"{module} belongs to no layer of LAYERS: add linmem.{parts[1]} to one")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of a module from a higher layer."""
    return [f"{source} -> {target}" for source in sorted(graph) for target in sorted(graph[source])
            if layer(target) > layer(source)]


def test_every_linmem_import_exists() -> None:
    found = missing_imports()
    assert not found, "imports of modules that do not exist: " + "; ".join(found)


def test_deferred_imports_exist() -> None:
    graph = {name: imported_names(name, path, set(modules())) for name, path in modules().items()}
    stale = [pair for pair in DEFERRED if pair[1] not in graph.get(pair[0], set())]
    assert not stale, f"DEFERRED names imports that no longer exist: {stale}"


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_upward_imports() -> None:
    found = upward_imports(import_graph())
    assert not found, "imports from a higher layer: " + "; ".join(found)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed onto linmem's top-level packages and modules (``linmem.train``, ...)."""
    unit = lambda module: ".".join(module.split(".")[:2])  # noqa: E731
    collapsed: dict[str, set[str]] = {unit(name): set() for name in graph}
    for name, targets in graph.items():
        collapsed[unit(name)].update(unit(t) for t in targets if unit(t) != unit(name))
    return collapsed


if __name__ == "__main__":
    graph = import_graph()
    circles, upward, missing = cycles(graph), upward_imports(graph), missing_imports()
    packages = cycles(package_graph(graph))
    for component in circles:
        print("circle:", " <-> ".join(component))
    for edge in upward:
        print("upward:", edge)
    for edge in missing:
        print("missing:", edge)
    for component in packages:
        print("package circle:", " <-> ".join(component))
    print(f"{len(circles)} circles ({sum(map(len, circles))} modules), {len(upward)} upward imports, "
          f"{len(missing)} missing; between top-level packages: {len(packages)} circles "
          f"({sum(map(len, packages))} packages); deferred: {len(DEFERRED)}")
