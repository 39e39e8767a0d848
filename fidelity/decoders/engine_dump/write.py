"""A run's calls written in SGLang's dumper layout (``fidelity run --write-dump sglang:DIR``), so that an SGLang
developer diffs our oracle against a live SGLang run with SGLang's own comparator, and so that our judgement reads
them back (``sglang-dump:DIR/oracle``).

``DIR/oracle/`` holds the oracle's free-mode sites, ``DIR/decoder/`` the decoder's: per call (a ``step``) the batch
metadata SGLang's dumper writes in its ``core`` mode (``input_ids``, ``positions``, ``seq_lens``, ``req_pool_indices``,
``rids``), the logits of every row as ``next_token_logits``, and each per-token site under the name SGLang's
DeepSeek-V4 module tree gives it where the built-in ``sglang`` map has one (``SGLANG_NAMES``), else as
``fidelity.<site>``; ``layer_id`` tagged, ``dims`` naming the site's dims (one rank: none split). The compressed
entries (a row per entry, not per token) are not written.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from fidelity.atomic_write import OutputError, check_new_dir
from fidelity.decoders.engine_dump.names import OWN_PREFIX
from fidelity.decoders.trace_file import ENTRY_SITES
from fidelity.model.sites import SITE, SITE_TABLE, Recorder, site_template

SGLANG_NAMES = {
    SITE.embed: "non_intrusive__model.embed_tokens.output",
    SITE.attn_in: "non_intrusive__model.layers.{i}.input_layernorm.output",
    SITE.attn_out: "non_intrusive__model.layers.{i}.self_attn.output",
    SITE.moe_in: "non_intrusive__model.layers.{i}.post_attention_layernorm.output",
    SITE.moe_out: "non_intrusive__model.layers.{i}.mlp.output",
    SITE.final: "non_intrusive__model.norm.output",
}
SIDES = ("oracle", "decoder")


def engine_name(site: str) -> tuple[str, int | None]:
    """(the dumper name of ``site``, its layer or None)."""
    template = site_template(site)
    layer = int(site[1 : site.index(".")]) if template != site else None
    name = SGLANG_NAMES.get(template)
    return (name.format(i=layer) if name else OWN_PREFIX + site), layer


def dims_of(site: str) -> str:
    """The site's dims as the dumper's ``dims`` string: ``t`` (tokens), then the site table's dim names."""
    shape = SITE_TABLE[site_template(site)].shape
    return " ".join(["t", *(shape or ("n",))])


class DumpWriter:
    """Writes ``DIR/oracle`` and ``DIR/decoder`` for a run of one sequence; ``finish`` moves them into place,
    ``abort`` removes them (nothing half-written)."""

    def __init__(self, directory: str | Path, overwrite: bool = False, option: str = "--write-dump"):
        self.target = check_new_dir(directory, overwrite, option)
        self.overwrite = overwrite
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.partial-", dir=self.target.parent))
        except OSError as err:
            raise OutputError(f"{option} {self.target}: cannot write in {self.target.parent}: {err.strerror}") from None
        self.index = dict.fromkeys(SIDES, 0)

    def add_call(self, side: str, step: int, ids: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor,
                 rec: Recorder) -> None:
        """One call of ``side`` (``oracle`` or ``decoder``): its tokens, positions, logits [n, vocab] and sites."""
        n = len(ids)
        self._put(side, step, "input_ids", ids.long().cpu())
        self._put(side, step, "positions", positions.long().cpu())
        self._put(side, step, "seq_lens", torch.tensor([int(positions[-1]) + 1]))
        self._put(side, step, "req_pool_indices", torch.tensor([0]))
        self._put(side, step, "rids", ["0"])
        self._put(side, step, "next_token_logits", logits.detach().float().cpu().reshape(n, -1))
        for site in rec.records:
            if site == "logits" or site_template(site) in ENTRY_SITES:
                continue
            t = rec.get(site)
            if t.shape[0] != n:
                continue  # recorded at sampled rows only
            name, layer = engine_name(site)
            self._put(side, step, name, t.detach().cpu().contiguous(), layer, dims_of(site))

    def _put(self, side: str, step: int, name: str, value, layer: int | None = None, dims: str | None = None) -> None:
        self.index[side] += 1
        tags = {"step": step, "rank": 0, "dump_index": self.index[side], "name": name, "recompute_status": "disabled",
                **({"layer_id": layer} if layer is not None else {})}
        meta = {**tags, "world_rank": 0, "world_size": 1, **({"dims": dims} if dims else {})}
        folder = self.tmp / side
        folder.mkdir(exist_ok=True)
        stem = "___".join(f"{k}={v}" for k, v in tags.items())
        try:
            torch.save({"value": value, "meta": meta}, folder / f"{stem}.pt")
        except OSError as err:
            raise OutputError(f"--write-dump {self.target}: cannot write {stem}.pt: {err.strerror}") from None

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self) -> Path:
        try:
            if self.target.exists():
                if not self.overwrite:
                    raise OutputError(f"--write-dump {self.target}: appeared while writing; not replaced")
                shutil.rmtree(self.target)
            self.tmp.chmod(0o755)
            self.tmp.rename(self.target)
        except OSError as err:
            self.abort()
            raise OutputError(f"--write-dump {self.target}: cannot write: {err.strerror}") from None
        return self.target
