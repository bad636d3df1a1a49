// Decode-shaped matrix products (M <= 8 activation rows), the direct-load variant: weights
// loaded straight into registers, a ring of k steps in flight per lane. The backend runs every
// decode GEMV mode here.
#include "common.cuh"
#include "mma.cuh"
#include "rms_prologue.cuh"

// ---------------------------------------------------------------------------------------------
// GEMV: out[m, n] = sum_k x[m, k] * w[n, k] (+ epilogue), M = 1..8, bf16 in/out, f32 accumulation.
//
// Tensor-core formulation: one mma.m16n8k16 (bf16 x bf16 -> f32) takes 16 weight rows (A) times
// 16 k, and 8 activation rows (B, the batch rows m; rows >= M are zero). The k order inside an
// mma does not matter for a dot product as long as A and B agree, so each lane loads 16
// contiguous bytes (8 k) of its weight rows and of its x row with one 128-bit load, and those
// four 32-bit registers feed two mmas directly (no shuffles, no conversions):
//   lane = 4 * g + t (g = groupID 0..7, t = 0..3), k = step base + 8 t:
//     wlo = A-row g [k .. k+8), whi = A-row g + 8 [k .. k+8), xv = x[g][k .. k+8) (0 if g >= M)
//     mma #1: A = {wlo.x, whi.x, wlo.y, whi.y}, B = {xv.x, xv.y}   (k .. k+4)
//     mma #2: A = {wlo.z, whi.z, wlo.w, whi.w}, B = {xv.z, xv.w}   (k+4 .. k+8)
//   D (16 x 8 f32): lane (g, t) holds A-rows g and g + 8 for batch rows 2t, 2t + 1.
// Tiles: 16 columns (A-rows = weight rows n0 .. n0 + 15), or 8 columns: the gated modes put the
// gate rows n0 .. n0 + 7 in A-rows 0..7 and the up rows N + n0 .. in A-rows 8..15 (the lane that
// holds a gate sum holds its up sum), plain 8-column tiles leave A-rows 8..15 zero (not loaded).
//
//   gemv_direct_bf16_m{M}(x, w, out, extra, N, K, mode)
// Modes (mode & 7): 0 plain, 1 + extra[n] (bias), 2 + extra[m * N + n] (residual; extra may equal
// out), 3 silu(x.w[n]) * (x.w[N + n]), 4 gelu_tanh(x.w[n]) * (x.w[N + n]) (w has 2N rows). Tile
// width: 8 for the gated modes and when mode & 8, else 16 (more, smaller blocks fill the last
// wave when ceil(N / 16) blocks would leave it mostly empty: the host picks).
// Launch: block 256 threads (8 warps), no dynamic shared memory (4 KiB static), any grid.x >= 1
// (block b takes tiles b, b + gridDim.x, ...). The backend launches min(tiles, 2 * SMs) blocks:
// one wave, every block resident from the start (so the next kernel's launch is triggered at
// once under programmatic dependent launch), the load ring running on from tile to tile.
// The 8 warps of a block split K (warp w takes k in [32 w, 32 w + 32) of every 256-wide step),
// then reduce through shared memory. Requirements: K % 8 == 0; x, w 16-byte aligned; out must
// not overlap x or w; w must not be written by a kernel of the same graph or stream chain: its
// loads may run before the wait for the previous kernel (programmatic dependent launch), and
// they are plain asm the compiler may move. Weights are streamed with
// ld.global.nc.L1::no_allocate (they are read once) so x stays in L1. The epilogue works on the f32 sums; the only rounding to bf16 is the
// final store.
//
//   rms_norm_gemv_direct_bf16_m{M}(x, norm_w, w, out, extra, N, K, mode, eps, weight_offset, nt)
// The same product of rms_norm(x). Every block first loads its first weights into registers,
// then computes the rows' inverse RMS (rms_prologue.cuh) while copying x into shared memory,
// scales it there by inv * (weight_offset + norm_w), rounded to bf16 exactly as add_rms_norm_bf16
// with nt threads rounds its output, and reads x from there. Same grid and block; dynamic shared
// memory M * (2 K + 64) bytes (over 48 KiB needs the function's MAX_DYNAMIC_SHARED_SIZE_BYTES
// raised); norm_w [K], 16-byte aligned; nt = the unfused norm's block size (a multiple of 32,
// <= 1024).
// ---------------------------------------------------------------------------------------------

