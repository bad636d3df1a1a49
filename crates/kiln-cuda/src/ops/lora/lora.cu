// LoRA deltas of a step, all adapters and packed parts in one pair of launches
// (the gathered low-rank product, in the manner of Punica's SGMV): each segment is
// one adapter's projection over one contiguous run of rows,
//   y[rows, col0 : col0 + cols] += scale * (x[rows] A^T) B^T,
// A [r, k] and B [cols, r] bf16. lora_shrink_bf16 writes t = x A^T in f32 as
// partial sums over chunks of k (no atomics: every row's sum has one order, so a
// row's delta is the same in any batch); lora_expand_bf16 sums the chunks, takes
// the product with B and adds it to y in place (one rounding to bf16).
// Steps of many rows (prefill) take the tensor-core pair instead: lora_shrink_mma_bf16
// writes t over all of k at once, lora_expand_mma_bf16 rounds it to bf16 for its products.
#include "common.cuh"
#include "vec8.cuh"
#include "mma.cuh"

#define LORA_MAX_SEGS 32
#define LORA_SHRINK_ROWS 8
#define LORA_SHRINK_K 512
#define LORA_EXPAND_ROWS 8     // rows a tile of the 8-column expands
#define LORA_EXPAND_ROWS16 16  // rows a tile of the one-column expands
#define LORA_MMA_MAX_R 64   // ranks the tensor-core kernels take (8 product tiles of 8)
#define LORA_MMA_ROWS 64    // rows a block of the tensor-core kernels (a warp 16)
#define LORA_MMA_COLS 256   // columns a block of lora_expand_mma_bf16

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

// Grid (segments, chunks of 256 columns, tiles of LORA_EXPAND_ROWS16 rows); block 256, dynamic
// shared memory LORA_EXPAND_ROWS16 * (largest r) floats. Thread n of a chunk owns column n of its
// segment: y[row, col0 + n] = bf16(y + scale * sum_j t[row, j] B[n, j]).
extern "C" __global__ void __launch_bounds__(256) lora_expand_bf16(bf16* __restrict__ y,
                                                                   const float* __restrict__ t_part,
                                                                   const LoraSegs p) {
    kiln_pdl_enter();
    const LoraSeg& s = p.s[blockIdx.x];
    const int tile0 = blockIdx.z * LORA_EXPAND_ROWS16;
    if (tile0 >= s.rows || (int)(blockIdx.y * blockDim.x) >= s.cols) return;
    const int nrows = min(LORA_EXPAND_ROWS16, s.rows - tile0);
    extern __shared__ float ts[];
    for (int i = threadIdx.x; i < LORA_EXPAND_ROWS16 * s.r; i += blockDim.x) {
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
    float acc[LORA_EXPAND_ROWS16];
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) acc[row] = 0.0f;
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
                    for (int row = 0; row < LORA_EXPAND_ROWS16; ++row)
                        acc[row] = fmaf(tj[row * s.r], bf[e], acc[row]);
                }
            }
        }
    } else {
        for (int j = 0; j < s.r; ++j) {
            const float bj = to_f32(brow[j]);
#pragma unroll
            for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) acc[row] = fmaf(ts[row * s.r + j], bj, acc[row]);
        }
    }
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) {
        if (row < nrows) {
            const long long idx = (long long)(s.row0 + tile0 + row) * p.width + s.col0 + n;
            y[idx] = to_bf16(to_f32(y[idx]) + s.scale * acc[row]);
        }
    }
}

