// Decode-shaped matrix products (M <= 8 activation rows), the direct-load variant: one 16-column
// tile per block, weights loaded straight into registers. On an H200 it beats the pipelined
// kernel of gemv.cu on the plain, bias and residual modes of decode shapes (qkv, o, down,
// SmolLM2-sized layers); the backend uses gemv.cu for the gated modes.
#include "common.cuh"
#include "mma.cuh"
#include "rms_prologue.cuh"

// ---------------------------------------------------------------------------------------------
// GEMV: out[m, n] = sum_k x[m, k] * w[n, k] (+ epilogue), M = 1..8, bf16 in/out, f32 accumulation.
//
// Tensor-core formulation: one mma.m16n8k16 (bf16 x bf16 -> f32) takes 16 weight rows (A, the
// output columns n) times 16 k, and 8 activation rows (B, the batch rows m; rows >= M are zero).
// The k order inside an mma does not matter for a dot product as long as A and B agree, so each
// lane loads 16 contiguous bytes (8 k) of its weight rows and of its x row with one 128-bit load,
// and those four 32-bit registers feed two mmas directly (no shuffles, no conversions):
//   lane = 4 * g + t (g = groupID 0..7, t = 0..3), k = step base + 8 t:
//     wlo = w[n0 + g    ][k .. k+8), whi = w[n0 + g + 8][k .. k+8), xv = x[g][k .. k+8) (0 if g >= M)
//     mma #1: A = {wlo.x, whi.x, wlo.y, whi.y}, B = {xv.x, xv.y}   (k .. k+4)
//     mma #2: A = {wlo.z, whi.z, wlo.w, whi.w}, B = {xv.z, xv.w}   (k+4 .. k+8)
//   D (16 x 8 f32): lane (g, t) holds out[m = 2t, 2t+1][n0 + g] and out[m = 2t, 2t+1][n0 + g + 8].
//
// Launch: block 256 threads (8 warps), no dynamic shared memory (8 KiB static), grid.x =
// ceil(N / 16) (one 16-column tile per block; any grid.x >= 1 is correct: blocks loop over tiles
// with stride gridDim.x). The 8 warps of a block split K (warp w takes k in [32 w, 32 w + 32)
// of every 256-wide step), then reduce through shared memory. Gated modes (3, 4) do the gate
// tile (w rows n) and the up tile (w rows N + n) in the same block, sharing the x loads.
// Requirements: K % 8 == 0; x, w 16-byte aligned; out must not overlap x or w.
// Weights are streamed with ld.global.nc.L1::no_allocate (they are read once) so x stays in L1.
// Modes: 0 plain, 1 + extra[n] (bias), 2 + extra[m * N + n] (residual; extra may equal out),
//        3 silu(x.w[n]) * (x.w[N + n]), 4 gelu_tanh(x.w[n]) * (x.w[N + n]) (w has 2N rows).
// The epilogue works on the f32 sums; the only rounding to bf16 is the final store.
//
// rms_norm_gemv_direct_bf16_m{M}(x, norm_w, w, out, extra, N, K, mode, eps, weight_offset, nt):
// the same product of rms_norm(x). Every block first asks L2 for its first round of weights,
// computes the rows' inverse RMS (rms_prologue.cuh) while copying x into shared memory, scales it
// there by inv * (weight_offset + norm_w), rounded to bf16 exactly as add_rms_norm_bf16 with nt
// threads rounds its output, and reads x from there. Same grid and block; dynamic shared memory
// M * (2 K + 64) bytes (over 48 KiB needs the function's MAX_DYNAMIC_SHARED_SIZE_BYTES raised);
// norm_w [K], 16-byte aligned; nt = the unfused norm's block size (a multiple of 32, <= 1024).
// ---------------------------------------------------------------------------------------------

// Resident blocks per multiprocessor the compiler must allow (register cap), and k steps in
// flight per lane in the plain modes: tuning knobs, timed on the H200 (bench/gpu/gemv_check.py).
#ifndef KILN_DIRECT_MIN_BLOCKS
#define KILN_DIRECT_MIN_BLOCKS 2
#endif
#ifndef KILN_DIRECT_U
#define KILN_DIRECT_U 4
#endif
// 1: the first round of weights goes into registers before waiting for the previous kernel;
// 0: it is only prefetched into L2.
#ifndef KILN_DIRECT_PRELOAD
#define KILN_DIRECT_PRELOAD 1
#endif

namespace gemv_direct_detail {

constexpr int kWarps = 8;
constexpr int kTileN = 16;               // output columns per mma tile
constexpr int kBlockK = kWarps * 32;     // k covered by the block per step (32 per warp)

// 16 bytes of weights, read once: bypass L1, ask L2 to fetch the surrounding 256 bytes.
// Predicated inside the asm (zeros when !ok) so the loads of a round stay branch-free.
__device__ __forceinline__ uint4 ld_stream(const bf16* p, bool ok) {
    uint4 r;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "r"((int)ok));
    return r;
}

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

