"""Sites: the stable names of the tensors both models emit (docs/design.md "Sites"). One table, one source of truth.

``{i}`` is the layer index. Shapes are per call: ``n`` new tokens, ``H`` heads, ``hc`` mHC streams,
``W`` window size, ``K`` index_topk (or the number of visible HCA entries), ``m`` new compressed entries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from types import SimpleNamespace

import torch

from fidelity.model.formats import packed_kv_row_bytes

PROBES = ("similarity", "residual", "logits", "sinkhorn", "indexer_recall", "visible_range", "routing",
          "routing_weights", "kv_storage")


@dataclass(frozen=True)
class Site:
    """One row of the site table.

    ``shape``: the dims after the first (token or entry) dim, as ``ModelConfig`` field names (None where they
    vary from call to call). ``probe``: how a pair of records is compared (``harness.site_pairs``):
    ``similarity`` (cosine, calc_diff, ...), ``residual`` (also the streams' norms), ``logits`` (also token
    agreement), ``sinkhorn``, ``indexer_recall``, ``visible_range``, ``routing`` (expert sets), ``routing_weights``,
    ``kv_storage`` (a decoder's stored cache bytes against its own ``attn.kv`` and the profile's FP8 scale rule;
    no oracle record: only a decoder that stores packed FP8 rows reports it).
    ``every_step``: compared at every decode step (False: in the prefill only; its errors show downstream).
    ``per_position``: a prefill also gets per-position cosine rows. ``after_routing``: compared on the tokens both
    models routed to the same experts (a routing flip is counted once, at ``moe.experts``). ``gated``: its cosine
    and calc_diff are held to the profile's limits in op and layer modes (``harness.thresholds``)."""

    shape: tuple[str, ...] | None
    probe: str
    what: str
    every_step: bool = True
    per_position: bool = False
    after_routing: bool = False
    gated: bool = False


SITE_TABLE: dict[str, Site] = {
    "embed": Site(("dim",), "similarity", "[n, dim] token embeddings", every_step=False),
    "L{i}.mhc_attn.pre": Site(("hc_mult",), "similarity",
                              "[n, hc] hc_pre collapse weights before attention", every_step=False),
    "L{i}.mhc_attn.post": Site(("hc_mult",), "similarity",
                               "[n, hc] hc_post expand weights after attention", every_step=False),
    "L{i}.mhc_attn.comb": Site(("hc_mult", "hc_mult"), "sinkhorn",
                               "[n, hc, hc] Sinkhorn-projected residual mixing matrix (applied transposed)"),
    "L{i}.attn.in": Site(("dim",), "similarity",
                         "[n, dim] attention input (hc_pre collapse, then attn_norm)", every_step=False),
    "L{i}.attn.q": Site(("n_heads", "head_dim"), "similarity",
                        "[n, H, head_dim] queries after weightless norm and RoPE", gated=True),
    "L{i}.attn.kv": Site(("head_dim",), "similarity", "[n, head_dim] window KV rows after norm and RoPE",
                         gated=True),
    "L{i}.attn.kv_cache": Site(("kv_row_bytes",), "kv_storage",
                               "[n, row_bytes] uint8 the window KV rows as the cache stores them for the call's "
                               "tokens (spec §5 FP8 layout: e4m3 nope codes, bf16 rope dims, ue8m0 1x64 scale bytes, "
                               "zero pad; 584 B at head_dim 512); kv_storage=fp8 decoders only"),
    "L{i}.attn.compressed_kv": Site(("head_dim",), "similarity",
                                    "[m, head_dim] compressed entries emitted by this call (after norm and RoPE)",
                                    gated=True),
    "L{i}.indexer.q": Site(("index_n_heads", "index_head_dim"), "similarity",
                           "[n, index_n_heads, index_head_dim] indexer queries after RoPE"),
    "L{i}.indexer.keys": Site(("index_head_dim",), "similarity",
                              "[m, index_head_dim] indexer keys emitted by this call"),
    "L{i}.indexer.weights": Site(("index_n_heads",), "similarity",
                                 "[n, index_n_heads] per-head index weights (weights_proj x scalings)",
                                 every_step=False),
    "L{i}.indexer.scores": Site(None, "similarity", "[n, entries] index scores, -inf where j >= (t+1)//4"),
    "L{i}.indexer.topk": Site(("index_topk",), "indexer_recall",
                              "[n, index_topk] selected compressed entries, -1 = none"),
    "L{i}.attn.visible": Site(None, "visible_range",
                              "[n, W + K] window token positions then compressed entry ids, -1 = padding"),
    "L{i}.attn.core": Site(("n_heads", "head_dim"), "similarity",
                           "[n, H, head_dim] attention output before inverse RoPE", gated=True),
    "L{i}.attn.out": Site(("dim",), "similarity",
                          "[n, dim] attention sublayer output (after the grouped output projection)", gated=True),
    "L{i}.mhc_ffn.pre": Site(("hc_mult",), "similarity",
                             "[n, hc] hc_pre collapse weights before the MoE", every_step=False),
    "L{i}.mhc_ffn.post": Site(("hc_mult",), "similarity",
                              "[n, hc] hc_post expand weights after the MoE", every_step=False),
    "L{i}.mhc_ffn.comb": Site(("hc_mult", "hc_mult"), "sinkhorn",
                              "[n, hc, hc] Sinkhorn-projected residual mixing matrix before the MoE"),
    "L{i}.moe.in": Site(("dim",), "similarity",
                        "[n, dim] MoE input (hc_pre collapse, then ffn_norm)", every_step=False),
    "L{i}.moe.scores": Site(("n_routed_experts",), "similarity",
                            "[n, n_routed_experts] gate selection scores (score_func + bias; score-routed layers)"),
    "L{i}.moe.experts": Site(("n_activated_experts",), "routing", "[n, n_activated_experts] routed expert ids"),
    "L{i}.moe.weights": Site(("n_activated_experts",), "routing_weights",
                             "[n, n_activated_experts] routing weights (normalised, x route_scale)"),
    "L{i}.moe.out": Site(("dim",), "similarity", "[n, dim] MoE output (routed + shared)", after_routing=True,
                         gated=True),
    "L{i}.residual": Site(("hc_mult", "dim"), "residual",
                          "[n, hc, dim] mHC streams leaving layer i", per_position=True, after_routing=True,
                          gated=True),
    "final": Site(("dim",), "similarity", "[n, dim] hc_head collapse followed by the final norm", gated=True),
    "logits": Site(("vocab_size",), "logits", "[n, vocab] output logits", per_position=True, gated=True),
}
SITES: dict[str, str] = {template: site.what for template, site in SITE_TABLE.items()}  # in data-flow order


