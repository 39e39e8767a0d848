"""Site and rule names come from the site table: every default threshold and every report / plot / compare rule
matches a site (or run row) of the default model, and a misspelt rule is caught."""

from __future__ import annotations

import re

import pytest

import fidelity
from fidelity.decoders.profiles import BUILTIN
from fidelity.harness.judgement import csa_layers, hash_layers
from fidelity.harness.thresholds import (
    COMB_SITES,
    EXPECTED_NONFINITE,
    KV_CACHE_SITES,
    MAIN_SITES,
    NONFINITE_SITES,
    Threshold,
    default_thresholds,
    unmatched_rules,
)
from fidelity.model.load import load_checkpoint
from fidelity.model.sites import ROW, RUN_ROWS, SITE, SITE_TABLE, layer_sites_regex, model_row_sites
from fidelity.outputs.report import LAYER_ERROR_SITES, RESIDUAL_SITE


@pytest.fixture(scope="module")
def default_config():
    return load_checkpoint(fidelity.default_checkpoint()).config


@pytest.fixture(scope="module")
def default_names(default_config):
    return model_row_sites(default_config.n_layers)


@pytest.mark.parametrize("profile", [*BUILTIN, "fp32", "fp64", "bf16"])
@pytest.mark.parametrize("reports_topk", [True, False])
def test_every_default_threshold_rule_matches_a_site_of_the_default_model(profile, reports_topk, default_config,
                                                                           default_names):
    rules = default_thresholds(profile, csa_layers(default_config), reports_topk, hash_layers(default_config),
                               default_config.index_topk, 4096)
    assert unmatched_rules(rules, default_names) == []


def test_every_report_rule_matches_a_site_of_the_default_model(default_names):
    regexes = [LAYER_ERROR_SITES, RESIDUAL_SITE, COMB_SITES, EXPECTED_NONFINITE, NONFINITE_SITES, MAIN_SITES,
               KV_CACHE_SITES, *(h.regex for h in vars(SITE).values()), *(h.regex for h in vars(ROW).values())]
    rules = [Threshold(regex, "cos", ">=", 0) for regex in regexes]
    assert unmatched_rules(rules, default_names) == []


def test_a_misspelt_rule_matches_no_site_and_is_named(default_names):
    typo = Threshold(r"L\d+\.attn\.ouput", "cos", ">=", 0.99)
    good = Threshold(SITE.attn_out.regex, "cos", ">=", 0.99)
    assert unmatched_rules([good, typo], default_names) == [typo]


def test_a_misspelt_site_handle_fails_when_it_is_read():
    with pytest.raises(AttributeError):
        _ = SITE.attn_ouput


def test_site_handles_cover_the_table_and_name_its_sites():
    assert list(vars(SITE).values()) == list(SITE_TABLE)
    assert [h.name for h in vars(ROW).values()] == list(RUN_ROWS)
    assert SITE.attn_q.at(3) == "L3.attn.q" and SITE.logits.at() == SITE.logits.name == "logits"
    with pytest.raises(ValueError, match="attn.q"):
        _ = SITE.attn_q.name


def test_layer_sites_regex_factors_shared_parts_and_matches_exactly_the_named_sites(default_names):
    handles = (SITE.attn_core, SITE.attn_out, SITE.moe_out, SITE.residual)
    regex = layer_sites_regex(*handles, layers="L(2|4)")
    assert regex == r"L(2|4)\.(attn\.(core|out)|moe\.out|residual)"
    matched = [n for n in default_names if re.fullmatch(regex, n)]
    assert matched == [h.at(i) for i in (2, 4) for h in handles]
    assert layer_sites_regex(SITE.indexer_q, SITE.indexer_keys) == r"L\d+\.indexer\.(q|keys)"
    with pytest.raises(ValueError, match="logits"):
        layer_sites_regex(SITE.logits)
