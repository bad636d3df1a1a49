// RMSNorm as a prologue of the decode GEMV kernels (rms_norm_gemv_*): every block recomputes the
// inverse RMS of the M <= 8 activation rows (x is hidden_size bf16, L2-resident) and scales x by
// inv_rms * (weight_offset + norm_w) as it feeds the tensor cores. Needs common.cuh.
//
// Numerics are those of add_rms_norm_bf16 (norm.cu) launched with `nt` threads per row
// (the host passes norm_threads(d), the block size the unfused launch would use), bit for bit:
//   - virtual thread j of nt sums x[j + nt * i]^2, i = 0, 1, ..., with one fma per element in i
//     order (16-byte loads: one real thread keeps eight virtual threads' sums);
//   - each virtual warp of 32 is reduced in warp_sum's butterfly order (xor 16, 8, 4, 2, 1), then
//     the nt / 32 warp sums (zero-padded to 32) by a second butterfly, as block_sum does;
//   - inv = rsqrtf(sum / d + eps), and every normalized value is rounded to bf16 as
//     to_bf16(x * inv * (weight_offset + w)), which is what the unfused kernel stores and the GEMV
//     then reads.
// So a fused product equals rms_norm + the plain GEMV on the same inputs.
#pragma once

namespace rms_prologue {

// 16 bytes through the read-only/L1 path (x rows and norm weights are re-read by every block).
// volatile: x is the previous kernel's output, so these loads must stay after kiln_pdl_wait().
__device__ __forceinline__ uint4 ld_v4(const bf16* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float2 bf2_to_f2(unsigned u) {
    __nv_bfloat162 h;
    *reinterpret_cast<unsigned*>(&h) = u;
    return __bfloat1622float2(h);
}

// Two normalized values, rounded as add_rms_norm_bf16 rounds its output.
__device__ __forceinline__ unsigned scale2(unsigned xb, unsigned wb, float inv, float off) {
    const float2 xf = bf2_to_f2(xb), wf = bf2_to_f2(wb);
    const bf16 lo = to_bf16(xf.x * inv * (off + wf.x));
    const bf16 hi = to_bf16(xf.y * inv * (off + wf.y));
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}

// Eight consecutive x values (xv) normalized with their norm weights (wv).
__device__ __forceinline__ uint4 scale8(uint4 xv, uint4 wv, float inv, float off) {
    return make_uint4(scale2(xv.x, wv.x, inv, off), scale2(xv.y, wv.y, inv, off), scale2(xv.z, wv.z, inv, off),
                      scale2(xv.w, wv.w, inv, off));
}

// inv[m] = 1 / rms of row m of x [M, d] for m < M, in shared memory, visible to the whole block on
// return. Block of 256 threads; every thread must call it (it synchronizes). Requirements:
// d % 8 == 0, nt a multiple of 32 in [32, 1024]; partial: 32 * M shared floats. With xs (shared,
// M rows of xs_stride 16-byte slots), every 16 bytes of x read on the way are stored there too:
// xs[m * xs_stride + e / 8] = x[m, e .. e + 8), each exactly once.
template <int M>
__device__ __forceinline__ void inv_rms_rows(const bf16* __restrict__ x, int d, float eps, int nt, float* partial,
                                             float* inv, uint4* xs = nullptr, int xs_stride = 0) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cols = nt >> 3;  // 16-byte columns: column c holds virtual threads 8c .. 8c + 7
    const int items = M * cols;
    // Block-uniform loop; cols % 4 == 0 keeps each virtual warp (4 columns) in 4 adjacent lanes.
    for (int base = 0; base < items; base += 256) {
        const int item = base + tid;
        const bool active = item < items;
        const int m = active ? item / cols : 0, c = active ? item % cols : 0;
        float ss[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) ss[q] = 0.0f;
        if (active) {
            const bf16* row = x + (long long)m * d;
            // Unrolled so that several loads are in flight (the sums keep their order).
#pragma unroll 4
            for (int e = 8 * c; e < d; e += nt) {
                const uint4 v = ld_v4(row + e);
                if (xs) xs[m * xs_stride + (e >> 3)] = v;
                const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const float2 f = bf2_to_f2(u[p]);
                    ss[2 * p] = __fmaf_rn(f.x, f.x, ss[2 * p]);
                    ss[2 * p + 1] = __fmaf_rn(f.y, f.y, ss[2 * p + 1]);
                }
            }
        }
        // Virtual lane 8t + q of a warp lives in lane t (= c % 4) of its group, register q.
        // Butterfly offset 16 pairs groups lanes t and t ^ 2, offset 8 lanes t and t ^ 1.
        float a[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) a[q] = ss[q] + __shfl_xor_sync(0xffffffffu, ss[q], 2);
#pragma unroll
        for (int q = 0; q < 8; ++q) a[q] = a[q] + __shfl_xor_sync(0xffffffffu, a[q], 1);
        // Offsets 4, 2, 1 inside the registers (virtual lanes 0..7).
        const float c0 = a[0] + a[4], c1 = a[1] + a[5], c2 = a[2] + a[6], c3 = a[3] + a[7];
        const float d0 = c0 + c2, d1 = c1 + c3;
        const float s = d0 + d1;
        if (active && (c & 3) == 0) partial[m * 32 + (c >> 2)] = s;
    }
    __syncthreads();
    const int nw = nt >> 5;
    for (int m = warp; m < M; m += 8) {
        float v = lane < nw ? partial[m * 32 + lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) inv[m] = rsqrtf(v / d + eps);
    }
    __syncthreads();
}

}  // namespace rms_prologue
