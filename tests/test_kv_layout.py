"""The packed FP8 KV row (``kv_layout``): the cache stores the 584 B layout the FP8-layout attention kernel and
FlashMLA read, byte for byte as an independent assembly of it, and reads back the values it was given."""

import pytest
import torch

from fidelity.decoders.production import kv_layout, ops
from fidelity.decoders.production.cache import KVStore
from fidelity.testing.strategies import _packed_fp8_kv

BF16 = torch.bfloat16


def test_the_fp8_store_holds_the_584_byte_rows_that_are_read_back_exactly():
    g = torch.Generator().manual_seed(0)
    rows = ops.kv_round((torch.randn(6, 512, generator=g) * 3).to(BF16), 64, "fp8")  # what the model stores
    store = KVStore(10, 512, 64, "fp8")
    store.write(torch.tensor([7, 1, 4, 0, 9, 2]), rows)
    slots = torch.tensor([7, 1, 4, 0, 9, 2])
    assert store.packed.shape == (10, 584) and kv_layout.row_bytes(512, 64) == 584
    assert torch.equal(store.packed[slots], _packed_fp8_kv(rows, 64))  # [448 codes | 128 rope | 7 scales | pad]
    assert torch.equal(store.read(slots).view(torch.int16), rows.view(torch.int16))
    assert torch.equal(kv_layout.unpack(store.packed[slots], 512, 64), rows)
    assert store.nbytes() == 10 * 584 and not store.packed[[3, 5, 6, 8]].any()


def test_narrow_widths_get_the_same_layout_padded_to_8_bytes():
    assert kv_layout.row_bytes(128, 64) == 200  # 64 codes + 128 rope + 1 scale + 7 pad
    rows = ops.kv_round(torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(BF16), 64, "fp8")
    packed = kv_layout.pack(rows, 64)
    assert torch.equal(packed, _packed_fp8_kv(rows, 64))
    codes, rope, scales = kv_layout.views(packed, 128, 64)
    assert (codes.shape, rope.shape, scales.shape) == ((3, 64), (3, 64), (3, 1))
    assert torch.equal(rope, rows[:, 64:]) and torch.equal(kv_layout.unpack(packed, 128, 64), rows)


def test_a_0xff_scale_byte_reads_as_nan_and_widths_without_whole_blocks_are_refused():
    packed = kv_layout.pack(torch.ones(1, 512, dtype=BF16), 64)
    packed[0, 576] = 0xFF  # the first block's scale byte: the e8m0 NaN
    out = kv_layout.unpack(packed, 512, 64)
    assert out[0, :64].isnan().all() and not out[0, 64:].isnan().any()
    with pytest.raises(ValueError, match=r"d - 64 rope dims a positive multiple of 64, found \[2, 96\]"):
        kv_layout.pack(torch.zeros(2, 96), 64)