@cache  # the names of a model's sites: a few hundred, looked up for every pair compared
def site_template(name: str) -> str:
    """``L3.attn.q`` -> ``L{i}.attn.q`` (names outside the layers are their own template)."""
    return re.sub(r"^L\d+\.", "L{i}.", name)


def site_of(name: str) -> Site:
    """The table row of a site name (``L3.attn.q``) or template (``L{i}.attn.q``)."""
    return SITE_TABLE[site_template(name)]


def _kv_row_bytes(cfg) -> int:
    return packed_kv_row_bytes(cfg.head_dim, cfg.rope_head_dim)


DERIVED_DIMS = {"kv_row_bytes": _kv_row_bytes}  # shape names that are not ModelConfig fields


def trailing_shape(template: str, cfg) -> tuple[int, ...] | None:
    """The shape of a record of site ``template`` after its first (token or entry) dim, from ``cfg``
    (a ``ModelConfig``; ``DERIVED_DIMS`` for the packed KV row's bytes); None where it varies from call to call
    (index scores, visible sets)."""
    shape = SITE_TABLE[template].shape
    if shape is None:
        return None
    return tuple(DERIVED_DIMS[f](cfg) if f in DERIVED_DIMS else getattr(cfg, f) for f in shape)


def site_name(template: str, layer: int | None = None) -> str:
    """``("L{i}.attn.q", 3)`` -> ``L3.attn.q``; a template outside the table raises KeyError."""
    if template not in SITE_TABLE:
        raise KeyError(f"unknown site template {template!r}; templates are listed in fidelity.model.sites.SITES")
    return template.replace("{i}", str(layer)) if layer is not None else template


def same_layer(template: str, name: str) -> str:
    """``template``'s site in the layer of the site ``name``: ``("L{i}.indexer.scores", "L3.indexer.topk")`` ->
    ``L3.indexer.scores``."""
    return site_name(template, int(name[1:name.index(".")]))


LAYER_PREFIX = "L{i}."
# data-flow order of the sites inside one layer ("attn.q", ...) and of those before and after the layers
LAYER_SITE_ORDER: tuple[str, ...] = tuple(t.removeprefix(LAYER_PREFIX) for t in SITE_TABLE
                                           if t.startswith(LAYER_PREFIX))
_FIRST_LAYER_SITE = next(i for i, t in enumerate(SITE_TABLE) if t.startswith(LAYER_PREFIX))
SITES_BEFORE_LAYERS: tuple[str, ...] = tuple(SITE_TABLE)[:_FIRST_LAYER_SITE]
SITES_AFTER_LAYERS: tuple[str, ...] = tuple(t for t in tuple(SITE_TABLE)[_FIRST_LAYER_SITE:]
                                            if not t.startswith(LAYER_PREFIX))
