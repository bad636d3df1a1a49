// LoRA deltas of a step, all adapters and packed parts in one pair of launches
// (the gathered low-rank product, in the manner of Punica's SGMV): each segment is
// one adapter's projection over one contiguous run of rows,
//   y[rows, col0 : col0 + cols] += scale * (x[rows] A^T) B^T,
// A [r, k] and B [cols, r] bf16. lora_shrink_bf16 writes t = x A^T in f32 as
// partial sums over chunks of k (no atomics: every row's sum has one order, so a
// row's delta is the same in any batch); lora_expand_bf16 sums the chunks, takes
// the product with B and adds it to y in place (one rounding to bf16).
#include "common.cuh"
#include "vec8.cuh"

#define LORA_MAX_SEGS 32
#define LORA_SHRINK_ROWS 8
#define LORA_SHRINK_K 512
#define LORA_EXPAND_ROWS 16

struct LoraSeg {
    const bf16* a;
    const bf16* b;
    float scale;
    int row0;
    int rows;
    int col0;
    int cols;
    int r;
    long long t_off;  // this segment's [rows, r] block of t
};

struct LoraSegs {
    LoraSeg s[LORA_MAX_SEGS];
    long long t_stride;  // floats of t per chunk of k
    int k;               // x's width (a multiple of 8)
    int width;           // y's width
    int num_kc;          // chunks of LORA_SHRINK_K along k
};

// Grid (segments, chunks of k, tiles of LORA_SHRINK_ROWS rows); block 256 (8 warps).
// A block stages its rows' chunk of x in shared memory; warp w takes ranks w, w + 8, ...
// and writes t_part[chunk][t_off + row * r + j].
extern "C" __global__ void __launch_bounds__(256) lora_shrink_bf16(const bf16* __restrict__ x,
                                                                   float* __restrict__ t_part,
                                                                   const LoraSegs p) {
    kiln_pdl_enter();
    const LoraSeg& s = p.s[blockIdx.x];
    const int tile0 = blockIdx.z * LORA_SHRINK_ROWS;
    if (tile0 >= s.rows) return;
    const int nrows = min(LORA_SHRINK_ROWS, s.rows - tile0);
    const int k0 = blockIdx.y * LORA_SHRINK_K;
    const int klen = min(LORA_SHRINK_K, p.k - k0);
    __shared__ __align__(16) bf16 xs[LORA_SHRINK_ROWS][LORA_SHRINK_K];
    for (int i = threadIdx.x; i < LORA_SHRINK_ROWS * (LORA_SHRINK_K / 8); i += blockDim.x) {
        const int row = i / (LORA_SHRINK_K / 8), c = (i % (LORA_SHRINK_K / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (row < nrows && c < klen)
            v = *reinterpret_cast<const uint4*>(x + (long long)(s.row0 + tile0 + row) * p.k + k0 + c);
        *reinterpret_cast<uint4*>(&xs[row][c]) = v;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    // Two ranks a pass, every load of both issued before the products.
    constexpr int PER_LANE = LORA_SHRINK_K / 256;  // 16-byte pieces of A a lane takes per rank
    for (int j = warp; j < s.r; j += 2 * nwarps) {
        const int j2 = j + nwarps;
        const bool two = j2 < s.r;
        uint4 av[2][PER_LANE];
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            const int c = lane * 8 + q * 256;
            const bool in = c < klen;
            av[0][q] = in ? *reinterpret_cast<const uint4*>(s.a + (long long)j * p.k + k0 + c)
                          : make_uint4(0, 0, 0, 0);
            av[1][q] = (in && two) ? *reinterpret_cast<const uint4*>(s.a + (long long)j2 * p.k + k0 + c)
                                   : make_uint4(0, 0, 0, 0);
        }
        float acc[2][LORA_SHRINK_ROWS];
#pragma unroll
        for (int row = 0; row < LORA_SHRINK_ROWS; ++row) acc[0][row] = acc[1][row] = 0.0f;
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            const int c = lane * 8 + q * 256;
            float a0[8], a1[8];
            vec8::unpack8(av[0][q], a0);
            vec8::unpack8(av[1][q], a1);
#pragma unroll
            for (int row = 0; row < LORA_SHRINK_ROWS; ++row) {
                float xf[8];
                vec8::unpack8(*reinterpret_cast<const uint4*>(&xs[row][c]), xf);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[0][row] = fmaf(a0[e], xf[e], acc[0][row]);
                    acc[1][row] = fmaf(a1[e], xf[e], acc[1][row]);
                }
            }
        }
        float* part = t_part + blockIdx.y * p.t_stride + s.t_off + (long long)tile0 * s.r;
#pragma unroll
        for (int row = 0; row < LORA_SHRINK_ROWS; ++row) {
            const float v0 = warp_sum(acc[0][row]);
            const float v1 = warp_sum(acc[1][row]);
            if (lane == 0 && row < nrows) {
                part[row * s.r + j] = v0;
                if (two) part[row * s.r + j2] = v1;
            }
        }
    }
}

