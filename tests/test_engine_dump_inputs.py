"""An SGLang-format dump written by hand from docs/engines.md (json-free: torch.save of {"value", "meta"} per
tensor), judged against the oracle, and the dumps refused before any work, each in one line naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fidelity import cli
from fidelity.model.default import DEFAULT_DIR
from fidelity.model.load import load_checkpoint
from oracles import OracleModel


def put(folder: Path, step: int, name: str, value, rank: int = 0, world: int = 1, index: int = 0, **tags) -> Path:
    """One dumper file: step=..___rank=..___dump_index=..___name=..[___tag=..].pt holding {"value", "meta"}."""
    extra = "".join(f"___{k}={v}" for k, v in tags.items())
    path = folder / f"step={step}___rank={rank}___dump_index={index}___name={name}{extra}.pt"
    meta = {"step": step, "rank": rank, "name": name, "world_rank": rank, "world_size": world, **tags}
    torch.save({"value": value, "meta": {**meta, **({"dims": tags["dims"]} if "dims" in tags else {})}}, path)
    return path


def hand_dump(folder: Path, pad: int = 2) -> list[int]:
    """Request "x": a 30-token prompt in one pass padded to 32 rows (a graph bucket), then two decode passes; the
    logits are the oracle's at each pass's last row (what SGLang's next_token_logits holds)."""
    folder.mkdir(parents=True)
    oracle = OracleModel(load_checkpoint(DEFAULT_DIR))
    ids = torch.arange(5, 37)
    passes = [(ids[:30], 0), (ids[30:31], 30), (ids[31:32], 31)]
    for step, (fed, start) in enumerate(passes):
        rows = torch.cat((fed, torch.zeros(pad, dtype=torch.long))) if step == 0 else fed
        positions = torch.cat((torch.arange(start, start + len(fed)), torch.zeros(pad if step == 0 else 0,
                                                                                   dtype=torch.long)))
        logits = oracle.logits(ids[: start + len(fed)])[-1:]
        for k, (name, value) in enumerate((("input_ids", rows), ("positions", positions),
                                           ("seq_lens", torch.tensor([start + len(fed)])), ("rids", ["x"]),
                                           ("next_token_logits", logits))):
            put(folder, step, name, value, index=k)
    return ids.tolist()


def run(tmp_path: Path, decoder: str, *extra: str) -> int:
    return cli.main(["run", "--decoder", decoder, "--dump-precision", "exact", "--out", str(tmp_path / "runs"),
                     "--run-id", "r", *extra])


def test_hand_written_dump_with_padded_rows_and_last_row_logits_judges_pass(tmp_path):
    hand_dump(tmp_path / "exp")
    assert run(tmp_path, f"sglang-dump:{tmp_path}") == 0
    verdict = json.loads((tmp_path / "runs" / "r" / "verdict.json").read_text())
    manifest = json.loads((tmp_path / "runs" / "r" / "manifest.json").read_text())
    assert verdict["verdict"] == "PASS" and verdict["checked"] > 0
    assert manifest["dump"]["padded_rows"] == 2 and manifest["dump"]["passes"] == 3
    assert manifest["dump"]["unmapped"] == []  # the batch metadata is read, not listed as unmapped


class Planted:
    """Unpickling this runs code: it would create the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def refused(tmp_path: Path, capsys, decoder: str, *extra: str) -> str:
    assert run(tmp_path, decoder, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not (tmp_path / "runs" / "r").exists()
    return err[-1]


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    marker = tmp_path / "ran"
    torch.save({"value": Planted(str(marker)), "meta": {}},
               tmp_path / "exp" / "step=0___rank=0___dump_index=9___name=evil.pt")
    line = refused(tmp_path, capsys, f"sglang-dump:{tmp_path}")
    assert "name=evil.pt: refused" in line and "weights_only" in line
    assert not marker.exists()


def test_missing_rank_is_refused(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    for p in (tmp_path / "exp").glob("*.pt"):
        data = torch.load(p, weights_only=True)
        data["meta"]["world_size"] = 2
        torch.save(data, p)
    assert "rank 1 missing" in refused(tmp_path, capsys, f"sglang-dump:{tmp_path}")


def test_mixed_world_sizes_are_refused(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    put(tmp_path / "exp", 0, "non_intrusive__model.norm.output", torch.zeros(32, 256), world=2, index=7)
    assert "different world sizes" in refused(tmp_path, capsys, f"sglang-dump:{tmp_path}")


def test_dims_over_another_axis_is_refused(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    put(tmp_path / "exp", 0, "non_intrusive__model.norm.output", torch.zeros(32, 256), index=7, dims="t[cp:zigzag] h")
    line = refused(tmp_path, capsys, f"sglang-dump:{tmp_path}")
    assert "final" in line and "'cp'" in line


def test_two_names_mapped_to_one_site_are_refused(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    put(tmp_path / "exp", 0, "norm_a", torch.zeros(32, 256), index=7)
    put(tmp_path / "exp", 0, "norm_b", torch.zeros(32, 256), index=8)
    (tmp_path / "map.toml").write_text("[[rule]]\nmatch = 'norm_.'\nsite = \"final\"\n")
    line = refused(tmp_path, capsys, f"sglang-dump:{tmp_path}", "--site-map", str(tmp_path / "map.toml"))
    assert "'norm_a' and 'norm_b' to one site final" in line


def test_a_site_whose_shape_disagrees_with_the_config_is_refused(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    put(tmp_path / "exp", 0, "non_intrusive__model.norm.output", torch.zeros(32, 7), index=7)
    line = refused(tmp_path, capsys, f"sglang-dump:{tmp_path}")
    assert "final" in line and "[7]" in line


def test_a_name_map_with_an_unknown_site_is_refused(tmp_path, capsys):
    hand_dump(tmp_path / "exp")
    (tmp_path / "map.toml").write_text("[[rule]]\nmatch = 'x'\nsite = \"L{i}.attn.outt\"\n")
    line = refused(tmp_path, capsys, f"sglang-dump:{tmp_path}", "--site-map", str(tmp_path / "map.toml"))
    assert "not a site template" in line


@pytest.mark.parametrize("text", ["t h[tp] d", "t (h*d)[tp]", "h(tp,partial)", "t h # tp:replicated"])
def test_dims_annotations_parse(text):
    from fidelity.decoders.engine_dump.dims import parse_dims

    join = parse_dims(text)
    assert (join.kind, join.dim) == {"t h[tp] d": ("concat", 1), "t (h*d)[tp]": ("concat", 1),
                                     "h(tp,partial)": ("sum", None), "t h # tp:replicated": ("replicated", None)}[text]


def test_oracle_written_with_write_dump_reads_back_and_judges_pass_bit_for_bit(tmp_path):
    dump = tmp_path / "dump"
    assert cli.main(["run", "--prompt-len", "150", "--decode", "3", "--mode", "free", "--write-dump",
                     f"sglang:{dump}", "--out", str(tmp_path / "runs"), "--run-id", "live"]) == 0
    assert sorted(p.name for p in dump.iterdir()) == ["decoder", "oracle"]
    import pandas as pd

    # call by call the oracle's calls are its dump's, bit for bit; judged in blocks (the default) its decode calls
    # are one causal pass, whose GEMMs over more rows round otherwise (docs/running.md, "Decode judged in blocks")
    for block, worst in (("1", 0.0), ("64", 1e-4)):
        assert run(tmp_path, f"sglang-dump:{dump / 'oracle'}", "--oracle-block", block, "--overwrite") == 0
        df = pd.read_parquet(tmp_path / "runs" / "r" / "metrics.parquet")
        exact = df[(df["mode"] == "free") & (df["position"] == -1) & (df["metric"] == "max_abs")]
        assert exact["site"].nunique() > 50 and (exact["value"] <= worst).all(), (block, exact["value"].max())
        assert json.loads((tmp_path / "runs" / "r" / "verdict.json").read_text())["verdict"] == "PASS"


def test_names_written_for_sglang_read_back_as_their_sites_through_the_sglang_map():
    from fidelity.decoders.engine_dump.names import load_map
    from fidelity.decoders.engine_dump.write import engine_name

    names = load_map("sglang")
    for site in ("embed", "L3.attn.in", "L3.attn.out", "L3.moe.in", "L3.moe.out", "final", "L2.attn.q",
                 "L4.residual"):
        name, layer = engine_name(site)
        assert names.site_of(name, layer)[0] == site


def test_write_dump_of_another_format_is_refused(tmp_path, capsys):
    assert cli.main(["run", "--write-dump", f"vllm:{tmp_path / 'd'}", "--out", str(tmp_path / "runs")]) == 2
    assert "expected sglang:DIR" in capsys.readouterr().err


def test_hook_dump_logits_written_one_pass_late_are_read_as_the_previous_pass(tmp_path):
    """SGLang's forward hook writes a pass's file when the model's forward returns, before the logits processor
    runs: pass N's logits land in pass N+1's file, and the last pass's in none (that pass is left out)."""
    hand_dump(tmp_path / "exp", pad=0)
    folder = tmp_path / "hook" / "TP0_PP0_Rank0_pid7"
    folder.mkdir(parents=True)
    by_step: dict[int, dict] = {}
    for p in (tmp_path / "exp").glob("*.pt"):
        tags = dict(kv.split("=", 1) for kv in p.stem.split("___"))
        by_step.setdefault(int(tags["step"]), {})[tags["name"]] = torch.load(p, weights_only=True)["value"]
    for step, names in sorted(by_step.items()):
        tensors = {f"model.forward_batch_info.{k}": names[k] for k in ("input_ids", "positions", "seq_lens")}
        if step > 0:
            tensors["logits_processor"] = by_step[step - 1]["next_token_logits"]
        torch.save(tensors, folder / f"Pass{step:05d}.pt")
    assert run(tmp_path, f"hook-dump:{tmp_path / 'hook'}") == 0
    manifest = json.loads((tmp_path / "runs" / "r" / "manifest.json").read_text())
    assert manifest["dump"]["passes"] == 2 and manifest["dump"]["passes_without_logits"] == 1
    assert json.loads((tmp_path / "runs" / "r" / "verdict.json").read_text())["verdict"] == "PASS"
