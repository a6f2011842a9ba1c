"""The package layout the design notes describe: no import cycle inside the engine, and
the HTTP package reaches into the engine's private modules only where the design says.

Both read the sources (``ast``), every import statement included, at module level or
inside a function: a cycle through a deferred import is still a cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parent.parent
ENGINE = ROOT / "engine" / "trio_mlx"
HTTP = ROOT / "http" / "trio_mlx_http"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: frozenset[str] = frozenset()) -> Iterator[str]:
    """Every module an import statement in ``path`` names. ``from a import b`` names
    ``a.b`` when that is one of ``modules`` (a submodule), else ``a`` (a name in it)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in modules else node.module


def engine_graph() -> dict[str, set[str]]:
    """Engine module -> the engine modules it imports (the package's ``__init__`` is ``trio_mlx``)."""
    paths = {_module_name(p, ENGINE.parent): p for p in ENGINE.rglob("*.py")}
    modules = frozenset(paths)
    return {
        name: {other for other in _imports(path, modules) if other in paths and other != name}
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` as a path that ends where it starts, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for child in sorted(graph.get(node, ())):
            cycle = visit(child)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    return next((c for n in sorted(graph) if (c := visit(n))), None)


def test_find_cycle_finds_a_deferred_cycle_and_accepts_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_engine_package_has_no_import_cycle() -> None:
    graph = engine_graph()
    # The package's __init__ imports the modules whose names it re-exports; no module
    # imports the package back (that would be a cycle through it).
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or ())


def test_only_the_package_init_and_what_opens_engines_import_the_engine_module() -> None:
    graph = engine_graph()
    importers = sorted(
        name for name, imported in graph.items() if "trio_mlx._core.engine" in imported
    )
    assert importers == ["trio_mlx", "trio_mlx._core.opening", "trio_mlx._host.host"]


def _named_private_modules() -> set[str]:
    """The private engine modules ``design/http.md`` says the HTTP package imports."""
    note = (ROOT / "design" / "http.md").read_text()
    paragraph = note.split("private engine modules it imports:", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`(trio_mlx\._[\w.]+)`", paragraph))


def test_the_http_package_imports_only_the_private_engine_modules_the_design_names() -> None:
    allowed = _named_private_modules()
    assert allowed  # the note names them; an empty list means the paragraph moved
    engine = frozenset(engine_graph())
    private = re.compile(r"^trio_mlx\._[\w.]+$")
    found = {
        (path.name, module)
        for path in HTTP.rglob("*.py")
        for module in _imports(path, engine)
        if private.match(module)
    }
    assert {module for _, module in found} <= allowed, sorted(found)


def _room(module: str) -> str:
    """The room of an engine module: its sub-package (``trio_mlx._lanes``), else itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_engines_rooms_import_each_other_without_a_cycle() -> None:
    rooms: dict[str, set[str]] = {}
    for module, imported in engine_graph().items():
        here = _room(module)
        rooms.setdefault(here, set()).update(_room(m) for m in imported if _room(m) != here)
    assert {"trio_mlx._core", "trio_mlx._lanes", "trio_mlx._start"} <= set(rooms)
    assert find_cycle(rooms) is None, " -> ".join(find_cycle(rooms) or ())
