"""Self-consistency at the sites: two plays of one sequence compared per position and per compressed entry, not only
by their logits (derived scripts: ``fidelity fuzz`` and scenario files; docs/fuzz.md "Checks at the sites").

A played sequence's records (:class:`SiteRows`) hold each position's row of the sites in :data:`ROW_SITES` and
each compressed entry's row of those in :data:`ENTRY_SITES` (entry ``e`` of a layer of ratio ``r`` is emitted by
the call that reaches position ``(e + 1) r - 1``). A check compares two plays where both computed a row, in
data-flow order (layer by layer), and names the first site that breaks:

- ``structure``: what no rounding moves: the index scores' masked entries (-inf where the causal rule hides an
  entry), the window positions and the number of compressed entries a query sees, the number of valid top-k picks,
  which values are finite. Broken, the pair fails whatever it promises;
- ``bits``: where the pair promises equal bits (``Decoder.same_bits``), every row and entry bit for bit;
- ``bound``: elsewhere each site's worst row against :data:`BOUNDS` (cosine, relative L2, the recall of the
  visible entries and top-k picks, the share of rows routed to other experts): a screen, as the logits bounds are,
  that the oracle confirms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from fidelity.model.config import ModelConfig
from fidelity.model.sites import LAYER_SITE_ORDER, Recorder, site_template
from probes.sets import member, unique_sorted

ROW_SITES = ("L{i}.attn.kv", "L{i}.indexer.scores", "L{i}.indexer.topk", "L{i}.attn.visible", "L{i}.attn.core",
             "L{i}.attn.out", "L{i}.moe.experts", "L{i}.residual")
ENTRY_SITES = ("L{i}.attn.compressed_kv", "L{i}.indexer.keys")
COMPARED = ROW_SITES + ENTRY_SITES
PATTERNS = tuple(re.escape(t).replace(re.escape("{i}"), r"\d+") for t in COMPARED)
# the order sites are compared in inside a layer (the model's data flow)
ORDER = tuple(t for t in (f"L{{i}}.{s}" for s in LAYER_SITE_ORDER) if t in COMPARED)
SETS = ("L{i}.indexer.topk", "L{i}.moe.experts")  # rows of ids, -1 = none, compared as sets


@dataclass(frozen=True)
class Bound:
    """A site's limits where bits may differ: the worst row's ``cos_min`` and ``rel_l2_max`` (float sites), the
    worst row's ``recall_min`` (id sets; the visible set's compressed entries), ``moved_max``: the share of rows
    whose id set differs."""

    cos_min: float = -1.0
    rel_l2_max: float = float("inf")
    recall_min: float = 0.0
    moved_max: float = 1.0


# Twice the clean decoder's worst deviation per template (1 - cos, relative L2, 1 - recall, the moved share) over
# the bounds-judged pairs of 129 fuzz scripts (production, trained default, reference profile, CPU; seeds 1 and 2,
# 512 and 1024 positions: benchmarks/site_spread.py, benchmarks/results/2026-12-07-site-spread/bounds.txt). The
# worst rows lie in the last layers (L5.attn.kv cos 0.942; L0-L2 stay above 0.987): a bound per template is as
# loose as its deepest layer. The index scores are judged by their structure alone: a row over a few entries
# swings with the FP4 rounding of its keys (clean cos down to 0.28), which its top-k recall sees as it matters.
BOUNDS: dict[str, Bound] = {
    "L{i}.attn.kv": Bound(cos_min=0.884, rel_l2_max=0.678),
    "L{i}.attn.compressed_kv": Bound(cos_min=0.997, rel_l2_max=0.111),
    "L{i}.indexer.keys": Bound(cos_min=0.973, rel_l2_max=0.327),
    "L{i}.indexer.scores": Bound(),
    "L{i}.indexer.topk": Bound(recall_min=0.75),
    "L{i}.attn.visible": Bound(recall_min=0.75),
    "L{i}.attn.core": Bound(cos_min=0.902, rel_l2_max=0.667),
    "L{i}.attn.out": Bound(cos_min=0.867, rel_l2_max=0.751),
    "L{i}.moe.experts": Bound(moved_max=0.5),
    "L{i}.residual": Bound(cos_min=0.862, rel_l2_max=0.742),
}


def layer_of(site: str) -> int:
    return int(site[1 : site.index(".")])


@dataclass
class SiteRows:
    """One played sequence's records of the compared sites: {site: [(first position or entry, rows [m, ...])]},
    in call order (a later call's rows replace an earlier call's at the same index)."""

    blocks: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)

    @staticmethod
    def recorder() -> Recorder:
        """A recorder of the compared sites, on the host."""
        return Recorder(patterns=PATTERNS)

    def add(self, rec: Recorder, start: int, n: int, cfg: ModelConfig) -> None:
        """The records of one call of ``n`` tokens from position ``start``; a record whose row count is not the
        call's tokens (or entries emitted) is left out."""
        for site in rec.records:
            first, count = start, n
            if site_template(site) not in COMPARED:
                continue
            if site_template(site) in ENTRY_SITES:
                r = cfg.ratio(layer_of(site))
                first, count = start // r, (start + n) // r - start // r
            rows = rec.get(site)
            if rows.shape[0] == count and count:
                self.blocks.setdefault(site, []).append((first, rows))

    def dense(self, site: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [N, ...] with ragged last dims padded (-inf for scores, -1 for ids), mask [N] of the rows held)."""
        blocks = self.blocks[site]
        size = max(first + t.shape[0] for first, t in blocks)
        width = max(t.shape[-1] for _, t in blocks)
        t0 = blocks[0][1]
        fill = float("-inf") if t0.is_floating_point() else -1
        out = torch.full((size, *t0.shape[1:-1], width), fill, dtype=t0.dtype)
        have = torch.zeros(size, dtype=torch.bool)
        for first, t in blocks:
            out[first : first + t.shape[0], ..., : t.shape[-1]] = t
            have[first : first + t.shape[0]] = True
        return out, have


@dataclass
class SiteVerdict:
    """The first site that breaks (``site`` '' when none), how (``check``: structure, bits or bound), ``detail``;
    ``stats``: {site: {statistic: value}} of every site compared (the spread the bounds are measured from)."""

    site: str = ""
    check: str = ""
    detail: str = ""
    stats: dict[str, dict[str, float]] = field(default_factory=dict)


def compare(a: SiteRows, b: SiteRows, positions: list[int], bitwise: bool, cfg: ModelConfig) -> SiteVerdict:
    """Sequence ``b`` against ``a`` at ``positions`` (and the compressed entries both hold), site by site in data-flow
    order; ``bitwise``: equal bits promised."""
    verdict = SiteVerdict()
    pos = torch.tensor(positions, dtype=torch.long)
    for layer in range(cfg.n_layers):
        for template in ORDER:
            site = template.replace("{i}", str(layer))
            if site not in a.blocks or site not in b.blocks:
                continue
            (ra, ha), (rb, hb) = a.dense(site), b.dense(site)
            n = min(len(ha), len(hb))
            if template in ENTRY_SITES:
                idx = torch.nonzero(ha[:n] & hb[:n]).flatten()
            else:
                p = pos[pos < n]
                idx = p[ha[p] & hb[p]]
            if not len(idx):
                continue
            x, y = _same_width(ra[idx], rb[idx], template)
            check, detail, stats = _compare_rows(template, x, y, idx, bitwise, cfg)
            verdict.stats[site] = stats
            if check and not verdict.site:
                verdict.site, verdict.check, verdict.detail = site, check, f"{site}: {detail}"
    return verdict


def _same_width(x: torch.Tensor, y: torch.Tensor, template: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows (index scores, visible sets) padded to one width: a column one side lacks is masked (-inf) or
    empty (-1)."""
    w = max(x.shape[-1], y.shape[-1])
    if x.shape[-1] == y.shape[-1]:
        return x, y
    fill = float("-inf") if x.is_floating_point() else -1
    pad = [torch.nn.functional.pad(t, (0, w - t.shape[-1]), value=fill) for t in (x, y)]
    return pad[0], pad[1]


