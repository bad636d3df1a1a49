// Skinny GEMM for decode batches of 9..64 rows: out[m, n] = sum_k x[m, k] * w[n, k] (+ epilogue),
// bf16 in/out, f32 accumulation on tensor cores (mma.sync m16n8k16), the weights streamed from
// HBM exactly once while every activation row is multiplied against them.
#include "common.cuh"
#include "mma.cuh"

// ---------------------------------------------------------------------------------------------
//   extern "C" __global__ void skinny_gemm_bf16_m{MT}(const bf16* x, const bf16* w, bf16* out,
//                                                      const bf16* extra, int M, int N, int K,
//                                                      int mode, float* ws, unsigned int* counters)
// MT = 16, 32, 48, 64: the row count M (1 <= M <= MT) rounded up to 16; rows >= M read as zero
// and are never written.
//
// HOST RULE (crates/kiln-cuda/src/skinny.rs, mirrored in bench/gpu/gemv_check.py):
//   cols  = mode >= 3 ? 64 : 128               (output columns per block)
//   tiles = ceil(N / cols)                     (N: output columns; w has 2N rows in the gated modes)
//   chunks = ceil(K / 64)
//   splits = grid.y, any value in 1..=chunks (the host picks it to fill the GPU)
//   grid = (tiles, splits, 1), block = 128 threads, dynamic shared memory
//   SMEM = 4 * (1024 + 8 * MT) * 16 bytes (over 48 KiB: the function's MAX_DYNAMIC_SHARED_SIZE_BYTES
//   must be raised first).
//   splits >= 2 needs ws (>= tiles * splits * MT * 128 floats, any contents) and counters
//   (>= tiles u32, all zero before the launch; every launch leaves them zero again); launches
//   that share counters must be stream-ordered. With splits == 1 both may be null.
//
// Work split: block (b, s) owns 128 weight rows (plain: output columns 128 b ..; gated: output
// columns 64 b .. 64 b + 63, their gate rows n and up rows N + n) and the k-chunks
// [chunks * s / splits, chunks * (s + 1) / splits). Its 4 warps take 32 weight rows each (two
// 16-row mma tiles; gated: the gate tile and the matching up tile) against all MT rows of x.
// Every 64-wide k-chunk is one pipeline stage: the block's 128 x 64 weights (16 KiB) and the
// MT x 64 activations, copied with cp.async (weights .cg with an L2 256-byte prefetch, read
// once; x .ca, re-read by every block from L2), 3 stages in flight ahead of the one consumed.
// Shared memory is laid out so that each lane reads its mma operands with one conflict-free
// 16-byte load per 8 k: the k order inside an mma does not matter for a dot product as long as
// A and B agree, so lane (g = lane / 4, t = lane % 4) takes k = 8 t .. 8 t + 8 of a 32-wide
// step, exactly as the GEMV kernels (gemv.cu) do:
//     A (weights, 16 rows n0..): lo = w[n0 + g][k..k+8), hi = w[n0 + g + 8][k..k+8)
//     B (x, 8 rows m0..):        xv = x[m0 + g][k..k+8)
//     mma #1: A = {lo.x, hi.x, lo.y, hi.y}, B = {xv.x, xv.y};  mma #2: .z/.w
//   D (16 x 8 f32): lane (g, t) holds (n0 + g, m0 + 2t), (n0 + g, m0 + 2t + 1), (n0 + g + 8, m0 + 2t),
//   (n0 + g + 8, m0 + 2t + 1).
// With splits == 1 the epilogue runs on the registers. With splits >= 2 every block stores its
// f32 partial sums in ws (its own slice), the block that completes a tile (a per-tile counter)
// adds the slices in split order 0, 1, ... (deterministic: the same sums in the same order
// whichever block arrives last), applies the epilogue and re-zeroes the counter.
// Requirements: K % 8 == 0; x, w 16-byte aligned; out must not overlap x, w or ws.
// Modes (as the GEMV kernels): 0 plain, 1 + extra[n] (bias), 2 + extra[m * N + n] (residual;
// extra may equal out), 3 silu(x.w[n]) * (x.w[N + n]), 4 gelu_tanh(x.w[n]) * (x.w[N + n]).
// The epilogue works on the f32 sums; the only rounding to bf16 is the final store.
// ---------------------------------------------------------------------------------------------

