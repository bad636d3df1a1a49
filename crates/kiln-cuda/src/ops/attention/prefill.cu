// Flash-attention-2 style prefill over the paged cache: tensor cores through inline-PTX
// mma.sync.m16n8k16 bf16 -> f32, ldmatrix, cp.async.
//
// Semantics match `paged_attention_bf16` (reference.cu): row r attends keys
// max(0, pos[r] + 1 - window) ..= pos[r] of its sequence (window <= 0: from 0),
// score = (q . k) * scale, then tanh(score / softcap) * softcap when softcap > 0,
// online softmax in f32, GQA head h -> kv head h / (heads / kv_heads).
//
// Common layout (all pointers are device pointers):
//   q:        row r, head h at q + r * q_stride + h * HEAD_DIM            (bf16)
//   k_cache, v_cache: [num_slots, kv_heads * HEAD_DIM]   (bf16; the _fp8 entries E4M3, widened
//             to bf16 as their chunks are staged, kv_elem.cuh)
//   slot of key p of sequence s = tables[s * table_width + p / block_size] * block_size + p % block_size
//   pos[r]:     position of row r;  row_seq[r]: sequence (block-table row) of row r
//   out:      row r, head h at out + r * out_stride + h * HEAD_DIM          (bf16)
// Alignment assumptions: q, out, k_cache, v_cache 16-byte aligned; q_stride and
// out_stride multiples of 8 elements (true for packed qkv rows with HEAD_DIM >= 64).
//
// Entry points (each for HEAD_DIM 64, 128, 256: suffixes _hd64, _hd128, _hd256):
//
//   flash_prefill_hdN(q, q_stride, k_cache, v_cache, pos, row_seq, tables, table_width,
//                     block_size, tiles, heads, kv_heads, kv_stride, scale, window, softcap, out, out_stride,
//                     sinks)   (sinks: null, or a sink logit a query head, as decode.cu's)
//     LAUNCH RULE (changed): grid (num_tiles, heads) (gridDim.y must equal heads), block 128 threads (4 warps),
//     tiles of at most KILN_FA_TILE_ROWS = 128 rows (any count 1..128 works; 128 is fastest),
//     dynamic shared memory SMEM_BYTES(HD) = 768 * (HD + 8) + 512 bytes:
//       HD 64: 55808, HD 128: 104960, HD 256: 203264 (all need the max-dynamic-smem attribute).
//     tiles[2t] = first row of tile t, tiles[2t+1] = its row count (1..128); the rows of a
//     tile belong to one sequence and have consecutive positions. Order the tiles longest
//     (most keys) first: CTAs run tile-major (all heads of tile 0, then tile 1, ...).
#include "common.cuh"
#include "kv_elem.cuh"

#define KILN_FA_TILE_ROWS 128
#define KILN_FA_KEYS 64
#define KILN_FA_SMEM_BYTES(HD) (768 * ((HD) + 8) + 512)

__device__ __forceinline__ unsigned int smem_u32(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int& r0, unsigned int& r1, unsigned int& r2, unsigned int& r3,
                                            unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int& r0, unsigned int& r1, unsigned int& r2,
                                                  unsigned int& r3, unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<unsigned int*>(&v);
}

