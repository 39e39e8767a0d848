// Sparse decode attention on the 584 B/token FP8 KV layout (sm_90a): CTA pairs that share dequantized rows,
// KV in 32-row half slots.
//
// A cache row is [448 e4m3 codes | 64 bf16 rope dims (128 B) | 7 ue8m0 scale bytes | 1 pad], 8-byte aligned.
// Semantics are ops.sparse_attention_fp8kv's: online softmax over blocks of 64 indices in idx order, fp32 logits
// times scale, P rounded to bf16 before P.V, the sink in the denominator, -1 indices masked.
//
// Launch: clusters of two CTAs (ranks 0 and 1) per (token, head group). With a multiple of 128 heads each CTA
// takes 64 heads of a 128-head group and all 512 output dims; otherwise (64 heads a group) both CTAs take the same
// 64 heads and 256 output dims each. A CTA is 384 threads:
//   warps 0-7  two math warpgroups. Block j (64 indices) is units 2j and 2j + 1 (32 rows each). Warpgroup w
//              computes S_w = Q[:, 256w:256w+256] K^T over the block, one m64n32k16 wgmma chain per unit as each
//              unit's slot fills; warpgroup 1 hands S_1 to warpgroup 0 through shared memory, warpgroup 0 returns
//              S = S_0 + S_1; both run the same softmax and accumulate O[:, its DV dims] += P V (wgmma m64nDVk16,
//              P from registers, V the units' tiles read MN-major), one commit group per unit, each unit's slot
//              released as soon as its group completes.
//   warps 8-11 the producer warpgroup. Of every 32-row unit, this CTA dequantizes rows 16 rank .. 16 rank + 15
//              (4 per warp): raw bytes staged by 8-byte cp.async two units ahead (two staging buffers), indices
//              loaded into registers eight units at a time one group ahead, dequantized (e4m3 -> f16 -> f32,
//              times 2^(b - 127) in fp32, rounded to bf16: exact, the tile equals kv_layout.unpack's rows) and
//              written to the unit's slot in BOTH CTAs: st.shared here, st.async to the peer (mapa addresses),
//              each st.async completing its bytes on the peer's `full` barrier of the slot.
// Four unit slots (a [32 rows, 512 dims] bf16 tile each, 128-byte swizzle, 8 column chunks of [32 rows, 64 dims])
// so the producers fill up to two units beyond the block the math works on. A slot is free once both math
// warpgroups of both CTAs have arrived on its `empty` barrier in each CTA. Q (64 KB), four 32 KB slots, the S
// exchange (16 KB) and the staged rows (18.7 KB) fill the 227 KB.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int D = 512;
constexpr int BN = 64;                         // indices per online-softmax block
constexpr int UNIT = 32;                       // rows of a slot (half a block)
constexpr int PART = 16;                       // rows of a unit a CTA dequantizes
constexpr int ROW_BYTES = 584;
constexpr int NS = 4;                          // unit slots
constexpr int SLOT_BYTES = UNIT * D * 2;       // one bf16 unit tile
constexpr int CHUNK_BYTES = 64 * 128;          // Q: [64 rows, 64 dims] bf16, 128-byte swizzle
constexpr int KV_CHUNK = UNIT * 128;           // a slot's [32 rows, 64 dims] chunk
constexpr int OFF_Q = 0;                       // Q [64 heads, 512 dims] bf16
constexpr int OFF_KV = OFF_Q + 64 * D * 2;
constexpr int OFF_X = OFF_KV + NS * SLOT_BYTES;  // S exchange: [32 values, 128 threads] fp32
constexpr int OFF_STAGE = OFF_X + 32 * 128 * 4;  // raw rows: two buffers of [16 rows, 584 B]
constexpr int STAGE_BYTES = PART * ROW_BYTES;
constexpr int OFF_MASK = OFF_STAGE + 2 * STAGE_BYTES;  // per slot, one 32-bit word per row: index >= 0
constexpr int OFF_BAR = OFF_MASK + NS * UNIT * 4;  // full[NS], empty[NS]
constexpr int SMEM_BYTES = OFF_BAR + 2 * NS * 8;
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory");
constexpr int THREADS = 384;
constexpr int FULL_ARRIVALS = 4;               // this CTA's 4 producer warps; the peer's part completes bytes
constexpr int PEER_BYTES = PART * D * 2 + PART * 4;  // what the peer's producers store here per unit (st.async)
constexpr int EMPTY_ARRIVALS = 4;              // 2 math warpgroups x 2 CTAs
// registers per thread after setmaxnreg: the launch gives the CTA 384 x 168, so PRODUCER_REGS + 2 MATH_REGS must
// stay within 3 x 168 = 504 (a larger request waits forever for registers)
constexpr int PRODUCER_REGS = 72;
constexpr int MATH_REGS = 216;
static_assert(PRODUCER_REGS + 2 * MATH_REGS <= 504, "setmaxnreg budget");
// named barriers (0 is __syncthreads): Q written, per math warpgroup; S_1 written; S written
constexpr int BAR_Q = 1, BAR_S1 = 3, BAR_S = 4;

