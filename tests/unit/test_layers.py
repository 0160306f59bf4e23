"""The layer contract of docs/design.md's module map, read off the source:
every import of a shmloader module (at run time or for the type checker)
points to its own layer or one below, the worker side imports nothing of
the main side, and no import cycle exists anywhere in the package."""

import ast
import pathlib

import pytest

import shmloader

PACKAGE = pathlib.Path(shmloader.__file__).parent

# Bottom to top: a module may import its own layer and those before it.  The
# layers are the package's subpackages (and its few top-level modules); a new
# top-level module must be placed here (see test_every_module_has_a_layer).
LAYERS = {
    "ring and memory": {"_shm", "_errors"},  # bytes and ordering, no policy
    "worker side": {"_worker"},  # what runs in a worker, and what both sides exchange
    "features": {"_features", "shared_list"},  # the mechanisms behind the options
    "main side": {"_main", "dataloader"},  # the loader and its iterators
    "built on the loader": {"integrations", "compare", "bench"},
}


def _modules():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    found["_shm._ring"] = PACKAGE / "_shm" / "_ring.pyx"
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The shmloader modules `name` imports (relative or absolute)."""
    if path.suffix != ".py":
        return set()
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("shmloader"):
                module = node.module.removeprefix("shmloader").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}".lstrip(".")
                found.add(sub if sub in MODULES else module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shmloader."):
                    found.add(alias.name.removeprefix("shmloader."))
    found.discard(name)
    found.discard("")  # the package itself (its public names)
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer_of(name: str) -> int | None:
    top = name.split(".")[0]
    for i, members in enumerate(LAYERS.values()):
        if top in members:
            return i
    return None


def _cycles(graph):
    """Every strongly connected set of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_every_module_has_a_layer():
    assert [m for m in sorted(MODULES) if m and layer_of(m) is None] == []


def test_every_import_points_to_its_own_layer_or_below():
    names = list(LAYERS)
    upward = [
        f"{module} ({names[layer_of(module)]}) imports {other} ({names[layer_of(other)]})"
        for module, imported in sorted(GRAPH.items())
        if module  # (the package's __init__ names the public ones)
        for other in sorted(imported)
        if layer_of(other) > layer_of(module)
    ]
    assert upward == []


def test_the_contract_sees_the_imports():
    """The graph is read right: a check that finds nothing must be able to."""
    assert "_main._ring_memory" in GRAPH["_main._iter_ring"]
    assert "_shm._ring" in GRAPH["_main._iter_ring"]
    assert "_errors" in GRAPH["_main._iterator"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    names = ("_shm._ring", "_worker._loop", "_features._resume", "_main._iterator", "bench.plot")
    assert [layer_of(m) for m in names] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("_")))
def test_every_private_module_is_in_the_module_map(name):
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    path = MODULES[name].relative_to(PACKAGE.parent)
    where = f"{path.parent}/" if path.name == "__init__.py" else str(path)
    assert f"`{where}`" in design, f"{where} is missing from docs/design.md's module map"
