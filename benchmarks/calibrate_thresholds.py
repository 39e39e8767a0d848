"""Clean-decoder margins: run every built-in profile clean on a checkpoint and table, per judged (metric, mode),
the worst value seen against the default threshold. Thresholds are derived from these tables.

    python benchmarks/calibrate_thresholds.py [--checkpoint DIR | --preset tiny] --out DIR [--decode 64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

import fidelity
from fidelity.decoders.production.profiles import BUILTIN
from fidelity.outputs.report import md_table


def worst_rows(res, profile: str) -> list[dict]:
    """Per (metric, mode, rule): the worst judged value and the rule's limit."""
    j = res.judgement
    rows = []
    for (metric, mode, k), g in j.judged.groupby(["metric", "mode", "rule_index"]):
        rule = j.rules[k]
        worst = g["value"].min() if rule.op == ">=" else g["value"].max()
        site = g.loc[g["value"].idxmin() if rule.op == ">=" else g["value"].idxmax(), "site"]
        rows.append({"profile": profile, "metric": metric, "mode": mode, "rule": f"{rule.site_regex} {rule.text}",
                     "worst": worst, "at": site, "failures": int((~g["passed"]).sum())})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint")
    p.add_argument("--preset")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.preset:
        ckpt = fidelity.synthesize(fidelity.ModelConfig.preset(a.preset), 0)
        ckpt.origin["preset"] = a.preset
    else:
        ckpt = a.checkpoint
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in BUILTIN:
            res = fidelity.run("production", ckpt, None, a.decode, ("free", "layer", "op"), tmp, profile=name,
                               run_id=name)
            print(f"{name}: {res.verdict}", flush=True)
            rows += worst_rows(res, name)
    table = pd.DataFrame(rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "clean_margins.csv", index=False)
    interesting = table[table["metric"].isin(["recall", "row_dev_excess", "col_dev", "cos", "calc_diff"])]
    (out / "clean_margins.md").write_text(md_table(interesting) + "\n")
    print(md_table(interesting[interesting["metric"].isin(["recall", "row_dev_excess"])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
