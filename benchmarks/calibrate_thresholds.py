"""Clean-decoder margins: run every built-in profile clean on a checkpoint (the default prompt at each decode
count, and held-out text files) and table, per judged (metric, mode), the worst value seen against the default
threshold, and each run's verdict. Thresholds are derived from these tables.

    python benchmarks/calibrate_thresholds.py [--checkpoint DIR | --preset tiny] --out DIR [--decode 16 64]
        [--held-out copy.py multiprocessing/spawn.py ...] [--profiles reference bf16 ...]
        [--sites logits embed 'L{i}.residual']   # the production decoder reporting only these sites
    python benchmarks/calibrate_thresholds.py --out DIR --rejudge   # DIR/runs judged with today's default rules

Held-out files are paths relative to the running Python's standard library (``fidelity.train.corpus``), tokenized
with the checkpoint's tokenizer; each runs with the largest decode count. The run directories stay under
``DIR/runs`` (re-judge them with ``fidelity report``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

import fidelity
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.profiles import BUILTIN
from fidelity.harness.judgement import judge, rules_for
from fidelity.harness.thresholds import profile_class
from fidelity.model import text
from fidelity.model.default import default_checkpoint, prompt_for
from fidelity.model.sites import Recorder
from fidelity.outputs.report import md_table
from fidelity.outputs.rundir import read_run
from fidelity.train.corpus import stdlib_root


def worst_rows(j, label: str) -> list[dict]:
    """Per (metric, mode, rule) of the judgement ``j``: the worst judged value and the rule's limit."""
    rows = []
    for (metric, mode, k), g in j.judged.groupby(["metric", "mode", "rule_index"]):
        rule = j.rules[k]
        worst = g["value"].min() if rule.op == ">=" else g["value"].max()
        site = g.loc[g["value"].idxmin() if rule.op == ">=" else g["value"].idxmax(), "site"]
        rows.append({"run": label, "metric": metric, "mode": mode, "rule": f"{rule.site_regex} {rule.text}",
                     "worst": worst, "at": site, "failures": int((~g["passed"]).sum())})
    return rows


def rejudged(run_dir: Path):
    """A stored run judged with the current default rules for its profile and config (what the run would get
    today), rather than the rules stored with it."""
    df, manifest = read_run(run_dir)
    cfg = fidelity.ModelConfig.from_dict(manifest["config"])
    profile = manifest["profile"]
    return judge(df, rules_for(profile, cfg), profile_class(profile)), manifest


class ReportedSites(ProductionDecoder):
    """The production decoder reporting only some site templates (as a trace of logits, ``embed`` and the
    residual streams does): what the thresholds of a decoder that reports no top-k are derived from."""

    def __init__(self, ckpt, profile: str, max_context: int, templates: tuple[str, ...]):
        super().__init__(ckpt, profile, max_context)
        self.templates = frozenset(templates)

    def sites(self) -> frozenset[str]:
        return self.templates

    @ProductionDecoder.rec.setter
    def rec(self, recorder) -> None:
        patterns = [re.escape(t).replace(re.escape("{i}"), r"\d+") for t in self.templates]
        self.session.rec = None if recorder is None else Recorder(patterns, recorder.records, device=recorder.device)


def prompts(ckpt, decode: list[int], held_out: list[str]) -> list[tuple[str, object, int]]:
    """(label, prompt ids or None for the default prompt, decode steps) of every run per profile."""
    out = [(f"default-{n}", None, n) for n in decode]
    if held_out:
        cfg = ckpt.config
        tok = text.load(str(Path(ckpt.path) / "tokenizer.json"))
        for rel in held_out:
            body = (stdlib_root() / rel).read_text(encoding="utf-8")
            ids = text.encode_prompt(tok, body, cfg.bos_token_id, cfg.vocab_size)
            out.append((rel.replace("/", "_"), ids, max(decode)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint")
    p.add_argument("--preset")
    p.add_argument("--decode", type=int, nargs="+", default=[64])
    p.add_argument("--held-out", nargs="*", default=[])
    p.add_argument("--profiles", nargs="*", default=list(BUILTIN))
    p.add_argument("--sites", nargs="*", help="report only these site templates (e.g. logits embed 'L{i}.residual')")
    p.add_argument("--rejudge", action="store_true",
                   help="judge the runs already under OUT/runs with today's default rules instead of running")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.preset:
        ckpt = fidelity.synthesize(fidelity.ModelConfig.preset(a.preset), 0)
        ckpt.origin["preset"] = a.preset
    else:
        ckpt = fidelity.load_checkpoint(a.checkpoint or default_checkpoint())
    out = Path(a.out)
    results = []  # (profile, prompt label, decode steps, judgement)
    if a.rejudge:
        for run_dir in sorted((out / "runs").iterdir()):
            j, manifest = rejudged(run_dir)
            name = manifest["profile"]["name"]
            results.append((name, run_dir.name.removeprefix(f"{name}-"), manifest["decode_steps"], j))
    for name in [] if a.rejudge else a.profiles:
        for label, prompt, steps in prompts(ckpt, a.decode, a.held_out):
            decoder, modes = "production", ("free", "layer", "op")
            if a.sites:
                n = len(prompt if prompt is not None else prompt_for(ckpt))
                decoder, modes = ReportedSites(ckpt, name, n + steps, tuple(a.sites)), ("free", "layer")
            res = fidelity.run(decoder, ckpt, prompt, steps, modes, out / "runs", profile=name,
                               run_id=f"{name}-{label}", overwrite=True)
            print(f"{name} {label}: {res.verdict} {res.first_divergence or ''}", flush=True)
            results.append((name, label, steps, res.judgement))
    verdicts = pd.DataFrame([{"profile": name, "prompt": label, "decode": steps,
                              "verdict": "PASS" if j.passed else "FAIL",
                              "first divergence": str(j.first_divergence) if j.first_divergence else "none"}
                             for name, label, steps, j in results])
    table = pd.DataFrame([{"profile": name, **r} for name, label, _, j in results for r in worst_rows(j, label)])
    table.to_csv(out / "clean_margins.csv", index=False)
    verdicts.to_csv(out / "verdicts.csv", index=False)
    worst = (table.sort_values("worst").groupby(["profile", "metric", "mode", "rule"], as_index=False)
             .agg(worst_min=("worst", "min"), worst_max=("worst", "max"), failures=("failures", "sum")))
    (out / "clean_margins.md").write_text(md_table(verdicts) + "\n\n" + md_table(worst) + "\n")
    print(md_table(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
