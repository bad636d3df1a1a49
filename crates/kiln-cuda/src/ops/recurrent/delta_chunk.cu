// The gated delta rule's chunk-parallel form, for prefills: the same outputs and states as the
// token-order kernels (recurrent.cu) up to f32 rounding, with most of the work done for every
// chunk of DELTA_CHUNK tokens at once instead of token after token.
//
// Within a chunk of tokens 0..L of one value head, with the state S_0 it starts from, the
// normalized keys and queries k_t and q_t, the write strengths beta_t and the cumulative log
// decays G_t = g_0 + ... + g_t:
//   S_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T,
//   u_t = beta_t (v_t - e^{G_t} S_0^T k_t) - sum_{s<t} A_ts u_s,
//         A_ts = beta_t e^{G_t - G_s} (k_t . k_s),
// so (I + A) u = beta V - beta e^G K S_0, and with T = (I + A)^-1:
//   u = U - W S_0,  U = T (beta V),  W = T (beta e^G K),
//   o_t = S_t^T q_t = e^{G_t} S_0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s.
// U and W do not depend on S_0: every chunk of every sequence solves for them at once
// (gated_delta_chunk_solve). Then each sequence's chunks run in order, carrying S from chunk to
// chunk (gated_delta_chunk_state: u, the S_0 part of the outputs, snapshots, the chunk's final
// state); then every chunk's outputs at once (gated_delta_chunk_out, with the gated RMSNorm).
//
// Work arrays (f32), n rows: qk [n][2 k_heads k_dim] (the normalized q, scaled by k_dim^-1/2,
// then k), gb [n][2 v_heads] (log decay g, rewritten as G within the chunk; then beta),
// W [n][v_heads][k_dim], U [n][v_heads][v_dim] (U, rewritten as u), oi [n][v_heads][v_dim] (the
// outputs' S_0 part). Chunks (i32, 4 a chunk): sequence, first row, tokens, tokens of the
// sequence before it in this step; seq_chunks[s]: sequence s's first chunk (then the count).
// Sequence metadata, state layout and snapshots as in recurrent.cu.
#include "common.cuh"
#include "recurrent.cuh"

#define DELTA_CHUNK 64
// The widest keys gated_delta_chunk_state keeps (8 warps, DELTA_CHUNK_KMAX / 8 rows a thread).
#define DELTA_CHUNK_KMAX 128

