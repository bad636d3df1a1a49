// Decode-shaped matrix products (M <= 8 activation rows) near the memory-bandwidth limit,
// and a row argmax + log-probability for greedy sampling on the GPU.
#include "common.cuh"
#include "mma.cuh"
#include "rms_prologue.cuh"

// 1: each block asks L2 for the weights of its first stages before waiting for the previous kernel.
#ifndef KILN_GEMV_PDL_PREFETCH
#define KILN_GEMV_PDL_PREFETCH 0
#endif

// ---------------------------------------------------------------------------------------------
// GEMV: out[m, n] = sum_k x[m, k] * w[n, k] (+ epilogue), M = 1..8, bf16 in/out, f32 accumulation.
//
//   extern "C" __global__ void gemv_bf16_m{M}(const bf16* x, const bf16* w, bf16* out, const bf16* extra,
//                                             int N, int K, int mode, int splits, float* ws,
//                                             unsigned int* counters)
//
// HOST RULE (implement verbatim; num_SMs = 132 on H200, from CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT):
//   tiles = ceil(N / 16)                      (16 output columns per tile)
//   steps = tiles * ceil(K / 256)             (work unit: one tile x 256 k)
//   default (measured fastest on H200 for every decode shape):  splits = 1, grid.x = tiles
//   optional split-K path (needs ws/counters; measured 0-3 us slower, kept for small-N shapes on
//   bigger GPUs):                                               splits = 2, grid.x = min(2 * num_SMs, steps)
//   block = 256 threads, no dynamic shared memory (48 KiB static), grid.y = grid.z = 1.
//   ws: >= M * (mode >= 3 ? 2N : N) floats, counters: >= tiles u32; both all zero before the first
//   launch; every launch leaves them all zero again (ws/counters may be null when splits == 1).
//   Launches that share ws/counters must be stream-ordered (not concurrent).
//
// Work split: the `steps` units are ordered tile-major (tile, k-chunk). With splits >= 2 block b of
// G = gridDim.x takes units [steps * b / G, steps * (b + 1) / G): every block streams the same number
// of bytes (+-1 unit), whatever N is (the kernel is built for 4 resident blocks per SM). A tile cut between blocks is reduced through ws with f32 atomics; a
// per-tile counter (in units of k-chunks) tells the block that completes the tile, which applies the
// epilogue, and re-zeroes ws and the counter. With splits == 1, block b takes whole tiles
// [tiles * b / G, tiles * (b + 1) / G) and never touches ws / counters. Any grid.x >= 1 is correct in
// both modes (splits's value beyond 1 vs >= 2 is not used). Results with splits >= 2 are not bitwise
// deterministic (f32 atomic order).
//
// Tensor-core formulation: one mma.m16n8k16 (bf16 x bf16 -> f32) takes 16 weight rows (A, the
// output columns n) times 16 k, and 8 activation rows (B, the batch rows m; rows >= M are zero).
// The k order inside an mma does not matter for a dot product as long as A and B agree, so each
// lane takes 16 contiguous bytes (8 k) of its weight rows and of its x row, and those four 32-bit
// registers feed two mmas directly (no shuffles, no conversions):
//   lane = 4 * g + t (g = groupID 0..7, t = 0..3), k = chunk base + 32 * warp + 8 t:
//     wlo = w[n0 + g    ][k .. k+8), whi = w[n0 + g + 8][k .. k+8), xv = x[g][k .. k+8) (0 if g >= M)
//     mma #1: A = {wlo.x, whi.x, wlo.y, whi.y}, B = {xv.x, xv.y}   (k .. k+4)
//     mma #2: A = {wlo.z, whi.z, wlo.w, whi.w}, B = {xv.z, xv.w}   (k+4 .. k+8)
//   D (16 x 8 f32): lane (g, t) holds out[m = 2t, 2t+1][n0 + g] and out[m = 2t, 2t+1][n0 + g + 8].
// Loads: every thread streams its own 16-byte pieces with cp.async (weights .cg + L2::256B
// prefetch, x .ca) into its own shared-memory slots, S units ahead (S = 2..5 by M and mode, all of
// 48 KiB), so there is no cross-thread synchronisation in the main loop; a thread only reads
// what it copied (cp.async.wait_group). The 8 warps of a block split each 256-wide k-chunk
// (32 k each) and are reduced through shared memory at the end of a tile segment.
// Gated modes (3, 4) do the gate rows n and the up rows N + n in the same unit, sharing x.
// Requirements: K % 8 == 0; x, w 16-byte aligned; out must not overlap x, w, ws.
// Modes: 0 plain, 1 + extra[n] (bias), 2 + extra[m * N + n] (residual; extra may equal out),
//        3 silu(x.w[n]) * (x.w[N + n]), 4 gelu_tanh(x.w[n]) * (x.w[N + n]) (w has 2N rows).
// The epilogue works on the f32 sums; the only rounding to bf16 is the final store.
//
// rms_norm_gemv_bf16_m{M}(x, norm_w, w, out, extra, N, K, mode, splits, ws, counters, eps,
//                         weight_offset, nt):
// the same product of rms_norm(x) (rms_prologue.cuh: each block issues its first stages, computes
// the rows' inverse RMS, then scales each x piece by inv * (weight_offset + norm_w) as it takes it
// from shared memory, rounded to bf16 exactly as add_rms_norm_bf16 with nt threads rounds its
// output; norm_w is read with plain loads issued before the stage wait). Same host rule and
// launch; norm_w [K], 16-byte aligned; nt = the unfused norm's block size (multiple of 32, <= 1024).
// ---------------------------------------------------------------------------------------------

