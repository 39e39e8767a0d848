"""The package layout: the data flow model -> oracles -> probes -> decoders -> harness -> outputs -> jobs, no module
importing one of a later layer, no import circle (imports inside functions count), and the old module paths of
moved modules still import (one module object under both names)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke  # quick: part of the subset for iterating (-m smoke)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fidelity", "oracles", "probes")
# earliest first; a module may import from its own layer and the ones before it
LAYERS = (
    ("fidelity.model", "fidelity._version", "fidelity.atomic_write", "fidelity.progress"),
    ("oracles",),
    ("probes",),
    ("fidelity.decoders",),
    ("fidelity.harness",),
    ("fidelity.outputs",),
    ("fidelity.testing", "fidelity.train"),
    ("fidelity.job", "fidelity.studies", "fidelity.api", "fidelity.cli", "fidelity"),
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (``from pkg import submodule`` names the
    submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def _layer(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module}: in no layer of tests/test_layout.py"
    return best[0]


def test_every_import_points_to_the_same_layer_or_an_earlier_one():
    upward = sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
                    for m, targets in GRAPH.items() for t in targets if _layer(t) > _layer(m))
    assert not upward, "\n".join(upward)


def test_no_module_imports_itself_through_others():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                cycles.append(sorted([v, *comp]))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_circle_and_an_upward_import(monkeypatch):
    monkeypatch.setitem(GRAPH, "fidelity.model.config", GRAPH["fidelity.model.config"] | {"fidelity.harness.runner"})
    with pytest.raises(AssertionError, match="fidelity.model.config"):
        test_every_import_points_to_the_same_layer_or_an_earlier_one()
    with pytest.raises(AssertionError, match="fidelity.model.config"):
        test_no_module_imports_itself_through_others()
