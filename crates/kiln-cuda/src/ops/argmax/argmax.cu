// Greedy sampling on the GPU: a row argmax and its log-probability.
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Greedy sampling: ids[row] = argmax_v logits[row, v] (lowest index on ties, NaNs ignored),
// logprobs[row] = logits[row, argmax] - logsumexp(logits[row, :]) in f32 (NaN when the row holds a
// NaN or +inf, as exp(v - max) over the row gives).
// Launch: grid.x = rows, block 1024 (any multiple of 32 up to 1024 works), no dynamic smem.
// One pass: each thread keeps a running (max, sum of exp(v - max), index) over its logits, read
// 16 bytes at a time with UN loads in flight (rows of a multiple of 16 bytes), then the block merges.
// ---------------------------------------------------------------------------------------------
namespace argmax_detail {

#define KILN_ARGMAX_NONE 0xffffffffu

__device__ __forceinline__ float load_logit(const bf16* p) { return to_f32(*p); }
__device__ __forceinline__ float load_logit(const float* p) { return *p; }

// The 16 / sizeof(T) logits of a 16-byte load.
__device__ __forceinline__ void unpack16(const uint4& u, const bf16*, float (&v)[8]) {
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack16(const uint4& u, const float*, float (&v)[4]) {
    v[0] = __uint_as_float(u.x);
    v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z);
    v[3] = __uint_as_float(u.w);
}

// Is (v2, i2) a better candidate than (v1, i1)? Index KILN_ARGMAX_NONE means "none yet".
__device__ __forceinline__ bool better(float v2, unsigned i2, float v1, unsigned i1) {
    if (i2 == KILN_ARGMAX_NONE) return false;
    if (i1 == KILN_ARGMAX_NONE) return true;
    return v2 > v1 || (v2 == v1 && i2 < i1);
}

// Running state of some logits: the max m at index i, s = sum of exp(v - m) over the finite and
// +inf ones, bad = a NaN or +inf was seen (the sum is NaN then).
struct Run {
    float m, s;
    unsigned i;
    int bad;
};

// Logit v at index i, indices increasing per thread (strict > keeps the lowest on ties).
__device__ __forceinline__ void take(Run& r, float v, unsigned i) {
    if (v != v) {
        r.bad = 1;
        return;
    }
    if (v == NEG_INF) return;
    if (v == -NEG_INF) r.bad = 1;
    if (r.i == KILN_ARGMAX_NONE) {
        r.m = v;
        r.s = 1.0f;
        r.i = i;
    } else if (v > r.m) {
        r.s = r.s * expf(r.m - v) + 1.0f;
        r.m = v;
        r.i = i;
    } else {
        r.s += expf(v - r.m);
    }
}

__device__ __forceinline__ void merge(Run& r, float om, float os, unsigned oi, int obad) {
    r.bad |= obad;
    if (oi == KILN_ARGMAX_NONE) return;
    if (r.i == KILN_ARGMAX_NONE) {
        r.m = om;
        r.s = os;
        r.i = oi;
    } else if (better(om, oi, r.m, r.i)) {
        r.s = os + r.s * expf(r.m - om);
        r.m = om;
        r.i = oi;
    } else {
        r.s += os * expf(om - r.m);
    }
}

__device__ __forceinline__ void warp_merge(Run& r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, r.m, off);
        const float os = __shfl_xor_sync(0xffffffffu, r.s, off);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, r.i, off);
        const int ob = __shfl_xor_sync(0xffffffffu, r.bad, off);
        merge(r, om, os, oi, ob);
    }
}

// A logit the row's mask (one bit per id, or none) forbids reads as -inf.
__device__ __forceinline__ float apply_mask(float v, const unsigned* mask, int i) {
    return (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1u)) ? NEG_INF : v;
}

template <typename T>
__device__ __forceinline__ void argmax_logprob(const T* __restrict__ logits, int V, unsigned int* __restrict__ ids,
                                               float* __restrict__ logprobs, const unsigned* __restrict__ mask) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int UN = 4;  // 16-byte loads in flight per thread
    __shared__ float sm[32], ss[32];
    __shared__ unsigned si[32];
    __shared__ int sb[32];
    const T* row = logits + (long long)blockIdx.x * V;
    Run r{NEG_INF, 0.0f, KILN_ARGMAX_NONE, 0};
    if (V % VEC == 0 && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
        const int chunks = V / VEC;
        const uint4* rc = reinterpret_cast<const uint4*>(row);
        for (int c0 = threadIdx.x; c0 < chunks; c0 += blockDim.x * UN) {
            uint4 u[UN];
#pragma unroll
            for (int j = 0; j < UN; ++j) {
                const int c = c0 + j * blockDim.x;
                u[j] = c < chunks ? rc[c] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < UN; ++j) {
                const int c = c0 + j * blockDim.x;
                if (c < chunks) {
                    float v[VEC];
                    unpack16(u[j], row, v);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) take(r, apply_mask(v[e], mask, c * VEC + e), (unsigned)(c * VEC + e));
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) take(r, apply_mask(load_logit(row + i), mask, i), (unsigned)i);
    }
    warp_merge(r);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        sm[warp] = r.m;
        ss[warp] = r.s;
        si[warp] = r.i;
        sb[warp] = r.bad;
    }
    __syncthreads();
    if (warp == 0) {
        Run t{NEG_INF, 0.0f, KILN_ARGMAX_NONE, 0};
        if (lane < num_warps) t = Run{sm[lane], ss[lane], si[lane], sb[lane]};
        warp_merge(t);
        if (lane == 0) {
            ids[blockIdx.x] = t.i == KILN_ARGMAX_NONE ? 0u : t.i;
            // logits[argmax] - (max + log(sum)) == -log(sum); all -inf (or empty) rows: uniform.
            logprobs[blockIdx.x] = t.i != KILN_ARGMAX_NONE ? (t.bad ? __int_as_float(0x7fc00000) : -logf(t.s))
                                                            : -logf((float)(V > 0 ? V : 1));
        }
    }
}

#undef KILN_ARGMAX_NONE

}  // namespace argmax_detail

extern "C" __global__ void argmax_logprob_bf16(const bf16* __restrict__ logits, int V, unsigned int* __restrict__ ids,
                                               float* __restrict__ logprobs) {
    kiln_pdl_enter();
    argmax_detail::argmax_logprob(logits, V, ids, logprobs, (const unsigned*)nullptr);
}

extern "C" __global__ void argmax_logprob_f32(const float* __restrict__ logits, int V, unsigned int* __restrict__ ids,
                                              float* __restrict__ logprobs) {
    kiln_pdl_enter();
    argmax_detail::argmax_logprob(logits, V, ids, logprobs, (const unsigned*)nullptr);
}

// Constrained greedy sampling: row r takes only the ids whose bit is set in
// masks[r * words ...] (an output format's allowed tokens; all-ones words for a
// free row); the log-probability is over the allowed ids.
extern "C" __global__ void argmax_logprob_masked_bf16(const bf16* __restrict__ logits, int V,
                                                      unsigned int* __restrict__ ids, float* __restrict__ logprobs,
                                                      const unsigned* __restrict__ masks, int words) {
    kiln_pdl_enter();
    argmax_detail::argmax_logprob(logits, V, ids, logprobs, masks + (long long)blockIdx.x * words);
}