// T = tiles per block (1 plain, 2 gated: gate + up), U = k steps with loads in flight per lane.
// red: shared scratch of T * kWarps * 128 floats. XS: x is read from xs (shared memory, rows of
// xs_stride(K) slots: the normalized rows of a norm kernel) instead of global memory.
// use_pre: pre holds round 0 of the block's first tile, already loaded by load_first_round.
template <int M, int T, int U, bool XS>
__device__ __forceinline__ void gemv_tiles(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,
                                           const bf16* extra, int N, int K, int mode, float* red,
                                           const uint4* xs, const uint4 (&pre)[U][T][2], bool use_pre) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ntiles = (N + kTileN - 1) / kTileN;
    const bf16* xrow = x + (long long)(g < M ? g : 0) * K;
    const bool xok = g < M;
    const uint4* xsrow = XS ? xs + (xok ? g : 0) * xs_stride(K) : nullptr;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int n0 = tile * kTileN;
        const bf16* wrow[T][2];
        bool rok[T][2];
#pragma unroll
        for (int tt = 0; tt < T; ++tt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n0 + g + 8 * h;
                rok[tt][h] = n < N;
                wrow[tt][h] = w + (long long)(rok[tt][h] ? n + tt * N : 0) * K;
            }
        }
        // Two accumulator sets (mma #1 / #2) to halve the dependent-mma chain.
        float acc[T][2][4];
#pragma unroll
        for (int tt = 0; tt < T; ++tt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[tt][j][i] = 0.0f;

        for (int k0 = 0; k0 < K; k0 += kBlockK * U) {
            uint4 wv[U][T][2];
            uint4 xv[U];
            if (XS) {  // shared-memory x first, so that nothing but weights is outstanding below
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int k = k0 + u * kBlockK + warp * 32 + t * 8;
                    xv[u] = k < K && xok ? xsrow[k >> 3] : make_uint4(0u, 0u, 0u, 0u);
                }
            }
            // Issue every load of this round before any math: U * T * 2 weight loads in flight.
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = k0 + u * kBlockK + warp * 32 + t * 8;
                const bool kok = k < K;  // K % 8 == 0: a lane's 8 values are all in or all out
#pragma unroll
                for (int tt = 0; tt < T; ++tt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (use_pre) wv[u][tt][h] = pre[u][tt][h];
                        else wv[u][tt][h] = ld_stream(wrow[tt][h] + k, kok && rok[tt][h]);
                    }
                if (!XS) xv[u] = ld_cached(xrow + k, kok && xok);
            }
            use_pre = false;
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int tt = 0; tt < T; ++tt) {
                    const uint4 lo = wv[u][tt][0], hi = wv[u][tt][1];
                    mma_bf16(acc[tt][0], lo.x, hi.x, lo.y, hi.y, xv[u].x, xv[u].y);
                    mma_bf16(acc[tt][1], lo.z, hi.z, lo.w, hi.w, xv[u].z, xv[u].w);
                }
        }
#pragma unroll
        for (int tt = 0; tt < T; ++tt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                red[(tt * kWarps + warp) * 128 + lane * 4 + i] = acc[tt][0][i] + acc[tt][1][i];
        __syncthreads();
        // Thread -> (column n0 + nl, row m); D element (nl, m) is in lane (nl % 8) * 4 + m / 2,
        // register (m & 1) + 2 * (nl / 8).
        if (threadIdx.x < kTileN * 8) {
            const int nl = threadIdx.x >> 3, m = threadIdx.x & 7;
            const int n = n0 + nl;
            if (m < M && n < N) {
                const int idx = ((nl & 7) * 4 + (m >> 1)) * 4 + (m & 1) + 2 * (nl >> 3);
                float s[T];
#pragma unroll
                for (int tt = 0; tt < T; ++tt) {
                    float v = 0.0f;
#pragma unroll
                    for (int ww = 0; ww < kWarps; ++ww) v += red[(tt * kWarps + ww) * 128 + idx];
                    s[tt] = v;
                }
                const long long o = (long long)m * N + n;
                float r;
                if (T == 2) {
                    r = gate_act(s[0], mode == 3 ? 0 : 1) * s[T - 1];
                } else {
                    r = s[0];
                    if (mode == 1) r += to_f32(extra[n]);
                    else if (mode == 2) r += to_f32(extra[o]);
                }
                out[o] = to_bf16(r);
            }
        }
        __syncthreads();
    }
}

// L2 prefetch of the weights of round 0 of this block's first tile (as gemv_tiles loads them).
template <int T, int U>
__device__ __forceinline__ void prefetch_first_round(const bf16* __restrict__ w, int N, int K) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    if ((int)blockIdx.x * kTileN >= N) return;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = u * kBlockK + warp * 32 + t * 8;
#pragma unroll
        for (int tt = 0; tt < T; ++tt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = blockIdx.x * kTileN + g + 8 * h;
                if (k < K && n < N) kiln_prefetch_l2(w + (long long)(n + tt * N) * K + k);
            }
    }
}