__device__ __forceinline__ float fa_exp2(float x) {  // 2^x; ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Cache slot of key `key` (or 0 past `last_key`: those rows are zero-filled, not loaded).
__device__ __forceinline__ unsigned int fa_slot(const unsigned int* __restrict__ table, int block_size, int key,
                                                int last_key) {
    if (key > last_key) return 0u;
    const unsigned int k = (unsigned int)key, bs = (unsigned int)block_size;
    return table[k / bs] * bs + k % bs;
}

// Gather 64 key rows (K and V) of one kv head into shared memory with cp.async, the slots
// taken from `slots` (shared memory); keys past `last_key` are zero-filled (their scores
// are masked, and P = 0 must not meet garbage NaNs in V).
template <int HD, typename KV>
__device__ __forceinline__ void fa_load_kv(bf16* kdst, bf16* vdst, const unsigned int* slots,
                                           const KV* __restrict__ k_src, const KV* __restrict__ v_src,
                                           long long kv_row, int c0, int last_key) {
    constexpr int LD = HD + 8;
    constexpr int VPR = HD / 8;  // 16-byte vectors per row
#pragma unroll
    for (int i = 0; i < KILN_FA_KEYS * VPR / 128; ++i) {
        const int idx = threadIdx.x + i * 128;
        const int r = idx / VPR, c = idx % VPR;
        const int off = r * LD + c * 8;
        if (c0 + r <= last_key) {
            const long long g = (long long)slots[r] * kv_row + c * 8;
            if constexpr (sizeof(KV) == 2) {
                cp_async16(smem_u32(kdst + off), k_src + g);
                cp_async16(smem_u32(vdst + off), v_src + g);
            } else {
                // E4M3: loaded, widened to bf16 and stored here (no asynchronous copy converts).
                *reinterpret_cast<uint4*>(kdst + off) = kv_elem::load8(k_src + g);
                *reinterpret_cast<uint4*>(vdst + off) = kv_elem::load8(v_src + g);
            }
        } else {
            *reinterpret_cast<uint4*>(kdst + off) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(vdst + off) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <int HD, typename KV>
__device__ __forceinline__ void flash_prefill_impl(const bf16* __restrict__ q, long long q_stride,
                                                   const KV* __restrict__ k_cache,
                                                   const KV* __restrict__ v_cache,
                                                   const unsigned int* __restrict__ pos,
                                                   const unsigned int* __restrict__ row_seq,
                                                   const unsigned int* __restrict__ tables, int table_width,
                                                   int block_size, const unsigned int* __restrict__ tiles,
                                                   int heads, int kv_heads, int kv_stride, float scale, int window,
                                                   float softcap, bf16* __restrict__ out, long long out_stride,
                                                   const bf16* __restrict__ sinks) {
    constexpr int LD = HD + 8;
    constexpr int NT = HD / 8;             // n-tiles of the output accumulator
    constexpr int MT = HD <= 128 ? 2 : 1;  // m16 tiles per warp
    constexpr int RP = 64 * MT;            // rows per pass
    constexpr int PASSES = KILN_FA_TILE_ROWS / RP;
    constexpr int KEYS = KILN_FA_KEYS;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(fa_smem);
    bf16* Ks = Qs + KILN_FA_TILE_ROWS * LD;  // [2][64][LD]
    bf16* Vs = Ks + 2 * KEYS * LD;           // [2][64][LD]
    unsigned int* s_slot = reinterpret_cast<unsigned int*>(Vs + 2 * KEYS * LD);  // [2][64]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    // CTAs are dispatched in linear block order (x fastest); remap it tile-major so that all heads
    // of a tile run back to back: the host's tile order (longest first) then holds across heads
    // (tail balance) and the heads of a GQA group read the same K/V from L2 close in time.
    const int lin = blockIdx.y * gridDim.x + blockIdx.x;
    const int tile = lin / gridDim.y, h = lin % gridDim.y;
    const int first = (int)tiles[2 * tile], n = (int)tiles[2 * tile + 1];
    const int kvh = h / (heads / kv_heads);
    const long long kv_row = kv_stride;  // a slot's row: the pool's, maybe wider than kv_heads * HD
    const unsigned int* table = tables + (long long)row_seq[first] * table_width;
    const int pos_first = (int)pos[first];
    const KV* k_src = k_cache + (long long)kvh * HD;
    const KV* v_src = v_cache + (long long)kvh * HD;

    // Score transform: v = raw (no softcap) or tanh(raw * scale / cap) * cap; the softmax
    // works on v * mul in the log2 domain.
    const bool capped = softcap > 0.0f;
    const float LOG2E = 1.4426950408889634f;
    const float mul = capped ? LOG2E : scale * LOG2E;
    const float cap_in = capped ? scale / softcap : 0.0f;

    // Q tile -> shared memory (rows >= n zero-filled); its own commit group.
    {
        constexpr int VPR = HD / 8;
#pragma unroll 4
        for (int i = 0; i < KILN_FA_TILE_ROWS * VPR / 128; ++i) {
            const int idx = tid + i * 128;
            const int r = idx / VPR, c = idx % VPR;
            bf16* d = Qs + r * LD + c * 8;
            if (r < n)
                cp_async16(smem_u32(d), q + (long long)(first + r) * q_stride + (long long)h * HD + c * 8);
            else
                *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
        }
        cp_async_commit();
    }

    const unsigned int qs_base = smem_u32(Qs);
    const unsigned int ks_base = smem_u32(Ks);
    const unsigned int vs_base = smem_u32(Vs);
    constexpr unsigned int KV_BUF_BYTES = KEYS * LD * 2;
    const int lm = lane & 7, lq = lane >> 3;
    // B (K, non-trans) x4: matrix lq: keys +(lq >> 1) * 8, cols +(lq & 1) * 8
    //   -> {b0, b1} of n-tile 2i, {b2, b3} of n-tile 2i + 1 for one k-step of 16.
    const unsigned int k_off = (unsigned int)(((lm + (lq >> 1) * 8) * LD + (lq & 1) * 8) * 2);
    // B (V, trans) x4: matrix lq: keys +(lq & 1) * 8, cols +(lq >> 1) * 8
    const unsigned int v_off = (unsigned int)(((lm + (lq & 1) * 8) * LD + (lq >> 1) * 8) * 2);

#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {
        const int prow0 = pass * RP;
        if (prow0 >= n) break;
        const int prow1 = min(n, prow0 + RP) - 1;  // last valid row of the pass
        const int lo = (window > 0 && pos_first + prow0 + 1 > window) ? pos_first + prow0 + 1 - window : 0;
        const int hi = pos_first + prow1;  // last key
        const int nchunks = (hi - lo) / KEYS + 1;

        // This warp's rows: wr0 .. wr0 + 16 * MT - 1 (local); valid ones up to wr1.
        const int wr0 = prow0 + warp * 16 * MT;
        const bool warp_active = wr0 < n;
        const int wr1 = min(n, wr0 + 16 * MT) - 1;
        const int wp0 = pos_first + wr0, wp1 = pos_first + wr1;

        __syncthreads();  // the previous pass is done with the K/V buffers and slots
        {
            const int c = tid >> 6;  // chunks 0 and 1
            if (c < nchunks) s_slot[tid] = fa_slot(table, block_size, lo + c * KEYS + (tid & 63), hi);
        }
        __syncthreads();
        fa_load_kv<HD, KV>(Ks, Vs, s_slot, k_src, v_src, kv_row, lo, hi);
        cp_async_commit();

        // Q fragments are read per k-step from shared memory.
        unsigned int q_addr[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            q_addr[mt] = qs_base + (unsigned int)(((wr0 + mt * 16 + lm + (lq & 1) * 8) * LD + (lq >> 1) * 8) * 2);

        // Row positions of this thread: [mt][0] = row g, [mt][1] = row g + 8 of m-tile mt.
        float o[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
        float m[MT][2], l[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = NEG_INF, l[mt][0] = l[mt][1] = 0.0f;

#pragma unroll 1
        for (int jc = 0; jc < nchunks; ++jc) {
            const int c0 = lo + jc * KEYS;
            const int buf = jc & 1;
            cp_async_wait<0>();  // chunk jc (and Q) landed for this thread
            __syncthreads();     // ... for all threads; everyone is done with chunk jc - 1
            if (jc + 1 < nchunks) {
                fa_load_kv<HD, KV>(Ks + (buf ^ 1) * KEYS * LD, Vs + (buf ^ 1) * KEYS * LD, s_slot + (buf ^ 1) * KEYS,
                               k_src, v_src, kv_row, c0 + KEYS, hi);
                cp_async_commit();
            }
            if (tid < KEYS && jc + 2 < nchunks) s_slot[buf * KEYS + tid] = fa_slot(table, block_size, c0 + 2 * KEYS + tid, hi);

            // Skip chunks fully masked for every row of this warp.
            if (!warp_active || c0 > wp1) continue;
            if (window > 0 && c0 + KEYS - 1 < wp0 + 1 - window) continue;
            const bool need_mask = (c0 + KEYS - 1 > wp0) || (window > 0 && c0 < wp1 + 1 - window);

            const unsigned int kb = ks_base + buf * KV_BUF_BYTES + k_off;
            const unsigned int vb = vs_base + buf * KV_BUF_BYTES + v_off;

            // S = Q K^T: (16 * MT) rows x 64 keys per warp.
            float s[MT][8][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ++ks) {
                unsigned int qa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], q_addr[mt] + ks * 32);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    unsigned int b0, b1, b2, b3;
                    ldmatrix_x4(b0, b1, b2, b3, kb + (i * 16 * LD + ks * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16(s[mt][2 * i], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b0, b1);
                        mma_bf16(s[mt][2 * i + 1], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b2, b3);
                    }
                }
            }

            // Transform, mask, online softmax; P (bf16) packed as A fragments.
            unsigned int pa[MT][4][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int pr0 = pos_first + wr0 + mt * 16 + g;  // position of row g (row g + 8: pr0 + 8)
                if (capped) {
#pragma unroll
                    for (int j = 0; j < 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][j][e] = tanhf(s[mt][j][e] * cap_in) * softcap;
                }
                if (need_mask) {
                    // visible: p - window < key <= p (no lower bound without a window); with
                    // key = c0 + 2 t4 + off, off = j * 8 + (e & 1) a compile-time constant.
                    const int hi0 = pr0 - c0 - 2 * t4, hi1 = hi0 + 8;
                    const int lo0 = window > 0 ? hi0 - window : -(1 << 30), lo1 = lo0 + 8;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int off = j * 8 + (e & 1);
                            const bool ok = (e < 2) ? (off <= hi0 && off > lo0) : (off <= hi1 && off > lo1);
                            s[mt][j][e] = ok ? s[mt][j][e] : NEG_INF;
                        }
                    }
#pragma unroll
                    for (int j = 0; j < 8; ++j)  // materialize the masked scores here (register pressure)
#pragma unroll
                        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(s[mt][j][e]));
                }
                float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    mx0 = fmaxf(mx0, fmaxf(s[mt][j][0], s[mt][j][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[mt][j][2], s[mt][j][3]));
                }
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
                const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
                // A row with nothing visible so far keeps m = -inf; use 0 as the exponent base
                // then (all its p are exp2(-inf) = 0 and the correction multiplies zeros).
                const float b0 = (mn0 == NEG_INF) ? 0.0f : mn0 * mul;
                const float b1 = (mn1 == NEG_INF) ? 0.0f : mn1 * mul;
                const float corr0 = fa_exp2(m[mt][0] * mul - b0), corr1 = fa_exp2(m[mt][1] * mul - b1);
                m[mt][0] = mn0;
                m[mt][1] = mn1;
                float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float e0 = fa_exp2(fmaf(s[mt][j][0], mul, -b0));
                    const float e1 = fa_exp2(fmaf(s[mt][j][1], mul, -b0));
                    const float e2 = fa_exp2(fmaf(s[mt][j][2], mul, -b1));
                    const float e3 = fa_exp2(fmaf(s[mt][j][3], mul, -b1));
                    rs0 += e0 + e1;
                    rs1 += e2 + e3;
                    pa[mt][j >> 1][(j & 1) * 2 + 0] = pack_bf16(e0, e1);
                    pa[mt][j >> 1][(j & 1) * 2 + 1] = pack_bf16(e2, e3);
                }
                l[mt][0] = l[mt][0] * corr0 + rs0;  // per-thread partial row sums (quad-reduced at the end)
                l[mt][1] = l[mt][1] * corr1 + rs1;
                if (corr0 != 1.0f || corr1 != 1.0f) {
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        o[mt][j][0] *= corr0;
                        o[mt][j][1] *= corr0;
                        o[mt][j][2] *= corr1;
                        o[mt][j][3] *= corr1;
                    }
                }
            }

            // O += P V: V (64 x HD) via ldmatrix.trans, each fragment shared by the MT m-tiles.
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int dn = 0; dn < HD / 16; ++dn) {
                    unsigned int v0, v1, v2, v3;
                    ldmatrix_x4_trans(v0, v1, v2, v3, vb + ((kk * 16) * LD + dn * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16(o[mt][2 * dn], pa[mt][kk][0], pa[mt][kk][1], pa[mt][kk][2], pa[mt][kk][3], v0, v1);
                        mma_bf16(o[mt][2 * dn + 1], pa[mt][kk][0], pa[mt][kk][1], pa[mt][kk][2], pa[mt][kk][3], v2,
                                 v3);
                    }
                }
            }
        }

        // Finalize: full row sums over the quad, normalize, store rows < n.
        if (warp_active) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    float lt = l[mt][hf];
                    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
                    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
                    // A sink logit joins the denominator, on the same base (m in the log2 domain).
                    if (sinks) lt += fa_exp2(to_f32(sinks[h]) * LOG2E - m[mt][hf] * mul);
                    const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
                    const int r = wr0 + mt * 16 + g + hf * 8;
                    if (r < n) {
                        bf16* op = out + (long long)(first + r) * out_stride + (long long)h * HD + 2 * t4;
#pragma unroll
                        for (int j = 0; j < NT; ++j)
                            *reinterpret_cast<__nv_bfloat162*>(op + j * 8) =
                                __floats2bfloat162_rn(o[mt][j][2 * hf] * inv, o[mt][j][2 * hf + 1] * inv);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
}