namespace skinny_detail {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kWarps * 32;  // weight rows per block
constexpr int kChunkK = 64;         // k per pipeline stage
constexpr int kStages = 4;
constexpr int kWSlots = kRows * kChunkK / 8;  // 16-byte slots of weights per stage (1024)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes of weights, read once: L2 only, with a 256-byte L2 prefetch (the next chunk of the
// row). src_bytes 0 writes zeros without reading.
__device__ __forceinline__ void cp_stream(unsigned dst, const bf16* src, bool ok) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

// Gated modes: the output column (within the block's 64) of block-local weight row r (0..127).
// Warp w owns rows 32 w .. 32 w + 31: its gate tile (tt = 0) and its up tile (tt = 1) for
// columns 16 w .. 16 w + 15. (Plain modes: row r is column r of the block's 128.)
__device__ __forceinline__ int gated_col(int r) { return ((r >> 5) << 4) + (r & 15); }

// The plain / bias / residual epilogue of one output.
__device__ __forceinline__ void store_plain(bf16* out, const bf16* extra, int N, int mode, int m, int n, float v) {
    const long long o = (long long)m * N + n;
    if (mode == 1) v += to_f32(extra[n]);
    else if (mode == 2) v += to_f32(extra[o]);
    out[o] = to_bf16(v);
}

template <int MT>
__device__ __forceinline__ void skinny(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,
                                       const bf16* extra, int M, int N, int K, int mode, float* __restrict__ ws,
                                       unsigned int* __restrict__ counters) {
    static_assert(MT % 16 == 0 && MT >= 16 && MT <= 64, "MT: 16, 32, 48 or 64");
    constexpr int MG = MT / 8;                    // 8-row groups of x
    constexpr int STAGE = kWSlots + MT * 8;       // 16-byte slots per stage
    constexpr int XPER = MT * 8 / kThreads;       // x slots each thread copies per stage
    static_assert(MT * 8 % kThreads == 0, "x slots per stage divide among the threads");
    extern __shared__ uint4 sm[];

    const bool gated = mode >= 3;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int chunks = (K + kChunkK - 1) / kChunkK;
    const int c0 = (int)((long long)chunks * split / splits);
    const int c1 = (int)((long long)chunks * (split + 1) / splits);

    // This lane's weight rows: tile tt, half h (row g + 8 h of the tile); -1 when out of range.
    long long wrow[2][2];
#pragma unroll
    for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * 32 + tt * 16 + g + 8 * h;  // block-local row
            if (gated) {
                const int col = b * 64 + gated_col(r);
                wrow[tt][h] = col < N ? (long long)col + (long long)tt * N : -1;
            } else {
                const int n = b * kRows + r;
                wrow[tt][h] = n < N ? n : -1;
            }
        }

    const unsigned sbase = smem_addr(sm);
    // Stage layout (16-byte slots): weights [warp][ks 0..1][tt][h][lane] (256 per warp), then x
    // [mg][ks][lane]; lane (g, t) of (ks) holds k = 32 ks + 8 t .. + 8 of the chunk.
    auto issue = [&](int c, int slot) {
        if (c < c1) {
            const unsigned st = sbase + (unsigned)(slot * STAGE) * 16u;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const int ks = q >> 2, tt = (q >> 1) & 1, h = q & 1;
                const int k = c * kChunkK + ks * 32 + t * 8;
                const long long row = wrow[tt][h];
                const bool ok = row >= 0 && k < K;
                cp_stream(st + (unsigned)((warp * 256 + q * 32 + lane) * 16), w + (ok ? row * K + k : 0), ok);
            }
#pragma unroll
            for (int i = 0; i < XPER; ++i) {
                const int p = i * kThreads + tid;
                const int q = p >> 5, pl = p & 31;
                const int m = (q >> 1) * 8 + (pl >> 2);
                const int k = c * kChunkK + (q & 1) * 32 + (pl & 3) * 8;
                const bool ok = m < M && k < K;
                cp_cached(st + (unsigned)((kWSlots + p) * 16), x + (ok ? (long long)m * K + k : 0), ok);
            }
        }
        cp_commit();  // possibly empty: keeps the group count uniform
    };

    float acc[2][MG][4];
