"""Testing your own kernel against the oracle: copy this into your suite and swap in your kernel.

Your kernel takes the production op's arguments (see ``fidelity.decoders.production.ops``); ``check_against_oracle``
draws inputs with hypothesis, runs your kernel (on ``device=...`` if given) and compares it with the fp64
oracle under the op's contract (``fidelity.testing.contract_of(op)``).
"""

import torch

from fidelity.testing import check_against_oracle


def my_sparse_attention(q, kv, idx, sink, scale, fmt="bf16"):
    """Dense masked softmax with the sink as one extra logit column (it has no value row).

    q [n, H, d] bf16, kv [m, d] bf16 (K = V), idx [n, K] int32 (-1 = masked), sink [H] fp32 -> [n, H, d] bf16.
    """
    valid = idx >= 0
    rows = torch.where(valid[..., None], kv[idx.clamp(min=0).long()].float(), 0.0)  # [n, K, d]
    logits = torch.einsum("nhd,nkd->nhk", q.float(), rows) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_column = sink.float()[None, :, None].expand(len(q), -1, 1)
    p = torch.cat((logits, sink_column), dim=-1).softmax(dim=-1)[..., :-1]  # drop the sink's share
    return torch.einsum("nhk,nkd->nhd", p, rows).to(torch.bfloat16)


def test_my_sparse_attention_matches_the_oracle():
    check_against_oracle("sparse_attention", my_sparse_attention, max_examples=25)  # add device="cuda" for GPU
