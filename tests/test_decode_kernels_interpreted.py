"""The decode step's element-wise kernels without a GPU: Triton's CPU interpreter runs them (in a subprocess, since
the interpreter is chosen when the kernels are defined): ``indexer_round`` against its bit-exact contract and the
emulation's bits, ``apply_rope`` against its contract, the decode GEMVs' in-launch activation quantization against
the separate one, the FP4 expert GEMV's e8m0 scale bytes (0, 1, 127, 254, 255) against the emulation's bits and
the GEMV against its contract.
Skipped where triton is not installed (the test extra installs it on Linux)."""

import pytest

pytest.importorskip("triton")

from tests.interpreted import run_checks  # noqa: E402

CHECKS = ["indexer_round_contract", "queries_64_heads", "key_signed_zeros_unrotated", "e2m1_ties_to_even",
          "extreme_scales", "apply_rope_contract", "rope_keeps_the_nope_dims",
          "gemvs_quantize_in_kernel_as_the_separate_launch",
          "k_sliced_gemv_adds_the_slices_in_order_and_resets_its_counts",
          "expert_w1_w3_in_one_launch_give_the_two_launches_bits", "expert_contract",
          "e8m0_scale_decodes_every_byte_as_formats", "fp4_gemv_scale_bytes_0_1_127_254_255_give_the_emulations_bits",
          "moe_sum_gives_the_loops_bits",
          "swiglu_close_to_the_emulation", "gate_contract", "decode_slots_give_the_references_integers",
          "compressor_decode_contract", "put_at_block_end_writes_the_row_only_where_the_block_completes",
          "mask_past_hides_the_entries_past_the_limit", "rms_norm_weightless_contract", "fp4_picked_linear_contract"]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return run_checks("decode_kernel_checks")


def test_the_interpreted_run_reports_every_check(interpreted):
    assert sorted(interpreted) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted_decode_kernel_check_passes(interpreted, check):
    assert interpreted[check] == "", f"{check}: {interpreted[check]}"
