// The recurrent mixers' scalar functions, shared by the token-order kernels (recurrent.cu) and
// the delta rule's chunk-parallel prefill (delta_chunk.cu).
#pragma once

namespace recurrent_detail {
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }
}  // namespace recurrent_detail
