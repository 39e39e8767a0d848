"""A run judged once: the rules that apply to it, every checked row with the rule that judged it, the verdict and
the first divergence.

The rules are resolved when the run is made (defaults from the profile's fields and the config's CSA layers,
then a user's threshold file) and stored in the run's manifest with the verdict. ``fidelity report`` reads them
back, so re-rendering a run without new thresholds reproduces its report and verdict exactly; with a new file,
its rules are appended to the stored ones and the manifest records the new judgement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fidelity.harness.thresholds import (
    TOKEN_FLIP_MARGIN,
    Divergence,
    Threshold,
    ThresholdError,
    apply_thresholds,
    blame_ranks,
    default_thresholds,
    first_divergence,
    load_thresholds,
    profile_class,
    sort_divergence,
    thresholds_for,
)
from fidelity.model.sites import SITE


@dataclass
class Judgement:
    """``rules`` in order (the last matching rule applies), ``judged``: every checked row with ``passed`` and the
    ``rule_index`` that judged it, ``profile_class`` of the defaults."""

    rules: list[Threshold]
    judged: pd.DataFrame
    profile_class: str

    @property
    def failures(self) -> pd.DataFrame:
        """Failing rows in divergence order."""
        return sort_divergence(self.judged[~self.judged["passed"]].drop(columns="passed"))

    @property
    def passed(self) -> bool:
        return bool(self.judged["passed"].all())

    @property
    def first_divergence(self) -> Divergence | None:
        """The first failing check of a whole tensor (a sharded site's ranks judged one by one name the ranks that
        fail it too); where only a rank's own tensor fails (a replicated copy that disagrees), that rank's."""
        failures = self.failures
        if "rank" in failures.columns and failures["rank"].notna().any():
            whole = failures[failures["rank"].isna()]
            div = first_divergence(whole if len(whole) else failures.drop(columns=["rank", "ranks"]))
            return blame_ranks(div, self.judged) if div is not None else None
        return first_divergence(failures)

    def rule_counts(self) -> pd.DataFrame:
        """Per rule (index into ``rules``): rows checked and rows failed; rules that judged nothing get 0."""
        g = self.judged.groupby("rule_index")["passed"]
        counts = pd.DataFrame({"checked": g.size(), "failed": g.size() - g.sum()})
        return counts.reindex(range(len(self.rules)), fill_value=0).astype("int64")

    def unmatched(self) -> list[Threshold]:
        """Rules (not ``off``) that judged no row: a site regex or mode that matches nothing in this run, or a
        rule that every matching row takes from a later one."""
        checked = self.rule_counts()["checked"]
        return [r for k, r in enumerate(self.rules) if r.op != "off" and checked[k] == 0]

    def manifest_entries(self) -> dict:
        """What the run's manifest stores: the rules, the profile class and the verdict."""
        div = self.first_divergence
        return {
            "thresholds": [r.to_dict() for r in self.rules],
            "profile_class": self.profile_class,
            "verdict": {"passed": self.passed, "checked": len(self.judged),
                        "failed": int((~self.judged["passed"]).sum()), "first_divergence": str(div) if div else None},
        }


def judge(df: pd.DataFrame, rules: Sequence[Threshold], klass: str,
          token_margin: float = TOKEN_FLIP_MARGIN) -> Judgement:
    """Judge the metric table ``df`` with ``rules``."""
    return Judgement(list(rules), apply_thresholds(df, rules, token_margin), klass)


def csa_layers(config: Mapping | object | None) -> list[int] | None:
    """The CSA (ratio 4) layers of a ``ModelConfig`` or a manifest's config dict; None when unknown."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        ratios = list(config.get("compress_ratios", []))
        ratios = ratios[: config.get("n_layers", len(ratios))]
        return [i for i, r in enumerate(ratios) if r == 4] if ratios else None
    return [i for i, kind in enumerate(config.layer_kinds) if kind == "csa"]


def hash_layers(config) -> list[int]:
    """The hash-routed layers of a ``ModelConfig``."""
    return [i for i in range(config.n_layers) if config.is_hash_layer(i)]


def rules_for(profile: object, config, decoder_sites: frozenset[str] | None = None,
              path: str | Path | None = None, context: int | None = None) -> list[Threshold]:
    """The rules a run of a decoder with ``profile`` on ``config`` over ``context`` tokens (prompt + decode steps;
    None: unknown) is judged with: the defaults for its profile, its config's CSA and hash layers, its top-k and
    context (the recall floor) and whether it reports its top-k (``decoder_sites``: its site templates; None: the
    built-in decoder, which does), then the rules of the threshold file ``path``."""
    reports_topk = decoder_sites is None or SITE.indexer_topk in decoder_sites
    return thresholds_for(profile, path, csa_layers(config), reports_topk, hash_layers(config), config.index_topk,
                          context)


def stored_rules(manifest: Mapping) -> list[Threshold] | None:
    """The rules a run was judged with, from its manifest; None for a manifest without them."""
    raw = manifest.get("thresholds")
    if raw is None:
        return None
    try:
        return [Threshold(**{**r, "modes": tuple(r.get("modes", ()))}) for r in raw]
    except (TypeError, ThresholdError) as err:
        raise ThresholdError(f"manifest.json: 'thresholds': expected a list of rules, found {raw!r:.200} ({err})") \
            from None


def run_rules(manifest: Mapping, df: pd.DataFrame, extra: str | Path | None = None) -> tuple[list[Threshold], str]:
    """(rules, profile class) for a run: the stored rules, or the defaults of its profile and config when the
    manifest has none, followed by the rules of the threshold file ``extra``."""
    profile = manifest.get("profile") or (str(df["profile"].iloc[0]) if len(df) else "reference")
    klass = manifest.get("profile_class") or profile_class(profile)
    rules = stored_rules(manifest)
    if rules is None:
        config = manifest.get("config")
        context = manifest.get("prompt_len", 0) + manifest.get("decode_steps", 0) or None
        rules = default_thresholds(profile, csa_layers(config),
                                   index_topk=config.get("index_topk") if isinstance(config, Mapping) else None,
                                   context=context)
    return rules + (load_thresholds(extra) if extra is not None else []), klass
