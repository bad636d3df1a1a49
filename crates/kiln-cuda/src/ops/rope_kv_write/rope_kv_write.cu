// Rotary position embedding and the KV-cache write: RoPE in place, the cache write of new
// keys and values, and both in one kernel on packed QKV rows.
#include "common.cuh"
#include "kv_elem.cuh"

// Rotate-half RoPE in place on x [tokens, heads * head_dim]; grid (tokens, heads),
// block covers half = rotary_dim / 2 pairs (i, i + half).
extern "C" __global__ void rope_bf16(bf16* __restrict__ x, const unsigned int* __restrict__ positions,
                                     const float* __restrict__ inv_freq, int heads, int head_dim, int half,
                                     float attention_scaling) {
    kiln_pdl_enter();
    const long long base = ((long long)blockIdx.x * heads + blockIdx.y) * head_dim;
    const float pos = (float)positions[blockIdx.x];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(inv_freq[i] * pos, &s, &c);
        s *= attention_scaling;
        c *= attention_scaling;
        const float a = to_f32(x[base + i]), b = to_f32(x[base + i + half]);
        x[base + i] = to_bf16(rope_first(a, b, c, s));
        x[base + i + half] = to_bf16(rope_second(a, b, c, s));
    }
}

// Write new keys and values [tokens, kv_row] into their cache slots [slots, kv_stride]
// (kv_stride >= kv_row: the pool's row, wider for a narrower layer); write_kv_fp8: as E4M3
// (kv_elem.cuh).
template <typename KV>
__device__ __forceinline__ void write_kv(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                         KV* __restrict__ k_cache, KV* __restrict__ v_cache,
                                         const unsigned int* __restrict__ slot_mapping, int kv_row, int kv_stride) {
    kiln_pdl_enter();
    const long long src = (long long)blockIdx.x * kv_row;
    const long long dst = (long long)slot_mapping[blockIdx.x] * kv_stride;
    for (int i = threadIdx.x; i < kv_row; i += blockDim.x) {
        kv_elem::store1(k_cache + dst + i, k[src + i]);
        kv_elem::store1(v_cache + dst + i, v[src + i]);
    }
}

#define KILN_WRITE_KV(NAME, KV)                                                                                \
    extern "C" __global__ void NAME(const bf16* __restrict__ k, const bf16* __restrict__ v,                     \
                                    KV* __restrict__ k_cache, KV* __restrict__ v_cache,                         \
                                    const unsigned int* __restrict__ slot_mapping, int kv_row, int kv_stride) { \
        write_kv<KV>(k, v, k_cache, v_cache, slot_mapping, kv_row, kv_stride);                                  \
    }
KILN_WRITE_KV(write_kv_bf16, bf16)
KILN_WRITE_KV(write_kv_fp8, kv8)

// Per-head RMSNorm (optional), RoPE on a packed QKV projection, and the KV-cache write, fused.
// qkv [n, stride] rows: [q: heads * head_dim | k: kv_heads * head_dim | v: kv_heads * head_dim].
// For token t = blockIdx.x at position pos[t], slot s = slots[t], and head blockIdx.y:
//   * with q_norm (and k_norm) set, the head is first RMS-normalized over its head_dim values
//     (Qwen3, Gemma 3): x * rsqrt(mean(x^2) + eps) * (weight_offset + w) in f32, rounded to bf16
//     before RoPE reads it, as the CPU reference computes it;
//   * y < heads: q head y is rotated in place in qkv (rotate-half, pairs (i, i + half), i < half);
//   * y = heads + h: k head h is rotated, written back in place into qkv AND to
//     k_cache[s * kv_stride + h * head_dim + i], and v head h is copied to v_cache at the same
//     offsets (RMS-normalized first when v_norm is set: Gemma 4);
//   * dims >= 2 * half pass through unrotated (normalized when a norm is set; left in qkv,
//     copied to the cache for k).
// Same math as rope_bf16: sincosf(inv_freq[i] * (float)pos) times attn_scaling, f32 from the
// bf16 inputs, one rounding.
// Launch: grid (n tokens, heads + kv_heads), block a multiple of 32 (64 or 128; <= 1024), no
// dynamic shared memory. One block per head keeps a decode step's single token from running
// on one multiprocessor.
__device__ __forceinline__ float qk_normed(const bf16* x, int d, float inv, const bf16* w, float off) {
    return w ? to_f32(to_bf16(to_f32(x[d]) * inv * (off + to_f32(w[d])))) : to_f32(x[d]);
}