namespace gemv_detail {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileN = 16;               // output columns per tile
constexpr int kChunkK = kWarps * 32;     // k per work unit (32 per warp)
constexpr int kSmemU4 = 48 * 1024 / 16;  // static shared memory, in 16-byte slots
#ifndef KILN_GEMV_MAX_STAGES  // tuning knob for bench/gpu/gemv_check.py sweeps; the default is the product
#define KILN_GEMV_MAX_STAGES 6
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes of weights, read once: L2 only, ask L2 to fetch the surrounding 256 bytes.
// src_bytes 0 writes zeros (rows >= N, k >= K) without reading.
#ifndef KILN_GEMV_PREFETCH  // tuning knob (256, 128 or 0 = no L2 prefetch hint)
#define KILN_GEMV_PREFETCH 256
#endif
#if KILN_GEMV_PREFETCH == 256
#define KILN_GEMV_CP_CG "cp.async.cg.shared.global.L2::256B"
#elif KILN_GEMV_PREFETCH == 128
#define KILN_GEMV_CP_CG "cp.async.cg.shared.global.L2::128B"
#else
#define KILN_GEMV_CP_CG "cp.async.cg.shared.global"
#endif
__device__ __forceinline__ void cp_stream(unsigned dst, const bf16* src, bool ok) {
    asm volatile(KILN_GEMV_CP_CG " [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

// T = weight tiles per unit (1 plain, 2 gated: gate + up).
// Shared-memory stage (one work unit), in uint4 slots: [2T][256 threads] weights, then
// [8 warps][4M lanes] x (only lanes with g < M load x).
// NORM: x is normalized as it is taken from shared memory; the rows' inverse RMS is computed after
// the first stages are issued, in scratch past the stages (kNormU4 slots).
constexpr int kNormU4 = (8 * 32 + 8) * 4 / 16;

template <int M, int T, bool NORM>
__device__ __forceinline__ void gemv_run(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,
                                         const bf16* extra, int N, int K, int mode, int splits,
                                         float* __restrict__ ws, unsigned int* __restrict__ counters,
                                         uint4* sm, const bf16* __restrict__ norm_w, float eps, float off,
                                         int nt) {
    constexpr int WQ = 2 * T;
    constexpr int STAGE = WQ * kThreads + 32 * M;
    constexpr int S0 = (kSmemU4 - (NORM ? kNormU4 : 0)) / STAGE;
    constexpr int S = S0 > KILN_GEMV_MAX_STAGES ? KILN_GEMV_MAX_STAGES : S0;
    static_assert(S >= 2, "shared memory too small for two stages");
    static_assert(T * kWarps * 128 * 4 <= STAGE * 16, "reduction scratch must fit in a stage");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles = (N + kTileN - 1) / kTileN;
    const int KS = (K + kChunkK - 1) / kChunkK;
    const long long G = gridDim.x, b = blockIdx.x;
    long long beg, end;
    if (splits <= 1) {
        beg = (long long)(tiles * b / G) * KS;
        end = (long long)(tiles * (b + 1) / G) * KS;
    } else {
        const long long total = (long long)tiles * KS;
        beg = total * b / G;
        end = total * (b + 1) / G;
    }
    const int kl = warp * 32 + t * 8;  // this lane's k offset inside a chunk
    // The weights of the first stages do not depend on the previous kernel: ask L2 for them
    // while it finishes (programmatic dependent launch), then wait for x.
    if (KILN_GEMV_PDL_PREFETCH) {
        int pt = (int)(beg / KS), pks = (int)(beg % KS);
        for (long long left = end - beg, s = 0; left > 0 && s < S - 1; --left, ++s) {
            const int k = pks * kChunkK + kl;
            if (k < K) {
#pragma unroll
                for (int tt = 0; tt < T; ++tt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int n = pt * kTileN + g + 8 * h;
                        if (n < N) kiln_prefetch_l2(w + (long long)(n + tt * N) * K + k);
                    }
            }
            if (++pks == KS) {
                pks = 0;
                ++pt;
            }
        }
    }
    kiln_pdl_wait();
    if (beg >= end) return;  // block-uniform

    const unsigned sbase = smem_addr(sm);
    const bool xlane = g < M;
    const bf16* xrow = x + (long long)(xlane ? g : 0) * K;

    // Issue pointer (tile, chunk) and slot.
    int it = (int)(beg / KS), iks = (int)(beg % KS), islot = 0;
    long long ileft = end - beg;
    auto issue = [&]() {
        if (ileft > 0) {
            const unsigned st = sbase + (unsigned)(islot * STAGE) * 16u;
            const int k = iks * kChunkK + kl;
            const bool kok = k < K;  // K % 8 == 0: a lane's 8 values are all in or all out
#pragma unroll
            for (int tt = 0; tt < T; ++tt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int n = it * kTileN + g + 8 * h;
                    const bool ok = kok && n < N;
                    const bf16* src = w + (ok ? (long long)(n + tt * N) * K + k : 0);
                    cp_stream(st + (unsigned)(((tt * 2 + h) * kThreads + tid) * 16), src, ok);
                }
            if (xlane) cp_cached(st + (unsigned)((WQ * kThreads + warp * 4 * M + lane) * 16), xrow + (kok ? k : 0), kok);
            --ileft;
            if (++iks == KS) {
                iks = 0;
                ++it;
            }
            if (++islot == S) islot = 0;
        }
        cp_commit();  // possibly empty: keeps the group count uniform
    };

#pragma unroll
    for (int s = 0; s < S - 1; ++s) issue();

    float xinv = 0.0f;
    if (NORM) {
        float* scratch = reinterpret_cast<float*>(sm + S * STAGE);
        rms_prologue::inv_rms_rows<M>(x, K, eps, nt, scratch, scratch + 32 * M);
        if (xlane) xinv = scratch[32 * M + g];
    }

    int ct = (int)(beg / KS), cks = (int)(beg % KS), seg0 = cks, cslot = 0;
    float acc[T][2][4];
#pragma unroll
    for (int tt = 0; tt < T; ++tt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[tt][j][i] = 0.0f;

    for (long long left = end - beg; left > 0; --left) {
        uint4 nv = make_uint4(0u, 0u, 0u, 0u);
        if (NORM && xlane) {  // in flight while the stage lands
            const int k = cks * kChunkK + kl;
            if (k < K) nv = rms_prologue::ld_v4(norm_w + k);
        }
        issue();          // unit (current + S - 1) into the slot consumed last iteration
        cp_wait<S - 1>();  // this thread's copies of the current unit have landed
        const uint4* st = sm + cslot * STAGE;
        uint4 xv = make_uint4(0u, 0u, 0u, 0u);
        if (xlane) xv = st[WQ * kThreads + warp * 4 * M + lane];
        if (NORM && xlane) xv = rms_prologue::scale8(xv, nv, xinv, off);
#pragma unroll
        for (int tt = 0; tt < T; ++tt) {
            const uint4 lo = st[(tt * 2) * kThreads + tid], hi = st[(tt * 2 + 1) * kThreads + tid];
            mma_bf16(acc[tt][0], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
            mma_bf16(acc[tt][1], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
        }
        ++cks;
        if (cks == KS || left == 1) {  // end of a tile segment (block-uniform)
            const bool full = seg0 == 0 && cks == KS;
            // The stage just consumed doubles as reduction scratch once every thread is past it.
            __syncthreads();
            float* red = reinterpret_cast<float*>(sm + cslot * STAGE);
#pragma unroll
            for (int tt = 0; tt < T; ++tt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    red[(tt * kWarps + warp) * 128 + lane * 4 + i] = acc[tt][0][i] + acc[tt][1][i];
                    acc[tt][0][i] = 0.0f;
                    acc[tt][1][i] = 0.0f;
                }
            __syncthreads();
            // Thread -> (column n0 + nl, row m); D element (nl, m) is in lane (nl % 8) * 4 + m / 2,
            // register (m & 1) + 2 * (nl / 8).
            const int nl = tid >> 3, m = tid & 7;
            const int n = ct * kTileN + nl;
            const bool active = tid < kTileN * 8 && m < M && n < N;
            float s[T];
#pragma unroll
            for (int tt = 0; tt < T; ++tt) s[tt] = 0.0f;
            if (active) {
                const int idx = ((nl & 7) * 4 + (m >> 1)) * 4 + (m & 1) + 2 * (nl >> 3);
#pragma unroll
                for (int tt = 0; tt < T; ++tt) {
                    float v = 0.0f;
#pragma unroll
                    for (int ww = 0; ww < kWarps; ++ww) v += red[(tt * kWarps + ww) * 128 + idx];
                    s[tt] = v;
                }
            }
            bool finish = full;
            if (!full) {
                // Partial tile: add to the workspace; the block that completes the tile finishes it.
                if (active) {
#pragma unroll
                    for (int tt = 0; tt < T; ++tt) atomicAdd(ws + ((long long)m * T + tt) * N + n, s[tt]);
                }
                __threadfence();
                __syncthreads();  // every thread's adds are in before the count moves
                bool last = false;
                if (tid == 0) {
                    const unsigned mine = (unsigned)(cks - seg0);
                    last = atomicAdd(counters + ct, mine) + mine == (unsigned)KS;
                    if (last) counters[ct] = 0u;  // every other contribution is in: nobody touches it again
                }
                finish = __syncthreads_or(last) != 0;
                if (finish) {
                    __threadfence();
                    if (active) {
#pragma unroll
                        for (int tt = 0; tt < T; ++tt) {
                            float* p = ws + ((long long)m * T + tt) * N + n;
                            s[tt] = __ldcg(p);
                            __stcg(p, 0.0f);
                        }
                    }
                }
            }
            if (finish && active) {
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
            __syncthreads();  // scratch (this stage) is refilled by the next issue()
            if (cks == KS) {
                cks = 0;
                ++ct;
            }
            seg0 = cks;
        }
        if (++cslot == S) cslot = 0;
    }
    cp_wait<0>();
}

template <int M>
__device__ __forceinline__ void gemv(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out,
                                     const bf16* extra, int N, int K, int mode, int splits, float* ws,
                                     unsigned int* counters) {
    __shared__ uint4 sm[kSmemU4];
    if (mode >= 3) gemv_run<M, 2, false>(x, w, out, extra, N, K, mode, splits, ws, counters, sm, nullptr, 0.0f, 0.0f, 0);
    else gemv_run<M, 1, false>(x, w, out, extra, N, K, mode, splits, ws, counters, sm, nullptr, 0.0f, 0.0f, 0);
}

template <int M>
__device__ __forceinline__ void rms_norm_gemv(const bf16* __restrict__ x, const bf16* __restrict__ norm_w,
                                              const bf16* __restrict__ w, bf16* out, const bf16* extra, int N,
                                              int K, int mode, int splits, float* ws, unsigned int* counters,
                                              float eps, float weight_offset, int nt) {
    __shared__ uint4 sm[kSmemU4];
    if (mode >= 3)
        gemv_run<M, 2, true>(x, w, out, extra, N, K, mode, splits, ws, counters, sm, norm_w, eps, weight_offset, nt);
    else
        gemv_run<M, 1, true>(x, w, out, extra, N, K, mode, splits, ws, counters, sm, norm_w, eps, weight_offset, nt);
}

}  // namespace gemv_detail

#define KILN_GEMV(MM)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 4) gemv_bf16_m##MM(                                  \
        const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* out, const bf16* extra, int N, int K, \
        int mode, int splits, float* ws, unsigned int* counters) {                                               \
        kiln_pdl_trigger();                                                                                      \
        gemv_detail::gemv<MM>(x, w, out, extra, N, K, mode, splits, ws, counters);                          \
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

#define KILN_RMS_NORM_GEMV(MM)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 4) rms_norm_gemv_bf16_m##MM(                             \
        const bf16* __restrict__ x, const bf16* __restrict__ norm_w, const bf16* __restrict__ w, bf16* out,    \
        const bf16* extra, int N, int K, int mode, int splits, float* ws, unsigned int* counters, float eps,  \
        float weight_offset, int nt) {                                                                           \
        kiln_pdl_trigger();                                                                                      \
        gemv_detail::rms_norm_gemv<MM>(x, norm_w, w, out, extra, N, K, mode, splits, ws, counters, eps,        \
                                       weight_offset, nt);                                                    \
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

// ---------------------------------------------------------------------------------------------
// Greedy sampling: ids[row] = argmax_v logits[row, v] (lowest index on ties, NaNs ignored),
// logprobs[row] = logits[row, argmax] - logsumexp(logits[row, :]) in f32 (NaN when the row holds a
// NaN or +inf, as exp(v - max) over the row gives).
// Launch: grid.x = rows, block 1024 (any multiple of 32 up to 1024 works), no dynamic smem.
// One pass: each thread keeps a running (max, sum of exp(v - max), index) over its logits, read
// 16 bytes at a time with UN loads in flight (rows of a multiple of 16 bytes), then the block merges.
// ---------------------------------------------------------------------------------------------
namespace argmax_detail {

#define KILN_ARGMAX_NONE 0xffffffffu

__device__ __forceinline__ float load_logit(const bf16* p) { return to_f32(*p); }
__device__ __forceinline__ float load_logit(const float* p) { return *p; }

// The 16 / sizeof(T) logits of a 16-byte load.
__device__ __forceinline__ void unpack16(const uint4& u, const bf16*, float (&v)[8]) {
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack16(const uint4& u, const float*, float (&v)[4]) {
    v[0] = __uint_as_float(u.x);
    v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z);
    v[3] = __uint_as_float(u.w);
}

// Is (v2, i2) a better candidate than (v1, i1)? Index KILN_ARGMAX_NONE means "none yet".
__device__ __forceinline__ bool better(float v2, unsigned i2, float v1, unsigned i1) {
    if (i2 == KILN_ARGMAX_NONE) return false;
    if (i1 == KILN_ARGMAX_NONE) return true;
    return v2 > v1 || (v2 == v1 && i2 < i1);
}

// Running state of some logits: the max m at index i, s = sum of exp(v - m) over the finite and
// +inf ones, bad = a NaN or +inf was seen (the sum is NaN then).
struct Run {
    float m, s;
    unsigned i;
    int bad;
};

// Logit v at index i, indices increasing per thread (strict > keeps the lowest on ties).
__device__ __forceinline__ void take(Run& r, float v, unsigned i) {
    if (v != v) {
        r.bad = 1;
        return;
    }
    if (v == NEG_INF) return;
    if (v == -NEG_INF) r.bad = 1;
    if (r.i == KILN_ARGMAX_NONE) {
        r.m = v;
        r.s = 1.0f;
        r.i = i;
    } else if (v > r.m) {
        r.s = r.s * expf(r.m - v) + 1.0f;
        r.m = v;
        r.i = i;
    } else {
        r.s += expf(v - r.m);
    }
}

__device__ __forceinline__ void merge(Run& r, float om, float os, unsigned oi, int obad) {
    r.bad |= obad;
    if (oi == KILN_ARGMAX_NONE) return;
    if (r.i == KILN_ARGMAX_NONE) {
        r.m = om;
        r.s = os;
        r.i = oi;
    } else if (better(om, oi, r.m, r.i)) {
        r.s = os + r.s * expf(r.m - om);
        r.m = om;
        r.i = oi;
    } else {
        r.s += os * expf(om - r.m);
    }
}

__device__ __forceinline__ void warp_merge(Run& r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, r.m, off);
        const float os = __shfl_xor_sync(0xffffffffu, r.s, off);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, r.i, off);
        const int ob = __shfl_xor_sync(0xffffffffu, r.bad, off);
        merge(r, om, os, oi, ob);
    }
}

// A logit the row's mask (one bit per id, or none) forbids reads as -inf.
__device__ __forceinline__ float apply_mask(float v, const unsigned* mask, int i) {
    return (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1u)) ? NEG_INF : v;
}

template <typename T>
__device__ __forceinline__ void argmax_logprob(const T* __restrict__ logits, int V, unsigned int* __restrict__ ids,
                                               float* __restrict__ logprobs, const unsigned* __restrict__ mask) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int UN = 4;  // 16-byte loads in flight per thread
    __shared__ float sm[32], ss[32];
    __shared__ unsigned si[32];
    __shared__ int sb[32];
    const T* row = logits + (long long)blockIdx.x * V;
    Run r{NEG_INF, 0.0f, KILN_ARGMAX_NONE, 0};
    if (V % VEC == 0 && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
        const int chunks = V / VEC;
        const uint4* rc = reinterpret_cast<const uint4*>(row);
        for (int c0 = threadIdx.x; c0 < chunks; c0 += blockDim.x * UN) {
            uint4 u[UN];
#pragma unroll
            for (int j = 0; j < UN; ++j) {
                const int c = c0 + j * blockDim.x;
                u[j] = c < chunks ? rc[c] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < UN; ++j) {
                const int c = c0 + j * blockDim.x;
                if (c < chunks) {
                    float v[VEC];
                    unpack16(u[j], row, v);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) take(r, apply_mask(v[e], mask, c * VEC + e), (unsigned)(c * VEC + e));
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) take(r, apply_mask(load_logit(row + i), mask, i), (unsigned)i);
    }
    warp_merge(r);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        sm[warp] = r.m;
        ss[warp] = r.s;
        si[warp] = r.i;
        sb[warp] = r.bad;
    }
    __syncthreads();
    if (warp == 0) {
        Run t{NEG_INF, 0.0f, KILN_ARGMAX_NONE, 0};
        if (lane < num_warps) t = Run{sm[lane], ss[lane], si[lane], sb[lane]};
        warp_merge(t);
        if (lane == 0) {
            ids[blockIdx.x] = t.i == KILN_ARGMAX_NONE ? 0u : t.i;
            // logits[argmax] - (max + log(sum)) == -log(sum); all -inf (or empty) rows: uniform.
            logprobs[blockIdx.x] = t.i != KILN_ARGMAX_NONE ? (t.bad ? __int_as_float(0x7fc00000) : -logf(t.s))
                                                            : -logf((float)(V > 0 ? V : 1));
        }
    }
}

#undef KILN_ARGMAX_NONE

}  // namespace argmax_detail

extern "C" __global__ void argmax_logprob_bf16(const bf16* __restrict__ logits, int V, unsigned int* __restrict__ ids,
                                               float* __restrict__ logprobs) {
    kiln_pdl_enter();
    argmax_detail::argmax_logprob(logits, V, ids, logprobs, (const unsigned*)nullptr);
}

extern "C" __global__ void argmax_logprob_f32(const float* __restrict__ logits, int V, unsigned int* __restrict__ ids,
                                              float* __restrict__ logprobs) {
    kiln_pdl_enter();
    argmax_detail::argmax_logprob(logits, V, ids, logprobs, (const unsigned*)nullptr);
}

// Constrained greedy sampling: row r takes only the ids whose bit is set in
// masks[r * words ...] (an output format's allowed tokens; all-ones words for a
// free row); the log-probability is over the allowed ids.
extern "C" __global__ void argmax_logprob_masked_bf16(const bf16* __restrict__ logits, int V,
                                                      unsigned int* __restrict__ ids, float* __restrict__ logprobs,
                                                      const unsigned* __restrict__ masks, int words) {
    kiln_pdl_enter();
    argmax_detail::argmax_logprob(logits, V, ids, logprobs, masks + (long long)blockIdx.x * words);
}