// The expand with the rest of the product's epilogue, over every row of the step (rows of no
// adapter too), written to a new output. v(i, j) = bf16(y[i, j] + scale * sum_j t[i, j] B[j'])
// where a segment covers (i, j) — the sums in lora_expand_bf16's order — else y[i, j]; then
//   act < 0:            out [n, width]  = v, plus resid if given (bf16(resid + v), add_scale_bf16's);
//   act >= 0 (kiln_act): out [n, width / 2] = act(v[:, c]) * v[:, width / 2 + c] (gated_act_packed_bf16's),
// so every row gets the bits lora_expand_bf16 then those kernels give. Grid (chunks of 256 output
// columns, tiles of LORA_EXPAND_ROWS16 rows); block 256; dynamic shared memory LORA_EXPAND_ROWS16 *
// (largest r) floats. A block takes the segments that meet its rows and columns (a step's rows
// are ordered by adapter: one or two), staging each one's t rows in turn.
__device__ __forceinline__ void lora_epi_dot(const LoraSeg& s, int n, const float* ts, int lo, int hi,
                                             const bf16* __restrict__ y, long long ybase, int width,
                                             float* v, unsigned& covered) {
    const bf16* brow = s.b + (long long)n * s.r;
    float acc[LORA_EXPAND_ROWS16];
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) acc[row] = 0.0f;
    if ((s.r & 7) == 0 && vec8::aligned16(brow)) {
        for (int j0 = 0; j0 < s.r; j0 += 8) {
            float bf[8];
            vec8::unpack8(*reinterpret_cast<const uint4*>(brow + j0), bf);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
#pragma unroll
                for (int row = 0; row < LORA_EXPAND_ROWS16; ++row)
                    acc[row] = fmaf(ts[row * s.r + j0 + e], bf[e], acc[row]);
            }
        }
    } else {
        for (int j = 0; j < s.r; ++j) {
            const float bj = to_f32(brow[j]);
#pragma unroll
            for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) acc[row] = fmaf(ts[row * s.r + j], bj, acc[row]);
        }
    }
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) {
        if (row >= lo && row < hi) {
            v[row] = to_f32(to_bf16(to_f32(y[ybase + (long long)row * width]) + s.scale * acc[row]));
            covered |= 1u << row;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) lora_expand_epi_bf16(
    const bf16* __restrict__ y, bf16* __restrict__ out, const bf16* __restrict__ resid,
    const float* __restrict__ t_part, const LoraSegs p, int n_rows, int nseg, int act) {
    kiln_pdl_enter();
    extern __shared__ float ts[];
    const int tile0 = blockIdx.y * LORA_EXPAND_ROWS16;
    const int nrows = min(LORA_EXPAND_ROWS16, n_rows - tile0);
    const bool gated = act >= 0;
    const int out_w = gated ? p.width / 2 : p.width;
    const int cb0 = blockIdx.x * blockDim.x, cb1 = min(cb0 + (int)blockDim.x, out_w);
    const int c = cb0 + threadIdx.x;
    const int jb = c + out_w;  // the up column (gated)
    float va[LORA_EXPAND_ROWS16], vb[LORA_EXPAND_ROWS16];
    unsigned cov_a = 0, cov_b = 0;
    const long long ybase = (long long)tile0 * p.width;
    for (int si = 0; si < nseg; ++si) {
        const LoraSeg& s = p.s[si];
        const int lo = max(s.row0, tile0) - tile0, hi = min(s.row0 + s.rows, tile0 + nrows) - tile0;
        if (lo >= hi) continue;
        const bool hit_a = s.col0 < cb1 && s.col0 + s.cols > cb0;
        const bool hit_b = gated && s.col0 < cb1 + out_w && s.col0 + s.cols > cb0 + out_w;
        if (!hit_a && !hit_b) continue;  // the same for the whole block
        __syncthreads();                 // the previous segment's rows are read
        for (int i = threadIdx.x; i < LORA_EXPAND_ROWS16 * s.r; i += blockDim.x) {
            const int row = i / s.r;
            float v = 0.0f;
            if (row >= lo && row < hi) {
                const long long off = s.t_off + (long long)(tile0 + row - s.row0) * s.r + i % s.r;
                for (int k = 0; k < p.num_kc; ++k) v += t_part[k * p.t_stride + off];
            }
            ts[i] = v;
        }
        __syncthreads();
        if (c < cb1 && c >= s.col0 && c < s.col0 + s.cols)
            lora_epi_dot(s, c - s.col0, ts, lo, hi, y, ybase + c, p.width, va, cov_a);
        if (gated && c < cb1 && jb >= s.col0 && jb < s.col0 + s.cols)
            lora_epi_dot(s, jb - s.col0, ts, lo, hi, y, ybase + jb, p.width, vb, cov_b);
    }
    if (c >= cb1) return;
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS16; ++row) {
        if (row < nrows) {
            const long long yi = ybase + (long long)row * p.width;
            const float a = (cov_a >> row) & 1 ? va[row] : to_f32(y[yi + c]);
            const long long oi = (long long)(tile0 + row) * out_w + c;
            if (gated) {
                const float u = (cov_b >> row) & 1 ? vb[row] : to_f32(y[yi + jb]);
                out[oi] = to_bf16(kiln_act(a, act) * u);
            } else {
                out[oi] = resid ? to_bf16(to_f32(resid[oi]) + a) : to_bf16(a);
            }
        }
    }
}