namespace delta_chunk_detail {
// Rows [0, len) of an f32 matrix (row t at src + t * src_stride; width a multiple of 4, rows
// 16-byte aligned) into shared memory (row t at dst + t * dst_stride), in 16-byte pieces with
// PER of a thread's loads in flight before any is stored: the staging costs a few memory
// latencies, not one a piece.
template <int PER>
__device__ __forceinline__ void stage_rows(float* dst, int dst_stride, const float* __restrict__ src,
                                           long long src_stride, int len, int width) {
    const int w4 = width >> 2, n4 = len * w4;
    for (int base = 0; base < n4; base += PER * blockDim.x) {
        float4 v[PER];
#pragma unroll
        for (int it = 0; it < PER; ++it) {
            const int e = base + it * blockDim.x + threadIdx.x;
            if (e < n4) {
                const int t = e / w4, i = e - t * w4;
                v[it] = __ldg(reinterpret_cast<const float4*>(src + t * src_stride) + i);
            }
        }
#pragma unroll
        for (int it = 0; it < PER; ++it) {
            const int e = base + it * blockDim.x + threadIdx.x;
            if (e < n4) {
                const int t = e / w4, i = e - t * w4;
                float* d = dst + t * dst_stride + 4 * i;
                d[0] = v[it].x, d[1] = v[it].y, d[2] = v[it].z, d[3] = v[it].w;
            }
        }
    }
}

// The chunk's decayed products M[t][s] = beta_t e^{G_t - G_s} (a_t . b_s) (beta 1 when null) for
// s < t (STRICT) or s <= t and t < len, zero elsewhere, into out [DELTA_CHUNK][DELTA_CHUNK]; a and
// b rows of k_dim floats `stride` apart in shared memory. By the block's threads in 4 x 4
// register tiles (8 loads for 16 products a step); tiles above the diagonal are zeros without
// products, and rows past the chunk's tokens (leftovers) are selected away, never scaled.
template <bool STRICT>
__device__ __forceinline__ void decayed_gram(const float* a, const float* b, int stride, int k_dim, int len,
                                             const float* G, const float* beta, float* out) {
    constexpr int T4 = DELTA_CHUNK / 4;
    for (int tile = threadIdx.x; tile < T4 * T4; tile += blockDim.x) {
        const int t0 = (tile / T4) * 4, s0 = (tile % T4) * 4;
        float acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
        if (s0 <= t0) {
#pragma unroll 4
            for (int i = 0; i < k_dim; ++i) {
                float av[4], bv[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) av[r] = a[(t0 + r) * stride + i], bv[r] = b[(s0 + r) * stride + i];
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int t = t0 + r, s = s0 + c;
                const bool keep = (STRICT ? s < t : s <= t) && t < len;
                out[t * DELTA_CHUNK + s] = keep ? (beta ? beta[t] : 1.0f) * __expf(G[t] - G[s]) * acc[r][c] : 0.0f;
            }
    }
}
}  // namespace delta_chunk_detail

// Per row: the normalized q and k of every key head (a warp a vector) and each value head's log
// decay and beta. Grid (rows), 256 threads.
extern "C" __global__ void __launch_bounds__(256) gated_delta_prep(
    const float* __restrict__ mixed, int mixed_stride, const bf16* __restrict__ x, long long x_stride,
    int b_col, int a_col, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    int k_heads, int v_heads, int k_dim, float* __restrict__ qk, float* __restrict__ gb) {
    kiln_pdl_enter();
    const long long r = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const float* mr = mixed + r * mixed_stride;
    float* o = qk + r * (2LL * k_heads * k_dim);
    const float q_scale = rsqrtf((float)k_dim);
    for (int vec = warp; vec < 2 * k_heads; vec += nwarps) {
        const float* src = mr + (long long)vec * k_dim;
        float ss = 0.0f;
        for (int i = lane; i < k_dim; i += 32) ss += src[i] * src[i];
        ss = warp_sum(ss);
        const float scale = rsqrtf(ss + 1e-6f) * (vec < k_heads ? q_scale : 1.0f);
        for (int i = lane; i < k_dim; i += 32) o[(long long)vec * k_dim + i] = src[i] * scale;
    }
    const bf16* xr = x + r * x_stride;
    for (int h = threadIdx.x; h < v_heads; h += blockDim.x) {
        gb[r * 2 * v_heads + h] =
            -__expf(a_log[h]) * recurrent_detail::softplus(to_f32(xr[a_col + h]) + dt_bias[h]);
        gb[r * 2 * v_heads + v_heads + h] = recurrent_detail::sigmoid(to_f32(xr[b_col + h]));
    }
}

// W and U of one chunk of one value head: grid (chunks, v_heads), 256 threads, dynamic shared
// memory max(DELTA_CHUNK (k_dim + 1), DELTA_CHUNK (k_dim + v_dim)) + DELTA_CHUNK^2
// + 2 DELTA_CHUNK floats. Also rewrites the chunk's g as G. Forward substitution a column a
// thread: x_t = rhs_t - sum_{s<t} A_ts x_s.
extern "C" __global__ void __launch_bounds__(256) gated_delta_chunk_solve(
    const float* __restrict__ mixed, int mixed_stride, int k_heads, int v_heads, int k_dim,
    int v_dim, const int* __restrict__ chunks, const float* __restrict__ qk, float* __restrict__ gb,
    float* __restrict__ W, float* __restrict__ U) {
    kiln_pdl_enter();
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y;
    const int row0 = chunks[4 * c + 1], len = chunks[4 * c + 2];
    const int kp = k_dim + 1, cols = k_dim + v_dim;
    const int big = max(DELTA_CHUNK * kp, DELTA_CHUNK * cols);
    float* ks = smem;                       // [DELTA_CHUNK][kp], then X [DELTA_CHUNK][cols]
    float* X = smem;
    float* A = smem + big;                  // [DELTA_CHUNK][DELTA_CHUNK]
    float* G = A + DELTA_CHUNK * DELTA_CHUNK;
    float* B = G + DELTA_CHUNK;
    const int kh = h / (v_heads / k_heads);
    const long long qk_stride = 2LL * k_heads * k_dim;
    const float* kbase = qk + (long long)(k_heads + kh) * k_dim;
    delta_chunk_detail::stage_rows<4>(ks, kp, kbase + row0 * qk_stride, qk_stride, len, k_dim);
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        G[t] = gb[(long long)(row0 + t) * 2 * v_heads + h];
        B[t] = gb[(long long)(row0 + t) * 2 * v_heads + v_heads + h];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int t = 0; t < len; ++t) {
            acc += G[t];
            G[t] = acc;
            gb[(long long)(row0 + t) * 2 * v_heads + h] = acc;
        }
    }
    __syncthreads();
    // A, strictly lower.
    delta_chunk_detail::decayed_gram<true>(ks, ks, kp, k_dim, len, G, B, A);
    __syncthreads();  // the keys' copy is read: X takes its place
    // The right-hand sides: beta e^G k | beta v.
    const float* vbase = mixed + 2LL * k_heads * k_dim + (long long)h * v_dim;
    delta_chunk_detail::stage_rows<4>(X, cols, kbase + row0 * qk_stride, qk_stride, len, k_dim);
    delta_chunk_detail::stage_rows<4>(X + k_dim, cols, vbase + (long long)row0 * mixed_stride, mixed_stride,
                                      len, v_dim);
    __syncthreads();
    for (int e = threadIdx.x; e < len * cols; e += blockDim.x) {
        const int t = e / cols, cc = e - t * cols;
        X[e] *= cc < k_dim ? B[t] * __expf(G[t]) : B[t];
    }
    __syncthreads();
    for (int cc = threadIdx.x; cc < cols; cc += blockDim.x) {
        for (int t = 0; t < len; ++t) {
            float acc = X[t * cols + cc];
            const float* at = A + t * DELTA_CHUNK;
            for (int s = 0; s < t; ++s) acc = fmaf(-at[s], X[s * cols + cc], acc);
            X[t * cols + cc] = acc;
            const long long r = row0 + t;
            if (cc < k_dim) W[(r * v_heads + h) * k_dim + cc] = acc;
            else U[(r * v_heads + h) * v_dim + (cc - k_dim)] = acc;
        }
    }
}

