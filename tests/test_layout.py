"""The package layout: the data flow model -> oracles -> probes -> decoders -> harness -> outputs -> jobs, no module
importing one of a later layer, no import circle (imports inside functions count); the production decoder's kernels
reached through the op table only (each kernel module imports what its allow-list names); the harness and the
studies never importing the production decoder (they judge any decoder)."""

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


PRODUCTION = "fidelity.decoders.production"
KERNELS = f"{PRODUCTION}.kernels"
# What every kernel module may import from the project: the Triton helpers and the op specs it shares with the
# emulation. Beyond them, by kernel module, the other kernel modules it may import, and why.
KERNEL_SHARED = {f"{KERNELS}._common", f"{PRODUCTION}.op_spec"}
KERNEL_ALLOWED = {
    "expert": {"act_quant"},  # the FP8 GEMM launch of its w1 / w3 / w2 projections
    "grouped_expert": {"act_quant"},  # the e4m3 activation quantizer's launch before its grouped GEMM
    "weight_gemv": {"act_quant"},  # ... and before the FP4 expert GEMV
    "sparse_attention": {"sparse_attention_ws", "sparse_attention_pair", "sparse_attention_ws_fp8kv"},  # its routes
    "sparse_attention_ws_fp8kv": {"sparse_attention_ws"},  # the warp-specialized pipeline's building blocks
    "indexer": {"indexer_ws"},  # its warp-specialized route
}
# Outside kernels/, the modules that may import kernel modules (the op table finds the rest by name), and which.
KERNEL_DOORS = {
    f"{PRODUCTION}.registry": {f"{KERNELS}._common"},  # device_transparent around every dispatched kernel
    f"{PRODUCTION}.topk": {f"{KERNELS}._common"},  # INTERPRET: the radix route also runs under the interpreter
}
# The harness and the studies judge any decoder: they import nothing of the production decoder (what they need of it
# comes through fidelity.decoders: default_decoder, indexer_scores, indexer_topk; faults through the switchboard).
JUDGES = ("fidelity.harness", "fidelity.studies")


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_kernel_modules_import_only_their_allow_list():
    wrong = []
    for m, targets in GRAPH.items():
        if not m.startswith(KERNELS + "."):
            continue
        allowed = KERNEL_SHARED | {f"{KERNELS}.{k}" for k in KERNEL_ALLOWED.get(m.removeprefix(KERNELS + "."), ())}
        wrong += [f"{m} imports {t}" for t in sorted(targets - allowed)]
    assert not wrong, "\n".join(wrong)


def test_only_the_op_table_imports_kernel_modules():
    wrong = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if not _under(m, (KERNELS,))
                   for t in targets if t.startswith(KERNELS + ".") and t not in KERNEL_DOORS.get(m, ()))
    assert not wrong, "\n".join(wrong)


def test_the_harness_and_the_studies_never_import_the_production_decoder():
    wrong = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _under(m, JUDGES)
                   for t in targets if _under(t, (PRODUCTION,)))
    assert not wrong, "\n".join(wrong)


def test_the_import_rules_see_a_side_door(monkeypatch):
    monkeypatch.setitem(GRAPH, f"{KERNELS}.take", GRAPH[f"{KERNELS}.take"] | {f"{KERNELS}.moe_sum"})
    monkeypatch.setitem(GRAPH, f"{PRODUCTION}.cache", GRAPH[f"{PRODUCTION}.cache"] | {f"{KERNELS}.take"})
    monkeypatch.setitem(GRAPH, "fidelity.harness.runner", GRAPH["fidelity.harness.runner"] | {f"{PRODUCTION}.model"})
    monkeypatch.setitem(GRAPH, "fidelity.studies.play", {f"{PRODUCTION}.decoder"})
    rules = ((test_kernel_modules_import_only_their_allow_list, ("kernels.take imports",)),
             (test_only_the_op_table_imports_kernel_modules, ("production.cache imports",)),
             (test_the_harness_and_the_studies_never_import_the_production_decoder,
              ("harness.runner imports", "studies.play imports")))
    for rule, culprits in rules:
        with pytest.raises(AssertionError) as found:
            rule()
        assert all(c in str(found.value) for c in culprits), str(found.value)