// The 8-column expands (lora_expand8_bf16, lora_expand8_epi_bf16: the same results as the two
// above, CudaOptions::lora_expand8): a thread takes 8 adjacent columns (one 16-byte piece of y)
// of a tile of LORA_EXPAND_ROWS rows, so each staged t value feeds 8 products (the kernels above:
// one) and y moves in 16-byte pieces.
// A column's sum runs over j in order: acc = fma(t[row, j], B[n, j], acc), j = 0 .. r - 1.

// t's rows of segment s for the tile's rows [lo, hi) (tile-relative; the others zero), the chunks
// of k summed in order, into ts [LORA_EXPAND_ROWS][r]. Every thread of the block takes part.
__device__ __forceinline__ void lora_stage_t(const LoraSeg& s, const float* __restrict__ t_part,
                                             const LoraSegs& p, int tile0, int lo, int hi, float* ts) {
    for (int i = threadIdx.x; i < LORA_EXPAND_ROWS * s.r; i += blockDim.x) {
        const int row = i / s.r;
        float v = 0.0f;
        if (row >= lo && row < hi) {
            const long long off = s.t_off + (long long)(tile0 + row - s.row0) * s.r + i % s.r;
            for (int c = 0; c < p.num_kc; ++c) v += t_part[c * p.t_stride + off];
        }
        ts[i] = v;
    }
}

// acc[row][c] = sum_j ts[row][j] B[n0 + c, j] for the segment's columns n0 .. n0 + 7 (those
// outside it, before its start or past its end: zero).
__device__ __forceinline__ void lora_dot8(const LoraSeg& s, int n0, const float* ts,
                                          float (&acc)[LORA_EXPAND_ROWS][8]) {
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[row][c] = 0.0f;
    const bool vec = (s.r & 7) == 0 && vec8::aligned16(s.b);
    for (int j0 = 0; j0 < s.r; j0 += 8) {
        float b[8][8];  // [column][rank j0 + e]
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const int n = n0 + c;
            const bf16* brow = s.b + (long long)n * s.r + j0;
            const bool in = n >= 0 && n < s.cols;
            if (in && vec) {
                vec8::unpack8(__ldg(reinterpret_cast<const uint4*>(brow)), b[c]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) b[c][e] = (in && j0 + e < s.r) ? to_f32(brow[e]) : 0.0f;
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if (j0 + e < s.r) {
#pragma unroll
                for (int row = 0; row < LORA_EXPAND_ROWS; ++row) {
                    const float tv = ts[row * s.r + j0 + e];
#pragma unroll
                    for (int c = 0; c < 8; ++c) acc[row][c] = fmaf(tv, b[c][e], acc[row][c]);
                }
            }
        }
    }
}

// Row `row` of y, columns col .. col + 7 of width `width` (those at or past `end`: zero), as bf16
// pieces; stored back by lora_store8.
__device__ __forceinline__ uint4 lora_load8(const bf16* __restrict__ y, long long row, int width, int col,
                                            int end) {
    const bf16* p = y + row * width + col;
    if (col + 8 <= end && (width & 7) == 0 && vec8::aligned16(p)) return *reinterpret_cast<const uint4*>(p);
    float f[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) f[c] = col + c < end ? to_f32(p[c]) : 0.0f;
    return vec8::pack8(f);
}

__device__ __forceinline__ void lora_store8(bf16* __restrict__ y, long long row, int width, int col, int end,
                                            const float (&f)[8]) {
    bf16* p = y + row * width + col;
    if (col + 8 <= end && (width & 7) == 0 && vec8::aligned16(p)) {
        *reinterpret_cast<uint4*>(p) = vec8::pack8(f);
    } else {
#pragma unroll
        for (int c = 0; c < 8; ++c)
            if (col + c < end) p[c] = to_bf16(f[c]);
    }
}