// Tuning knobs, timed on the H200 (bench/gpu/gemv_sweep.py): resident blocks per multiprocessor
// the compiler must allow (register cap); k steps in flight per lane with two weight rows per
// lane (16-column and gated tiles) and with one (plain 8-column tiles); 1: the first steps'
// weights go into registers before waiting for the previous kernel, 0: only into L2.
#ifndef KILN_DIRECT_MIN_BLOCKS
#define KILN_DIRECT_MIN_BLOCKS 2
#endif
#ifndef KILN_DIRECT_U
#define KILN_DIRECT_U 4
#endif
#ifndef KILN_DIRECT_HALF_U
#define KILN_DIRECT_HALF_U 4
#endif
#ifndef KILN_DIRECT_PRELOAD
#define KILN_DIRECT_PRELOAD 1
#endif

namespace gemv_direct_detail {

constexpr int kWarps = 8;
constexpr int kTileN = 16;               // output columns per mma tile
constexpr int kBlockK = kWarps * 32;     // k covered by the block per step (32 per warp)

// 16 bytes of activations (re-read by every block): through the read-only/L1 path. volatile:
// x is the previous kernel's output, so the load must stay after kiln_pdl_wait().
__device__ __forceinline__ uint4 ld_cached(const bf16* p, bool ok) {
    uint4 r;
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "r"((int)ok));
    return r;
}

// Row stride, in 16-byte slots, of the normalized x rows a norm kernel keeps in shared memory:
// 64 bytes of padding put consecutive rows in opposite bank halves (conflict-free x reads).
__device__ __forceinline__ int xs_stride(int K) { return K / 8 + 4; }

// The weight row that A-row (g + 8 h) of the tile at column n0 reads, null past N. 16-column
// tiles: rows n0 .. n0 + 15. 8-column tiles: A-rows 0..7 are rows n0 .. n0 + 7 (the gate rows
// in the gated modes), A-rows 8..15 the up rows N + n0 .. N + n0 + 7 (gated) or nothing (h = 0
// is the only one loaded then).
__device__ __forceinline__ const bf16* weight_row(const bf16* __restrict__ w, int N, int K, int n0, int g, int h,
                                                 int cols) {
    const int n = cols == 16 ? n0 + g + 8 * h : n0 + g;
    if (n >= N) return nullptr;
    return w + (long long)(cols == 16 ? n : n + h * N) * K;
}

// Loads of one k step for a lane: H weight rows (1 or 2) at k.
template <int H>
__device__ __forceinline__ void load_step(const bf16* r0, const bf16* r1, int k, bool kok, uint4 (&wv)[H]) {
    wv[0] = ld_stream16<true>(r0 != nullptr ? r0 + k : nullptr, kok && r0 != nullptr);
    if (H == 2) wv[H - 1] = ld_stream16<true>(r1 != nullptr ? r1 + k : nullptr, kok && r1 != nullptr);
}

