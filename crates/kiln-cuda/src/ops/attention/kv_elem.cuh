// The KV cache's element: bf16, or E4M3 FP8 (`--kv-cache-dtype fp8`: one byte a key or value,
// at unit scale as vLLM keeps it by default: round to nearest, saturating at +-448). Kernels
// that read or write the cache are templates over the element, kv8 = unsigned char. Needs
// common.cuh.
#pragma once
#include <cuda_fp16.h>

typedef unsigned char kv8;

namespace kv_elem {

// Two E4M3 codes (low byte first) as a bf16 pair, exactly (E4M3 -> f16 -> f32 is exact, and an
// E4M3 value has 4 significant bits).
__device__ __forceinline__ unsigned e4m3x2_bf16x2(unsigned short v) {
    unsigned h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return (__float_as_uint(f.x) >> 16) | (__float_as_uint(f.y) & 0xffff0000u);
}

// Eight consecutive elements as eight bf16 (16 bytes): bf16 as stored, E4M3 widened.
__device__ __forceinline__ uint4 load8(const bf16* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint4 load8(const kv8* p) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    return make_uint4(e4m3x2_bf16x2((unsigned short)(r.x & 0xffffu)), e4m3x2_bf16x2((unsigned short)(r.x >> 16)),
                      e4m3x2_bf16x2((unsigned short)(r.y & 0xffffu)), e4m3x2_bf16x2((unsigned short)(r.y >> 16)));
}

// One element as f32.
__device__ __forceinline__ float load1(const bf16* p) { return to_f32(*p); }
__device__ __forceinline__ float load1(const kv8* p) {
    const unsigned w = e4m3x2_bf16x2((unsigned short)*p);
    return __uint_as_float(w << 16);
}

// Stores v (already rounded to bf16 by the caller) as an element.
__device__ __forceinline__ void store1(bf16* p, bf16 v) { *p = v; }
__device__ __forceinline__ void store1(kv8* p, bf16 v) {
    unsigned short c;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(c) : "f"(to_f32(v)), "f"(0.0f));
    *p = (kv8)(c & 0xffu);
}

}  // namespace kv_elem
