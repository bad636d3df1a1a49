// Products with FP8 E4M3 weights kept on the device as stored (Kiln's FP8 blocks: runs of 128 of
// a row under an f32 scale; blocks.rs splits each block into its 128 E4M3 bytes, the body, and its
// scale, the meta, so a row's bytes are contiguous and the scales run-major), on the tensor cores:
// the decode products here, larger ones through cuBLASLt's block-scaled FP8 GEMM over activations
// quantized by quant_e4m3_rows (lt.rs).
//
//   qgemv_fp8_m{M}(x, norm_w, eps, off, nt, parts, out, residual, K, ldo, gated, act)
//     The contract of blocks.cu's qgemv_<fmt>_m{M} (M <= 8 rows of x; norm prologue, residual,
//     packed gate/up, up to three stacked parts). Every block stages x' (normalized as
//     add_rms_norm_bf16 rounds it, when norm_w != 0) in shared memory as f16 X = x' * 2^-e, e a
//     power of two a row putting its largest magnitude in [2^14, 2^15): x' has bf16's 8
//     significant bits, so X is exact (only values below 2^-38 of the row's largest lose bits).
//     A tile is 16 weight rows (A-rows; gated: 8 gate rows in A-rows 0..7 and their up rows in
//     8..15) against the M rows of X (B columns, zero past M), mma.m16n8k16 f16 x f16 -> f32:
//     lane 4 g + t of warp w loads 16 E4M3 bytes of A-rows g and g + 8 at k = 512 s + 64 w + 16 t
//     (step s), converts them to f16 (exact), and runs 4 mmas with X row g at the same k (the k
//     order inside an mma does not matter when A and B agree). A warp's 64 k of a step lie in one
//     run of 128, so each step's four mmas start from zero and are added to the sums times their
//     rows' scales. A block takes tiles blockIdx.x, + gridDim.x, ...; its (tile, step) items' loads
//     run U items ahead through a ring of registers (the first U before waiting on the previous
//     kernel), across tiles. The 8 warps' sums are reduced through shared memory, times 2^e, and
//     the epilogue stores bf16. Block 256 threads, any grid; dynamic shared memory
//     blocks.rs's fp8_smem(M, K) = M (2 K + 16) bytes; K % 128 == 0; x, norm_w 16-byte aligned;
//     out must not overlap x; residual may be out itself (each element is read, then written,
//     by one thread: blocks.rs adds the last rows of a cuBLASLt product this way).
//   dequant_fp8_bf16(body, meta, ids, out, K, rows_out, row0, rows)
//     out[r, :] = W[ids ? ids[r] : row0 + r, :] as bf16 (e4m3 * scale rounded once), r < rows_out,
//     of a part of `rows` rows; a thread per 32 elements, any grid.
//   quant_e4m3_rows(x, codes, scales, n, K, ss)
//     The activations of cuBLASLt's FP8 products: x [n, K] bf16 in runs of 128 a row, each as
//     E4M3 codes (round to nearest, saturating) under an f32 scale amax / 448 (1 for a zero run,
//     or one whose amax is below 448 FLT_MIN),
//     scales[run * ss + row] (ss >= n, a multiple of 4). A warp a run, any grid.
#include "common.cuh"
#include "mma.cuh"
#include "rms_prologue.cuh"
#include "block_parts.cuh"
#include "kv_elem.cuh"
#include <cuda_fp16.h>

// Tuning knobs (KILN_KERNEL_DEFINES): (tile, step) items in flight a lane, and the resident
// blocks an SM the compiler must allow (register cap; the host launches that many an SM).
#ifndef KILN_FP8_U
#define KILN_FP8_U 4
#endif
#ifndef KILN_FP8_MIN_BLOCKS
#define KILN_FP8_MIN_BLOCKS 2
#endif