template <typename KV>
__device__ __forceinline__ void qkv_rope_write(bf16* __restrict__ qkv, long long stride, KV* __restrict__ k_cache,
                                               KV* __restrict__ v_cache, const unsigned int* __restrict__ pos,
                                               const unsigned int* __restrict__ slots,
                                               const float* __restrict__ inv_freq, int half, float attn_scaling,
                                               int heads, int kv_heads, int head_dim, int kv_stride,
                                               const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm,
                                               const bf16* __restrict__ v_norm, float eps, float weight_offset) {
    kiln_pdl_enter();
    bf16* row = qkv + (long long)blockIdx.x * stride;
    const float p = (float)pos[blockIdx.x];
    const bool is_k = (int)blockIdx.y >= heads;
    const int h = is_k ? (int)blockIdx.y - heads : (int)blockIdx.y;
    const long long hoff = (long long)h * head_dim;
    const long long koff = (long long)heads * head_dim, voff = koff + (long long)kv_heads * head_dim;
    const long long cbase = is_k ? (long long)slots[blockIdx.x] * kv_stride + hoff : 0;
    bf16* x = row + (is_k ? koff : 0) + hoff;
    const bf16* w = is_k ? k_norm : q_norm;
    float inv = 1.0f;
    if (w) {  // uniform over the block: every thread reaches block_sum
        float ss = 0.0f;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            const float v = to_f32(x[d]);
            ss += v * v;
        }
        inv = rsqrtf(block_sum(ss) / head_dim + eps);
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, c;
        sincosf(inv_freq[i] * p, &sn, &c);
        sn *= attn_scaling;
        c *= attn_scaling;
        const float a = qk_normed(x, i, inv, w, weight_offset), b = qk_normed(x, i + half, inv, w, weight_offset);
        const bf16 ra = to_bf16(rope_first(a, b, c, sn)), rb = to_bf16(rope_second(a, b, c, sn));
        x[i] = ra;
        x[i + half] = rb;
        if (is_k) {
            kv_elem::store1(k_cache + cbase + i, ra);
            kv_elem::store1(k_cache + cbase + i + half, rb);
        }
    }
    // The unrotated tail (partial rotary), normalized when a norm is set.
    for (int d = 2 * half + threadIdx.x; d < head_dim; d += blockDim.x) {
        const bf16 t = to_bf16(qk_normed(x, d, inv, w, weight_offset));
        x[d] = t;
        if (is_k) kv_elem::store1(k_cache + cbase + d, t);
    }
    if (!is_k) return;
    const bf16* v = row + voff + hoff;
    float vinv = 1.0f;
    if (v_norm) {  // uniform over the block, as for q and k
        float ss = 0.0f;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            const float t = to_f32(v[d]);
            ss += t * t;
        }
        vinv = rsqrtf(block_sum(ss) / head_dim + eps);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
        kv_elem::store1(v_cache + cbase + d, v_norm ? to_bf16(qk_normed(v, d, vinv, v_norm, weight_offset)) : v[d]);
}

#define KILN_QKV_ROPE_WRITE(NAME, KV)                                                                          \
    extern "C" __global__ void NAME(bf16* __restrict__ qkv, long long stride, KV* __restrict__ k_cache,         \
                                    KV* __restrict__ v_cache, const unsigned int* __restrict__ pos,             \
                                    const unsigned int* __restrict__ slots, const float* __restrict__ inv_freq, \
                                    int half, float attn_scaling, int heads, int kv_heads, int head_dim,        \
                                    int kv_stride, const bf16* __restrict__ q_norm,                             \
                                    const bf16* __restrict__ k_norm, const bf16* __restrict__ v_norm,           \
                                    float eps, float weight_offset) {                                           \
        qkv_rope_write<KV>(qkv, stride, k_cache, v_cache, pos, slots, inv_freq, half, attn_scaling, heads,     \
                           kv_heads, head_dim, kv_stride, q_norm, k_norm, v_norm, eps, weight_offset);          \
    }
KILN_QKV_ROPE_WRITE(qkv_rope_write_bf16, bf16)
KILN_QKV_ROPE_WRITE(qkv_rope_write_fp8, kv8)
