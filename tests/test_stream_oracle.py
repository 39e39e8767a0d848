"""The oracle layer by layer over a decoder's calls known in advance (``oracles.stream``) gives the call-by-call
oracle's records bit for bit: a production run's dump (chunked prefill, decode steps) judged both ways in free and layer
modes has the same metric table, value for value."""

from __future__ import annotations

import pandas as pd

import fidelity
from fidelity import cli
from fidelity.api import plan_checkpoint
from fidelity.decoders.engine_dump import open_dump


def test_stream_oracle_metrics_equal_the_call_by_call_oracle_bit_for_bit(tmp_path):
    dump = tmp_path / "dump"
    assert cli.main(["run", "--prompt-len", "300", "--prefill-chunk", "128", "--decode", "3", "--write-dump",
                     f"sglang:{dump}", "--out", str(tmp_path / "runs"), "--run-id", "live"]) == 0
    plan = plan_checkpoint(None)
    tables = {}
    for stream in (False, True):
        [decoder] = open_dump(f"sglang-dump:{dump / 'decoder'}", plan.config)
        res = fidelity.run(decoder, plan, out=tmp_path / "runs", run_id=f"stream-{stream}", oracle_stream=stream,
                           oracle_block=1)
        assert res.manifest["oracle_order"] == ("layer by layer over the decoder's known calls" if stream
                                                else "call by call")
        df = pd.read_parquet(res.run_dir / "metrics.parquet")
        tables[stream] = df[df["site"] != "memory"].drop(columns="run_id").reset_index(drop=True)
    assert len(tables[True]) > 5000 and set(tables[True]["mode"]) == {"free", "layer"}  # no entries dumped: no op mode
    assert tables[False].equals(tables[True])
