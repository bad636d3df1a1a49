// Multi-head latent attention's per-head projections (kiln_tensor::mla), bf16 in and out, f32
// sums, weights bf16 on the device. Each op is a block-diagonal product: one block a (row, head).
#include "common.cuh"

// q [n, heads * (nope + rope)] -> out [n, heads * (rope + latent)]: each head's rope part, then
// W_UK[h]^T q_nope (w_uk [heads, nope, latent]). Grid n * heads, 256 threads; dynamic shared
// memory nope floats.
extern "C" __global__ void __launch_bounds__(256) mla_query_bf16(const bf16* __restrict__ q,
                                                                 const bf16* __restrict__ w_uk,
                                                                 bf16* __restrict__ out, int heads, int nope,
                                                                 int rope, int latent) {
    kiln_pdl_enter();
    extern __shared__ float mla_qn[];
    const int row = blockIdx.x / heads, h = blockIdx.x % heads;
    const bf16* qh = q + ((long long)row * heads + h) * (nope + rope);
    bf16* oh = out + ((long long)row * heads + h) * (rope + latent);
    for (int d = threadIdx.x; d < nope; d += blockDim.x) mla_qn[d] = to_f32(qh[d]);
    for (int d = threadIdx.x; d < rope; d += blockDim.x) oh[d] = qh[nope + d];
    __syncthreads();
    const bf16* w = w_uk + (long long)h * nope * latent;
    for (int j = threadIdx.x; j < latent; j += blockDim.x) {
        float acc = 0.0f;
        for (int d = 0; d < nope; ++d) acc += mla_qn[d] * to_f32(w[(long long)d * latent + j]);
        oh[rope + j] = to_bf16(acc);
    }
}

// x [n, latent + rope] -> out [n, rope + latent]: the rope part, then the latent RMS-normed with
// w [latent] (bf16). Grid n, 256 threads.
extern "C" __global__ void __launch_bounds__(256) mla_kv_bf16(const bf16* __restrict__ x,
                                                              const bf16* __restrict__ w,
                                                              bf16* __restrict__ out, int rope, int latent,
                                                              float eps) {
    kiln_pdl_enter();
    const bf16* xr = x + (long long)blockIdx.x * (latent + rope);
    bf16* o = out + (long long)blockIdx.x * (latent + rope);
    float s = 0.0f;
    for (int i = threadIdx.x; i < latent; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        s += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(s) / (float)latent + eps);
    for (int i = threadIdx.x; i < rope; i += blockDim.x) o[i] = xr[latent + i];
    for (int i = threadIdx.x; i < latent; i += blockDim.x) o[rope + i] = to_bf16(to_f32(xr[i]) * inv * to_f32(w[i]));
}

// o [n, heads * (rope + latent)] -> out [n, heads * value]: W_UV[h] o[h][rope..] (w_uv [heads,
// value, latent]), a warp a value column (lanes stride the latent). Grid n * heads, 256 threads;
// dynamic shared memory latent floats.
extern "C" __global__ void __launch_bounds__(256) mla_output_bf16(const bf16* __restrict__ o,
                                                                  const bf16* __restrict__ w_uv,
                                                                  bf16* __restrict__ out, int heads, int rope,
                                                                  int latent, int value) {
    kiln_pdl_enter();
    extern __shared__ float mla_lat[];
    const int row = blockIdx.x / heads, h = blockIdx.x % heads;
    const bf16* oh = o + ((long long)row * heads + h) * (rope + latent) + rope;
    for (int c = threadIdx.x; c < latent; c += blockDim.x) mla_lat[c] = to_f32(oh[c]);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const bf16* w = w_uv + (long long)h * value * latent;
    bf16* out_h = out + ((long long)row * heads + h) * value;
    for (int j = warp; j < value; j += warps) {
        const bf16* wj = w + (long long)j * latent;
        float acc = 0.0f;
        for (int c = lane; c < latent; c += 32) acc += mla_lat[c] * to_f32(wj[c]);
        acc = warp_sum(acc);
        if (lane == 0) out_h[j] = to_bf16(acc);
    }
}
