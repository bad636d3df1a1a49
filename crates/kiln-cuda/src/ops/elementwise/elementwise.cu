// Elementwise ops on bf16 activations with f32 math: sums, scaling, bias and residual adds, and
// the f32 copy of logits.
#include "common.cuh"
#include "vec8.cuh"

// out = a + b, or out = a * s when b is null.
extern "C" __global__ void add_scale_bf16(const bf16* __restrict__ a, const bf16* __restrict__ b,
                                          bf16* __restrict__ out, long long n, float s) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = b ? to_bf16(to_f32(a[i]) + to_f32(b[i])) : to_bf16(to_f32(a[i]) * s);
    }
}

// Soft-capping out = tanh(x / cap) * cap (Gemma's final logits), f32 math.
extern "C" __global__ void softcap_bf16(const bf16* __restrict__ x, bf16* __restrict__ out, long long n,
                                        float cap) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = to_bf16(tanhf(to_f32(x[i]) / cap) * cap);
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

// x [n_rows, m] += bias[c] (if bias) + residual[r, c] (if residual), in f32 with one rounding:
// x = bf16((x + bias) + residual). For the epilogue of a cuBLAS GEMM.
// Launch: 1-D grid-stride; block 256, any grid (e.g. ceil(n_rows * m / (256 * 8)) capped).
// 16-byte vectorized when m % 8 == 0 and the pointers are 16-byte aligned.
extern "C" __global__ void bias_residual_bf16(bf16* __restrict__ x, const bf16* __restrict__ bias,
                                              const bf16* __restrict__ residual, long long n_rows, int m) {
    kiln_pdl_enter();
    using namespace vec8;
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

// bf16 -> f32 copy (logits to the host).
extern "C" __global__ void to_f32_bf16(const bf16* __restrict__ x, float* __restrict__ out, long long n) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = to_f32(x[i]);
    }
}
