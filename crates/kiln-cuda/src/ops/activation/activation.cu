// Gated activations: act(gate) * up with SiLU or GELU (tanh approximation), from separate
// gate and up tensors or from packed [gate | up] rows.
#include "common.cuh"
#include "vec8.cuh"

// out = act(gate) * up over n elements; act 0 = SiLU, 1 = GELU (tanh approximation), 2 = sigmoid.
extern "C" __global__ void gated_act_bf16(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                          bf16* __restrict__ out, long long n, int act) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i]);
        out[i] = to_bf16(kiln_act(g, act) * to_f32(up[i]));
    }
}

// out [n_rows, inter] = act(gate) * up with gu [n_rows, 2 * inter] = [gate | up] per row.
// act 0 = SiLU, 1 = GELU (tanh approximation), as gated_act_bf16.
// Launch: 1-D grid-stride; block 256, grid e.g. min(ceil(n_rows * inter / (256 * 8)), 65535 * 8)
// (any grid works). 16-byte vectorized when inter % 8 == 0 and both pointers are 16-byte aligned.
extern "C" __global__ void gated_act_packed_bf16(const bf16* __restrict__ gu, bf16* __restrict__ out,
                                                 long long n_rows, int inter, int act) {
    kiln_pdl_enter();
    using namespace vec8;
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
            for (int i = 0; i < 8; ++i) o[i] = kiln_act(g[i], act) * u[i];
            *reinterpret_cast<uint4*>(out + r * inter + c) = pack8(o);
        }
    } else {
        const long long n = n_rows * inter;
        for (long long i = first; i < n; i += gstride) {
            const long long r = i / inter;
            const int c = (int)(i - r * inter);
            const float g = to_f32(gu[r * 2 * inter + c]), u = to_f32(gu[r * 2 * inter + inter + c]);
            out[i] = to_bf16(kiln_act(g, act) * u);
        }
    }
}

// GELU with the exact erf form, out = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (BERT's "gelu").
extern "C" __global__ void gelu_erf_bf16(const bf16* __restrict__ x, bf16* __restrict__ out, long long n) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = to_f32(x[i]);
        out[i] = to_bf16(0.5f * v * (1.0f + erff(v * 0.70710678118654752f)));
    }
}