namespace delta_chunk_detail {
// This warp's part of rows[t] . S[:, lane's column] for the chunk's tokens (its key rows warp,
// warp + 8, ...), into red[warp][t][lane]; the rows are read as broadcasts.
template <int RK>
__device__ __forceinline__ void rows_times_state(const float* rows, int len, int k_dim, const float (&S)[RK],
                                                 float* red, int warp, int lane) {
    for (int t = 0; t < len; ++t) {
        const float* row = rows + t * k_dim;
        float p = 0.0f;
#pragma unroll
        for (int r = 0; r < RK; ++r)
            if (warp + 8 * r < k_dim) p = fmaf(row[warp + 8 * r], S[r], p);
        red[(warp * DELTA_CHUNK + t) * 32 + lane] = p;
    }
}

// The sum over the 8 warps' parts of token t's product for this lane's column.
__device__ __forceinline__ float warps_sum(const float* red, int t, int lane) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) sum += red[(w * DELTA_CHUNK + t) * 32 + lane];
    return sum;
}
}  // namespace delta_chunk_detail

// Each sequence's chunks in order for 32 columns of one value head's state: grid (sequences,
// v_heads, ceil(v_dim / 32)), 256 threads (lane: column; warp w: key rows w, w + 8, ...; the
// state in registers), dynamic shared memory (8 + 1) DELTA_CHUNK 32 + DELTA_CHUNK
// + 2 DELTA_CHUNK k_dim floats: the chunk's rows of W (then of q) and of k are staged there, so
// the products read them as broadcasts. Writes u over U, the outputs' S_0 part, the snapshots
// and the final state.
extern "C" __global__ void __launch_bounds__(256, 1) gated_delta_chunk_state(
    const float* __restrict__ qk, const float* __restrict__ gb, const float* __restrict__ W,
    float* __restrict__ U, float* __restrict__ oi, int k_heads, int v_heads, int k_dim, int v_dim,
    float* __restrict__ state, long long slot_len, long long conv_len, const int* __restrict__ seqs,
    const int* __restrict__ snaps, int num_seqs, const int* __restrict__ chunks,
    const int* __restrict__ seq_chunks) {
    kiln_pdl_enter();
    constexpr int RK = DELTA_CHUNK_KMAX / 8;
    extern __shared__ float smem[];
    float* red = smem;                          // [8][DELTA_CHUNK][32]: partial sums by warp
    float* us = red + 8 * DELTA_CHUNK * 32;     // [DELTA_CHUNK][32]: this block's columns of u
    float* G = us + DELTA_CHUNK * 32;           // [DELTA_CHUNK]
    float* wq = G + DELTA_CHUNK;                // [DELTA_CHUNK][k_dim]: W's rows, then q's
    float* kc = wq + DELTA_CHUNK * k_dim;       // [DELTA_CHUNK][k_dim]: k's rows
    const int s = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.z * 32 + lane;
    const bool col = j < v_dim;
    if (s >= num_seqs) return;
    const int* m = seqs + 6 * s;
    const int slot = m[2], src = m[3], fresh = m[4];
    const int snap0 = m[5], snap1 = s + 1 < num_seqs ? seqs[6 * (s + 1) + 5] : seqs[6 * num_seqs];
    if (slot < 0) return;
    const long long head_len = (long long)k_dim * v_dim;
    const int kh = h / (v_heads / k_heads);
    const long long qk_stride = 2LL * k_heads * k_dim;
    float S[RK];
    const float* from = state + (long long)src * slot_len + conv_len + h * head_len;
#pragma unroll
    for (int r = 0; r < RK; ++r) {
        const int i = warp + 8 * r;
        S[r] = (col && i < k_dim && !fresh) ? from[(long long)i * v_dim + j] : 0.0f;
    }
    const int c_end = seq_chunks[s + 1];
    for (int c = seq_chunks[s]; c < c_end; ++c) {
        const int row0 = chunks[4 * c + 1], len = chunks[4 * c + 2], off = chunks[4 * c + 3];
        if (threadIdx.x < len) G[threadIdx.x] = gb[(long long)(row0 + threadIdx.x) * 2 * v_heads + h];
        delta_chunk_detail::stage_rows<4>(wq, k_dim, W + ((long long)row0 * v_heads + h) * k_dim,
                                          (long long)v_heads * k_dim, len, k_dim);
        delta_chunk_detail::stage_rows<4>(kc, k_dim, qk + row0 * qk_stride + (long long)(k_heads + kh) * k_dim,
                                          qk_stride, len, k_dim);
        // This thread's U values (tokens warp, warp + 8, ...), loaded while the products run.
        float uv[DELTA_CHUNK / 8];
#pragma unroll
        for (int e = 0; e < DELTA_CHUNK / 8; ++e) {
            const int t = warp + 8 * e;
            uv[e] = (col && t < len) ? U[((long long)(row0 + t) * v_heads + h) * v_dim + j] : 0.0f;
        }
        __syncthreads();
        // u_t = U_t - W_t S_0.
        delta_chunk_detail::rows_times_state<RK>(wq, len, k_dim, S, red, warp, lane);
        __syncthreads();
#pragma unroll
        for (int e = 0; e < DELTA_CHUNK / 8; ++e) {
            const int t = warp + 8 * e;
            if (t < len) {
                const float u = col ? uv[e] - delta_chunk_detail::warps_sum(red, t, lane) : 0.0f;
                if (col) U[((long long)(row0 + t) * v_heads + h) * v_dim + j] = u;
                us[t * 32 + lane] = u;
            }
        }
        // W's rows are read: q's take their place.
        delta_chunk_detail::stage_rows<4>(wq, k_dim, qk + row0 * qk_stride + (long long)kh * k_dim, qk_stride,
                                          len, k_dim);
        __syncthreads();
        // The outputs' part from the chunk's start state: e^{G_t} q_t^T S_0.
        delta_chunk_detail::rows_times_state<RK>(wq, len, k_dim, S, red, warp, lane);
        __syncthreads();
        for (int t = warp; t < len; t += 8) {
            const float sum = delta_chunk_detail::warps_sum(red, t, lane);
            if (col) oi[((long long)(row0 + t) * v_heads + h) * v_dim + j] = __expf(G[t]) * sum;
        }
        // Snapshots after the chunk's first tt + 1 tokens: S_tt.
        for (int qn = snap0; qn < snap1; ++qn) {
            const int T = snaps[2 * qn];
            if (T <= off || T > off + len) continue;
            const int tt = T - off - 1;
            float* to = state + (long long)snaps[2 * qn + 1] * slot_len + conv_len + h * head_len;
#pragma unroll
            for (int r = 0; r < RK; ++r) {
                const int i = warp + 8 * r;
                if (!col || i >= k_dim) continue;
                float v = __expf(G[tt]) * S[r];
                for (int t = 0; t <= tt; ++t)
                    v = fmaf(kc[t * k_dim + i] * __expf(G[tt] - G[t]), us[t * 32 + lane], v);
                to[(long long)i * v_dim + j] = v;
            }
        }
        // The state at the chunk's end.
        const float gl = G[len - 1];
        const float dl = __expf(gl);
#pragma unroll
        for (int r = 0; r < RK; ++r) S[r] *= dl;
        for (int t = 0; t < len; ++t) {
            const float fu = __expf(gl - G[t]) * us[t * 32 + lane];
            const float* kr = kc + t * k_dim;
#pragma unroll
            for (int r = 0; r < RK; ++r)
                if (warp + 8 * r < k_dim) S[r] = fmaf(kr[warp + 8 * r], fu, S[r]);
        }
        __syncthreads();  // G, us, red and the staged rows are rewritten by the next chunk
    }
    float* own = state + (long long)slot * slot_len + conv_len + h * head_len;
#pragma unroll
    for (int r = 0; r < RK; ++r) {
        const int i = warp + 8 * r;
        if (col && i < k_dim) own[(long long)i * v_dim + j] = S[r];
    }
}