def _compare_rows(template: str, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, bitwise: bool,
                  cfg: ModelConfig) -> tuple[str, str, dict[str, float]]:
    """(check, detail, stats) of one site's rows ``x`` (side a), ``y`` (side b) [m, ...] at rows ``idx`` [m]."""
    what = "entry" if template in ENTRY_SITES else "position"
    if template == "L{i}.attn.visible":
        return _visible(x, y, idx, bitwise, cfg.window_size)
    if template in SETS:
        return _sets(template, x, y, idx, bitwise)
    xf, yf = x.reshape(len(x), -1), y.reshape(len(y), -1)
    finite_x, finite_y = torch.isfinite(xf), torch.isfinite(yf)
    broken = (finite_x != finite_y).any(-1)
    if broken.any():
        row = int(idx[broken.nonzero()[0, 0]])
        masked = " masked" if template == "L{i}.indexer.scores" else " finite"
        return "structure", (f"the{masked} entries differ at {int(broken.sum())} of {len(idx)} rows, first at "
                             f"{what} {row}"), {"structure_rows": float(broken.sum())}
    xd, yd = xf.double().where(finite_x, 0.0), yf.double().where(finite_y, 0.0)
    unequal = ((xf != yf) & finite_x).any(-1)
    dot, nx, ny = (xd * yd).sum(-1), xd.norm(dim=-1), yd.norm(dim=-1)
    cos = torch.where((nx > 0) & (ny > 0), dot / (nx * ny).clamp_min(1e-300), (nx == ny).double())
    rel = torch.where(nx > 0, (yd - xd).norm(dim=-1) / nx.clamp_min(1e-300),
                      torch.where(ny > 0, float("inf"), 0.0).double())
    stats = {"rows": float(len(idx)), "unequal_rows": float(unequal.sum()), "cos_min": float(cos.min()),
             "rel_l2_max": float(rel.max())}
    if bitwise and unequal.any():
        row = int(idx[unequal.nonzero()[0, 0]])
        return "bits", (f"{int(unequal.sum())} of {len(idx)} rows differ where equal bits are promised, first at "
                        f"{what} {row} (cos {float(cos[unequal].min()):.6f})"), stats
    bound = BOUNDS[template]
    if not bitwise and (stats["cos_min"] < bound.cos_min or stats["rel_l2_max"] > bound.rel_l2_max):
        worst = int(idx[int(cos.argmin())])
        over = int(((cos < bound.cos_min) | (rel > bound.rel_l2_max)).sum())
        return "bound", (f"{over} of {len(idx)} rows past the bounds (cos >= {bound.cos_min}, rel_l2 <= "
                         f"{bound.rel_l2_max}), worst {what} {worst}: cos {stats['cos_min']:.5f}, rel_l2 "
                         f"{stats['rel_l2_max']:.4f}"), stats
    return "", "", stats