struct Params {
    const uint16_t* q;      // bf16 [n, H, 512]
    const uint8_t* kv;      // [m, 584]
    const int32_t* idx;     // [n, topk]
    const float* sink;      // [H]
    uint16_t* o;            // bf16 [n, H, 512]
    int64_t q_sn, q_sh, idx_sn, o_sn, o_sh;
    int topk, groups;
    float scale;
    int parts;              // PART_* bits that run (all but for the diagnosis, which times parts alone)
};

// Params::parts bits: the producers' row copies, the math warpgroups' MMAs and softmax, the producers'
// dequantization and stores
constexpr int PART_LOADS = 1, PART_MATH = 2, PART_DEQUANT = 4;
// diagnosis only: with PART_LOADS off, issue no copies at all (instead of zero-filled ones)
constexpr int PART_NO_COPY = 8;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ uint32_t map_to_rank(uint32_t addr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void bar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// one arrival on the mbarrier at shared::cluster address `bar` (this CTA's or the peer's)
__device__ __forceinline__ void bar_arrive_cluster(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(bar) : "memory");
}

// one arrival on this CTA's mbarrier `bar`
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" :: "r"(bar) : "memory");
}

// one arrival on this CTA's mbarrier `bar` that also expects `bytes` of transactions in the phase
__device__ __forceinline__ void bar_arrive_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" :: "r"(bar),
                 "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// st.async to the peer's shared memory, completing its bytes on the peer's mbarrier `bar`
__device__ __forceinline__ void sts128_peer(uint32_t addr, uint4 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar) : "memory");
}

__device__ __forceinline__ void sts64(uint32_t addr, uint2 v) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" :: "r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

__device__ __forceinline__ void sts64_peer(uint32_t addr, uint2 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                 :: "r"(addr), "r"(v.x), "r"(v.y), "r"(bar) : "memory");
}

// one word to this CTA's shared memory (shared::cta address) and to the peer's (st.async, completing on `bar`)
__device__ __forceinline__ void sts32_both(uint32_t local, uint32_t remote, uint32_t v, uint32_t bar) {
    asm volatile("st.shared.u32 [%0], %2;\nst.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%1], %2, [%3];"
                 :: "r"(local), "r"(remote), "r"(v), "r"(bar) : "memory");
}

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// two e4m3 codes (low byte first) times the fp32 scale -> bf16x2 (low half: the first code). e4m3 -> f16 -> f32
// is exact, the fp32 product is exact (a 4-bit significand times a power of two, subnormal results included), and
// the one rounding is to bf16, as kv_layout.unpack's fp32 product rounded to bf16.
__device__ __forceinline__ uint32_t dequant2(uint32_t codes2, float scale) {
    uint32_t r;
    asm("{\n.reg .b16 c, h0, h1;\n.reg .b32 p;\n.reg .f32 f0, f1;\n"
        "cvt.u16.u32 c, %1;\n"
        "cvt.rn.f16x2.e4m3x2 p, c;\n"
        "mov.b32 {h0, h1}, p;\n"
        "cvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\n"
        "mul.rn.f32 f0, f0, %2;\nmul.rn.f32 f1, f1, %2;\n"
        "cvt.rn.bf16x2.f32 %0, f1, f0;\n}\n"
        : "=r"(r) : "r"(codes2), "f"(scale));
    return r;
}