// One block's tiles (blockIdx.x, + gridDim.x, ...). H = weight rows a lane loads per k step: 2
// for 16-column tiles and the gated 8-column tiles, 1 for plain 8-column tiles (A-rows 8..15 are
// zero). U = k steps in flight per lane: a ring of U slots, each consumed and at once refilled
// with the step U further on — in the last round of a tile, with the first steps of the block's
// next tile — so the loads never drain between rounds or tiles. red: shared scratch of
// kWarps * 128 floats. XS: x is read from xs (shared memory, rows of xs_stride(K) slots: a norm
// kernel's normalized rows) instead of global memory. use_pre: pre holds the first U steps of
// the block's first tile, loaded by load_first_round before the PDL wait.
template <int M, int H, int U, bool XS>
__device__ __forceinline__ void gemv_tiles(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,
                                           const bf16* extra, int N, int K, int mode, int cols, float* red,
                                           const uint4* xs, const uint4 (&pre)[U][H], bool use_pre) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ntiles = (N + cols - 1) / cols;
    const bf16* xrow = x + (long long)(g < M ? g : 0) * K;
    const bool xok = g < M;
    const uint4* xsrow = XS ? xs + (xok ? g : 0) * xs_stride(K) : nullptr;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    constexpr int kRound = kBlockK * U;                  // k covered by one round of the ring
    const int kpad = (K + kRound - 1) / kRound * kRound;  // K rounded up to whole rounds
    int tile = blockIdx.x;
    if (tile >= ntiles) return;
    const bf16* r0 = weight_row(w, N, K, tile * cols, g, 0, cols);
    const bf16* r1 = H == 2 ? weight_row(w, N, K, tile * cols, g, 1, cols) : nullptr;

    uint4 wv[U][H];
    uint4 xv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = u * kBlockK + warp * 32 + t * 8;
        if (use_pre) {
#pragma unroll
            for (int h = 0; h < H; ++h) wv[u][h] = pre[u][h];
        } else {
            load_step<H>(r0, r1, k, k < K, wv[u]);
        }
        if (!XS) xv[u] = ld_cached(xrow + k, k < K && xok);
    }
    for (; tile < ntiles; tile += gridDim.x) {
        const int n0 = tile * cols, next = tile + gridDim.x;
        const bf16* n_r0 = next < ntiles ? weight_row(w, N, K, next * cols, g, 0, cols) : nullptr;
        const bf16* n_r1 = H == 2 && next < ntiles ? weight_row(w, N, K, next * cols, g, 1, cols) : nullptr;
        // Two accumulator sets (mma #1 / #2) to halve the dependent-mma chain.
        float acc[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
        for (int k0 = 0; k0 < kpad; k0 += kRound) {
            // The last round refills the ring from the next tile (its steps 0 .. U - 1).
            const bool last = k0 + kRound >= kpad;
            const bf16* l0 = last ? n_r0 : r0;
            const bf16* l1 = last ? n_r1 : r1;
            const int shift = last ? kRound - kpad : kRound;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = k0 + u * kBlockK + warp * 32 + t * 8;
                const uint4 xu = XS ? (k < K && xok ? xsrow[k >> 3] : zero) : xv[u];
                const uint4 lo = wv[u][0], hi = H == 2 ? wv[u][H - 1] : zero;
                mma_bf16(acc[0], lo.x, hi.x, lo.y, hi.y, xu.x, xu.y);
                mma_bf16(acc[1], lo.z, hi.z, lo.w, hi.w, xu.z, xu.w);
                const int kn = k + shift;  // K % 8 == 0: a lane's 8 values are all in or all out
                load_step<H>(l0, l1, kn, kn < K, wv[u]);
                if (!XS) xv[u] = ld_cached(xrow + kn, kn < K && xok);
            }
        }
        r0 = n_r0;
        r1 = n_r1;
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp * 128 + lane * 4 + i] = acc[0][i] + acc[1][i];
        __syncthreads();
        // Thread -> (A-row r, batch row m); D element (r, m) is in lane (r % 8) * 4 + m / 2,
        // register (m & 1) + 2 * (r / 8).
        if (threadIdx.x < kTileN * 8) {
            const int r = threadIdx.x >> 3, m = threadIdx.x & 7;
            const int n = n0 + r;
            if (r < cols && m < M && n < N) {
                float s[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int rr = r + 8 * j;  // j = 1: the up row of a gated 8-column tile
                    const int idx = ((rr & 7) * 4 + (m >> 1)) * 4 + (m & 1) + 2 * (rr >> 3);
                    float v = 0.0f;
#pragma unroll
                    for (int ww = 0; ww < kWarps; ++ww) v += red[ww * 128 + idx];
                    s[j] = v;
                    if (mode < 3) break;
                }
                const long long o = (long long)m * N + n;
                float res;
                if (mode >= 3) {
                    res = gate_act(s[0], mode == 3 ? 0 : 1) * s[1];
                } else {
                    res = s[0];
                    if (mode == 1) res += to_f32(extra[n]);
                    else if (mode == 2) res += to_f32(extra[o]);
                }
                out[o] = to_bf16(res);
            }
        }
        __syncthreads();
    }
}

// L2 prefetch of the first U steps of this block's first tile (as gemv_tiles loads them).
template <int H, int U>
__device__ __forceinline__ void prefetch_first_round(const bf16* __restrict__ w, int N, int K, int cols) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const bf16* row = weight_row(w, N, K, (int)blockIdx.x * cols, g, h, cols);
        if (row == nullptr) continue;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = u * kBlockK + warp * 32 + t * 8;
            if (k < K) kiln_prefetch_l2(row + k);
        }
    }
}

// Loads the first U steps of this block's first tile into registers, exactly as gemv_tiles would.
template <int H, int U>
__device__ __forceinline__ void load_first_round(const bf16* __restrict__ w, int N, int K, int cols, uint4 (&wv)[U][H]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = (int)blockIdx.x * cols;
    const bf16* r0 = weight_row(w, N, K, n0, g, 0, cols);
    const bf16* r1 = H == 2 ? weight_row(w, N, K, n0, g, 1, cols) : nullptr;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = u * kBlockK + warp * 32 + t * 8;
        load_step<H>(r0, r1, k, k < K, wv[u]);
    }
}

// The first U steps of the block's first tile go into registers before waiting for the previous
// kernel (programmatic dependent launch): the weights do not depend on it.
template <int H, int U>
__device__ __forceinline__ bool preload(const bf16* __restrict__ w, int N, int K, int cols, uint4 (&pre)[U][H]) {
    const bool use_pre = KILN_DIRECT_PRELOAD && (int)blockIdx.x * cols < N;
    if (use_pre) load_first_round<H, U>(w, N, K, cols, pre);
    else prefetch_first_round<H, U>(w, N, K, cols);
    return use_pre;
}