#define KILN_FA_MIN_BLOCKS_64 3
#define KILN_FA_MIN_BLOCKS_128 2
#define KILN_FA_MIN_BLOCKS_256 1

#define KILN_PREFILL_ENTRY(HD, SUFFIX, KV)                                                                        \
    extern "C" __global__ void __launch_bounds__(128, KILN_FA_MIN_BLOCKS_##HD) flash_prefill##SUFFIX##_hd##HD(        \
        const bf16* __restrict__ q, long long q_stride, const KV* __restrict__ k_cache,                          \
        const KV* __restrict__ v_cache, const unsigned int* __restrict__ pos,                                    \
        const unsigned int* __restrict__ row_seq, const unsigned int* __restrict__ tables, int table_width,      \
        int block_size, const unsigned int* __restrict__ tiles, int heads, int kv_heads, int kv_stride,          \
        float scale,                                                                                             \
        int window, float softcap, bf16* __restrict__ out, long long out_stride,                                 \
        const bf16* __restrict__ sinks) {                                                                        \
        kiln_pdl_enter();                                                                                        \
        flash_prefill_impl<HD, KV>(q, q_stride, k_cache, v_cache, pos, row_seq, tables, table_width, block_size, \
                                   tiles, heads, kv_heads, kv_stride, scale, window, softcap, out, out_stride,   \
                                   sinks);                                                                       \
    }


KILN_PREFILL_ENTRY(64, , bf16)
KILN_PREFILL_ENTRY(128, , bf16)
KILN_PREFILL_ENTRY(256, , bf16)
KILN_PREFILL_ENTRY(64, _fp8, kv8)
KILN_PREFILL_ENTRY(128, _fp8, kv8)
KILN_PREFILL_ENTRY(256, _fp8, kv8)