// eight codes (one 8-byte word) -> eight bf16 (16 bytes)
__device__ __forceinline__ uint4 dequant8(uint2 w, float scale) {
    return make_uint4(dequant2(w.x & 0xFFFF, scale), dequant2(w.x >> 16, scale), dequant2(w.y & 0xFFFF, scale),
                      dequant2(w.y >> 16, scale));
}

// 2^(b - 127) as fp32 (b = 0: the subnormal 2^-127)
__device__ __forceinline__ float ue8m0(uint32_t b) {
    return __uint_as_float(b ? (b << 23) : 0x400000u);
}

// byte offset of (row, 16-byte unit u of the 64 units of a 512-dim row) in a tile: 8 chunks of [64 rows, 128 B],
// the unit's position within its 128-byte row segment XOR-swizzled by row mod 8
__device__ __forceinline__ uint32_t tile_offset(uint32_t row, uint32_t u) {
    return (u >> 3) * CHUNK_BYTES + row * 128 + (((u & 7) ^ (row & 7)) << 4);
}

// byte offset of (row, 16-byte unit u) in a [32 rows, 512 dims] slot: 8 chunks of [32 rows, 128 B]
__device__ __forceinline__ uint32_t kv_offset(uint32_t row, uint32_t u) {
    return (u >> 3) * KV_CHUNK + row * 128 + (((u & 7) ^ (row & 7)) << 4);
}

// shared-memory matrix descriptor, 128-byte swizzle
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
           (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ void wgmma_ss_n32(float* d, uint64_t a, uint64_t b, uint32_t accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_n128(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}

__device__ __forceinline__ void wgmma_rs_n256(float* d, const uint32_t* a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));
}


