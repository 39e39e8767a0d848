"""The warp-specialized FP4 indexer (``kernels/indexer_ws.py``) without a GPU: the reasons it gives for inputs it
cannot take, the argument checks made before a launch, and its key unpack (the PTX string, interpreted) against
the e2m1 values and the queries' dim order. (The rest runs inside the Gluon kernel, which the CPU interpreter
cannot run: tests/gpu/test_indexer_ws.py covers it.)"""

import pytest
import torch

pytest.importorskip("triton")
indexer = pytest.importorskip("fidelity.decoders.production.kernels.indexer")
indexer_ws = pytest.importorskip("fidelity.decoders.production.kernels.indexer_ws")


def _inputs(n=1, h=64, e=100):
    return (torch.zeros(n, h, 128, dtype=torch.bfloat16), torch.zeros(e, 64, dtype=torch.uint8),
            torch.zeros(e, 4, dtype=torch.uint8), torch.zeros(n, h, dtype=torch.bfloat16))


def test_ws_refuses_cpu_tensors_and_names_the_reason():
    q, packed, scales, w = _inputs()
    assert indexer_ws.takes(q, packed, scales) == "needs CUDA tensors q [n, H, d], packed [e, d/2], scales [e, d/32]"
    with pytest.raises(ValueError, match="mma 'ws' cannot run: needs CUDA tensors"):
        indexer.index_scores_fp4(q, packed, scales, w, mma="ws")


def test_an_unknown_mma_is_refused():
    with pytest.raises(ValueError, match="mma: expected 'auto', 'fp8', 'bf16' or 'ws', found 'tf32'"):
        indexer.index_scores_fp4(*_inputs(), mma="tf32")