// Normalizes the rows of x into xs (shared memory, rows of xs_stride(K) slots).
template <int M>
__device__ __forceinline__ void norm_rows(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, int K,
                                          float eps, float weight_offset, int nt, uint4* xs) {
    __shared__ float partial[32 * M];
    __shared__ float inv[M];
    // Pass 1 (the norm's reduction) leaves x in xs; pass 2 normalizes it in place.
    const int cols = K >> 3, stride = xs_stride(K);
    rms_prologue::inv_rms_rows<M>(x, K, eps, nt, partial, inv, xs, stride);
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols, c = i - m * cols;
        uint4* p = xs + m * stride + c;
        *p = rms_prologue::scale8(*p, rms_prologue::ld_v4(norm_w + 8 * c), inv[m], weight_offset);
    }
    __syncthreads();
}

// Tile width and mode from the mode argument: the gated modes (3, 4) and mode | 8 run 8-column
// tiles (twice the blocks: a fuller last wave when N / 16 blocks would leave it mostly empty).
__device__ __forceinline__ int tile_cols(int mode) { return (mode & 7) >= 3 || (mode & 8) ? 8 : 16; }

template <int M, bool XS>
__device__ __forceinline__ void run(const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                                    const bf16* __restrict__ w, bf16* out, const bf16* extra, int N, int K, int mode,
                                    float eps, float weight_offset, int nt) {
    extern __shared__ uint4 xs[];  // norm kernels: M rows of xs_stride(K) slots (dynamic)
    __shared__ float red[kWarps * 128];
    kiln_pdl_trigger();
    const int cols = tile_cols(mode);
    mode &= 7;
    if (cols == 16 || mode >= 3) {
        uint4 pre[KILN_DIRECT_U][2];
        const bool use_pre = preload<2, KILN_DIRECT_U>(w, N, K, cols, pre);
        kiln_pdl_wait();  // x is the previous kernel's output
        if constexpr (XS) norm_rows<M>(x, norm_w, K, eps, weight_offset, nt, xs);
        gemv_tiles<M, 2, KILN_DIRECT_U, XS>(x, w, out, extra, N, K, mode, cols, red, xs, pre, use_pre);
    } else {
        uint4 pre[KILN_DIRECT_HALF_U][1];
        const bool use_pre = preload<1, KILN_DIRECT_HALF_U>(w, N, K, cols, pre);
        kiln_pdl_wait();
        if constexpr (XS) norm_rows<M>(x, norm_w, K, eps, weight_offset, nt, xs);
        gemv_tiles<M, 1, KILN_DIRECT_HALF_U, XS>(x, w, out, extra, N, K, mode, cols, red, xs, pre, use_pre);
    }
}

}  // namespace gemv_direct_detail

#define KILN_GEMV(MM)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, KILN_DIRECT_MIN_BLOCKS)                            \
        gemv_direct_bf16_m##MM(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,        \
                               const bf16* extra, int N, int K, int mode) {                              \
        gemv_direct_detail::run<MM, false>(x, nullptr, w, out, extra, N, K, mode, 0.0f, 0.0f, 0);        \
    }
KILN_GEMV(1)
KILN_GEMV(2)
KILN_GEMV(3)
KILN_GEMV(4)
KILN_GEMV(5)
KILN_GEMV(6)
KILN_GEMV(7)
KILN_GEMV(8)
#undef KILN_GEMV

#define KILN_RMS_NORM_GEMV(MM)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, KILN_DIRECT_MIN_BLOCKS) rms_norm_gemv_direct_bf16_m##MM( \
        const bf16* __restrict__ x, const bf16* __restrict__ norm_w, const bf16* __restrict__ w, bf16* out,  \
        const bf16* extra, int N, int K, int mode, float eps, float weight_offset, int nt) {               \
        gemv_direct_detail::run<MM, true>(x, norm_w, w, out, extra, N, K, mode, eps, weight_offset, nt);   \
    }
KILN_RMS_NORM_GEMV(1)
KILN_RMS_NORM_GEMV(2)
KILN_RMS_NORM_GEMV(3)
KILN_RMS_NORM_GEMV(4)
KILN_RMS_NORM_GEMV(5)
KILN_RMS_NORM_GEMV(6)
KILN_RMS_NORM_GEMV(7)
KILN_RMS_NORM_GEMV(8)
#undef KILN_RMS_NORM_GEMV