template <int DV>
__device__ __forceinline__ void wgmma_pv(float* acc, const uint32_t* a, uint64_t b) {
    if constexpr (DV == 256) {
        wgmma_rs_n256(acc, a, b);
    } else {
        wgmma_rs_n128(acc, a, b);
    }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- producer warpgroup: rows 16 rank .. 16 rank + 15 of every 32-row unit, staged two units ahead ----
// A lane handles words lane, lane + 32 and lane + 64 (lane < 9) of each of its warp's rows (73 words a row): word
// lane holds the codes of dims 8 lane .. (chunk lane / 8), word 32 + lane those of dims 256 + 8 lane .. (lane < 24)
// or rope dims 448 + 4 (lane - 24) .., word 64 + lane rope dims 480 + 4 lane .. (lane < 8) or the scale bytes
// (lane 8).
__device__ __forceinline__ void store_row(uint32_t base, uint32_t peer_base, uint32_t peer_full, uint32_t slot,
                                          uint32_t row, uint32_t lane, uint2 w0, uint2 w1, uint2 w2) {
    const uint32_t sw_lo = __shfl_sync(0xffffffffu, w2.x, 8);  // scale bytes 0-3 (word 72)
    const uint32_t sw_hi = __shfl_sync(0xffffffffu, w2.y, 8);  // scale bytes 4-6
    const uint4 v0 = dequant8(w0, ue8m0((sw_lo >> (8 * (lane >> 3))) & 0xFF));
    const uint32_t o0 = slot + kv_offset(row, lane);
    sts128(base + o0, v0);
    sts128_peer(peer_base + o0, v0, peer_full);
    if (lane < 24) {  // chunks 4-6: scale bytes 4-6
        const uint4 v1 = dequant8(w1, ue8m0((sw_hi >> (8 * (lane >> 3))) & 0xFF));
        const uint32_t o1 = slot + kv_offset(row, 32 + lane);
        sts128(base + o1, v1);
        sts128_peer(peer_base + o1, v1, peer_full);
    } else {
        const uint32_t dim = 448 + 4 * (lane - 24);
        const uint32_t o1 = slot + kv_offset(row, dim / 8) + (dim % 8) * 2;
        sts64(base + o1, w1);
        sts64_peer(peer_base + o1, w1, peer_full);
    }
    if (lane < 8) {
        const uint32_t dim = 480 + 4 * lane;
        const uint32_t o2 = slot + kv_offset(row, dim / 8) + (dim % 8) * 2;
        sts64(base + o2, w2);
        sts64_peer(peer_base + o2, w2, peer_full);
    }
}

// Per unit u: wait for unit u's staged rows (copies issued two units earlier), read them into registers, issue
// unit u + 2's copies into the same staging rows, wait for the slot, dequantize and store here and in the peer, the
// mask words, the proxy fence and one arrival per warp (warp 0's also expects the peer's part).
__device__ __forceinline__ void produce(const Params& p, uint8_t* smem, uint32_t rank, int64_t token, int nb) {
    const uint32_t warp = threadIdx.x / 32 - 8, lane = threadIdx.x % 32;
    const uint32_t base = smem_u32(smem);
    const uint32_t peer_base = map_to_rank(base, rank ^ 1);
    const int32_t* idx_row = p.idx + token * p.idx_sn;
    const int nu = 2 * nb;
    const uint32_t row0 = PART * rank + 4 * warp;  // this warp's first row of a unit's 32
    // lane l: the index of row row0 + l % 4 of unit 8 g + l / 4 (-1 past the end)
    auto group_ids = [&](int g) -> int32_t {
        const int e = (8 * g + static_cast<int>(lane >> 2)) * UNIT + static_cast<int>(row0 + (lane & 3));
        return e < p.topk ? __ldg(idx_row + e) : -1;
    };
    const bool copies = (p.parts & PART_LOADS) || !(p.parts & PART_NO_COPY);
    const uint32_t bytes_on = (p.parts & PART_LOADS) ? 8 : 0;
    auto stage = [&](int32_t ids, int u, uint32_t i) {  // unit u's row row0 + i into staging buffer u % 2
        const int32_t id = __shfl_sync(0xffffffffu, ids, (u & 7) * 4 + i);
        const uint8_t* src = p.kv + static_cast<int64_t>(id < 0 ? 0 : id) * ROW_BYTES;
        const uint32_t bytes = id < 0 ? 0 : bytes_on;
        const uint32_t dst = base + OFF_STAGE + (u & 1) * STAGE_BYTES + (4 * warp + i) * ROW_BYTES;
        cp_async8(dst + lane * 8, src + lane * 8, bytes);
        cp_async8(dst + (lane + 32) * 8, src + (lane + 32) * 8, bytes);
        if (lane < 9) cp_async8(dst + (lane + 64) * 8, src + (lane + 64) * 8, bytes);
    };
    int32_t ids_cur = group_ids(0), ids_nxt = group_ids(1);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        if (copies && u < nu) {
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) stage(ids_cur, u, i);
        }
        cp_async_commit();
    }
    for (int u = 0; u < nu; ++u) {
        const int s = u % NS;
        if ((u & 7) == 0 && u > 0) {
            ids_cur = ids_nxt;
            ids_nxt = group_ids(u / 8 + 1);
        }
        cp_async_wait<1>();  // unit u's copies (unit u + 1's may still be in flight)
        const uint32_t stg = base + OFF_STAGE + (u & 1) * STAGE_BYTES + 4 * warp * ROW_BYTES;
        uint2 w[4][3];
#pragma unroll
        for (uint32_t i = 0; i < 4; ++i) {
            w[i][0] = lds64(stg + i * ROW_BYTES + lane * 8);
            w[i][1] = lds64(stg + i * ROW_BYTES + (lane + 32) * 8);
            w[i][2] = lane < 9 ? lds64(stg + i * ROW_BYTES + (lane + 64) * 8) : make_uint2(0, 0);
        }
        if (copies && u + 2 < nu) {  // unit u + 2 into these staging rows (after this lane's reads of them)
            const int32_t ids2 = (u & 7) < 6 ? ids_cur : ids_nxt;
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) stage(ids2, u + 2, i);
        }
        cp_async_commit();
        const int32_t mid = __shfl_sync(0xffffffffu, ids_cur, (u & 7) * 4 + (lane & 3));
        bar_wait(base + OFF_BAR + (NS + s) * 8, ((u / NS) & 1) ^ 1);  // the slot is free in both CTAs
        const uint32_t slot = OFF_KV + s * SLOT_BYTES;
        const uint32_t peer_full = peer_base + OFF_BAR + s * 8;
        if (p.parts & PART_DEQUANT) {
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) {
                store_row(base, peer_base, peer_full, slot, row0 + i, lane, w[i][0], w[i][1], w[i][2]);
            }
        }
        if (lane < 4) {
            const uint32_t m = OFF_MASK + (s * UNIT + row0 + lane) * 4;
            sts32_both(base + m, peer_base + m, mid >= 0 ? 1u : 0u, peer_full);
        }
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {  // warp 0 also expects the peer's part of the unit
            if (warp == 0) {
                bar_arrive_expect(base + OFF_BAR + s * 8, (p.parts & PART_DEQUANT) ? PEER_BYTES : PART * 4);
            } else {
                bar_arrive(base + OFF_BAR + s * 8);
            }
        }
    }
}

