"""The pair probes batched under ``torch.vmap`` (``site_pairs.PAIR_PROBES``: indexer recall, visible sets, routing,
residual norms) give every pair's own metrics: a real run with port bugs planted (so the sets differ and the
metrics are not all zeros) judged with its pairs batched and pair by pair writes the same table, bit for bit."""

from __future__ import annotations

import pandas as pd
import torch

import fidelity
from fidelity.api import plan_checkpoint
from fidelity.decoders.faults import inject
from fidelity.harness import site_pairs

KEYS = ["site", "layer", "metric", "step", "phase", "mode", "position"]
FAULTS = ("window-127", "topk-cap-half", "routing-bias-in-weights")


def _table(res) -> pd.DataFrame:
    df = pd.read_parquet(res.run_dir / "metrics.parquet")
    df = df[df["site"] != "memory"].drop(columns="run_id")  # allocator bytes differ run to run
    return df.sort_values(KEYS, kind="stable").reset_index(drop=True)


def test_pair_probes_batched_under_vmap_give_each_pairs_own_metrics(tmp_path, monkeypatch):
    plan = plan_checkpoint(None, preset="tiny", layers=4)
    runs, mapped, vmap = {}, [], torch.vmap
    monkeypatch.setattr(torch, "vmap", lambda fn: mapped.append(fn) or vmap(fn))
    with inject(*FAULTS):
        for label, least in (("batched", 2), ("pair by pair", 10**9)):
            monkeypatch.setattr(site_pairs, "VMAP_MIN_PAIRS", least)
            runs[label] = fidelity.run("production", plan, prompt=150, decode_steps=10, out=tmp_path,
                                       run_id=label.replace(" ", "-"), oracle_block=10)
            if label == "batched":
                assert len(mapped) > 10  # the batches did go through vmap
                mapped.clear()
    assert not mapped
    a, b = _table(runs["batched"]), _table(runs["pair by pair"])
    pd.testing.assert_frame_equal(a, b)
    probed = a[a["site"].str.contains(r"\.visible|\.topk|\.experts|\.residual") & (a["value"] != 0)]
    assert {"missing", "true_miss", "routing_agree", "rms", "ref_rms"} <= set(probed["metric"])
    assert runs["batched"].verdict != "PASS"
