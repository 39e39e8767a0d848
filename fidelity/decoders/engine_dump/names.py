"""Name maps: an engine's tensor names -> the harness's sites (``fidelity/model/sites.py``).

A map is a TOML file (the built-in ones: ``fidelity/data/engines/<engine>.toml``, docs/engines.md):

```toml
engine = "sglang"
about = "where the names come from"
[meta]                      # the batch metadata the engine dumps beside the tensors (token alignment)
input_ids = "input_ids"
positions = "positions"
seq_lens = "seq_lens"
rids = "rids"
req_pool_indices = "req_pool_indices"
logits = "next_token_logits"
[[rule]]
match = 'non_intrusive__model\\.layers\\.(?P<layer>\\d+)\\.self_attn\\.output'   # full match on the name
site = "L{i}.attn.out"      # a site template; {i}: the ``layer`` group, else the dump's layer_id tag
dims = "t h # tp:replicated"   # optional: how ranks join when the dump carries no dims annotation
lead = 1                    # optional: leading dims that are rows (2 for [batch, tokens, ...] outputs)
```

Names ``fidelity.<site>`` (what ``fidelity run --write-dump`` writes for sites SGLang has no module for) are that
site in every map. A rule with ``site = ""`` names tensors that are known and not compared (kept out of the report's
list of unmapped names). A user's map (``--site-map FILE``) is read first, so its rules win; ``base =
"transformers"`` in it names the built-in map read after it (default: the dump format's engine), ``replace = true``
reads none.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from fidelity.decoders.engine_dump.dims import DimsError, parse_dims
from fidelity.model.sites import SITE_TABLE, is_site, site_name

ENGINES = ("sglang", "transformers", "vllm")
OWN_PREFIX = "fidelity."  # ``fidelity.<site>``: a site of ours by its own name (what ``--write-dump`` writes)
META_FIELDS = ("input_ids", "positions", "seq_lens", "rids", "req_pool_indices", "logits")


class NameMapError(ValueError):
    """A name map that cannot be used; the message names the file and the rule."""


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    site: str  # a template, "" = known and not compared
    dims: str | None
    lead: int
    source: str


OWN_RULE = Rule(re.compile(re.escape(OWN_PREFIX) + ".*"), "", None, 1, "fidelity.<site> names")


@dataclass
class NameMap:
    """Rules in order (the first match wins) and the batch metadata names."""

    rules: list[Rule]
    meta: dict[str, str]
    sources: list[str] = field(default_factory=list)

    def site_of(self, name: str, layer: int | None) -> tuple[str, Rule] | None:
        """(site name, rule) for an engine tensor ``name`` (``layer``: the dump's layer_id tag); ("", rule) for a
        name known and not compared; None for a name no rule matches."""
        for rule in self.rules:
            m = rule.pattern.fullmatch(name)
            if m is None:
                continue
            if not rule.site:
                return "", rule
            if "{i}" not in rule.site:
                return rule.site, rule
            found = m.groupdict().get("layer")
            i = int(found) if found is not None else layer
            if i is None:
                raise NameMapError(f"{rule.source}: rule {rule.pattern.pattern!r} -> {rule.site}: {name!r} has no "
                                   "layer (no 'layer' group matched and the dump gives no layer_id)")
            return site_name(rule.site, i), rule
        own = name.removeprefix(OWN_PREFIX)
        if own != name and is_site(own):
            return own, OWN_RULE
        return None

    def meta_name(self, field_name: str) -> str | None:
        return self.meta.get(field_name)


def builtin_map(engine: str) -> Path:
    if engine not in ENGINES:
        raise NameMapError(f"name map: expected one of {', '.join(ENGINES)}, found {engine!r}")
    return Path(str(resources.files("fidelity") / "data" / "engines" / f"{engine}.toml"))


def load_map(engine: str, user: str | Path | None = None) -> NameMap:
    """The engine's built-in map, after the rules of a user's map file ``user`` (its ``meta`` entries win)."""
    parts = []
    if user is not None:
        parts.append(_read(Path(user)))
        engine = parts[0][3] or engine
    if not (parts and parts[0][2]):
        parts.append(_read(builtin_map(engine)))
    rules = [r for rs, *_ in parts for r in rs]
    meta: dict[str, str] = {}
    for _, m, *_ in reversed(parts):
        meta.update(m)
    return NameMap(rules, meta, [src for *_, src in parts])


def _read(path: Path) -> tuple[list[Rule], dict[str, str], bool, str | None, str]:
    """(rules, meta, replace, base, source) of the map file ``path``."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise NameMapError(f"name map {path}: cannot read: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise NameMapError(f"name map {path}: not valid TOML: {err}") from None
    unknown = sorted(set(raw) - {"engine", "about", "meta", "rule", "replace", "base"})
    if unknown:
        raise NameMapError(f"name map {path}: unknown key {unknown[0]!r} (expected engine, about, meta, rule, "
                           "base, replace)")
    base = raw.get("base")
    if base is not None and base not in ENGINES:
        raise NameMapError(f"name map {path}: base: expected one of {', '.join(ENGINES)}, found {base!r}")
    meta = raw.get("meta", {})
    if not isinstance(meta, dict) or any(k not in META_FIELDS or not isinstance(v, str) for k, v in meta.items()):
        raise NameMapError(f"name map {path}: [meta]: expected names for {', '.join(META_FIELDS)}, found {meta!r}")
    rules = [_rule(path, k, r) for k, r in enumerate(raw.get("rule", []))]
    return rules, meta, bool(raw.get("replace", False)), base, str(path)


def _rule(path: Path, k: int, r) -> Rule:
    where = f"name map {path}: rule {k + 1}"
    if not isinstance(r, dict) or set(r) - {"match", "site", "dims", "lead"} or "match" not in r or "site" not in r:
        raise NameMapError(f"{where}: expected match, site and optionally dims, lead; found {r!r}")
    try:
        pattern = re.compile(r["match"])
    except re.error as err:
        raise NameMapError(f"{where}: match {r['match']!r} is not a regex: {err}") from None
    site = r["site"]
    if site and site not in SITE_TABLE:
        raise NameMapError(f"{where}: site {site!r} is not a site template (fidelity.model.sites.SITES, e.g. "
                           "'L{i}.attn.out')")
    if r.get("dims") is not None:
        try:
            parse_dims(r["dims"])
        except DimsError as err:
            raise NameMapError(f"{where}: {err}") from None
    lead = r.get("lead", 1)
    if not isinstance(lead, int) or lead < 1:
        raise NameMapError(f"{where}: lead: expected an integer >= 1 (leading dims that are rows), found {lead!r}")
    return Rule(pattern, site, r.get("dims"), lead, str(path))