// S (this warpgroup's 256 dims) over one unit: columns 32 h .. 32 h + 31 of the block, into s[16 h .. 16 h + 15]
__device__ __forceinline__ void qk_unit(float* s, uint32_t q_tile, uint32_t slot, uint32_t wg) {
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
        const uint32_t c = 4 * wg + kk / 4;
        wgmma_ss_n32(s, smem_desc(q_tile + c * CHUNK_BYTES + (kk % 4) * 32, 16, 1024),
                     smem_desc(slot + c * KV_CHUNK + (kk % 4) * 32, 16, 1024), kk > 0);
    }
}

// ---- math warpgroups ----
template <bool HEAD_SPLIT>
__device__ __forceinline__ void compute(const Params& p, uint8_t* smem, uint32_t rank, int64_t token, int group,
                                        int nb) {
    constexpr int DV = HEAD_SPLIT ? 256 : 128;  // output dims of a warpgroup
    const uint32_t wg = threadIdx.x / 128, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const uint32_t base = smem_u32(smem);
    const uint32_t own_base = map_to_rank(base, rank);
    const uint32_t peer_base = map_to_rank(base, rank ^ 1);
    const int h0 = HEAD_SPLIT ? group * 128 + static_cast<int>(rank) * 64 : group * 64;
    const int d0 = HEAD_SPLIT ? 256 * static_cast<int>(wg) : 256 * static_cast<int>(rank) + DV * static_cast<int>(wg);

    // Q[h0 .., 256 wg .. 256 wg + 255] into chunks 4 wg .. 4 wg + 3
    const uint16_t* q = p.q + token * p.q_sn + static_cast<int64_t>(h0) * p.q_sh + 256 * wg;
#pragma unroll 4
    for (int it = 0; it < 16; ++it) {
        const uint32_t lin = it * 128 + t, row = lin / 32, unit = lin % 32;
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(q + row * p.q_sh + unit * 8));
        sts128(base + OFF_Q + tile_offset(row, 32 * wg + unit), v);
    }
    fence_proxy_async();
    named_sync(BAR_Q + wg, 128);

    float acc[DV / 2];
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) acc[i] = 0.f;
    float s[32];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows r0 = 16 warp + lane / 4, r1 = r0 + 8
    const uint32_t qcol = 2 * (lane % 4);
    float* xch = reinterpret_cast<float*>(smem + OFF_X) + t;
    const uint32_t q_tile = base + OFF_Q;
    const bool math = p.parts & PART_MATH;
    auto release = [&](int sl) {  // this warpgroup is done with slot sl (its wgmmas on it completed)
        const uint32_t e = OFF_BAR + (NS + sl) * 8;
        if (t == 0) bar_arrive_cluster(own_base + e);
        if (t == 32) bar_arrive_cluster(peer_base + e);
    };

    if (!math) {  // diagnosis: the handshakes alone
        for (int j = 0; j < nb; ++j) {
            bar_wait(base + OFF_BAR + ((2 * j) % NS) * 8, ((2 * j) / NS) & 1);
            bar_wait(base + OFF_BAR + ((2 * j + 1) % NS) * 8, ((2 * j + 1) / NS) & 1);
            __syncwarp();
            release((2 * j) % NS);
            release((2 * j + 1) % NS);
        }
        nb = 0;
    }
    for (int j = 0; j < nb; ++j) {
        const int ua = 2 * j, ub = 2 * j + 1;
        const int sa = ua % NS, sb = ub % NS;
        const uint32_t slot_a = base + OFF_KV + sa * SLOT_BYTES, slot_b = base + OFF_KV + sb * SLOT_BYTES;
        uint32_t valid[8];  // byte 0: column 8k + qcol is a row, byte 1: column 8k + qcol + 1
        bar_wait(base + OFF_BAR + sa * 8, (ua / NS) & 1);
        fence_proxy_async();  // the rows stored by both CTAs' producers, then read by wgmma
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint2 v = *reinterpret_cast<const uint2*>(smem + OFF_MASK + (sa * UNIT + 8 * k + qcol) * 4);
            valid[k] = (v.x ? 1u : 0u) | (v.y ? 0x100u : 0u);
        }
        wgmma_fence();
        qk_unit(s, q_tile, slot_a, wg);
        wgmma_commit();
        bar_wait(base + OFF_BAR + sb * 8, (ub / NS) & 1);
        fence_proxy_async();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint2 v = *reinterpret_cast<const uint2*>(smem + OFF_MASK + (sb * UNIT + 8 * k + qcol) * 4);
            valid[4 + k] = (v.x ? 1u : 0u) | (v.y ? 0x100u : 0u);
        }
        wgmma_fence();
        qk_unit(s + 16, q_tile, slot_b, wg);
        wgmma_commit();
        wgmma_wait<0>();
        // S = S_0 + S_1, the same fp32 values in both warpgroups
        if (wg == 1) {
#pragma unroll
            for (int i = 0; i < 32; ++i) xch[i * 128] = s[i];
            named_arrive(BAR_S1, 256);
            named_sync(BAR_S, 256);
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] = xch[i * 128];
        } else {
            named_sync(BAR_S1, 256);
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                s[i] += xch[i * 128];
                xch[i * 128] = s[i];
            }
            named_arrive(BAR_S, 256);
        }
        // logits x scale, masked; the block's row max
        float bm0 = -INFINITY, bm1 = -INFINITY;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool ok = (valid[k] >> (8 * (e & 1))) & 0xFF;
                float v = s[4 * k + e] * p.scale;
                v = ok ? v : -INFINITY;
                s[4 * k + e] = v;
                if (e < 2) bm0 = fmaxf(bm0, v); else bm1 = fmaxf(bm1, v);
            }
        }
        bm0 = fmaxf(bm0, __shfl_xor_sync(0xffffffffu, bm0, 1));
        bm0 = fmaxf(bm0, __shfl_xor_sync(0xffffffffu, bm0, 2));
        bm1 = fmaxf(bm1, __shfl_xor_sync(0xffffffffu, bm1, 1));
        bm1 = fmaxf(bm1, __shfl_xor_sync(0xffffffffu, bm1, 2));
        const float n0 = fmaxf(m0, bm0), n1 = fmaxf(m1, bm1);
        const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
        const float a0 = exp2_approx((m0 - u0) * 1.4426950408889634f);
        const float a1 = exp2_approx((m1 - u1) * 1.4426950408889634f);
        float r0 = 0.f, r1 = 0.f;
        uint32_t pa[16];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float p0 = exp2_approx((s[4 * k] - u0) * 1.4426950408889634f);
            const float p1 = exp2_approx((s[4 * k + 1] - u0) * 1.4426950408889634f);
            const float p2 = exp2_approx((s[4 * k + 2] - u1) * 1.4426950408889634f);
            const float p3 = exp2_approx((s[4 * k + 3] - u1) * 1.4426950408889634f);
            r0 += p0 + p1;
            r1 += p2 + p3;
            pa[2 * k] = pack_bf16(p0, p1);
            pa[2 * k + 1] = pack_bf16(p2, p3);
        }
        r0 += __shfl_xor_sync(0xffffffffu, r0, 1);
        r0 += __shfl_xor_sync(0xffffffffu, r0, 2);
        r1 += __shfl_xor_sync(0xffffffffu, r1, 1);
        r1 += __shfl_xor_sync(0xffffffffu, r1, 2);
        l0 = l0 * a0 + r0;
        l1 = l1 * a1 + r1;
        m0 = n0;
        m1 = n1;