namespace fp8_detail {

typedef unsigned char u8;
constexpr int kWarps = 8;
constexpr int kStepK = kWarps * 64;

using block_parts::Parts;

// Scales from one run of 128 to the next in a part of `rows` rows.
__device__ __forceinline__ long long scale_stride(long long rows) { return (rows + 3) & ~3LL; }

// Row r of the stacked parts: its bytes (K a row), its first scale and the stride from one run's
// scale to the next (blocks.rs stores a part's scales run-major, [K / 128][rows padded to 4]: the
// layout cuBLASLt's 1x128 block scaling reads).
__device__ __forceinline__ void row_of(const Parts& p, int r, int K, const u8*& w, const float*& s, int& ss) {
    const u8* body;
    const u8* meta;
    int local;
    block_parts::part_of(p, r, body, meta, local);
    const int rows = r < p.rows[0] ? p.rows[0] : r < p.rows[0] + p.rows[1] ? p.rows[1] : p.rows[2];
    w = body + (long long)local * K;
    s = reinterpret_cast<const float*>(meta) + local;
    ss = scale_stride(rows);
}

// Four E4M3 bytes (of w, in order) as two f16 pairs: bytes 0, 1 in lo, 2, 3 in hi.
__device__ __forceinline__ void e4m3x4_to_f16(unsigned w, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#else
    // Before sm_89: through bf16 bits (kv_elem.cuh), exactly (f16 holds every E4M3 value).
    const auto h2 = [](unsigned short v) {
        const unsigned b = kv_elem::e4m3x2_bf16x2(v);
        const __half2 h = __floats2half2_rn(__uint_as_float(b << 16), __uint_as_float(b & 0xffff0000u));
        return *reinterpret_cast<const unsigned*>(&h);
    };
    lo = h2((unsigned short)(w & 0xffffu));
    hi = h2((unsigned short)(w >> 16));
#endif
}

// One item's loads: 16 bytes of A-rows g and g + 8 at k, and their runs' scales.
struct Slot {
    uint4 lo, hi;
    float slo, shi;
};

// Row stride of staged X, in 16-byte slots: 2 K + 16 bytes, so that the 8 lanes of a phase (X
// rows g, g + 1 at 4 k offsets) hit distinct banks.
__device__ __forceinline__ int xs_stride(int K) { return K / 8 + 1; }

// Stages the M rows of x' into xs as f16 X = x' * 2^-e, and xsc[m] = 2^e.
template <int M>
__device__ __forceinline__ void stage(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                      float off, int nt, int K, uint4* xs, float* xsc) {
    __shared__ float partial[32 * M];
    __shared__ float inv[M];
    __shared__ int amax[M];
    const int cols = K / 8, stride = xs_stride(K);
    if (threadIdx.x < M) amax[threadIdx.x] = 0;
    if (norm_w) {
        rms_prologue::inv_rms_rows<M>(x, K, eps, nt, partial, inv, xs, stride);
    } else {
        for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
            const int m = i / cols, c = i - m * cols;
            xs[m * stride + c] = rms_prologue::ld_v4(x + (long long)m * K + 8 * c);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols, c = i - m * cols;
        uint4* p = xs + m * stride + c;
        uint4 v = *p;
        if (norm_w) v = rms_prologue::scale8(v, rms_prologue::ld_v4(norm_w + 8 * c), inv[m], off);
        *p = v;
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        float a = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 f = rms_prologue::bf2_to_f2(w[q]);
            a = fmaxf(a, fmaxf(fabsf(f.x), fabsf(f.y)));
            if (f.x != f.x || f.y != f.y) a = __int_as_float(0x7f800000);
        }
        if (a > 0.0f) atomicMax(&amax[m], __float_as_int(a));
    }
    __syncthreads();
    if (threadIdx.x < M) {
        // amax < 2^(E + 1): X = x' 2^-(E - 14) < 2^15. Zero, infinite or NaN rows: e = 0.
        const int bits = amax[threadIdx.x], E = ((bits >> 23) & 0xff) - 127;
        const int e = bits == 0 || E == 128 ? 0 : max(E - 14, -126);
        xsc[threadIdx.x] = __int_as_float((127 + e) << 23);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols, c = i - m * cols;
        uint4* p = xs + m * stride + c;
        const uint4 v = *p;
        const float down = 1.0f / xsc[m];  // a power of two: exact
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        unsigned h[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 f = rms_prologue::bf2_to_f2(w[q]);
            const __half2 hv = __floats2half2_rn(f.x * down, f.y * down);
            h[q] = *reinterpret_cast<const unsigned*>(&hv);
        }
        *p = make_uint4(h[0], h[1], h[2], h[3]);
    }
    __syncthreads();
}