// Grid (segments, chunks of 8 * 128 columns, tiles of LORA_EXPAND_ROWS rows); block 128, dynamic
// shared memory LORA_EXPAND_ROWS * (largest r) floats. In place:
// y[row, col0 + n] = bf16(y + scale * sum_j t[row, j] B[n, j]) for the segment's rows.
extern "C" __global__ void __launch_bounds__(128) lora_expand8_bf16(bf16* __restrict__ y,
                                                                   const float* __restrict__ t_part,
                                                                   const LoraSegs p) {
    kiln_pdl_enter();
    const LoraSeg& s = p.s[blockIdx.x];
    const int tile0 = blockIdx.z * LORA_EXPAND_ROWS;
    if (tile0 >= s.rows || (int)(blockIdx.y * blockDim.x * 8) >= s.cols) return;
    const int nrows = min(LORA_EXPAND_ROWS, s.rows - tile0);
    extern __shared__ float ts[];
    // Tile rows relative to the segment here: stage rows s.row0 + tile0 ...
    lora_stage_t(s, t_part, p, s.row0 + tile0, 0, nrows, ts);
    __syncthreads();
    const int n0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (n0 >= s.cols) return;
    float acc[LORA_EXPAND_ROWS][8];
    lora_dot8(s, n0, ts, acc);
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row) {
        if (row < nrows) {
            const long long r = s.row0 + tile0 + row;
            float f[8];
            vec8::unpack8(lora_load8(y, r, p.width, s.col0 + n0, s.col0 + s.cols), f);
#pragma unroll
            for (int c = 0; c < 8; ++c) f[c] = to_f32(to_bf16(f[c] + s.scale * acc[row][c]));
            lora_store8(y, r, p.width, s.col0 + n0, s.col0 + s.cols, f);
        }
    }
}

// The expand with the rest of the product's epilogue, over every row of the step (rows of no
// adapter too), written to a new output. v(i, j) = bf16(y[i, j] + scale * sum_j t[i, j] B[j'])
// where a segment covers (i, j) (lora_expand_bf16's sums), else y[i, j]; then
//   act < 0:  out [n, width] = v, or bf16(resid + v) with a residual (add_scale_bf16's sum);
//   act >= 0: out [n, width / 2] = act(v[:, c]) * v[:, width / 2 + c] (gated_act_packed_bf16's),
// so every row gets the bits lora_expand_bf16 then those kernels give. Grid (chunks of 8 * 128
// output columns, tiles of LORA_EXPAND_ROWS rows); block 128; dynamic shared memory
// LORA_EXPAND_ROWS * (largest r) floats. A block takes the segments that meet its rows and
// columns (a step's rows are ordered by adapter: one or two), staging each one's t rows in turn.
// v is kept as bf16 pieces (it is bf16 by definition).
__device__ __forceinline__ void lora_epi_apply(const LoraSeg& s, int col, const float* ts, int lo, int hi,
                                               uint4 (&v)[LORA_EXPAND_ROWS]) {
    // This thread's columns col .. col + 7 of y that lie in the segment.
    const int first = max(col, s.col0), last = min(col + 8, s.col0 + s.cols);
    if (first >= last) return;
    float acc[LORA_EXPAND_ROWS][8];
    lora_dot8(s, col - s.col0, ts, acc);
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row) {
        if (row >= lo && row < hi) {
            float f[8];
            vec8::unpack8(v[row], f);
#pragma unroll
            for (int c = 0; c < 8; ++c)
                if (col + c >= first && col + c < last) f[c] = to_f32(to_bf16(f[c] + s.scale * acc[row][c]));
            v[row] = vec8::pack8(f);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) lora_expand8_epi_bf16(
    const bf16* __restrict__ y, bf16* __restrict__ out, const bf16* __restrict__ resid,
    const float* __restrict__ t_part, const LoraSegs p, int n_rows, int nseg, int act) {
    kiln_pdl_enter();
    extern __shared__ float ts[];
    const int tile0 = blockIdx.y * LORA_EXPAND_ROWS;
    const int nrows = min(LORA_EXPAND_ROWS, n_rows - tile0);
    const bool gated = act >= 0;
    const int out_w = gated ? p.width / 2 : p.width;
    const int cb0 = blockIdx.x * blockDim.x * 8, cb1 = min(cb0 + (int)blockDim.x * 8, out_w);
    const int c = cb0 + threadIdx.x * 8;  // this thread's first output column
    const bool mine = c < cb1;
    uint4 va[LORA_EXPAND_ROWS], vb[LORA_EXPAND_ROWS];
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row) {
        const bool in = mine && row < nrows;
        va[row] = in ? lora_load8(y, tile0 + row, p.width, c, out_w) : make_uint4(0, 0, 0, 0);
        vb[row] = in && gated ? lora_load8(y, tile0 + row, p.width, out_w + c, 2 * out_w)
                              : make_uint4(0, 0, 0, 0);
    }
    for (int si = 0; si < nseg; ++si) {
        const LoraSeg& s = p.s[si];
        const int lo = max(s.row0, tile0) - tile0, hi = min(s.row0 + s.rows, tile0 + nrows) - tile0;
        if (lo >= hi) continue;
        const bool hit_a = s.col0 < cb1 && s.col0 + s.cols > cb0;
        const bool hit_b = gated && s.col0 < cb1 + out_w && s.col0 + s.cols > cb0 + out_w;
        if (!hit_a && !hit_b) continue;  // the same for the whole block
        __syncthreads();                 // the previous segment's rows are read
        lora_stage_t(s, t_part, p, tile0, lo, hi, ts);
        __syncthreads();
        if (mine) {
            lora_epi_apply(s, c, ts, lo, hi, va);
            if (gated) lora_epi_apply(s, out_w + c, ts, lo, hi, vb);
        }
    }
    if (!mine) return;
#pragma unroll
    for (int row = 0; row < LORA_EXPAND_ROWS; ++row) {
        if (row < nrows) {
            float a[8], o[8];
            vec8::unpack8(va[row], a);
            const long long r = tile0 + row;
            if (gated) {
                float u[8];
                vec8::unpack8(vb[row], u);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = kiln_act(a[e], act) * u[e];
            } else if (resid) {
                float rv[8];
                vec8::unpack8(lora_load8(resid, r, out_w, c, out_w), rv);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = rv[e] + a[e];
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = a[e];
            }
            lora_store8(out, r, out_w, c, out_w, o);
        }
    }
}

