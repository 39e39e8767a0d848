"""Decode calls and short prefill chunks judged in blocks (``RunSpec.oracle_block``: the oracle over a block as one
pass in every mode that does not pick the tokens, every call's probes in one batch) give the metric table of calls
judged one at a time: the same rows, values equal up to the oracle's GEMM rounding over more rows, the same
verdict."""

from __future__ import annotations

import pandas as pd
import pytest

import fidelity
from fidelity import cli
from fidelity.api import plan_checkpoint

KEYS = ["site", "layer", "metric", "step", "phase", "mode", "position"]


def _table(res) -> pd.DataFrame:
    df = pd.read_parquet(res.run_dir / "metrics.parquet")
    return df[df["site"] != "memory"].drop(columns="run_id")  # allocator bytes differ run to run


# (stream, prefill chunks, block): with chunks of 7 and a block of 16, two or three chunks form a block; a chunk
# longer than the block (as every chunk is with a block of 1) is judged as it is made, after the chunks queued
CASES = [("oracle", None, 5), ("production", None, 5), ("oracle", 7, 16), ("oracle", (5, 7, 100, 28), 16)]


@pytest.mark.parametrize(("stream", "chunk", "block"), CASES)
def test_calls_judged_in_blocks_give_the_call_by_call_metrics_and_verdict(tmp_path, stream, chunk, block):
    plan = plan_checkpoint(None)
    runs = {b: fidelity.run("production", plan, prompt=140, decode_steps=12, out=tmp_path, stream=stream,
                            run_id=f"block-{b}", oracle_block=b, prefill_chunk=chunk) for b in (1, block)}
    assert runs[block].manifest["oracle_block"] == block and runs[1].manifest["oracle_block"] == 1
    assert runs[block].manifest["generated"] == runs[1].manifest["generated"]
    assert runs[block].verdict == runs[1].verdict
    both = _table(runs[1]).merge(_table(runs[block]), on=KEYS, how="outer", suffixes=("_alone", "_block"),
                                 indicator=True)
    assert (both["_merge"] == "both").all(), both[both["_merge"] != "both"][KEYS].head().to_string()
    assert len(both) > 20000 and set(both["mode"]) == {"free", "layer", "op"}
    a, b = both["value_alone"], both["value_block"]
    same = (a == b) | (a.isna() & b.isna())  # inf sqnr where both are exact; NaN where a metric has no value
    off = ~same & ~((a - b).abs() <= 1e-3 * a.abs().clip(lower=1.0))
    # an op the decoder matches exactly call by call (index -1: no difference) differs by the block's rounding: the
    # index then names where that rounding is largest
    off &= ~((both["metric"] == "max_abs_index") & ((a == -1) | (b == -1)))
    assert not off.any(), both[off][[*KEYS, "value_alone", "value_block"]].head().to_string()
    assert (~same).any()  # the blocks did run as one pass: their rounding shows somewhere
    if chunk is not None:  # ... in the prefill chunks too, whose per-position rows are kept
        prefill = both["phase"] == "prefill"
        assert both[prefill]["position"].notna().any() and (~same & prefill).any()
        assert both[prefill]["step"].nunique() == (len(chunk) if isinstance(chunk, tuple) else 140 // chunk)


def test_an_oracle_block_below_one_is_refused(capsys, tmp_path):
    assert cli.main(["run", "--oracle-block", "0", "--out", str(tmp_path)]) == 2
    assert "--oracle-block: expected >= 1 decode call, found 0" in capsys.readouterr().err
