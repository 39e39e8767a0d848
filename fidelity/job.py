"""A run from start to verdict: runner -> metrics table -> judgement -> run directory (``fidelity run``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fidelity.decoders import default_decoder
from fidelity.decoders.base import Decoder
from fidelity.decoders.profiles import get_profile, profile_dict
from fidelity.decoders.trace_file import TraceWriter
from fidelity.harness.judgement import Judgement, judge, rules_for
from fidelity.harness.runner import Runner, RunSpec, check_spec
from fidelity.harness.thresholds import COLUMNS, RANK_COLUMNS, Divergence, profile_class
from fidelity.outputs.rundir import check_output, new_run_id, write_run


@dataclass
class RunResult:
    """A judged run: ``verdict`` ('PASS' / 'FAIL'), ``first_divergence``, ``run_dir``, the judgement and manifest."""

    run_dir: Path
    judgement: Judgement
    manifest: dict

    @property
    def failures(self) -> pd.DataFrame:
        return self.judgement.failures

    @property
    def first_divergence(self) -> Divergence | None:
        return self.judgement.first_divergence

    @property
    def passed(self) -> bool:
        return self.judgement.passed

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def tidy(df: pd.DataFrame, run_id: str, profile: str) -> pd.DataFrame:
    """The runner's rows in the long format of ``thresholds.COLUMNS`` (and, where a decoder reported sharded sites,
    ``rank`` / ``ranks``: rows of one rank's own tensor, empty on the others)."""
    df = df.assign(run_id=run_id, profile=profile)
    df["position"] = df["position"].fillna(-1).astype("int64")
    for col in ("step", "layer"):
        df[col] = df[col].astype("int64")
    df["value"] = df["value"].astype("float64")
    return df[list(COLUMNS) + [c for c in RANK_COLUMNS if c in df.columns]]


def run_job(checkpoint, spec: RunSpec, out_root: str | Path = "runs", run_id: str | None = None,
            thresholds_path: str | Path | None = None, overwrite: bool = False, progress=None,
            decoder: Decoder | None = None, trace: str | Path | None = None,
            dump: str | Path | None = None) -> RunResult:
    """Run ``spec`` on ``decoder`` (default: ``fidelity.decoders.default_decoder``, the production decoder with
    ``spec.profile``), judge it once and write the run directory; ``trace``: also record the decoder's calls as a
    trace directory there; ``dump``: write the decoder's and the oracle's sites in SGLang's dumper layout
    (``<dump>/decoder``, ``<dump>/oracle``). Thresholds, the profile and the output places are checked before the
    long work; a decoder object starts from position 0 (``Decoder.reset``: one that consumed tokens and cannot reset
    is refused)."""
    profile = decoder.profile if decoder is not None else profile_dict(get_profile(spec.profile))
    rules = rules_for(profile, checkpoint.config, decoder.sites() if decoder is not None else None, thresholds_path,
                      len(spec.prompt) + spec.decode_steps)
    run_id = run_id or new_run_id()
    check_output(out_root, run_id, overwrite)
    if decoder is None:
        check_spec(checkpoint, spec)
        decoder = default_decoder(checkpoint, spec.profile, spec.context(), spec.device)
    decoder.reset()
    writer = dumper = None
    if trace is not None:
        writer = TraceWriter(trace, checkpoint.config, spec.prompt, decoder.label, profile, overwrite=overwrite)
    if dump is not None:
        from fidelity.decoders.engine_dump.write import DumpWriter

        dumper = DumpWriter(dump, overwrite)
    try:
        df, manifest = Runner(checkpoint, spec, progress, decoder, writer, dumper).run()
    except BaseException:
        for w in (writer, dumper):
            if w is not None:
                w.abort()
        raise
    manifest["run_id"] = run_id
    df = tidy(df, run_id, str(manifest["profile"]["name"]))
    judgement = judge(df, rules, profile_class(profile))
    run_dir = write_run(out_root, run_id, df, manifest, judgement, overwrite=overwrite)
    return RunResult(run_dir, judgement, manifest)