# the mHC sites of a layer by (sublayer, part): ("attn", "comb") -> "L{i}.mhc_attn.comb"
MHC_SITES: dict[tuple[str, str], str] = {
    (t.split(".")[1].removeprefix("mhc_"), t.split(".")[2]): t for t in SITE_TABLE if t.startswith("L{i}.mhc_")}


def _template_regex(template: str) -> str:
    return re.escape(template).replace(re.escape("{i}"), r"\d+")


SITE_PATTERN = re.compile("^(" + "|".join(_template_regex(t) for t in SITES) + ")$")


def sites_regex(keep) -> str:
    """A regex matching every site name whose table row satisfies ``keep(Site)`` (full match), in table order."""
    return "|".join(_template_regex(t) for t, site in SITE_TABLE.items() if keep(site))


def is_site(name: str) -> bool:
    return SITE_PATTERN.match(name) is not None


# Rows a run's metric table holds under names of their own, outside the site table (the run's loop: token agreement,
# the sampler, stop conditions, repetition, memory, a decoder that raised), in report order after the sites.
RUN_ROWS: tuple[str, ...] = ("tokens", "sampler", "stops", "repetition", "memory", "decoder")


class SiteHandle(str):
    """A site template (or run row) reached by attribute, ``SITE.attn_q``, so that a misspelt name fails when the
    module loads instead of matching nothing. It is the template itself (a ``str``: ``"L{i}.attn.q"``, usable where
    a template is), with ``at(3)``: ``L3.attn.q``; ``regex``: every layer's name, ``L\\d+\\.attn\\.q`` (a site
    outside the layers: its own name, escaped)."""

    __slots__ = ()

    @property
    def suffix(self) -> str:
        """The name inside a layer (``attn.q``); the whole name outside the layers."""
        return self.removeprefix(LAYER_PREFIX)

    @property
    def in_layer(self) -> bool:
        return self.startswith(LAYER_PREFIX)

    @property
    def regex(self) -> str:
        return _template_regex(self)

    @property
    def name(self) -> str:
        """The name of a site outside the layers or of a run row (``logits``, ``memory``); ValueError for a layer's."""
        if self.in_layer:
            raise ValueError(f"{self}: a layer's site has a name per layer; expected .at(layer)")
        return str(self)

    def at(self, layer: int | None = None) -> str:
        """The site's name in ``layer`` (None outside the layers)."""
        return str(site_name(self, layer)) if self in SITE_TABLE else str(self)


def model_row_sites(n_layers: int) -> list[str]:
    """Every site name of a model of ``n_layers`` layers in data-flow order, then the run rows: the names a run's
    metric table can hold."""
    names = list(SITES_BEFORE_LAYERS)
    names += [f"L{i}.{suffix}" for i in range(n_layers) for suffix in LAYER_SITE_ORDER]
    return [*names, *SITES_AFTER_LAYERS, *RUN_ROWS]


def _handle_attr(template: str) -> str:
    return template.removeprefix(LAYER_PREFIX).replace(".", "_")


# SITE.embed, SITE.attn_q, SITE.mhc_attn_comb, SITE.moe_out, SITE.residual, SITE.logits, ...: one per table row;
# ROW.tokens, ROW.memory, ...: one per run row.
SITE = SimpleNamespace(**{_handle_attr(t): SiteHandle(t) for t in SITE_TABLE})
ROW = SimpleNamespace(**{name: SiteHandle(name) for name in RUN_ROWS})


def layer_sites_regex(*handles: SiteHandle, layers: str = r"L\d+") -> str:
    """A regex matching the named sites of the layers ``layers`` matches, the names' shared leading parts factored
    out in the order given:
    ``(SITE.attn_core, SITE.attn_out, SITE.moe_out)`` -> ``L\\d+\\.(attn\\.(core|out)|moe\\.out)``. A handle
    outside the layers raises ValueError."""
    if outside := [str(h) for h in handles if not h.in_layer]:
        raise ValueError(f"layer_sites_regex: expected sites inside the layers (L{{i}}.*), found {outside}")
    return layers + r"\." + _alternatives([h.suffix.split(".") for h in handles])


def _alternatives(paths: list[list[str]]) -> str:
    """Dotted name parts -> one regex, alternatives grouped by their first part (first appearance order)."""
    groups: dict[str, list[list[str]]] = {}
    for path in paths:
        groups.setdefault(path[0], []).append(path[1:])
    parts = []
    for head, tails in groups.items():
        rest = [t for t in tails if t]
        if not rest:
            parts.append(re.escape(head))
        elif len(tails) == 1:
            parts.append(re.escape(".".join([head, *rest[0]])))
        elif len(rest) < len(tails):  # the name itself and names below it
            parts.append(re.escape(head) + r"(\." + _alternatives(rest) + ")?")
        else:
            parts.append(re.escape(head) + r"\." + _alternatives(rest))
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