// Tensor-core shrink. Grid (segments, tiles of LORA_MMA_ROWS rows); block 128: warp w takes
// rows 16w .. 16w + 15 of the tile and every rank over all of k, one mma.m16n8k16 a 16 rows x 8
// ranks x 16 k (k's order inside a product as in gemv.cu: a lane's 16-byte piece of a row of x
// and of a row of A feed two products, so both operands see the same permutation). A row's sums
// do not depend on the other rows. Writes t_part[t_off + row * r + j] (one chunk of k: num_kc 1).
extern "C" __global__ void __launch_bounds__(128) lora_shrink_mma_bf16(const bf16* __restrict__ x,
                                                                       float* __restrict__ t_part,
                                                                       const LoraSegs p) {
    kiln_pdl_enter();
    const LoraSeg& s = p.s[blockIdx.x];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = blockIdx.y * LORA_MMA_ROWS + warp * 16;
    if (r0 >= s.rows) return;
    const int g = lane >> 2, t = lane & 3;
    const int nt = (s.r + 7) >> 3;
    const bool lo_ok = r0 + g < s.rows, hi_ok = r0 + g + 8 < s.rows;
    const bf16* xlo = x + (long long)(s.row0 + r0 + g) * p.k;
    const bf16* xhi = x + (long long)(s.row0 + r0 + g + 8) * p.k;
    float acc[LORA_MMA_MAX_R / 8][4];
#pragma unroll
    for (int j = 0; j < LORA_MMA_MAX_R / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < p.k; k0 += 32) {
        const int k = k0 + 8 * t;
        const bool kok = k < p.k;  // k is a multiple of 8: a piece is all in or all out
        const uint4 xl = ld_stream16<false>(xlo + k, kok && lo_ok);
        const uint4 xh = ld_stream16<false>(xhi + k, kok && hi_ok);
#pragma unroll
        for (int j = 0; j < LORA_MMA_MAX_R / 8; ++j) {
            if (j < nt) {
                const int rank = 8 * j + g;
                const uint4 av = (kok && rank < s.r)
                                     ? __ldg(reinterpret_cast<const uint4*>(s.a + (long long)rank * p.k + k))
                                     : make_uint4(0, 0, 0, 0);
                mma_bf16(acc[j], xl.x, xh.x, xl.y, xh.y, av.x, av.y);
                mma_bf16(acc[j], xl.z, xh.z, xl.w, xh.w, av.z, av.w);
            }
        }
    }
    // acc[j]: (row g, ranks 8j + 2t, 8j + 2t + 1), (row g + 8, the same ranks).
    float* out = t_part + s.t_off + (long long)r0 * s.r;
#pragma unroll
    for (int j = 0; j < LORA_MMA_MAX_R / 8; ++j) {
        if (j < nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = g + (e >> 1) * 8, rank = 8 * j + 2 * t + (e & 1);
                if (r0 + row < s.rows && rank < s.r) out[row * s.r + rank] = acc[j][e];
            }
        }
    }
}

