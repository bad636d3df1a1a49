// The KV cache's element: bf16, or E4M3 FP8 (`--kv-cache-dtype fp8`: one byte a key or value,
// at unit scale as vLLM keeps it by default: round to nearest, saturating at +-448). Kernels
// that read or write the cache are templates over the element, kv8 = unsigned char. sm_89 and
// newer convert with their FP8 instructions; older GPUs (which compile these units too: the
// bf16 entries live beside the FP8 ones) in integer arithmetic, to the same values. Needs
// common.cuh.
#pragma once
#include <cuda_fp16.h>

typedef unsigned char kv8;

namespace kv_elem {

// One E4M3 code as bf16 bits, in integer arithmetic (GPUs before sm_89 have no FP8 conversion
// instructions): normal codes rebased to bf16's exponent, subnormals m * 2^-9 normalized, the
// NaN code (S.1111.111) to a quiet NaN.
__device__ __forceinline__ unsigned e4m3_bf16_bits(unsigned c) {
    const unsigned s = (c & 0x80u) << 8, e = (c >> 3) & 15u, m = c & 7u;
    if (e == 15u && m == 7u) return s | 0x7fc0u;
    if (e != 0u) return s | ((e + 120u) << 7) | (m << 4);
    if (m == 0u) return s;
    // m * 2^-9: the leading bit of m at position p is 2^(p - 9), the rest the mantissa.
    const int p = 31 - __clz(m);
    return s | ((unsigned)(p - 9 + 127) << 7) | (((m << (3 - p)) & 7u) << 4);
}

// Two E4M3 codes (low byte first) as a bf16 pair, exactly (E4M3 -> f16 -> f32 is exact, and an
// E4M3 value has 4 significant bits).
__device__ __forceinline__ unsigned e4m3x2_bf16x2(unsigned short v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return (__float_as_uint(f.x) >> 16) | (__float_as_uint(f.y) & 0xffff0000u);
#else
    return e4m3_bf16_bits(v & 0xffu) | (e4m3_bf16_bits(v >> 8) << 16);
#endif
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

// x as an E4M3 code in integer and float arithmetic: round to nearest even, saturating at
// +-448, NaN to the NaN code (what cvt.rn.satfinite does on sm_89 and newer).
__device__ __forceinline__ unsigned e4m3_of(float x) {
    const unsigned s = x < 0.0f ? 0x80u : 0u;
    float a = fabsf(x);
    if (a != a) return 0x7fu;
    if (a < 0.015625f) return s | (unsigned)rintf(a * 512.0f);  // m 2^-9; m = 8 is 0x08, 2^-6
    a = fminf(a, 448.0f);
    int e;
    const float f = frexpf(a, &e);  // a = f 2^e, f in [0.5, 1)
    unsigned q = (unsigned)rintf(f * 16.0f);  // 1.mmm in eighths: 8..16
    if (q == 16u) q = 8u, ++e;
    const unsigned code = ((unsigned)(e + 6) << 3) | (q - 8u);
    return s | (code > 0x7eu ? 0x7eu : code);
}

// Stores v (already rounded to bf16 by the caller) as an element.
__device__ __forceinline__ void store1(bf16* p, bf16 v) { *p = v; }
__device__ __forceinline__ void store1(kv8* p, bf16 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short c;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(c) : "f"(to_f32(v)), "f"(0.0f));
    *p = (kv8)(c & 0xffu);
#else
    *p = (kv8)e4m3_of(to_f32(v));
#endif
}

}  // namespace kv_elem
