// Shared helpers for Kiln's CUDA kernels: bf16 conversions and warp/block sums.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

// -inf without <cmath> (NVRTC has no host headers).
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int num_warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < num_warps) ? partial[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    v = partial[0];
    __syncthreads();
    return v;
}

// The gated activations' gate function: act 0 = SiLU, 1 = GELU (tanh approximation), 2 = sigmoid.
__device__ __forceinline__ float kiln_act(float g, int act) {
    if (act == 0) return g / (1.0f + __expf(-g));
    if (act == 2) return 1.0f / (1.0f + __expf(-g));
    const float c = 0.7978845608f;
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

// Rotate-half RoPE of one pair (a, b) = (x[i], x[i + half]) with c, s = cos, sin (times the
// attention scaling): a c - b s and b c + a s, every product and sum rounded once in f32 (no fused
// multiply-add: the CPU backend's order), so each kernel that rotates gives the same bits.
__device__ __forceinline__ float rope_first(float a, float b, float c, float s) {
    return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
__device__ __forceinline__ float rope_second(float a, float b, float c, float s) {
    return __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// Programmatic dependent launch (sm_90+; no-ops below and when the launch did
// not ask for it). Every kernel begins with kiln_pdl_enter(): it lets the next
// kernel of the stream be scheduled as soon as all of this grid's blocks have
// started, then waits until the previous kernel has finished and its writes
// are visible. Nothing before the wait may read what an earlier kernel wrote
// or write anything an earlier kernel reads (only prefetches of weights, which
// no kernel writes, go before it).
__device__ __forceinline__ void kiln_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void kiln_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void kiln_pdl_enter() {
    kiln_pdl_trigger();
    kiln_pdl_wait();
}

// Ask L2 for the line holding p ahead of its load (weights, which no kernel writes: allowed
// before kiln_pdl_wait()).
__device__ __forceinline__ void kiln_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