def test_ws_refuses_weights_or_positions_of_the_wrong_shape_before_launching():
    q, packed, scales, w = _inputs(n=2)
    with pytest.raises(ValueError, match=r"weights \[2, 64\] and positions \[2\] expected .* found weights \[2, 32\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w[:, :32])
    with pytest.raises(ValueError, match=r"found weights \[2, 64\], positions \[3\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, torch.zeros(3, dtype=torch.int64))


def test_ws_refuses_a_consumer_count_it_has_no_build_for_before_launching():
    q, packed, scales, w = _inputs(n=2)
    with pytest.raises(ValueError, match="consumers must be 2, or 4 for one query, found 3 for 2 queries"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, consumers=3)
    with pytest.raises(ValueError, match="consumers must be 2, or 4 for one query, found 4 for 2 queries"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, consumers=4)


def test_ws_refuses_a_paths_counter_of_the_wrong_dtype_or_shape_before_launching():
    q, packed, scales, w = _inputs()
    with pytest.raises(ValueError, match=r"paths must be int32 \[2\] on cpu, found torch.int64 \[2\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"found torch.int32 \[3\]"):
        indexer_ws.index_scores_fp4_ws(q, packed, scales, w, paths=torch.zeros(3, dtype=torch.int32))


def _run_ptx(asm: str, regs: dict) -> dict:
    """Interprets the straight-line PTX of an inline-asm string (b32 and, or, shl, shr, prmt) on Python ints."""
    body = asm.strip().strip("{}").split(";")
    for line in body:
        words = line.replace(",", " ").split()
        if not words or words[0] == ".reg":
            continue
        op, dst, *src = words
        val = [regs[s] if s in regs else int(s, 0) for s in src]
        if op == "and.b32":
            out = val[0] & val[1]
        elif op == "or.b32":
            out = val[0] | val[1]
        elif op == "shl.b32":
            out = (val[0] << val[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            out = val[0] >> val[1]
        elif op == "prmt.b32":  # default mode: byte n of {b, a} picked by selector nibble n; bit 3 replicates the msb
            pool = val[0].to_bytes(4, "little") + val[1].to_bytes(4, "little")
            out = 0
            for n in range(4):
                sel = (val[2] >> (4 * n)) & 0xF
                byte = pool[sel & 7]
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * n)
        else:
            raise AssertionError(f"no interpreter for {op}")
        regs[dst] = out
    return regs


def _unpack_word(word: int, k: int) -> tuple[bytes, bytes]:
    """The kernel's unpack of 4 packed bytes with a block offset k: the e4m3 bytes x (elements 0-3) and y (4-7)."""
    lo, hi = k * 0x08080800 + indexer_ws._TABLE_LO.value, k * 0x08080808 + indexer_ws._TABLE_HI.value
    regs = _run_ptx(indexer_ws._UNPACK.value, {"$2": word, "$3": lo, "$7": hi})
    return regs["$0"].to_bytes(4, "little"), regs["$1"].to_bytes(4, "little")


def test_unpack_asm_gives_the_folded_e4m3_codes_of_every_nibble():
    """The kernel's PTX unpack, interpreted: for every packed byte value and block offset k = 0..SPREAD, x holds
    elements 0-3 and y elements 4-7 of the word, each the e2m1 value times 2^(k - 5) exactly (signed zeros
    kept)."""
    from fidelity.model.formats import FP4_VALUES

    e2m1 = [(-1.0 if n & 8 else 1.0) * FP4_VALUES[n & 7] for n in range(16)]
    for k in range(indexer_ws.SPREAD + 1):
        for b in range(256):
            word = b * 0x01010101 ^ 0x00A05F30  # four different bytes built from b
            x, y = _unpack_word(word, k)
            codes = torch.tensor(list(x + y), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            want = torch.tensor([e2m1[(word >> (4 * i)) & 0xF] * 2.0 ** (k - 5) for i in range(8)])
            assert torch.equal(codes, want) and torch.equal(codes.signbit(), want.signbit()), (k, hex(word))


def test_key_operands_and_query_reorder_put_the_same_dim_in_every_column():
    """Operand j of a key (``_unpack_half``): column 16a + 4t + i holds element 4a + i of word j of block t, i.e.
    dim 32t + 8j + 4a + i; the queries' reorder (``_query_half``, mirrored here with the kernel's reshape, permute
    and split) puts that same dim of q in that column, so the four chained K = 32 products sum q . k."""
    from fidelity.model.formats import FP4_VALUES

    e2m1 = [(-1.0 if n & 8 else 1.0) * FP4_VALUES[n & 7] for n in range(16)]
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)  # one key: 4 blocks of 16 bytes
    natural = torch.tensor([e2m1[(int(packed[d // 2]) >> (4 * (d % 2))) & 0xF] * 2.0 ** (3 - 5) for d in range(128)])
    q = torch.arange(128.0)
    for j in range(4):
        operand, dim_at = [0] * 32, [0] * 32
        for t in range(4):
            x, y = _unpack_word(int.from_bytes(bytes(packed[16 * t + 4 * j:16 * t + 4 * j + 4].tolist()), "little"), 3)
            for a, half in enumerate((x, y)):
                for i in range(4):
                    operand[16 * a + 4 * t + i], dim_at[16 * a + 4 * t + i] = half[i], 32 * t + 8 * j + 4 * a + i
        codes = torch.tensor(operand, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        assert torch.equal(codes, natural[dim_at])
        c, jp = divmod(j, 2)  # consumer c codes operands 2c and 2c + 1 from dims 32t + 16c .. 32t + 16c + 15
        x = q.reshape(4, 32)[:, 16 * c:16 * c + 16]  # [t, u]
        reordered = x.reshape(4, 2, 2, 4).permute(2, 0, 3, 1).reshape(32, 2)[:, jp]
        assert torch.equal(reordered, q[dim_at])


def _scores_bf16_steps(s: torch.Tensor, w: torch.Tensor, f: float, folded: bool) -> torch.Tensor:
    """Per key: sum_h bf16(w_h * relu(bf16(s_h * f))) in fp32 (heads in order), rounded to bf16; ``folded``: the
    power of two f applied to the fp32 head sum instead (the ws kernel's folded path)."""
    bf16 = torch.bfloat16
    x = s if folded else s * f
    t = (x.to(bf16).relu() * w.to(bf16)).float()
    head_sum = t.cumsum(dim=-1, dtype=torch.float32)[..., -1]
    return (head_sum * f if folded else head_sum).to(bf16)


def test_a_power_of_two_after_the_head_sum_gives_the_reference_scores_inside_the_kernels_bounds():
    """The folded path multiplies the head sum by F = 2^fe instead of every q.k; the kernel takes it only for fe in
    [max(-101 - a, -108), min(95 - b, 101)] with nonzero weights in [2^a, 2^(b + 1)) (``_query_params``) and
    unscaled sums in [2^-18, 2^25]. At both ends of that range the scores equal the reference order of steps bit
    for bit; 30 powers of two below it, with small sums, they do not (subnormal products round differently)."""
    g = torch.Generator().manual_seed(1)
    a, b = -20, -6
    mant = torch.randint(1 << 7, 1 << 8, (4000, 64), generator=g).double()
    s = (mant * torch.randint(-1, 2, (4000, 64), generator=g) * 2.0 ** torch.randint(-25, 18, (4000, 64),
                                                                                    generator=g)).float()
    w = (torch.randint(1 << 7, 1 << 8, (64,), generator=g).double() * torch.randint(-1, 2, (64,), generator=g)
         * 2.0 ** torch.randint(a - 7, b - 6, (64,), generator=g)).float()
    w[0], w[1] = 2.0**a, -(2.0 ** (b + 1)) * (1 - 2.0**-8)  # both ends of the weight range
    lo, hi = max(-101 - a, -108), min(95 - b, 101)
    for fe in (lo, hi, 0):
        f = 2.0**fe
        assert torch.equal(_scores_bf16_steps(s, w, f, True), _scores_bf16_steps(s, w, f, False)), fe
    small = s.abs().clamp(max=2.0**-9) * s.sign()  # sums near 2^-18: their products reach the subnormals first
    f = 2.0 ** (lo - 30)
    assert not torch.equal(_scores_bf16_steps(small, w, f, True), _scores_bf16_steps(small, w, f, False))