// Grid (segments, chunks of 256 columns, tiles of LORA_EXPAND_ROWS rows); block 256, dynamic
// shared memory LORA_EXPAND_ROWS * (largest r) floats. Thread n of a chunk owns column n of its
// segment: y[row, col0 + n] = bf16(y + scale * sum_j t[row, j] B[n, j]).
extern "C" __global__ void __launch_bounds__(256) lora_expand_bf16(bf16* __restrict__ y,
                                                                   const float* __restrict__ t_part,
                                                                   const LoraSegs p) {
    kiln_pdl_enter();
    const LoraSeg& s = p.s[blockIdx.x];
    const int tile0 = blockIdx.z * LORA_EXPAND_ROWS;
    if (tile0 >= s.rows || (int)(blockIdx.y * blockDim.x) >= s.cols) return;
    const int nrows = min(LORA_EXPAND_ROWS, s.rows - tile0);
    extern __shared__ float ts[];
    for (int i = threadIdx.x; i < LORA_EXPAND_ROWS * s.r; i += blockDim.x) {
        float v = 0.0f;
        if (i < nrows * s.r) {
            const long long off = s.t_off + (long long)tile0 * s.r + i;
            for (int c = 0; c < p.num_kc; ++c) v += t_part[c * p.t_stride + off];
        }
        ts[i] = v;
    }
    __syncthreads();
    const int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= s.cols) return;
    const bf16* brow = s.b + (long long)n * s.r;
    float acc[LORA_EXPAND_ROWS];
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row) acc[row] = 0.0f;
    if ((s.r & 7) == 0 && vec8::aligned16(brow)) {
        // B's row in 16-byte pieces, up to four loads in flight before the products.
        for (int j0 = 0; j0 < s.r; j0 += 32) {
            uint4 bv[4];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                bv[q] = j0 + q * 8 < s.r ? *reinterpret_cast<const uint4*>(brow + j0 + q * 8)
                                         : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (j0 + q * 8 >= s.r) break;
                float bf[8];
                vec8::unpack8(bv[q], bf);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float* tj = ts + j0 + q * 8 + e;
#pragma unroll
                    for (int row = 0; row < LORA_EXPAND_ROWS; ++row)
                        acc[row] = fmaf(tj[row * s.r], bf[e], acc[row]);
                }
            }
        }
    } else {
        for (int j = 0; j < s.r; ++j) {
            const float bj = to_f32(brow[j]);
#pragma unroll
            for (int row = 0; row < LORA_EXPAND_ROWS; ++row) acc[row] = fmaf(ts[row * s.r + j], bj, acc[row]);
        }
    }
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row) {
        if (row < nrows) {
            const long long idx = (long long)(s.row0 + tile0 + row) * p.width + s.col0 + n;
            y[idx] = to_bf16(to_f32(y[idx]) + s.scale * acc[row]);
        }
    }
}
