// Row-wise and elementwise ops on bf16 activations with f32 math.
#include "common.cuh"

// out[t, :] = table[ids[t], :]. One block per token.
// One row of d bf16 by the block: 16 bytes a thread where both rows allow it.
__device__ __forceinline__ void copy_row_bf16(const bf16* __restrict__ src, bf16* __restrict__ dst, int d) {
    if ((d & 7) == 0 && ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15ull) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* o = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < d / 8; i += blockDim.x) o[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" __global__ void embedding_bf16(const bf16* __restrict__ table, const unsigned int* __restrict__ ids,
                                          bf16* __restrict__ out, int d) {
    kiln_pdl_enter();
    const long long row = ids[blockIdx.x];
    copy_row_bf16(table + row * d, out + (long long)blockIdx.x * d, d);
}

// Fused residual add + RMSNorm, one block per row:
//   sum = x + residual (written back to residual when residual is non-null),
//   out = sum / sqrt(mean(sum^2) + eps) * (weight_offset + w).
// rms_prologue.cuh reproduces this kernel's summation order and rounding (keep them in step).
extern "C" __global__ void add_rms_norm_bf16(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                             const bf16* __restrict__ w, bf16* __restrict__ out, int d, float eps,
                                             float weight_offset) {
    kiln_pdl_enter();
    const long long base = (long long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f32(x[base + i]);
        if (residual) {
            v += to_f32(residual[base + i]);
            residual[base + i] = to_bf16(v);
        }
        ss = __fmaf_rn(v, v, ss);  // what `ss += v * v` contracts to; rms_prologue.cuh relies on it
    }
    const float inv = rsqrtf(block_sum(ss) / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        // Re-read the (rounded) sum, as the next layer will see it.
        const float v = residual ? to_f32(residual[base + i]) : to_f32(x[base + i]);
        out[base + i] = to_bf16(v * inv * (weight_offset + to_f32(w[i])));
    }
}

// out = act(gate) * up over n elements; act 0 = SiLU, 1 = GELU (tanh approximation).
extern "C" __global__ void gated_act_bf16(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                          bf16* __restrict__ out, long long n, int act) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i]);
        float a;
        if (act == 0) {
            a = g / (1.0f + __expf(-g));
        } else {
            const float c = 0.7978845608f;
            a = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
        }
        out[i] = to_bf16(a * to_f32(up[i]));
    }
}

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

// Write new keys and values [tokens, kv_row] into their cache slots [slots, kv_row].
extern "C" __global__ void write_kv_bf16(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                         bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                         const unsigned int* __restrict__ slot_mapping, int kv_row) {
    kiln_pdl_enter();
    const long long src = (long long)blockIdx.x * kv_row;
    const long long dst = (long long)slot_mapping[blockIdx.x] * kv_row;
    for (int i = threadIdx.x; i < kv_row; i += blockDim.x) {
        k_cache[dst + i] = k[src + i];
        v_cache[dst + i] = v[src + i];
    }
}

// out = a + b, or out = a * s when b is null.
extern "C" __global__ void add_scale_bf16(const bf16* __restrict__ a, const bf16* __restrict__ b,
                                          bf16* __restrict__ out, long long n, float s) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = b ? to_bf16(to_f32(a[i]) + to_f32(b[i])) : to_bf16(to_f32(a[i]) * s);
    }
}

// Add a bias [m] to every row of x [n, m] in place.
extern "C" __global__ void add_bias_bf16(bf16* __restrict__ x, const bf16* __restrict__ bias, long long n, int m) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n * m;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = to_bf16(to_f32(x[i]) + to_f32(bias[i % m]));
    }
}

// Rows `rows` of x [n, d] into out [len(rows), d].
extern "C" __global__ void gather_rows_bf16(const bf16* __restrict__ x, const unsigned int* __restrict__ rows,
                                            bf16* __restrict__ out, int d) {
    kiln_pdl_enter();
    copy_row_bf16(x + (long long)rows[blockIdx.x] * d, out + (long long)blockIdx.x * d, d);
}

// bf16 -> f32 copy (logits to the host).
extern "C" __global__ void to_f32_bf16(const bf16* __restrict__ x, float* __restrict__ out, long long n) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = to_f32(x[i]);
    }
}

// Columns [0, width) of every row of src (row stride src_stride) into dst [rows, width].
extern "C" __global__ void copy_cols_bf16(const bf16* __restrict__ src, long long src_stride, bf16* __restrict__ dst,
                                          int width, long long rows) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * width;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width, c = i % width;
        dst[i] = src[r * src_stride + c];
    }
}