@dataclass
class Recorder:
    """Collects tensors at the sites whose names match any of ``patterns`` (regexes; default: all).

    Each call appends ``(step, tensor)``; ``step`` is the index of the model call (prefill = 0).
    Tensors are detached copies on ``device`` (None: on the device they come from, e.g. a GPU's memory).
    ``rows`` (call rows, ascending) with ``rows_only`` (site templates): those sites keep only these rows of the
    call, counted across the parts a site is recorded in (a prefill's index scores come one query chunk at a time).
    """

    patterns: Iterable[str] = (".*",)
    records: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    step: int = 0
    device: str | None = "cpu"
    rows: torch.Tensor | None = None
    rows_only: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self._compiled = [re.compile(p) for p in self.patterns]
        self._seen_rows: dict[str, int] = {}
        self.at_rows: dict[str, torch.Tensor] = {}  # site -> the call rows its record holds (recorded ``at``)
        self.parts: dict[str, list[tuple[int, int, int | None, torch.Tensor]]] = {}  # site -> rank tensors

    def part(self, site: str, rank: int, ranks: int, dim: int | None, tensor: torch.Tensor) -> None:
        """Rank ``rank`` of ``ranks``'s own tensor of ``site`` (recorded whole as well): its part along ``dim`` of
        the whole, or with ``dim`` None a whole copy (a replicated tensor); the runner judges each rank's."""
        if self.wants(site):
            self.parts.setdefault(site, []).append((rank, ranks, dim, tensor.detach()))

    def wants(self, site: str) -> bool:
        return any(p.fullmatch(site) for p in self._compiled)

    def __call__(self, site: str, tensor: torch.Tensor, kept: bool = False, at: torch.Tensor | None = None) -> None:
        """Record ``tensor`` at ``site``; ``kept``: it holds only the rows :meth:`kept_rows` names, in order (a
        model that computed just those), so no rows are selected here; ``at``: it holds these rows of the call alone
        (an engine's logits at each sequence's last row), compared with the same rows of the oracle's."""
        if not is_site(site):
            raise KeyError(f"unknown site {site!r}; sites are listed in fidelity.model.sites.SITES")
        if at is not None and self.wants(site):
            self.at_rows[site] = at
        if self.wants(site):
            if self.kept_rows(site) is not None and not kept:
                tensor = self._select_kept(site, tensor)
            copy = tensor.detach().clone() if self.device is None else tensor.detach().to(self.device, copy=True)
            self.records.setdefault(site, []).append((self.step, copy))

    def kept_rows(self, site: str) -> torch.Tensor | None:
        """The call rows (ascending) this recorder keeps of ``site``; None where it keeps every row."""
        return self.rows if self.rows is not None and site_template(site) in self.rows_only else None

    def _select_kept(self, site: str, part: torch.Tensor) -> torch.Tensor:
        """The rows of ``part`` [m, ...] that are in ``rows``, ``part`` being the call's rows after those recorded
        at ``site`` so far."""
        start = self._seen_rows.get(site, 0)
        self._seen_rows[site] = start + part.shape[0]
        inside = self.rows[(self.rows >= start) & (self.rows < start + part.shape[0])] - start
        return part.index_select(0, inside.to(part.device))

    def get(self, site: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        """All records of ``site`` concatenated along dim 0 (tokens); ragged last dims are -1/-inf padded. A site
        recorded once is returned as stored, not copied (a prefill chunk's records reach a GiB): read it, do not
        modify it. ``rows``: those rows of the call only (a site recorded at ``rows`` alone is returned whole)."""
        parts = [t for _, t in self.records.get(site, [])]
        if not parts:
            raise KeyError(f"site {site!r} was not recorded")
        if len(parts) == 1:
            whole = parts[0]
        else:
            if parts[0].ndim >= 2 and len({p.shape[-1] for p in parts}) > 1:
                width = max(p.shape[-1] for p in parts)
                fill = -1 if not parts[0].is_floating_point() else float("-inf")
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=fill) for p in parts]
            whole = torch.cat(parts, dim=0)
        if rows is None:
            return whole
        if self.kept_rows(site) is not None:
            if not torch.equal(rows.cpu(), self.rows.cpu()):
                raise ValueError(f"{site}: recorded at rows {self.rows.tolist()}, asked for rows {rows.tolist()}")
            return whole
        return whole[rows.to(whole.device)]


def record(rec, template: str, layer: int | None, tensor) -> None:
    """Hand ``tensor`` (or, lazily, what a callable returns) to ``rec`` as the site ``template`` of ``layer`` (None
    outside the layers) when ``rec`` wants that site; nothing without a recorder. What every model's ``emit`` does."""
    if rec is None:
        return
    site = site_name(template, layer)
    if rec.wants(site):
        rec(site, tensor() if callable(tensor) else tensor)
