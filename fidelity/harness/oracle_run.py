"""The oracle on its own: prefill a prompt, decode greedily, and summarise per layer (``fidelity oracle``).

The summary checks the oracle's own consistency too: the decode steps' logits are compared with one
full-sequence forward over the same tokens (they must agree to rounding).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fidelity.model.sampling import Sampler, StopSet, generate
from fidelity.model.sites import SITE, Recorder
from oracles import OracleModel

ORACLE_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}  # the names the CLI and run manifests use


def dtype_name(dtype: torch.dtype) -> str:
    """'fp32' / 'fp64' (the CLI's names) for an oracle dtype."""
    return next((k for k, v in ORACLE_DTYPES.items() if v == dtype), str(dtype).removeprefix("torch."))


@dataclass
class OracleSummary:
    prompt_len: int
    decode_steps: int
    dtype: str
    seconds_prefill: float
    seconds_decode: float
    seconds_full: float
    generated: list[int]
    decode_vs_full_rel_err: float
    layers: list[dict[str, float | int | str]] = field(default_factory=list)
    logits_std: float = 0.0
    prompt_nll: float = float("nan")  # mean next-token NLL (nats) of prompt[1:] under the prefill's logits
    text: str | None = None  # the greedy continuation as text (with a tokenizer)


def _rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def layer_rows(rec: Recorder, kinds: tuple[str, ...]) -> list[dict[str, float | int | str]]:
    """Per layer: residual RMS, sublayer output RMS, Sinkhorn deviations, NaN count (prefill records)."""
    rows = []
    for i, kind in enumerate(kinds):
        res = rec.get(SITE.residual.at(i))
        comb = torch.cat([rec.get(SITE.mhc_attn_comb.at(i)), rec.get(SITE.mhc_ffn_comb.at(i))])
        rows.append({
            "layer": i,
            "kind": kind,
            "residual_rms": _rms(res),
            "attn_out_rms": _rms(rec.get(SITE.attn_out.at(i))),
            "moe_out_rms": _rms(rec.get(SITE.moe_out.at(i))),
            "sinkhorn_row_dev": float((comb.sum(-1) - 1).abs().max()),
            "sinkhorn_col_dev": float((comb.sum(-2) - 1).abs().max()),
            "nonfinite": int((~torch.isfinite(res)).sum()),
        })
    return rows


def run_oracle(checkpoint, prompt: torch.Tensor, decode_steps: int, dtype: torch.dtype = torch.float32,
               progress=None, tokenizer=None) -> OracleSummary:
    """Prefill ``prompt`` [T], greedily decode ``decode_steps`` tokens (``sampling.generate``, the one generation
    loop), then re-run the whole sequence and compare its logits with the incremental ones.
    ``tokenizer``: also give the continuation as text."""
    model = OracleModel(checkpoint, dtype)
    rec = Recorder([r"L\d+\.(residual|attn\.out|moe\.out|mhc_(attn|ffn)\.comb)"])
    session = model.session(rec)
    t0 = time.perf_counter()
    if progress:
        progress(f"prefill ({len(prompt)} tokens)", 0, 1, "oracle")
    logits = session.prefill(prompt)
    if progress:
        progress(f"prefill ({len(prompt)} tokens)", 1, 1, "oracle")
    t1 = time.perf_counter()
    rows = layer_rows(rec, checkpoint.config.layer_kinds)
    session.rec = None
    steps = [logits[-1]]

    def step(token: int) -> torch.Tensor:
        steps.append(session.step(token))
        if progress:
            progress("decode", len(steps) - 1, decode_steps)
        return steps[-1]

    generated = generate(lambda _: steps[0], step, prompt, decode_steps, Sampler(), StopSet.of([])).ids  # greedy
    t2 = time.perf_counter()
    tokens = torch.cat([prompt, torch.tensor(generated, dtype=torch.long)])
    if progress:
        progress(f"full-sequence check ({len(tokens)} tokens)", 0, 1, "oracle")
    full = model.logits(tokens)[len(prompt) - 1 : len(prompt) - 1 + len(steps)]
    if progress:
        progress(f"full-sequence check ({len(tokens)} tokens)", 1, 1, "oracle")
    t3 = time.perf_counter()
    inc = torch.stack(steps)
    err = float(((inc - full).abs().amax(-1) / full.abs().amax(-1)).max())
    nll = float(torch.nn.functional.cross_entropy(logits[:-1].double(), prompt[1:])) if len(prompt) > 1 else math.nan
    return OracleSummary(
        prompt_len=len(prompt), decode_steps=decode_steps, dtype=dtype_name(dtype),
        seconds_prefill=t1 - t0, seconds_decode=t2 - t1, seconds_full=t3 - t2, generated=generated,
        decode_vs_full_rel_err=err, layers=rows, logits_std=float(logits.std()), prompt_nll=nll,
        text=tokenizer.decode(generated) if tokenizer is not None else None,
    )


def format_summary(s: OracleSummary, title: str, vocab_size: int | None = None) -> str:
    lines = [
        title,
        f"prompt {s.prompt_len} tokens, {s.decode_steps} greedy decode step{'' if s.decode_steps == 1 else 's'}, "
        f"{s.dtype}",
        f"time: prefill {s.seconds_prefill:.2f} s, decode {s.seconds_decode:.2f} s "
        f"({1000 * s.seconds_decode / max(s.decode_steps, 1):.0f} ms/token), "
        f"full-sequence re-run {s.seconds_full:.2f} s",
        "",
        "layer kind residual_rms attn_out_rms moe_out_rms sinkhorn|row-1| sinkhorn|col-1| nonfinite",
    ]
    for r in s.layers:
        lines.append(
            f"{r['layer']:>5} {r['kind']:>4} {r['residual_rms']:>12.4g} {r['attn_out_rms']:>12.4g} "
            f"{r['moe_out_rms']:>11.4g} {r['sinkhorn_row_dev']:>15.2e} {r['sinkhorn_col_dev']:>15.2e} "
            f"{r['nonfinite']:>9}"
        )
    lines += [
        "",
        f"prompt logits std: {s.logits_std:.4g}",
        f"prompt NLL: {s.prompt_nll:.4f} nats/token over {max(s.prompt_len - 1, 0)} predicted tokens "
        f"(uniform: {math.log(vocab_size):.4f})" if vocab_size else f"prompt NLL: {s.prompt_nll:.4f} nats/token",
        f"greedy continuation (first 16): {s.generated[:16]}",
        f"incremental decode vs full-sequence logits: max rel err {s.decode_vs_full_rel_err:.2e}",
    ]
    if s.text is not None:
        lines += ["", "greedy continuation as text:", s.text]
    return "\n".join(lines)
