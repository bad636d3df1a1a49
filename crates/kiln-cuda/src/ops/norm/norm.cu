// RMSNorm of bf16 rows with f32 math, optionally after a residual add.
#include "common.cuh"
#include "vec8.cuh"

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

// RMSNorm of strided rows: out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * (weight_offset + w),
// x row r at x + r * x_stride + blockIdx.y * d, out row r at out + r * out_stride + blockIdx.y * d
// (strides in elements): grid.y > 1 normalizes grid.y consecutive rows of d inside each strided
// row, e.g. every head of the q or k part of packed qkv rows (QK-norm). x may equal out.
// Same math as add_rms_norm_bf16 with no residual. One block per row: grid.x = n_rows,
// block 256 (any multiple of 32 up to 1024), no dynamic shared memory. 16-byte vectorized when
// d, both strides are multiples of 8 and x, out, w are 16-byte aligned; scalar otherwise.
extern "C" __global__ void rms_norm_rows_bf16(const bf16* x, long long x_stride, bf16* out,
                                              long long out_stride, const bf16* __restrict__ w, int d, float eps,
                                              float weight_offset) {
    kiln_pdl_enter();
    using namespace vec8;
    const bf16* xr = x + (long long)blockIdx.x * x_stride + (long long)blockIdx.y * d;
    bf16* orow = out + (long long)blockIdx.x * out_stride + (long long)blockIdx.y * d;
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