// Loads round 0 of this block's first tile into registers, exactly as gemv_tiles would.
template <int T, int U>
__device__ __forceinline__ void load_first_round(const bf16* __restrict__ w, int N, int K, uint4 (&wv)[U][T][2]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = (int)blockIdx.x * kTileN;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = u * kBlockK + warp * 32 + t * 8;
#pragma unroll
        for (int tt = 0; tt < T; ++tt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n0 + g + 8 * h;
                const bool ok = n < N;
                wv[u][tt][h] = ld_stream(w + (long long)(ok ? n + tt * N : 0) * K + k, k < K && ok);
            }
    }
}

// The weights do not depend on the previous kernel: the plain modes load their first round
// into registers before waiting for it (programmatic dependent launch), the gated ones ask L2.
template <int M>
__device__ __forceinline__ void gemv(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,
                                     const bf16* extra, int N, int K, int mode) {
    __shared__ float red[2 * kWarps * 128];
    kiln_pdl_trigger();
    if (mode >= 3) {
        uint4 none[4][2][2];
        prefetch_first_round<2, 4>(w, N, K);
        kiln_pdl_wait();
        gemv_tiles<M, 2, 4, false>(x, w, out, extra, N, K, mode, red, nullptr, none, false);
    } else {
        uint4 pre[KILN_DIRECT_U][1][2];
        const bool use_pre = KILN_DIRECT_PRELOAD && (int)blockIdx.x * kTileN < N;
        if (use_pre) load_first_round<1, KILN_DIRECT_U>(w, N, K, pre);
        else prefetch_first_round<1, KILN_DIRECT_U>(w, N, K);
        kiln_pdl_wait();
        gemv_tiles<M, 1, KILN_DIRECT_U, false>(x, w, out, extra, N, K, mode, red, nullptr, pre, use_pre);
    }
}

template <int M>
__device__ __forceinline__ void rms_norm_gemv(const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                                              const bf16* __restrict__ w, bf16* out, const bf16* extra, int N,
                                              int K, int mode, float eps, float weight_offset, int nt) {
    extern __shared__ uint4 xs[];  // M rows of xs_stride(K) slots (dynamic)
    __shared__ float red[2 * kWarps * 128];
    __shared__ float partial[32 * M];
    __shared__ float inv[M];
    kiln_pdl_trigger();
    uint4 pre[KILN_DIRECT_U][1][2];
    const bool use_pre = KILN_DIRECT_PRELOAD && mode < 3 && (int)blockIdx.x * kTileN < N;
    if (mode >= 3) prefetch_first_round<2, 4>(w, N, K);
    else if (use_pre) load_first_round<1, KILN_DIRECT_U>(w, N, K, pre);
    else prefetch_first_round<1, KILN_DIRECT_U>(w, N, K);
    kiln_pdl_wait();  // x is the previous kernel's output
    // Pass 1 (the norm's reduction) leaves x in xs; pass 2 normalizes it in place.
    const int cols = K >> 3, stride = xs_stride(K);
    rms_prologue::inv_rms_rows<M>(x, K, eps, nt, partial, inv, xs, stride);
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols, c = i - m * cols;
        uint4* p = xs + m * stride + c;
        *p = rms_prologue::scale8(*p, rms_prologue::ld_v4(norm_w + 8 * c), inv[m], weight_offset);
    }
    __syncthreads();
    if (mode >= 3) {
        uint4 none[4][2][2];
        gemv_tiles<M, 2, 4, true>(x, w, out, extra, N, K, mode, red, xs, none, false);
    } else {
        gemv_tiles<M, 1, KILN_DIRECT_U, true>(x, w, out, extra, N, K, mode, red, xs, pre, use_pre);
    }
}

}  // namespace gemv_direct_detail

#define KILN_GEMV(MM)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, KILN_DIRECT_MIN_BLOCKS) gemv_direct_bf16_m##MM(                                     \
        const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out, const bf16* extra, int N, int K, \
        int mode) {                                                                                         \
        gemv_direct_detail::gemv<MM>(x, w, out, extra, N, K, mode);                                                \
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

#define KILN_RMS_NORM_GEMV(MM)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, KILN_DIRECT_MIN_BLOCKS) rms_norm_gemv_direct_bf16_m##MM(                        \
        const bf16* __restrict__ x, const bf16* __restrict__ norm_w, const bf16* __restrict__ w, bf16* out,   \
        const bf16* extra, int N, int K, int mode, float eps, float weight_offset, int nt) {                \
        gemv_direct_detail::rms_norm_gemv<MM>(x, norm_w, w, out, extra, N, K, mode, eps, weight_offset, nt); \
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