#pragma unroll
        for (int i = 0; i < DV / 8; ++i) {
            acc[4 * i] *= a0;
            acc[4 * i + 1] *= a0;
            acc[4 * i + 2] *= a1;
            acc[4 * i + 3] *= a1;
        }
        // O += P V: rows 0-31 from slot a, rows 32-63 from slot b, one commit group each
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {  // rows 16 kk .. 16 kk + 15 of the unit; A: P's columns 16 kk ..
            const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
            wgmma_pv<DV>(acc, a, smem_desc(slot_a + (d0 / 64) * KV_CHUNK + kk * 2048, KV_CHUNK, 1024));
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 2; kk < 4; ++kk) {
            const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
            wgmma_pv<DV>(acc, a, smem_desc(slot_b + (d0 / 64) * KV_CHUNK + (kk - 2) * 2048, KV_CHUNK, 1024));
        }
        wgmma_commit();
        wgmma_wait<1>();
        release(sa);
        wgmma_wait<0>();
        release(sb);
    }

    // O = acc / (l + exp(sink - m)), bf16
    const int hr0 = h0 + 16 * static_cast<int>(warp) + static_cast<int>(lane / 4), hr1 = hr0 + 8;
    const float L0 = l0 + exp2_approx((p.sink[hr0] - m0) * 1.4426950408889634f);
    const float L1 = l1 + exp2_approx((p.sink[hr1] - m1) * 1.4426950408889634f);
    uint16_t* o0 = p.o + token * p.o_sn + static_cast<int64_t>(hr0) * p.o_sh + d0 + qcol;
    uint16_t* o1 = p.o + token * p.o_sn + static_cast<int64_t>(hr1) * p.o_sh + d0 + qcol;
