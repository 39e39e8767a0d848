"""Trace format version 2 (fidelity/decoders/trace_file.py, docs/traces.md): a mixed batch with a fork and a rolled
back proposal, written with ``TraceWriter`` from a serving loop and by hand from the format's description alone
(json + safetensors, no import of the package), with sharded sites; each sequence judged against the oracle on its
own timeline; version 1 traces still load; a malformed trace is refused naming what is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fidelity
from fidelity.api import plan_checkpoint
from fidelity.cli import main
from fidelity.decoders.base import Call
from fidelity.decoders.production.decoder import ProductionDecoder, Sequence
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.trace_file import TraceError, TraceWriter, read_trace
from fidelity.model.sites import Recorder
from fidelity.outputs.rundir import read_run

SITES = (r"embed", r"L\d+\.residual", r"L\d+\.attn\.compressed_kv")  # free and layer mode, and compressed entries
KEYS = ["step", "site", "metric", "mode", "position"]
KV = "L2.attn.compressed_kv"


def _script(ids: torch.Tensor) -> list[dict]:
    """Two prompts in one call; a decode step beside a prefill chunk; sequence 2 forked from 0 at 30 (inside its
    first call); the child's own tokens beside a decode step; a 3-token proposal on 0 with 1 accepted, rolled
    back; a step of each."""
    return [
        {"call": [(0, ids[0:40]), (1, ids[100:123])]},
        {"call": [(0, ids[40:41]), (1, ids[123:130])]},
        {"fork": (2, 0, 30)},
        {"call": [(2, ids[200:210]), (0, ids[41:42])]},
        {"call": [(0, torch.tensor([int(ids[42]), 7, 9]))], "accept": 1},
        {"call": [(0, ids[43:44]), (1, ids[130:131]), (2, ids[210:211])]},
    ]


def _serve(ckpt, ids: torch.Tensor) -> list[dict]:
    """The script on the production decoder, each sequence's rows computed by its own session with a recorder
    (as a serving loop's hooks record them): per call {seq, ids, start, logits, sites}, forks and rollbacks."""
    dec = ProductionDecoder(ckpt, max_context=400)
    pos: dict[int, int] = {}
    events = []
    for e in _script(ids):
        if "fork" in e:
            dec.fork(*e["fork"])
            pos[e["fork"][0]] = e["fork"][2]
            events.append({"fork": list(e["fork"])})
            continue
        rows = []
        for seq, t in e["call"]:
            if seq not in dec.seqs:
                dec.seqs[seq] = Sequence(dec.model.session())
            rec = Recorder(patterns=SITES)
            dec.seqs[seq].session.rec = rec
            logits = dec.forward([Call(seq, t, pos.get(seq, 0))])[0]
            dec.seqs[seq].session.rec = None
            rows.append({"seq": seq, "ids": t.clone(), "start": pos.get(seq, 0), "logits": logits.float(),
                         "sites": {name: rec.get(name) for name in rec.records}})
            pos[seq] = pos.get(seq, 0) + len(t)
        events.append({"call": rows})
        if "accept" in e:
            ((seq, t),) = e["call"]
            pos[seq] += e["accept"] - len(t)
            dec.rollback(seq, pos[seq])
            events.append({"rollback": [seq, pos[seq]]})
    return events


def _write_with_writer(path, ckpt, events, profile) -> None:
    writer = TraceWriter(path, ckpt.config, decoder="serving loop", profile=profile,
                         checkpoint={"path": str(ckpt.path)})
    for e in events:
        if "fork" in e:
            writer.fork(*e["fork"])
        elif "rollback" in e:
            writer.rollback(*e["rollback"])
        else:
            for row in e["call"]:
                for name, t in row["sites"].items():
                    writer(name, t, seq=row["seq"])
            writer.end_call([(r["seq"], r["ids"]) for r in e["call"]], [r["logits"] for r in e["call"]])
    writer.finish()


def write_by_hand(path, config: dict, checkpoint: dict, profile: dict, events: list[dict], ranks: int = 1) -> None:
    """Version 2 from docs/traces.md alone (json, torch, safetensors): per call one file with ids, positions, seq
    and logits of every row, residual and embed sites as the call's whole tensors, compressed entries per sequence
    (``@seq``); with ``ranks`` > 1 logits and residuals stored as shards (``#rank``) split along their last dim."""
    path.mkdir()
    out, dims = [], {"logits": 1, "L{i}.residual": 2, "embed": 1}
    for e in events:
        if "call" not in e:
            out.append(e)
            continue
        k = sum("call" in x for x in out)
        rows = e["call"]
        tensors = {"ids": torch.cat([r["ids"] for r in rows]),
                   "positions": torch.cat([torch.arange(r["start"], r["start"] + len(r["ids"])) for r in rows]),
                   "seq": torch.cat([torch.full((len(r["ids"]),), r["seq"]) for r in rows]),
                   "logits": torch.cat([r["logits"] for r in rows])}
        for name in rows[0]["sites"]:
            if name.endswith("compressed_kv"):
                tensors.update({f"{name}@{r['seq']}": r["sites"][name] for r in rows})
            else:
                tensors[name] = torch.cat([r["sites"][name] for r in rows])
        if ranks > 1:
            for name in [n for n in tensors if n == "logits" or n.endswith("residual") or n == "embed"]:
                dim = dims["L{i}.residual" if name.endswith("residual") else name]
                for rank, part in enumerate(tensors.pop(name).chunk(ranks, dim=dim)):
                    tensors[f"{name}#{rank}"] = part.contiguous()
        name = f"batch-{k}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / name))
        out.append({"call": name, "rows": [[r["seq"], r["start"], len(r["ids"])] for r in rows],
                    "sites": sorted(n for n in tensors if n not in ("ids", "positions", "seq", "logits"))})
    manifest = {"format": "dsv4-fidelity-trace", "version": 2, "decoder": "by hand", "profile": profile,
                "config": config, "checkpoint": checkpoint, "events": out}
    if ranks > 1:
        manifest["shards"] = {"ranks": ranks, "dims": dims}
    (path / "trace.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    plan = plan_checkpoint(None)
    ckpt = plan.open()
    events = _serve(ckpt, plan.prompt(300))
    root = tmp_path_factory.mktemp("v2")
    profile = ProductionDecoder(ckpt, max_context=8).profile
    _write_with_writer(root / "writer", ckpt, events, profile)
    args = (ckpt.config.to_official_dict(), {"path": str(ckpt.path)}, profile, events)
    write_by_hand(root / "hand", *args)
    write_by_hand(root / "sharded", *args, ranks=2)
    return plan, root


def test_each_sequence_has_its_timeline_fork_and_rollback_resolved(served):
    _, root = served
    trace = read_trace(root / "writer")
    assert trace.sequences == [0, 1, 2] and trace.manifest["version"] == 2
    views = {k: TraceDecoder(root / "writer", k) for k in (0, 1, 2)}
    assert [views[0].chunks, len(views[0].generated)] == [[40], 4]  # the proposal kept 1 of 3 rows
    assert [views[1].chunks, len(views[1].generated)] == [[23, 7], 1]
    assert [views[2].chunks, len(views[2].generated)] == [[30, 10], 1]  # the parent's 30, then its own
    ids = served[0].prompt(300)
    assert torch.equal(views[2].prompt, torch.cat((ids[:30], ids[200:210])))
    assert views[0].generated == ids[40:44].tolist()
    with pytest.raises(TraceError, match=r"holds sequences \[0, 1, 2\]; replay one"):
        TraceDecoder(root / "writer")


def test_every_sequence_of_a_mixed_batch_passes_against_the_oracle_and_the_hand_written_trace_agrees(served, tmp_path):
    plan, root = served
    metrics = {}
    for name in ("writer", "hand", "sharded"):
        for k in (0, 1, 2):
            res = fidelity.run(TraceDecoder(root / name, k), plan, modes=("free", "layer"), out=tmp_path,
                               run_id=f"{name}-{k}")
            assert res.verdict == "PASS", (name, k, res.first_divergence)
            df = read_run(res.run_dir)[0]
            assert ("rank" in df.columns) == (name == "sharded")  # a sharded site is judged per rank too
            whole = df[df["rank"].isna()] if "rank" in df.columns else df
            metrics[name, k] = whole[whole["site"] != "memory"].set_index(KEYS)["value"].sort_index()
    for k in (0, 1, 2):
        assert len(metrics["writer", k]) > 200
        for other in ("hand", "sharded"):  # the same numbers, however stored
            pd_equal = metrics["writer", k].equals(metrics[other, k])
            assert pd_equal, (other, k)


def test_the_command_line_judges_every_sequence_or_the_one_named(served, tmp_path, capsys):
    plan, root = served
    trace = f"trace:{root / 'writer'}"
    assert main(["run", "--decoder", trace, "--mode", "free", "--out", str(tmp_path), "--run-id", "t"]) == 0
    out = capsys.readouterr().out
    assert out.count("verdict: PASS") == 3 and "sequence 2" in out
    assert out.strip().splitlines()[-1] == "overall: all 3 sequences PASS"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-seq0", "t-seq1", "t-seq2"]
    strict = tmp_path / "strict.toml"
    strict.write_text("['logits']\ncos = \">=0.9999999999\"\n")
    argv = ["run", "--decoder", trace, "--mode", "free", "--decode", "50", "--thresholds", str(strict), "--gate"]
    assert main([*argv, "--out", str(tmp_path / "strict"), "--run-id", "t"]) == 1
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == "overall: 3 of 3 sequences FAIL"
    assert "fidelity: note: --decode 50: does not apply to --decoder trace:DIR (a trace replays its own decode " \
           "steps); ignored" in err
    assert main(["run", "--decoder", trace, "--trace-seq", "1", "--mode", "free", "--out", str(tmp_path),
                 "--run-id", "one"]) == 0
    assert (tmp_path / "one").is_dir()
    assert main(["run", "--decoder", trace, "--trace-seq", "5", "--out", str(tmp_path)]) == 2
    assert "no sequence 5; the trace holds sequences [0, 1, 2]" in capsys.readouterr().err


def test_a_version_1_trace_still_loads(served, tmp_path):
    """Sequence 1's timeline as a version 1 trace (prompt, generated, steps; no seq): same metrics as the v2 view."""
    plan, root = served
    v1 = tmp_path / "v1"
    v1.mkdir()
    view = TraceDecoder(root / "writer", 1)
    steps = []
    for k, seg in enumerate(view.steps):
        t = load_file(root / "writer" / seg.call.file)
        rows = slice(seg.rows.offset, seg.rows.offset + seg.keep)
        kept = {"ids": t["ids"][rows], "positions": t["positions"][rows], "logits": t["logits"][rows]}
        kept.update({n.removesuffix("@1"): x for n, x in t.items() if n.endswith("@1")})
        save_file(kept, str(v1 / f"step-{k:05d}.safetensors"))
        steps.append({"file": f"step-{k:05d}.safetensors", "positions": [seg.start, seg.stop],
                      "sites": sorted(n for n in kept if n not in ("ids", "positions", "logits"))})
    m = json.loads((root / "writer" / "trace.json").read_text())
    del m["events"]
    m.update(version=1, prompt=view.prompt.tolist(), generated=view.generated, steps=steps)
    (v1 / "trace.json").write_text(json.dumps(m))
    a = fidelity.run(TraceDecoder(v1), plan, modes=("free", "layer"), out=tmp_path, run_id="run-v1")
    b = fidelity.run(TraceDecoder(root / "writer", 1), plan, modes=("free", "layer"), out=tmp_path, run_id="run-v2")
    da, db = (read_run(r.run_dir)[0] for r in (a, b))
    da, db = (d[d["site"] != "memory"].set_index(KEYS)["value"].sort_index() for d in (da, db))
    assert a.verdict == b.verdict == "PASS" and da.equals(db)


def _edit(src, dst, change_json=None, change_file=None):
    shutil.copytree(src, dst)
    if change_json:
        m = json.loads((dst / "trace.json").read_text())
        change_json(m)
        (dst / "trace.json").write_text(json.dumps(m))
    if change_file:
        name, change = change_file
        t = load_file(dst / name)
        change(t)
        save_file(t, str(dst / name))
    return dst


@pytest.mark.parametrize(("source", "json_edit", "file_edit", "message"), [
    ("sharded", None, ("batch-0.safetensors", lambda t: t.pop("logits#1")), "logits: shards of ranks [1] missing"),
    ("sharded", lambda m: m["shards"]["dims"].pop("L{i}.residual"), None,
     "shards.dims: no split dim for 'L0.residual'"),
    ("hand", None, ("batch-0.safetensors", lambda t: t.update({"L2.attn.compressed_kv": t.pop(f"{KV}@0")})),
     "L2.attn.compressed_kv: a call of several sequences stores compressed entries per sequence"),
    ("hand", None, ("batch-1.safetensors", lambda t: t.update(seq=t["seq"].flip(0))), "seq: expected [0, 1, 1"),
    ("hand", lambda m: m["events"][6]["rows"][0].__setitem__(1, 44), None,
     "events[6] (batch-4.safetensors): sequence 0 starts at 44; it stands at 43"),
    ("hand", lambda m: m["events"].__setitem__(2, {"fork": [2, 0, "x"]}), None, "events[2]: expected {'call'"),
    ("hand", lambda m: m.update(version=3), None, "version: expected 1 or 2, found 3"),
    ("hand", lambda m: m["events"][0]["rows"].append([0, 40, 1]), None,
     "events[0] (batch-0.safetensors): sequence 0 is listed twice in one call's rows"),
    ("hand", None, ("batch-1.safetensors", lambda t: t["ids"].__setitem__(3, -1)),
     "batch-1.safetensors: ids: row 3 is -1, expected a token id in [0, 4096)"),
    ("hand", None, ("batch-1.safetensors", lambda t: t["ids"].__setitem__(0, 4096)),
     "batch-1.safetensors: ids: row 0 is 4096, expected a token id in [0, 4096)"),
])
@pytest.mark.smoke
def test_a_malformed_trace_is_refused_naming_what_is_wrong(served, tmp_path, source, json_edit, file_edit, message):
    _, root = served
    bad = _edit(root / source, tmp_path / "bad", json_edit, file_edit)
    with pytest.raises(TraceError) as err:
        for k in (0, 1, 2):
            TraceDecoder(bad, k)
    assert message in str(err.value), str(err.value)


def test_a_trace_of_another_model_is_named_a_config_mismatch_before_its_tensors_are_read(served, tmp_path, capsys):
    """trace.json's config says hidden size 512, the checkpoint's is 256: the config is named, not a site's shape."""
    from fidelity import cli

    _, root = served
    bad = _edit(root / "hand", tmp_path / "d512", lambda m: m["config"].update(dim=512))
    assert cli.main(["run", "--decoder", f"trace:{bad}", "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its config differs from the checkpoint's (dim: 512 vs 256)" in err[0], err
    assert not (tmp_path / "runs").exists()
