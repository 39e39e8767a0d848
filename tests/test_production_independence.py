"""The production path shares no numerical code with the oracle: no production module imports ``oracles``, and
its own RoPE frequencies and gate, written apart, agree with the oracle's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fidelity.decoders.production
from fidelity.decoders.production import ops
from fidelity.decoders.production.rope_freqs import rope_inv_freq
from fidelity.model.config import ModelConfig
from oracles.moe import gate as oracle_gate
from oracles.rope import inv_freq as oracle_inv_freq


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_production_module_imports_the_oracle():
    root = Path(fidelity.decoders.production.__file__).parent
    offenders = {str(p.relative_to(root)): sorted(m for m in _imported_modules(p) if m.split(".")[0] == "oracles")
                 for p in root.rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_kernel_knows_about_fault_injection():
    """Faults are planted in the emulation and the dispatch (``registry.implementation``), never in a kernel."""
    root = Path(fidelity.decoders.production.__file__).parent / "kernels"
    offenders = {p.name: m for p in root.rglob("*.py") for m in _imported_modules(p) if m.endswith(".faults")}
    assert offenders == {}


@pytest.mark.parametrize("preset", ["tiny", "flash", "pro"])
def test_production_rope_frequencies_equal_the_oracles_fp32_bit_for_bit(preset):
    cfg = ModelConfig.preset(preset)
    for ratio in {0, *cfg.compress_ratios}:
        assert torch.equal(rope_inv_freq(cfg, ratio), oracle_inv_freq(cfg, ratio, torch.float32)), ratio


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_production_gate_equals_the_oracle_gate(score_func):
    cfg = ModelConfig.preset("tiny").replace(score_func=score_func)
    g = torch.Generator().manual_seed(5)
    n, dim, e = 16, cfg.dim, cfg.n_routed_experts
    x, w, bias = torch.randn(n, dim, generator=g), torch.randn(e, dim, generator=g) / 16, torch.randn(e, generator=g)
    ids, tid2eid = torch.randint(0, 100, (n,), generator=g), torch.randint(0, e, (100, cfg.n_activated_experts))
    for b, table in ((bias, None), (None, None), (None, tid2eid)):
        got, want = ops.gate(x, w, b, table, ids, cfg), oracle_gate(x, w, b, table, ids, cfg)
        assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
