"""The oracle against an implementation we did not write: transformers' ``DeepseekV4ForCausalLM`` (fp32).

Random tiny HF models (every parameter randomised, including those HF initialises to 0/1) are written
with ``save_pretrained``, read back with ``load_checkpoint`` and compared position by position.
"""

from __future__ import annotations

import pytest
import torch

from fidelity.model.config import ModelConfig
from fidelity.model.load import load_checkpoint
from fidelity.model.sites import Recorder
from oracles import OracleModel
from tests.hf_reference import random_hf_model

LOGIT_REL_TOL = 1e-4  # max relative error per position when top-k selects everything
HIDDEN_REL_TOL = 1e-5
NEAR_TIE = 1e-4  # relative gap between the k-th and (k+1)-th oracle score below which a swap is a near-tie

BASE = ModelConfig.preset("tiny").replace(vocab_size=512)
CONFIGS = {
    # the tiny default's schedule: 2 SWA, CSA/HCA interleaved, 3 hash layers, YaRN on, top-k >= entries
    "tiny-yarn-topk-all": (BASE.replace(index_topk=1024), 300),
    # V4-Pro-like: HCA bootstrap layers, no hash layers, YaRN off
    "pro-schedule-no-yarn": (BASE.replace(compress_ratios=(128, 128, 4, 128), n_layers=4, n_hash_layers=0,
                                          original_seq_len=0, index_topk=1024), 300),
    # CSA first, one hash layer, 2 index heads, odd top-2 of 4 experts
    "csa-first-hash1": (BASE.replace(compress_ratios=(4, 0, 128, 4), n_layers=4, n_hash_layers=1, index_n_heads=2,
                                     n_routed_experts=4, index_topk=1024), 261),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Max abs error per position over the max abs reference value per position."""
    return (a.double() - b.double()).abs().flatten(1).amax(-1) / b.double().abs().flatten(1).amax(-1)


def _pair(cfg: ModelConfig, tmp_path, seed: int = 0):
    hf = random_hf_model(cfg, seed)
    hf.save_pretrained(tmp_path)
    return hf, OracleModel(load_checkpoint(tmp_path))


def _hf_run(hf, ids: torch.Tensor):
    """HF logits [T, V], hidden states, and indexer top-k [T, k] per CSA layer (via forward hooks)."""
    topk: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            hooks.append(comp.indexer.register_forward_hook(
                lambda _m, _a, out, i=i: topk.__setitem__(i, out[0].clone())))
    with torch.no_grad():
        out = hf(ids[None], use_cache=False, output_hidden_states=True)
    for h in hooks:
        h.remove()
    return out.logits[0], [h[0] for h in out.hidden_states], topk


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_oracle_logits_and_hidden_states_match_transformers(name, tmp_path):
    cfg, length = CONFIGS[name]
    hf, oracle = _pair(cfg, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_hidden, _ = _hf_run(hf, ids)
    rec = Recorder([r"L\d+\.residual", "final"])
    logits = oracle.logits(ids, rec)
    err = _rel(logits, ref_logits)
    assert err.max() <= LOGIT_REL_TOL, f"{name}: logits max rel err {err.max():.2e} at position {err.argmax()}"
    for i in range(cfg.n_layers - 1):  # HF's last hidden state is the final norm output
        herr = _rel(rec.get(f"L{i}.residual"), ref_hidden[i + 1])
        assert herr.max() <= HIDDEN_REL_TOL, f"{name}: layer {i} streams max rel err {herr.max():.2e}"
    ferr = _rel(rec.get("final"), ref_hidden[-1])
    assert ferr.max() <= HIDDEN_REL_TOL


def test_indexer_topk_sets_match_transformers_except_near_ties(tmp_path):
    cfg = BASE.replace(index_topk=8)  # fewer than the 75 entries a 300-token prompt compresses to
    hf, oracle = _pair(cfg, tmp_path, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(4))
    ref_logits, _, ref_topk = _hf_run(hf, ids)
    rec = Recorder([r"L\d+\.indexer\.(topk|scores)"])
    logits = oracle.logits(ids, rec)
    csa = [i for i in range(cfg.n_layers) if cfg.ratio(i) == 4]
    assert sorted(ref_topk) == csa
    first_diff = len(ids)
    compared = 0
    for i in csa:  # a near-tie flip at position t changes every later layer from position t on: stop there
        ours, theirs, scores = rec.get(f"L{i}.indexer.topk"), ref_topk[i], rec.get(f"L{i}.indexer.scores")
        for t in range(first_diff):
            a = {int(j) for j in ours[t] if j >= 0}
            b = {int(j) for j in theirs[t] if j >= 0}
            compared += len(a)
            if a == b:
                continue
            first_diff = min(first_diff, t)
            kth = scores[t].sort(descending=True).values
            k = len(a)
            scale = kth[torch.isfinite(kth)].abs().max()  # exact ties (ReLU zeros) have gap 0
            gap = (kth[k - 1] - kth[k]).abs() / scale
            assert gap < NEAR_TIE, f"L{i} position {t}: top-k differs without a near-tie (gap {gap:.2e})"
    assert compared > 1000
    err = _rel(logits[:first_diff], ref_logits[:first_diff])
    assert err.max() <= LOGIT_REL_TOL


def test_oracle_decode_session_matches_transformers_cached_decode(tmp_path):
    cfg = BASE.replace(index_topk=1024)
    hf, oracle = _pair(cfg, tmp_path, seed=5)
    ids = torch.randint(0, cfg.vocab_size, (140,), generator=torch.Generator().manual_seed(6))
    session = oracle.session()
    ours = [session.prefill(ids[:125])[-1]] + [session.step(t) for t in ids[125:139]]
    with torch.no_grad():
        out = hf(ids[None, :125], use_cache=True)
        cache, theirs = out.cache, [out.logits[0, -1]]
        for t in range(125, 139):
            out = hf(ids[None, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            theirs.append(out.logits[0, -1])
    err = _rel(torch.stack(ours), torch.stack(theirs))
    assert err.max() <= LOGIT_REL_TOL


def test_oracle_fp32_and_fp64_agree_and_transformers_is_as_close_to_fp64(tmp_path):
    cfg = BASE.replace(index_topk=1024)
    hf, oracle32 = _pair(cfg, tmp_path, seed=7)
    oracle64 = OracleModel(oracle32.ckpt, torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (260,), generator=torch.Generator().manual_seed(8))
    ref = _hf_run(hf, ids)[0]
    exact = oracle64.logits(ids)
    ours = _rel(oracle32.logits(ids), exact).max()
    theirs = _rel(ref, exact).max()
    assert ours <= 1e-5 and theirs <= 1e-5
