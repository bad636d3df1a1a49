// RMSNorm of bf16 rows with f32 math, optionally after a residual add.
#include "common.cuh"
#include "vec8.cuh"

// Fused residual add + RMSNorm, one block per row:
//   sum = x + residual (written back to residual when residual is non-null),
//   out = sum / sqrt(mean(sum^2) + eps) * (weight_offset + w),
//   and with `after` non-null (post-norm blocks; residual null): out = after + bf16(out), one
//   more rounding, as the norm and then the sum round.
// rms_prologue.cuh reproduces this kernel's summation order and rounding (keep them in step).
extern "C" __global__ void add_rms_norm_bf16(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                             const bf16* __restrict__ w, bf16* __restrict__ out, int d, float eps,
                                             float weight_offset, const bf16* __restrict__ after) {
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
        const bf16 y = to_bf16(v * inv * (weight_offset + to_f32(w[i])));
        out[base + i] = after ? to_bf16(to_f32(after[base + i]) + to_f32(y)) : y;
    }
}

// LayerNorm of rows: out = (x - mean) / sqrt(var + eps) * w + b with the biased variance
// (torch.nn.LayerNorm), mean and variance in two passes in f32; w, b f32 [d].
// Launch: one block per row, 256 threads.
extern "C" __global__ void layer_norm_bf16(const bf16* __restrict__ x, bf16* __restrict__ out,
                                           const float* __restrict__ w, const float* __restrict__ b, int d,
                                           float eps) {
    kiln_pdl_enter();
    const bf16* xr = x + (long long)blockIdx.x * d;
    bf16* o = out + (long long)blockIdx.x * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += to_f32(xr[i]);
    const float mean = block_sum(s) / (float)d;
    float v = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float t = to_f32(xr[i]) - mean;
        v += t * t;
    }
    const float inv = 1.0f / sqrtf(block_sum(v) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = to_bf16((to_f32(xr[i]) - mean) * inv * w[i] + b[i]);
}