#pragma unroll
    for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int mg = 0; mg < MG; ++mg)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[tt][mg][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(c0 + s, s);

    int slot = 0;
    for (int c = c0; c < c1; ++c) {
        cp_wait<kStages - 2>();  // this thread's copies of chunk c have landed
        __syncthreads();         // everyone's have; and everyone is done with the slot refilled below
        issue(c + kStages - 1, slot == 0 ? kStages - 1 : slot - 1);
        const uint4* st = sm + slot * STAGE;
        const uint4* wst = st + warp * 256;
        const uint4* xst = st + kWSlots;
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            uint4 a[2][2];
#pragma unroll
            for (int tt = 0; tt < 2; ++tt)
#pragma unroll
                for (int h = 0; h < 2; ++h) a[tt][h] = wst[((ks * 2 + tt) * 2 + h) * 32 + lane];
#pragma unroll
            for (int mg = 0; mg < MG; ++mg) {
                const uint4 xv = xst[(mg * 2 + ks) * 32 + lane];
#pragma unroll
                for (int tt = 0; tt < 2; ++tt) {
                    mma_bf16(acc[tt][mg], a[tt][0].x, a[tt][1].x, a[tt][0].y, a[tt][1].y, xv.x, xv.y);
                    mma_bf16(acc[tt][mg], a[tt][0].z, a[tt][1].z, a[tt][0].w, a[tt][1].w, xv.z, xv.w);
                }
            }
        }
        if (++slot == kStages) slot = 0;
    }
    cp_wait<0>();

    const int act = mode == 3 ? 0 : 1;
    if (splits == 1) {
#pragma unroll
        for (int mg = 0; mg < MG; ++mg)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = mg * 8 + 2 * t + (i & 1);
                if (m >= M) continue;
                const int nl = g + 8 * (i >> 1);
                if (gated) {
                    const int col = b * 64 + warp * 16 + nl;
                    if (col < N)
                        out[(long long)m * N + col] = to_bf16(gate_act(acc[0][mg][i], act) * acc[1][mg][i]);
                } else {
#pragma unroll
                    for (int tt = 0; tt < 2; ++tt) {
                        const int n = b * kRows + warp * 32 + tt * 16 + nl;
                        if (n < N) store_plain(out, extra, N, mode, m, n, acc[tt][mg][i]);
                    }
                }
            }
        return;
    }

    // Split K: this block's partial sums into its slice ws[(b * splits + split)][m][r].
    float* mine = ws + ((long long)b * splits + split) * (MT * kRows);
#pragma unroll
    for (int mg = 0; mg < MG; ++mg)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = mg * 8 + 2 * t + (i & 1);
            if (m >= M) continue;
#pragma unroll
            for (int tt = 0; tt < 2; ++tt) {
                const int r = warp * 32 + tt * 16 + g + 8 * (i >> 1);
                __stcg(mine + m * kRows + r, acc[tt][mg][i]);
            }
        }
    __threadfence();
    __syncthreads();  // every thread's partials are out before the count moves
    bool last = false;
    if (tid == 0) {
        last = atomicAdd(counters + b, 1u) == (unsigned)(splits - 1);
        if (last) counters[b] = 0u;  // every other split is in: nobody touches it again
    }
    if (__syncthreads_or(last) == 0) return;
    __threadfence();
    // Every split's partials are in: sum them in split order (float4 loads, MT / 4 of them in flight
    // per thread) into shared memory (the pipeline stages are free: every copy has landed and every
    // warp is past the main loop), then apply the epilogue from there.
    const float4* all = reinterpret_cast<const float4*>(ws + (long long)b * splits * (MT * kRows));
    constexpr int ITEMS = MT * kRows / 4 / kThreads;  // float4 sums per thread; item i: m = it / 32
    float4 sum[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) sum[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < splits; ++s) {
        const float4* p = all + (long long)s * (MT * kRows / 4);
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int it = i * kThreads + tid;
            if ((it >> 5) < M) {
                const float4 v = __ldcg(p + it);
                sum[i].x += v.x;
                sum[i].y += v.y;
                sum[i].z += v.z;
                sum[i].w += v.w;
            }
        }
    }
    float4* red4 = reinterpret_cast<float4*>(sm);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) red4[i * kThreads + tid] = sum[i];
    __syncthreads();
    const float* red = reinterpret_cast<const float*>(sm);  // [m][r], 128 floats a row
    const int cols = gated ? 64 : kRows;
    for (int e = tid; e < M * cols; e += kThreads) {
        const int m = e / cols, j = e - m * cols;
        if (gated) {
            const int col = b * 64 + j;
            if (col >= N) continue;
            const int rg = (j >> 4) * 32 + (j & 15);  // gate row of column j; its up row is rg + 16
            out[(long long)m * N + col] = to_bf16(gate_act(red[m * kRows + rg], act) * red[m * kRows + rg + 16]);
        } else {
            const int n = b * kRows + j;
            if (n < N) store_plain(out, extra, N, mode, m, n, red[m * kRows + j]);
        }
    }
}

}  // namespace skinny_detail

#define KILN_SKINNY(MT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, 2) skinny_gemm_bf16_m##MT(                              \
        const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out, const bf16* extra, int M, int N,   \
        int K, int mode, float* ws, unsigned int* counters) {                                                    \
        kiln_pdl_enter();                                                                                        \
        skinny_detail::skinny<MT>(x, w, out, extra, M, N, K, mode, ws, counters);                              \
    }
KILN_SKINNY(16)
KILN_SKINNY(32)
KILN_SKINNY(48)
KILN_SKINNY(64)
#undef KILN_SKINNY
