"""Route choice of the CUDA sparse attention, checked without a GPU: which kernel a config selects, the refusals,
and how the warp-specialized kernel lays out its CTAs (one or two consumer warpgroups)."""

import pytest
import torch

pytest.importorskip("triton")
sparse_attention = pytest.importorskip("fidelity.decoders.production.kernels.sparse_attention")
ws = pytest.importorskip("fidelity.decoders.production.kernels.sparse_attention_ws")

BF16 = torch.bfloat16


def _inputs():
    return torch.zeros(2, 64, 512, dtype=BF16), torch.zeros(10, 512, dtype=BF16), torch.zeros(2, 8, dtype=torch.int32)


def test_triton_launch_parameters_select_the_triton_route():
    q, kv, idx = _inputs()
    assert sparse_attention._route(q, kv, idx, "bf16", {"block_h": 32}) == ("triton", {"block_h": 32})
    assert sparse_attention._route(q, kv, idx, "bf16", {"route": "triton"}) == ("triton", None)


def test_a_ws_route_that_cannot_run_says_why():
    q, kv, idx = _inputs()  # CPU tensors: the ws kernel refuses them
    with pytest.raises(ValueError, match="route 'ws' cannot run: needs CUDA tensors"):
        sparse_attention._route(q, kv, idx, "bf16", {"route": "ws"})
    with pytest.raises(ValueError, match=r"\['consumers'\] is a parameter of route 'ws', which does not run here "
                                         r"\(needs CUDA tensors"):
        sparse_attention._route(q, kv, idx, "bf16", {"consumers": 2})
    with pytest.raises(ValueError, match=r"\['consumers'\] is a parameter of route 'ws'.*\(config route 'triton'\)"):
        sparse_attention._route(q, kv, idx, "bf16", {"route": "triton", "consumers": 2})
    with pytest.raises(ValueError, match=r"\(Triton launch parameters \['block_h'\] given\)"):
        sparse_attention._route(q, kv, idx, "bf16", {"block_h": 32, "consumers": 2})


@pytest.mark.parametrize("n, heads, expected", [
    (64, 64, 1),  # Flash decode b64: 128 CTAs of 32 heads fit one wave of 132 SMs
    (64, 128, 2),  # Pro decode b64: 256 CTAs would take two waves; 128 CTAs of 64 heads take one
    (1, 64, 1), (1, 128, 1),  # batch 1: one wave either way, and one consumer is the faster CTA
    (32, 128, 1),  # Pro decode b32: 128 CTAs of 32 heads fit one wave
    (128, 64, 2),  # Flash decode b128: two waves of one-consumer CTAs against one wave of two-consumer CTAs
    (512, 64, 2), (4096, 128, 2),  # prefill-sized grids: half the waves
    (300, 96, 1),  # 96 heads: not a multiple of 64
])
def test_two_consumers_are_chosen_when_they_save_waves(n, heads, expected):
    assert ws.consumers_for(n, heads, sms=132) == expected