#pragma unroll
    for (int i = 0; i < DV / 8; ++i) {
        *reinterpret_cast<uint32_t*>(o0 + 8 * i) = pack_bf16(__fdiv_rn(acc[4 * i], L0), __fdiv_rn(acc[4 * i + 1], L0));
        *reinterpret_cast<uint32_t*>(o1 + 8 * i) =
            pack_bf16(__fdiv_rn(acc[4 * i + 2], L1), __fdiv_rn(acc[4 * i + 3], L1));
    }
}

template <bool HEAD_SPLIT>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS, 1) fp8kv_pair_kernel(const Params p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t rank = cluster_rank();
    const int cluster = blockIdx.x / 2;
    const int64_t token = cluster / p.groups;
    const int group = cluster % p.groups;
    const int nb = (p.topk + BN - 1) / BN;
    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; ++s) {
            bar_init(smem_u32(smem + OFF_BAR + s * 8), FULL_ARRIVALS);
            bar_init(smem_u32(smem + OFF_BAR + (NS + s) * 8), EMPTY_ARRIVALS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_sync();  // both CTAs' barriers exist before either CTA arrives on the other's
    if (threadIdx.x >= 256) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGS));
        produce(p, smem, rank, token, nb);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(MATH_REGS));
        compute<HEAD_SPLIT>(p, smem, rank, token, group, nb);
    }
    cluster_sync();  // neither CTA leaves while the other may still write to its shared memory
}

}  // namespace

// q bf16 [n, H, 512] (last dim contiguous, 16-byte aligned rows), kv uint8 [m, 584] contiguous, idx int32 [n, topk]
// (last dim contiguous), sink fp32 [H], o bf16 [n, H, 512]; H a multiple of 64; parts: PART_* bits (7: all).
// Returns a cudaError_t.
extern "C" int fidelity_fp8kv_pair_launch(const void* q, const void* kv, const void* idx, const void* sink, void* o,
                                          int n, int heads, int topk, int64_t q_sn, int64_t q_sh, int64_t idx_sn,
                                          int64_t o_sn, int64_t o_sh, float scale, int parts,
                                          cudaStream_t stream) {
    Params p{static_cast<const uint16_t*>(q), static_cast<const uint8_t*>(kv), static_cast<const int32_t*>(idx),
             static_cast<const float*>(sink), static_cast<uint16_t*>(o), q_sn, q_sh, idx_sn, o_sn, o_sh, topk, 0,
             scale, parts};
    const bool head_split = heads % 128 == 0;
    p.groups = head_split ? heads / 128 : heads / 64;
    const dim3 grid(2 * p.groups * n), block(THREADS);
    cudaError_t err;
    if (head_split) {
        err = cudaFuncSetAttribute(fp8kv_pair_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
        if (err == cudaSuccess) fp8kv_pair_kernel<true><<<grid, block, SMEM_BYTES, stream>>>(p);
    } else {
        err = cudaFuncSetAttribute(fp8kv_pair_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
        if (err == cudaSuccess) fp8kv_pair_kernel<false><<<grid, block, SMEM_BYTES, stream>>>(p);
    }
    return static_cast<int>(err == cudaSuccess ? cudaGetLastError() : err);
}