template <int M>
__device__ __forceinline__ void qgemv(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                      float off, int nt, const Parts& parts, bf16* out,
                                      const bf16* residual, int K, int ldo, bool gated, int act) {
    constexpr int U = KILN_FP8_U;
    extern __shared__ uint4 xs[];
    __shared__ float red[kWarps * 128];
    __shared__ float xsc[M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int total = parts.rows[0] + parts.rows[1] + parts.rows[2];
    const int rows_out = gated ? total / 2 : total;
    const int tile_rows = gated ? 8 : 16;
    const int ntiles = (rows_out + tile_rows - 1) / tile_rows;
    const int steps = (K + kStepK - 1) / kStepK;
    const int my_tiles = (int)blockIdx.x < ntiles ? (ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int items = my_tiles * steps;

    // The load cursor: tile, step, and the tile's two rows for this lane (null past the rows).
    int l_tile = blockIdx.x, l_step = 0;
    const u8* wlo = nullptr;
    const u8* whi = nullptr;
    const float* slo = nullptr;
    const float* shi = nullptr;
    int sslo = 0, sshi = 0;
    auto set_tile = [&](int tile) {
        const int n0 = tile * tile_rows;
        const int rlo = n0 + g, rhi = gated ? rows_out + n0 + g : n0 + g + 8;
        const bool oklo = n0 + g < rows_out, okhi = gated ? oklo : rhi < rows_out;
        wlo = whi = nullptr;
        if (oklo) row_of(parts, rlo, K, wlo, slo, sslo);
        if (okhi) row_of(parts, rhi, K, whi, shi, sshi);
    };
    auto load = [&](Slot& sl) {
        const int k = l_step * kStepK + warp * 64 + t * 16;
        const bool kok = k < K;
        sl.lo = ld_stream16<false>(wlo + k, kok && wlo != nullptr);
        sl.hi = ld_stream16<false>(whi + k, kok && whi != nullptr);
        sl.slo = kok && wlo != nullptr ? __ldg(slo + (k >> 7) * sslo) : 0.0f;
        sl.shi = kok && whi != nullptr ? __ldg(shi + (k >> 7) * sshi) : 0.0f;
        if (++l_step == steps) {
            l_step = 0;
            l_tile += gridDim.x;
            if (l_tile < ntiles) set_tile(l_tile);
        }
    };

    Slot ring[U];
    kiln_pdl_trigger();
    if (items > 0) set_tile(l_tile);
#pragma unroll
    for (int j = 0; j < U; ++j)
        if (j < items) load(ring[j]);
    kiln_pdl_wait();
    stage<M>(x, norm_w, eps, off, nt, K, xs, xsc);

    const uint4* xrow = xs + (g < M ? g : 0) * xs_stride(K);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int c_tile = blockIdx.x, c_step = 0;
    for (int i0 = 0; i0 < items; i0 += U) {
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (i0 + j >= items) continue;  // block-uniform
            // The slot is consumed first, then refilled with the item U on (a refill before the
            // last use would make the loop carry a copy that waits for the new loads).
            const Slot& sl = ring[j];
            const int k = c_step * kStepK + warp * 64 + t * 16;
            const bool xok = g < M && k < K;
            const uint4 xa = xok ? xrow[k >> 3] : zero, xb = xok ? xrow[(k >> 3) + 1] : zero;
            const unsigned xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
            const unsigned wl[4] = {sl.lo.x, sl.lo.y, sl.lo.z, sl.lo.w};
            const unsigned wh[4] = {sl.hi.x, sl.hi.y, sl.hi.z, sl.hi.w};
            const float slo = sl.slo, shi = sl.shi;
            // (Two independent chains of two mmas measured no faster: 266.5 against 265.4 tok/s.)
            float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                unsigned l01, l23, h01, h23;
                e4m3x4_to_f16(wl[q], l01, l23);
                e4m3x4_to_f16(wh[q], h01, h23);
                mma_f16(tmp, l01, h01, l23, h23, xw[2 * q], xw[2 * q + 1]);
            }
            if (i0 + j + U < items) load(ring[j]);
            acc[0] = fmaf(slo, tmp[0], acc[0]);
            acc[1] = fmaf(slo, tmp[1], acc[1]);
            acc[2] = fmaf(shi, tmp[2], acc[2]);
            acc[3] = fmaf(shi, tmp[3], acc[3]);
            if (++c_step < steps) continue;
            // The tile's last step: reduce the 8 warps' sums and store.
#pragma unroll
            for (int q = 0; q < 4; ++q) red[warp * 128 + lane * 4 + q] = acc[q], acc[q] = 0.0f;
            __syncthreads();
            // Thread -> (A-row r, batch row m); D element (r, m) is in lane (r % 8) * 4 + m / 2,
            // register (m & 1) + 2 * (r / 8).
            if (threadIdx.x < 16 * 8) {
                const int r = threadIdx.x >> 3, m = threadIdx.x & 7;
                const int n = c_tile * tile_rows + r;
                if (r < tile_rows && m < M && n < rows_out) {
                    float s[2] = {0.0f, 0.0f};
                    for (int h = 0; h < (gated ? 2 : 1); ++h) {
                        const int rr = r + 8 * h;  // h = 1: the up row of a gated tile
                        const int idx = ((rr & 7) * 4 + (m >> 1)) * 4 + (m & 1) + 2 * (rr >> 3);
                        float v = 0.0f;
#pragma unroll
                        for (int ww = 0; ww < kWarps; ++ww) v += red[ww * 128 + idx];
                        s[h] = v * xsc[m];
                    }
                    float v = gated ? gate_act(s[0], act) * s[1] : s[0];
                    const long long o = (long long)m * ldo + n;
                    if (residual) v += to_f32(residual[o]);
                    out[o] = to_bf16(v);
                }
            }
            __syncthreads();
            c_step = 0;
            c_tile += gridDim.x;
        }
    }
}

}  // namespace fp8_detail

