// 16-byte vector helpers shared by the row-wise kernels: 8 bf16 <-> 8 f32 through one
// 16-byte word. Needs common.cuh.
#pragma once

namespace vec8 {

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

}  // namespace vec8
