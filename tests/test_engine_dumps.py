"""Engines' own dumps judged as written: SGLang's dumper (run for real, over transformers' DeepseekV4 with two
tensor-parallel ranks as gloo processes) and the forward-hook layout, clean, with a bug in rank 1's shard of one
layer's queries, and with a bug before sharding; the verdict says which rank, or that it is not one rank's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fidelity import cli
from fidelity.model.default import DEFAULT_DIR
from tests.engine_dumps import HOOK_SITE_MAP, SITE_MAP, dumper_path, to_hook_layout, write_sglang_dump

needs_sglang = pytest.mark.skipif(dumper_path() is None, reason="sglang's dumper not installed (pip install --no-deps "
                                  "sglang==0.5.23 pyzmq: what .ci/run installs)")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dumps")
    out = {}
    for k, plant in enumerate((None, "rank", "all")):
        name = plant or "clean"
        out[name] = write_sglang_dump(DEFAULT_DIR, root / name, plant=plant, port=29561 + k)
        out[f"hook-{name}"] = to_hook_layout(out[name], root / f"hook-{name}")
    (root / "map.toml").write_text(SITE_MAP)
    (root / "hook-map.toml").write_text(HOOK_SITE_MAP)
    out["map"], out["hook-map"] = root / "map.toml", root / "hook-map.toml"
    return out


def judge(tmp_path: Path, dumps: dict, kind: str, plant: str, seq: int | None = 0) -> list[dict]:
    """The verdicts of the ``kind`` (sglang / hook) dump with ``plant``, sequence ``seq`` (None: every one)."""
    prefix, fmt = ("", "sglang-dump") if kind == "sglang" else ("hook-", "hook-dump")
    args = ["run", "--decoder", f"{fmt}:{dumps[prefix + plant]}", "--site-map", str(dumps[prefix + "map"]),
            "--dump-precision", "exact", "--out", str(tmp_path), "--run-id", "r"]
    cli.main(args + ([] if seq is None else ["--trace-seq", str(seq)]))
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("r*/verdict.json"))]


@needs_sglang
@pytest.mark.parametrize("kind", ["sglang", "hook"])
def test_clean_tp2_dump_of_transformers_judges_pass_on_every_sequence(dumps, tmp_path, kind):
    verdicts = judge(tmp_path, dumps, kind, "clean", seq=None)
    assert [v["verdict"] for v in verdicts] == ["PASS"] * 3
    manifest = json.loads((tmp_path / "r-seq0" / "manifest.json").read_text())
    assert manifest["dump"]["ranks"] == 2 and manifest["dump"]["passes"] == 8


@needs_sglang
@pytest.mark.parametrize("kind", ["sglang", "hook"])
def test_bug_in_rank_1s_shard_is_blamed_on_rank_1(dumps, tmp_path, kind):
    [v] = judge(tmp_path, dumps, kind, "rank")
    first = v["first_divergence"]
    assert v["verdict"] == "FAIL" and first["site"] == "L3.attn.q" and first["step"] == 0
    assert first["ranks_failed"] == [1] and first["ranks"] == 2
    assert "L3.attn.q on rank 1 of 2" in first["text"]


@needs_sglang
@pytest.mark.parametrize("kind", ["sglang", "hook"])
def test_bug_before_sharding_names_the_layer_without_blaming_a_rank(dumps, tmp_path, kind):
    [v] = judge(tmp_path, dumps, kind, "all")
    first = v["first_divergence"]
    assert first["site"] == "L3.attn.q" and first["ranks_failed"] == [0, 1]
    assert "on every rank (2 of 2: not one rank's shard)" in first["text"]