#define KILN_QGEMV_FP8(MM)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, KILN_FP8_MIN_BLOCKS) qgemv_fp8_m##MM(                \
        const bf16* x, const bf16* norm_w, float eps, float off, int nt, fp8_detail::Parts parts, bf16* out, \
        const bf16* residual, int K, int ldo, int gated, int act) {                                        \
        fp8_detail::qgemv<MM>(x, norm_w, eps, off, nt, parts, out, residual, K, ldo, gated != 0, act);              \
    }
KILN_QGEMV_FP8(1)
KILN_QGEMV_FP8(2)
KILN_QGEMV_FP8(3)
KILN_QGEMV_FP8(4)
KILN_QGEMV_FP8(5)
KILN_QGEMV_FP8(6)
KILN_QGEMV_FP8(7)
KILN_QGEMV_FP8(8)
#undef KILN_QGEMV_FP8

extern "C" __global__ void dequant_fp8_bf16(const unsigned char* __restrict__ body, const unsigned char* __restrict__ meta,
                                            const unsigned* __restrict__ ids, bf16* __restrict__ out, int K,
                                            long long rows_out, long long row0, long long rows) {
    kiln_pdl_enter();
    const int per_row = K / 32;
    const long long ss = fp8_detail::scale_stride(rows);
    const float* scales = reinterpret_cast<const float*>(meta);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows_out * per_row;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / per_row;
        const int c = (int)(i % per_row);
        const long long src = ids ? (long long)ids[r] : row0 + r;
        const float s = scales[(c / 4) * ss + src];
        const uint4* p = reinterpret_cast<const uint4*>(body + src * K + 32 * c);
        const uint4 a = p[0], b = p[1];
        const unsigned w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        uint4* o = reinterpret_cast<uint4*>(out + r * K + 32 * c);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned ow[4];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                unsigned lo, hi;
                fp8_detail::e4m3x4_to_f16(w[2 * j + q], lo, hi);
                const float2 fl = __half22float2(*reinterpret_cast<const __half2*>(&lo));
                const float2 fh = __half22float2(*reinterpret_cast<const __half2*>(&hi));
                const __nv_bfloat162 bl = __floats2bfloat162_rn(fl.x * s, fl.y * s);
                const __nv_bfloat162 bh = __floats2bfloat162_rn(fh.x * s, fh.y * s);
                ow[2 * q] = *reinterpret_cast<const unsigned*>(&bl);
                ow[2 * q + 1] = *reinterpret_cast<const unsigned*>(&bh);
            }
            o[j] = make_uint4(ow[0], ow[1], ow[2], ow[3]);
        }
    }
}

extern "C" __global__ void quant_e4m3_rows(const bf16* __restrict__ x, unsigned char* __restrict__ codes,
                                           float* __restrict__ scales, long long n, int K, long long ss) {
    kiln_pdl_enter();
    const int lane = threadIdx.x & 31, runs = K / 128;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long w = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; w < n * runs; w += warps) {
        const long long row = w / runs;
        const int run = (int)(w % runs);
        const long long at = row * K + run * 128 + lane * 4;
        const uint2 v = *reinterpret_cast<const uint2*>(x + at);
        const float2 a = rms_prologue::bf2_to_f2(v.x), b = rms_prologue::bf2_to_f2(v.y);
        float m = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        // (A run below 448 times the least normal float, whose scale would be subnormal and its
        // inverse infinite, counts as zero.)
        const float s = m > 448.0f * 1.17549435e-38f ? m / 448.0f : 1.0f;
        const float inv = 1.0f / s;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        unsigned short lo, hi;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(a.x * inv), "f"(a.y * inv));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(b.x * inv), "f"(b.y * inv));
        *reinterpret_cast<unsigned*>(codes + at) = (unsigned)lo | ((unsigned)hi << 16);
#else
        *reinterpret_cast<unsigned*>(codes + at) =
            kv_elem::e4m3_of(a.x * inv) | (kv_elem::e4m3_of(a.y * inv) << 8) |
            (kv_elem::e4m3_of(b.x * inv) << 16) | (kv_elem::e4m3_of(b.y * inv) << 24);
#endif
        if (lane == 0) scales[run * ss + row] = s;
    }
}
