// Paged causal attention, the reference CUDA version: one block per
// (new token, query head), keys processed in chunks of blockDim.x with an
// online softmax, f32 math over bf16 K/V. Correct for any context length;
// the flash-style prefill and split-KV decode kernels replace it for speed.
#include "common.cuh"
#include "kv_elem.cuh"

__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int num_warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < num_warps) ? partial[threadIdx.x] : NEG_INF;
    if (warp == 0) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    v = partial[0];
    __syncthreads();
    return v;
}

// q [tokens, heads * head_dim]; caches [slots, kv_stride] (kv_stride >= kv_heads * head_dim);
// row_end: null for causal attention (a row reads keys up to its position), else each row's
// sequence's last key (bidirectional: keys up to it, a window keeping |query - key| < window);
// row_pos[t]: the token's position; row_seq[t]: its sequence, whose block
// table is tables[row_seq[t] * table_width ..]. Dynamic shared memory:
// (blockDim.x + head_dim) floats. paged_attention_fp8: caches of E4M3 (kv_elem.cuh).
// sinks: null, or a learned logit a query head [heads] in every softmax, its weight dropped
// (gpt-oss): the row's weights are exp(s_j) / (sum_i exp(s_i) + exp(sink)).
template <typename KV>
__device__ __forceinline__ void paged_attention(const bf16* __restrict__ q, const KV* __restrict__ k_cache,
                                                const KV* __restrict__ v_cache, bf16* __restrict__ out,
                                                const unsigned int* __restrict__ row_pos,
                                                const unsigned int* __restrict__ row_seq,
                                                const unsigned int* __restrict__ row_end,
                                                const unsigned int* __restrict__ tables, int table_width, int heads,
                                                int kv_heads, int kv_stride,
                                                int head_dim, int block_size, float scale, int window,
                                                float softcap, const bf16* __restrict__ sinks) {
    kiln_pdl_enter();
    extern __shared__ float smem[];
    float* scores = smem;               // blockDim.x
    float* acc = smem + blockDim.x;     // head_dim
    const int t = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int kv_row = kv_stride;
    const int pos = (int)row_pos[t];
    const int first = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    // Causal: up to the row itself; bidirectional: to the sequence's end, within the window ahead.
    const int last = row_end == nullptr ? pos
                     : window > 0       ? min((int)row_end[t], pos + window - 1)
                                        : (int)row_end[t];
    const unsigned int* table = tables + (long long)row_seq[t] * table_width;
    const bf16* qv = q + ((long long)t * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) acc[d] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    __syncthreads();
    for (int c0 = first; c0 <= last; c0 += blockDim.x) {
        const int key = c0 + threadIdx.x;
        float s = NEG_INF;
        if (key <= last) {
            const long long slot = (long long)table[key / block_size] * block_size + key % block_size;
            const KV* kv = k_cache + slot * kv_row + (long long)kvh * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot += to_f32(qv[d]) * kv_elem::load1(kv + d);
            s = dot * scale;
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
        }
        const float m_new = fmaxf(m, block_max(s));
        const float p = (key <= last) ? __expf(s - m_new) : 0.0f;
        scores[threadIdx.x] = p;
        const float correction = __expf(m - m_new);
        l = l * correction + block_sum(p);
        m = m_new;
        __syncthreads();
        const int n_keys = min((int)blockDim.x, last - c0 + 1);
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float a = acc[d] * correction;
            for (int j = 0; j < n_keys; ++j) {
                const int kk = c0 + j;
                const long long slot = (long long)table[kk / block_size] * block_size + kk % block_size;
                a += scores[j] * kv_elem::load1(v_cache + slot * kv_row + (long long)kvh * head_dim + d);
            }
            acc[d] = a;
        }
        __syncthreads();
    }
    // (acc and l are relative to exp(m); the sink joins the denominator only.)
    if (sinks) l += __expf(to_f32(sinks[h]) - m);
    bf16* o = out + ((long long)t * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = to_bf16(acc[d] / l);
}

#define KILN_PAGED_ATTENTION(NAME, KV)                                                                         \
    extern "C" __global__ void NAME(const bf16* __restrict__ q, const KV* __restrict__ k_cache,                 \
                                    const KV* __restrict__ v_cache, bf16* __restrict__ out,                     \
                                    const unsigned int* __restrict__ row_pos,                                   \
                                    const unsigned int* __restrict__ row_seq,                                   \
                                    const unsigned int* __restrict__ row_end,                                   \
                                    const unsigned int* __restrict__ tables, int table_width, int heads,        \
                                    int kv_heads, int kv_stride, int head_dim, int block_size, float scale,     \
                                    int window, float softcap, const bf16* __restrict__ sinks) {                \
        paged_attention<KV>(q, k_cache, v_cache, out, row_pos, row_seq, row_end, tables, table_width, heads,   \
                            kv_heads, kv_stride, head_dim, block_size, scale, window, softcap, sinks);          \
    }
KILN_PAGED_ATTENTION(paged_attention_bf16, bf16)
KILN_PAGED_ATTENTION(paged_attention_fp8, kv8)