// Four of B's row's elements j .. j + 3 (zeros past r) as two bf16 pairs.
__device__ __forceinline__ uint2 lora_b4(const bf16* __restrict__ row, int r, int j, bool ok) {
    if (!ok || j >= r) return make_uint2(0, 0);
    if ((r & 3) == 0) return __ldg(reinterpret_cast<const uint2*>(row + j));
    __nv_bfloat162 lo, hi;
    lo.x = row[j];
    lo.y = j + 1 < r ? row[j + 1] : to_bf16(0.0f);
    hi.x = j + 2 < r ? row[j + 2] : to_bf16(0.0f);
    hi.y = j + 3 < r ? row[j + 3] : to_bf16(0.0f);
    return make_uint2(*reinterpret_cast<unsigned*>(&lo), *reinterpret_cast<unsigned*>(&hi));
}

__device__ __forceinline__ unsigned lora_pack(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // a in the low half
    return *reinterpret_cast<unsigned*>(&v);
}

// Tensor-core expand. Grid (segments, chunks of LORA_MMA_COLS columns, tiles of LORA_MMA_ROWS
// rows); block 128: warp w takes rows 16w .. 16w + 15 of the tile and the chunk's column tiles of
// 8, y[row, col0 + n] = bf16(y + scale * sum_j bf16(t[row, j]) B[n, j]) (t rounded to bf16 for the
// products, as PEFT's bf16 adapters round their low-rank rows). Each product takes 16 ranks: lane
// (g, t) holds ranks 16q + 4t .. 16q + 4t + 3 of rows g and g + 8 and of B's row n0 + g.
extern "C" __global__ void __launch_bounds__(128) lora_expand_mma_bf16(bf16* __restrict__ y,
                                                                       const float* __restrict__ t_part,
                                                                       const LoraSegs p) {
    kiln_pdl_enter();
    const LoraSeg& s = p.s[blockIdx.x];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = blockIdx.z * LORA_MMA_ROWS + warp * 16;
    const int c0 = blockIdx.y * LORA_MMA_COLS;
    if (r0 >= s.rows || c0 >= s.cols) return;
    const int g = lane >> 2, t = lane & 3;
    const bool lo_ok = r0 + g < s.rows, hi_ok = r0 + g + 8 < s.rows;
    const float* tlo = t_part + s.t_off + (long long)(r0 + g) * s.r;
    const float* thi = tlo + 8LL * s.r;
    const int ks = (s.r + 15) >> 4;
    unsigned a[LORA_MMA_MAX_R / 16][4];
#pragma unroll
    for (int q = 0; q < LORA_MMA_MAX_R / 16; ++q) {
        float lo[4], hi[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = 16 * q + 4 * t + e;
            lo[e] = (q < ks && lo_ok && j < s.r) ? tlo[j] : 0.0f;
            hi[e] = (q < ks && hi_ok && j < s.r) ? thi[j] : 0.0f;
        }
        a[q][0] = lora_pack(lo[0], lo[1]);
        a[q][1] = lora_pack(hi[0], hi[1]);
        a[q][2] = lora_pack(lo[2], lo[3]);
        a[q][3] = lora_pack(hi[2], hi[3]);
    }
    const int cend = min(c0 + LORA_MMA_COLS, s.cols);
    bf16* ylo = y + (long long)(s.row0 + r0 + g) * p.width + s.col0;
    bf16* yhi = ylo + 8LL * p.width;
    for (int n0 = c0; n0 < cend; n0 += 8) {
        const int n = n0 + g;
        const bf16* brow = s.b + (long long)n * s.r;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int q = 0; q < LORA_MMA_MAX_R / 16; ++q) {
            if (q < ks) {
                const uint2 bv = lora_b4(brow, s.r, 16 * q + 4 * t, n < cend);
                mma_bf16(acc, a[q][0], a[q][1], a[q][2], a[q][3], bv.x, bv.y);
            }
        }
        // acc: (row g, columns n0 + 2t, n0 + 2t + 1), (row g + 8, the same columns).
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = n0 + 2 * t + (e & 1);
            bf16* yr = e < 2 ? ylo : yhi;
            if (col < cend && (e < 2 ? lo_ok : hi_ok)) yr[col] = to_bf16(to_f32(yr[col]) + s.scale * acc[e]);
        }
    }
}
