// Fused glue kernels around the matrix products: RoPE + KV-cache write on a packed QKV row,
// gated activation on a packed gate|up row, bias + residual after a GEMM, strided RMSNorm.
#include "common.cuh"

namespace fused_detail {

// Same activations as gated_act_bf16 (act 0 = SiLU, 1 = GELU tanh approximation).
__device__ __forceinline__ float act_fn(float g, int act) {
    if (act == 0) return g / (1.0f + __expf(-g));
    const float c = 0.7978845608f;
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// 8 bf16 <-> 8 f32 through one 16-byte word.
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
    const unsigned r[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(r[i] << 16);
        f[2 * i + 1] = __uint_as_float(r[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned lo = (unsigned)__bfloat16_as_ushort(to_bf16(f[2 * i]));
        const unsigned hi = (unsigned)__bfloat16_as_ushort(to_bf16(f[2 * i + 1]));
        r[i] = lo | (hi << 16);
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}

}  // namespace fused_detail

// RoPE on a packed QKV projection, with the KV-cache write fused in.
// qkv [n, stride] rows: [q: heads * head_dim | k: kv_heads * head_dim | v: kv_heads * head_dim].
// For token t = blockIdx.x at position pos[t], slot s = slots[t], and head blockIdx.y:
//   * y < heads: q head y is rotated in place in qkv (rotate-half, pairs (i, i + half), i < half);
//   * y = heads + h: k head h is rotated, written back in place into qkv AND to
//     k_cache[s * kv_heads * head_dim + h * head_dim + i], and v head h is copied to v_cache at
//     the same offsets;
//   * dims >= 2 * half pass through unchanged (left in qkv, copied to the cache for k).
// Same math as rope_bf16: sincosf(inv_freq[i] * (float)pos) times attn_scaling, f32 from the
// bf16 inputs, one rounding.
// Launch: grid (n tokens, heads + kv_heads), block 64 or 128 (any size <= 1024), no shared memory.
// One block per head keeps a decode step's single token from running on one multiprocessor.
extern "C" __global__ void qkv_rope_write_bf16(bf16* __restrict__ qkv, long long stride, bf16* __restrict__ k_cache,
                                               bf16* __restrict__ v_cache, const unsigned int* __restrict__ pos,
                                               const unsigned int* __restrict__ slots,
                                               const float* __restrict__ inv_freq, int half, float attn_scaling,
                                               int heads, int kv_heads, int head_dim) {
    kiln_pdl_enter();
    bf16* row = qkv + (long long)blockIdx.x * stride;
    const float p = (float)pos[blockIdx.x];
    const bool is_k = (int)blockIdx.y >= heads;
    const int h = is_k ? (int)blockIdx.y - heads : (int)blockIdx.y;
    const long long hoff = (long long)h * head_dim;
    const long long koff = (long long)heads * head_dim, voff = koff + (long long)kv_heads * head_dim;
    const long long cbase = is_k ? (long long)slots[blockIdx.x] * kv_heads * head_dim + hoff : 0;
    bf16* x = row + (is_k ? koff : 0) + hoff;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, c;
        sincosf(inv_freq[i] * p, &sn, &c);
        sn *= attn_scaling;
        c *= attn_scaling;
        const float a = to_f32(x[i]), b = to_f32(x[i + half]);
        const bf16 ra = to_bf16(rope_first(a, b, c, sn)), rb = to_bf16(rope_second(a, b, c, sn));
        x[i] = ra;
        x[i + half] = rb;
        if (is_k) {
            k_cache[cbase + i] = ra;
            k_cache[cbase + i + half] = rb;
        }
    }
    if (!is_k) return;
    // Unrotated tail of the k head (partial rotary), and the v head.
    for (int d = 2 * half + threadIdx.x; d < head_dim; d += blockDim.x) k_cache[cbase + d] = x[d];
    const bf16* v = row + voff + hoff;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) v_cache[cbase + d] = v[d];
}

// out [n_rows, inter] = act(gate) * up with gu [n_rows, 2 * inter] = [gate | up] per row.
// act 0 = SiLU, 1 = GELU (tanh approximation), as gated_act_bf16.
// Launch: 1-D grid-stride; block 256, grid e.g. min(ceil(n_rows * inter / (256 * 8)), 65535 * 8)
// (any grid works). 16-byte vectorized when inter % 8 == 0 and both pointers are 16-byte aligned.
extern "C" __global__ void gated_act_packed_bf16(const bf16* __restrict__ gu, bf16* __restrict__ out,
                                                 long long n_rows, int inter, int act) {
    kiln_pdl_enter();
    using namespace fused_detail;
    const long long gstride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((inter & 7) == 0 && aligned16(gu) && aligned16(out)) {
        const int per_row = inter >> 3;
        const long long n8 = n_rows * per_row;
        for (long long v = first; v < n8; v += gstride) {
            const long long r = v / per_row;
            const int c = (int)(v - r * per_row) * 8;
            const bf16* src = gu + r * 2 * inter + c;
            float g[8], u[8], o[8];
            unpack8(*reinterpret_cast<const uint4*>(src), g);
            unpack8(*reinterpret_cast<const uint4*>(src + inter), u);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = act_fn(g[i], act) * u[i];
            *reinterpret_cast<uint4*>(out + r * inter + c) = pack8(o);
        }
    } else {
        const long long n = n_rows * inter;
        for (long long i = first; i < n; i += gstride) {
            const long long r = i / inter;
            const int c = (int)(i - r * inter);
            const float g = to_f32(gu[r * 2 * inter + c]), u = to_f32(gu[r * 2 * inter + inter + c]);
            out[i] = to_bf16(act_fn(g, act) * u);
        }
    }
}

// x [n_rows, m] += bias[c] (if bias) + residual[r, c] (if residual), in f32 with one rounding:
// x = bf16((x + bias) + residual). For the epilogue of a cuBLAS GEMM.
// Launch: 1-D grid-stride; block 256, any grid (e.g. ceil(n_rows * m / (256 * 8)) capped).
// 16-byte vectorized when m % 8 == 0 and the pointers are 16-byte aligned.
extern "C" __global__ void bias_residual_bf16(bf16* __restrict__ x, const bf16* __restrict__ bias,
                                              const bf16* __restrict__ residual, long long n_rows, int m) {
    kiln_pdl_enter();
    using namespace fused_detail;
    const long long gstride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((m & 7) == 0 && aligned16(x) && (!bias || aligned16(bias)) && (!residual || aligned16(residual))) {
        const int per_row = m >> 3;
        const long long n8 = n_rows * per_row;
        for (long long v = first; v < n8; v += gstride) {
            const long long r = v / per_row;
            const int c = (int)(v - r * per_row) * 8;
            const long long o = r * m + c;
            float a[8], t[8];
            unpack8(*reinterpret_cast<const uint4*>(x + o), a);
            if (bias) {
                unpack8(*reinterpret_cast<const uint4*>(bias + c), t);
#pragma unroll
                for (int i = 0; i < 8; ++i) a[i] += t[i];
            }
            if (residual) {
                unpack8(*reinterpret_cast<const uint4*>(residual + o), t);
#pragma unroll
                for (int i = 0; i < 8; ++i) a[i] += t[i];
            }
            *reinterpret_cast<uint4*>(x + o) = pack8(a);
        }
    } else {
        const long long n = n_rows * m;
        for (long long i = first; i < n; i += gstride) {
            float a = to_f32(x[i]);
            if (bias) a += to_f32(bias[i % m]);
            if (residual) a += to_f32(residual[i]);
            x[i] = to_bf16(a);
        }
    }
}

// RMSNorm of strided rows: out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * (weight_offset + w),
// x row r at x + r * x_stride, out row r at out + r * out_stride (strides in elements).
// Same math as add_rms_norm_bf16 with no residual. One block per row: grid.x = n_rows,
// block 256 (any multiple of 32 up to 1024), no dynamic shared memory. 16-byte vectorized when
// d, both strides are multiples of 8 and x, out, w are 16-byte aligned; scalar otherwise.
extern "C" __global__ void rms_norm_rows_bf16(const bf16* x, long long x_stride, bf16* out,
                                              long long out_stride, const bf16* __restrict__ w, int d, float eps,
                                              float weight_offset) {
    kiln_pdl_enter();
    using namespace fused_detail;
    const bf16* xr = x + (long long)blockIdx.x * x_stride;
    bf16* orow = out + (long long)blockIdx.x * out_stride;
    const bool vec = (d & 7) == 0 && (x_stride & 7) == 0 && (out_stride & 7) == 0 && aligned16(x) &&
                     aligned16(out) && aligned16(w);
    float ss = 0.0f;
    if (vec) {
        const int d8 = d >> 3;
        for (int v = threadIdx.x; v < d8; v += blockDim.x) {
            float a[8];
            unpack8(*reinterpret_cast<const uint4*>(xr + v * 8), a);
#pragma unroll
            for (int i = 0; i < 8; ++i) ss += a[i] * a[i];
        }
        const float inv = rsqrtf(block_sum(ss) / d + eps);
        for (int v = threadIdx.x; v < d8; v += blockDim.x) {
            float a[8], ww[8];
            unpack8(*reinterpret_cast<const uint4*>(xr + v * 8), a);
            unpack8(*reinterpret_cast<const uint4*>(w + v * 8), ww);
#pragma unroll
            for (int i = 0; i < 8; ++i) a[i] = a[i] * inv * (weight_offset + ww[i]);
            *reinterpret_cast<uint4*>(orow + v * 8) = pack8(a);
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            const float v = to_f32(xr[i]);
            ss += v * v;
        }
        const float inv = rsqrtf(block_sum(ss) / d + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x)
            orow[i] = to_bf16(to_f32(xr[i]) * inv * (weight_offset + to_f32(w[i])));
    }
}