def _row_set(row: torch.Tensor) -> frozenset[int]:
    return frozenset(v for v in row.tolist() if v >= 0)


def _id_sets(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids per row of x, y int [n, L] (negative: none) as sets: (|x row|, |y row|, |x row & y row|), int [n] each."""
    sx, fx = unique_sorted(x.long())
    sy, fy = unique_sorted(y.long())
    return fx.sum(-1), fy.sum(-1), (fx & member(sx, sy)).sum(-1)


def _sets(template: str, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
          bitwise: bool) -> tuple[str, str, dict[str, float]]:
    """Id sets per row (top-k picks, routed experts): their sizes are structure, their members bits or bounds."""
    nx, ny, shared = _id_sets(x, y)
    sizes = (nx != ny).nonzero().flatten().tolist()
    if sizes:
        k = sizes[0]
        return "structure", (f"{len(sizes)} of {len(idx)} rows pick another number of ids, first at position "
                             f"{int(idx[k])}: {int(nx[k])} vs {int(ny[k])}"), {"structure_rows": float(len(sizes))}
    recall = torch.where(nx > 0, shared.double() / nx.clamp(min=1).double(), 1.0)
    moved = (recall < 1).nonzero().flatten().tolist()
    stats = {"rows": float(len(idx)), "recall_min": float(recall.min()), "moved_share": len(moved) / len(idx)}
    if bitwise and moved:
        return "bits", (f"{len(moved)} of {len(idx)} rows pick other ids where equal bits are promised, first at "
                        f"position {int(idx[moved[0]])}"), stats
    bound = BOUNDS[template]
    if not bitwise and (stats["recall_min"] < bound.recall_min or stats["moved_share"] > bound.moved_max):
        k = int(recall.argmin())  # the first of the worst rows
        return "bound", (f"{len(moved)} of {len(idx)} rows pick other ids (recall >= {bound.recall_min}, moved <= "
                         f"{bound.moved_max}), worst position {int(idx[k])}: recall {float(recall[k]):.3f}"), stats
    return "", "", stats


def _visible(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, bitwise: bool,
             window: int) -> tuple[str, str, dict[str, float]]:
    """The positions a query sees: the window's (``window`` columns) are structure, as is the number of compressed
    entries; which entries, bits or bounds."""
    nx, ny, shared = _id_sets(x[:, :window], y[:, :window])
    bad = ((nx != ny) | (shared != nx)).nonzero().flatten().tolist()
    if bad:
        k = bad[0]
        only = sorted(_row_set(x[k, :window]) ^ _row_set(y[k, :window]))[:4]
        return "structure", (f"the window positions differ at {len(bad)} of {len(idx)} rows, first at position "
                             f"{int(idx[k])}: {only} on one side only"), {"structure_rows": float(len(bad))}
    return _sets("L{i}.attn.visible", x[:, window:], y[:, window:], idx, bitwise)
