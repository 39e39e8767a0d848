"""Test your own kernels against the oracle: one contract per production op (spec §3-§4).

Every op of ``fidelity.decoders.production.registry.OPS`` names its :class:`OpContract` (an attribute of
``fidelity.testing.contracts``; :func:`contract_of`) and its input strategy (a function of
``fidelity.testing.strategies``; :func:`strategy_of`):

* a hypothesis strategy of :class:`Case` objects: inputs with the *kernel signature* (argument order, shapes
  and dtypes as the production model calls the op: bf16 activations, fp32 weights / sinks / mixing
  coefficients, int32 attention indices), drawn to cover what ports get wrong: lengths around the 4 / 64 /
  128 boundaries, top-k wider than the entries available, an empty compressed cache, -1 indices anywhere
  after the always-valid first one, whole 64-blocks of -1, 1..16 heads, RoPE positions up to 2^20, a NaN;
* the expected result: the oracle op (``oracles/``) in fp64 on the same inputs (kind ``tolerance``), or a
  bit-exact reference function (kind ``bitexact``: ``kv_round`` and ``indexer_round``, whose exact-math oracles are
  the identity and the rotation);
* per output, a :class:`Tolerance` derived from the rounding steps the official reference itself takes.

A per-element relative error ``<= r`` gives, for every row (last dim), ``calc_diff = |x-y|^2/(|x|^2+|y|^2)
<= r^2/2`` and ``1 - cos <= r^2/2``; r counts the bf16 roundings (u = 2^-8) on the reference path, x1.25
for the fp32 arithmetic around them. Non-finite values must sit exactly where the expected result has them;
metrics use the coordinates finite in both.

=====================  ==========================================================================
op                     limit (per row; u = 2^-8)
=====================  ==========================================================================
act_linear             |err| <= (2^-4 + k 2^-23) sum_k |x_k w_jk| + 1.25u |y| elementwise (one e4m3 rounding)
rms_norm, hc_post,     r = 1.25u: calc_diff <= 1.19e-5, cos >= 1 - 1.19e-5 (one rounding)
hc_head, hc_pre.y      (apply_rope: same, and the nope dims exactly unchanged)
rms_norm_weightless    calc_diff <= 1.46e-4 (r = 3.5 x 1.25u, bf16 ops); cos >= 1 - 1.19e-5
sparse_attention       r = 2.5u: calc_diff, 1 - cos <= 4.77e-5 (P and the output rounded to bf16)
index_scores,          |err| <= 4u sum_h |w_h| relu(q_h.k) + d 2^-23 sum_h |w_h| |q_h|.|k| elementwise
index_scores_fp4       (on the dequantized FP4 keys)
sinkhorn_split, gate,  r = 2^-14 (fp32 math): calc_diff, 1 - cos <= 1.86e-9; gate indices: same set
hc_pre.pre/post/comb
expert                 r = 2 x 2^-4 + 4u (two e4m3 activation roundings): calc_diff <= 9.9e-3, cos >= 0.990
kv_round               bit-exact vs fake_quant_fp8(nope, 1x64, scale_floor) + unchanged rope dims
indexer_round          bit-exact vs hadamard then fake_quant_fp4 (1x32; or the FP8 1x128 round)
compressor_decode      entry: r = 3 x 1.25u (pool, norm, RoPE each rounded to bf16); carries: r = 2^-14 (fp32)
rms_norm_fp8           codes: |code*s - y| <= half an e4m3 step + 1.25u|y|; scale bytes of the exact amax
rms_norm_act_quant     y: as rms_norm; xq: rms_norm_fp8's bound on code * scale
kv_norm_rope_fp8       nope: half an e4m3 step (1x64) + 1.25u|y|; rope: 2 x 1.25u (|y_2i| + |y_2i+1|) elementwise
=====================  ==========================================================================

Usage (in your pytest suite)::

    from fidelity.testing import check_against_oracle

    def test_my_kernel():
        check_against_oracle("sparse_attention", my_sparse_attention, device="cuda")

Requires hypothesis (the ``test`` extra).
"""

from fidelity.testing import strategies
from fidelity.testing.cases import Case, OpContract, Output, Tolerance
from fidelity.testing.check import check_against_oracle, check_all_registered, check_case
from fidelity.testing.contracts import contract_of, indexer_round_reference, kv_round_reference, strategy_of

__all__ = [
    "Case",
    "OpContract",
    "Output",
    "Tolerance",
    "check_against_oracle",
    "check_all_registered",
    "check_case",
    "contract_of",
    "indexer_round_reference",
    "kv_round_reference",
    "strategies",
    "strategy_of",
]