// One chunk's outputs for one value head: o_t = oi_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s,
// then the gated RMSNorm. Grid (chunks, v_heads), a thread a column (blockDim.x a multiple of 32,
// >= v_dim, at most 256), dynamic shared memory max(2 DELTA_CHUNK (k_dim + 1), DELTA_CHUNK v_dim)
// + DELTA_CHUNK^2 + DELTA_CHUNK + 8 DELTA_CHUNK floats.
extern "C" __global__ void __launch_bounds__(256) gated_delta_chunk_out(
    const float* __restrict__ qk, const float* __restrict__ gb, const float* __restrict__ U,
    const float* __restrict__ oi, const bf16* __restrict__ x, long long x_stride, int z_col,
    const float* __restrict__ norm_w, float eps, int k_heads, int v_heads, int k_dim, int v_dim,
    const int* __restrict__ seqs, const int* __restrict__ chunks, bf16* __restrict__ out) {
    kiln_pdl_enter();
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int seq = chunks[4 * c], row0 = chunks[4 * c + 1], len = chunks[4 * c + 2];
    const int vw = v_heads * v_dim;
    const bool col = j < v_dim;
    if (seqs[6 * seq + 2] < 0) {
        for (int t = 0; t < len; ++t)
            if (col) out[(long long)(row0 + t) * vw + h * v_dim + j] = to_bf16(0.0f);
        return;
    }
    const int kp = k_dim + 1;
    const int big = max(2 * DELTA_CHUNK * kp, DELTA_CHUNK * v_dim);
    float* qs = smem;                       // [DELTA_CHUNK][kp], ks after it; then us
    float* ks = qs + DELTA_CHUNK * kp;
    float* us = smem;                       // [DELTA_CHUNK][v_dim]
    float* P = smem + big;                  // [DELTA_CHUNK][DELTA_CHUNK]
    float* G = P + DELTA_CHUNK * DELTA_CHUNK;
    float* red = G + DELTA_CHUNK;           // [DELTA_CHUNK][8]
    const int kh = h / (v_heads / k_heads);
    const long long qk_stride = 2LL * k_heads * k_dim;
    delta_chunk_detail::stage_rows<4>(qs, kp, qk + row0 * qk_stride + (long long)kh * k_dim, qk_stride, len,
                                      k_dim);
    delta_chunk_detail::stage_rows<4>(ks, kp, qk + row0 * qk_stride + (long long)(k_heads + kh) * k_dim,
                                      qk_stride, len, k_dim);
    for (int t = threadIdx.x; t < len; t += blockDim.x) G[t] = gb[(long long)(row0 + t) * 2 * v_heads + h];
    __syncthreads();
    // P, lower with its diagonal.
    delta_chunk_detail::decayed_gram<false>(qs, ks, kp, k_dim, len, G, nullptr, P);
    __syncthreads();  // q and k are read: u takes their place
    delta_chunk_detail::stage_rows<4>(us, v_dim, U + ((long long)row0 * v_heads + h) * v_dim,
                                      (long long)v_heads * v_dim, len, v_dim);
    // The outputs' S_0 parts, all in flight at once.
    float o[DELTA_CHUNK];
#pragma unroll
    for (int t = 0; t < DELTA_CHUNK; ++t)
        o[t] = (t < len && col) ? oi[((long long)(row0 + t) * v_heads + h) * v_dim + j] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int t = 0; t < DELTA_CHUNK; ++t) {
        float acc = o[t];
        if (t < len && col) {
            const float* pt = P + t * DELTA_CHUNK;
            for (int s = 0; s <= t; ++s) acc = fmaf(pt[s], us[s * v_dim + j], acc);
        }
        o[t] = acc;
        if (t < len) {
            const float ss = warp_sum(acc * acc);
            if (lane == 0) red[t * 8 + warp] = ss;
        }
    }
    __syncthreads();
    const float nw = col ? norm_w[j] : 0.0f;
#pragma unroll
    for (int t = 0; t < DELTA_CHUNK; ++t) {
        if (t >= len || !col) continue;
        float tot = 0.0f;
        for (int w = 0; w < nwarps; ++w) tot += red[t * 8 + w];
        const float inv = rsqrtf(tot / (float)v_dim + eps);
        const long long r = row0 + t;
        const float z = to_f32(x[r * x_stride + z_col + h * v_dim + j]);
        out[r * vw + h * v_dim + j] = to_bf16(nw * (o[t] * inv) * recurrent_detail::silu(z));
    }
}
