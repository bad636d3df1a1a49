// Products with block-quantized weights kept on the device in their file's formats (GGUF's
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K … Q6_K, and Kiln's Q4_Z: AWQ/GPTQ int4 with
// zero points), dequantized in registers.
//
// Layout (blocks.rs repacks each GGUF matrix at upload, byte for byte, no bytes added): every
// block's bytes are split into a body (its quants, and for K-quants its scales) and a meta part
// (its f16 scale(s)/e8m0 exponent), stored as two arrays over all blocks of the matrix, block g =
// row * blocks_per_row + b: body at body + g * BODY, meta at meta + g * META. Bodies are 16 bytes
// or a multiple of 16 (so 128-bit loads), except Q5_0/Q5_1's 20 (quants, then the 4 high-bit
// bytes; 32-bit loads).
//
// Work unit: UE consecutive elements of a row whose codes come from one set of loads (a whole
// block for the 32-element formats; 64 of Q4_K/Q5_K's 256, whose quant bytes hold two 32-element
// chunks in their low and high nibbles; 128 of Q2_K/Q3_K/Q6_K's). unit<F>(body, meta, u, q, s, b)
// gives unit u's codes as small integers, four to a word in element order (q[i] = elements 4 i ..
// 4 i + 3 as signed bytes), and per 16 elements h a scale and an offset: w = s[h] * code + b[h].
//
//   qgemv_<fmt>_m{M}[_r{RW}](x, norm_w, eps, off, nt, parts, out, residual, K, ldo, gated, act)
//     out[r * ldo + n] = sum_k x'[r, k] * W[n, k] (+ residual[r * ldo + n] when residual != 0),
//     r < M (1..8); x' = x, or rms_norm(x) * (off + norm_w) rounded to bf16 as add_rms_norm_bf16
//     with nt threads rounds it (rms_prologue.cuh) when norm_w != 0. W: up to three parts of this
//     format stacked by rows (Parts). gated != 0: out[., n] = act(x'.W[n]) * (x'.W[R + n]) over
//     R = half the rows (act 0 SiLU, 1 GELU tanh), as a packed gate/up product.
//     Every block stages x' in shared memory as exact integers (stage_x: each 32 elements X_e * 2^e
//     with |X| < 2^14, split into two signed bytes X = 256 a + c, so the integer products are
//     exact and only x' values below 2^-13 of their 32-element group's largest lose bits), then
//     each warp takes RW consecutive output rows a pass (RW = 1, or 2 by the _r2 suffix, for M
//     <= 2; gated: RW / 2 gate rows and their up rows, so one), warp w of the grid rows w * RW, w * RW +
//     8 * RW * gridDim.x, ...; lane l takes units l, l + 32, ... and sums each 16 or 32 elements'
//     code . a and code . c with dp4a, then s * 2^e * (256 sum_a + sum_c) + b * sum(x') in f32; the M sums
//     (two for gated) are reduced across the warp and rounded once at the store. Block 256
//     threads; dynamic shared memory blocks.rs's qgemv_smem(M, K); K % 256 == 0 for K-quants,
//     % 32 otherwise; x, norm_w 16-byte aligned; out must not overlap x.
//   dequant_<fmt>_bf16(body, meta, ids, out, K, rows_out, row0)
//     out[r, :] = W[ids ? ids[r] : row0 + r, :] as bf16 (fmaf(s, code, b) rounded once), r <
//     rows_out: a thread per unit (the rows of an embedding lookup, or a slab of rows for the
//     tensor-core GEMM of larger batches).
#include "common.cuh"
#include "rms_prologue.cuh"
#include <cuda_fp16.h>

// Tuning knobs (KILN_KERNEL_DEFINES): units of a lane unrolled (their loads in flight together),
// the resident blocks an SM the compiler must allow (register cap), and whether a warp loads its
// first unit before x is staged.
#ifndef KILN_QGEMV_UNROLL
#define KILN_QGEMV_UNROLL 2
#endif
#ifndef KILN_QGEMV_MIN_BLOCKS
#define KILN_QGEMV_MIN_BLOCKS 2
#endif
#ifndef KILN_QGEMV_PRELOAD
#define KILN_QGEMV_PRELOAD 1
#endif

namespace blocks_detail {

enum Format { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4NL, MXFP4, Q2K, Q3K, Q4K, Q5K, Q6K, Q4Z, Q4Z32 };

// BE elements a block, BODY and META bytes, UE elements a unit, SUB elements a scale.
template <int F> struct Fmt;
template <> struct Fmt<Q8_0> { static constexpr int BE = 32, BODY = 32, META = 2, UE = 32, SUB = 32; };
template <> struct Fmt<Q4_0> { static constexpr int BE = 32, BODY = 16, META = 2, UE = 32, SUB = 32; };
template <> struct Fmt<Q4_1> { static constexpr int BE = 32, BODY = 16, META = 4, UE = 32, SUB = 32; };
template <> struct Fmt<Q5_0> { static constexpr int BE = 32, BODY = 20, META = 2, UE = 32, SUB = 32; };
template <> struct Fmt<Q5_1> { static constexpr int BE = 32, BODY = 20, META = 4, UE = 32, SUB = 32; };
template <> struct Fmt<IQ4NL> { static constexpr int BE = 32, BODY = 16, META = 2, UE = 32, SUB = 32; };
template <> struct Fmt<MXFP4> { static constexpr int BE = 32, BODY = 16, META = 1, UE = 32, SUB = 32; };
template <> struct Fmt<Q2K> { static constexpr int BE = 256, BODY = 80, META = 4, UE = 128, SUB = 16; };
template <> struct Fmt<Q3K> { static constexpr int BE = 256, BODY = 96, META = 14, UE = 128, SUB = 16; };
template <> struct Fmt<Q4K> { static constexpr int BE = 256, BODY = 144, META = 0, UE = 64, SUB = 32; };
template <> struct Fmt<Q5K> { static constexpr int BE = 256, BODY = 176, META = 0, UE = 64, SUB = 32; };
template <> struct Fmt<Q6K> { static constexpr int BE = 256, BODY = 208, META = 2, UE = 128, SUB = 16; };
template <> struct Fmt<Q4Z> { static constexpr int BE = 128, BODY = 64, META = 4, UE = 64, SUB = 32; };
template <> struct Fmt<Q4Z32> { static constexpr int BE = 32, BODY = 16, META = 4, UE = 32, SUB = 32; };

__constant__ __align__(16) signed char kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};
// e2m1 values doubled (the scale is halved to match), sign in bit 3.
__constant__ __align__(16) signed char kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

typedef unsigned char u8;

__device__ __forceinline__ float half_at(const u8* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ uint4 ld16(const u8* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ unsigned ld4(const u8* p) { return __ldg(reinterpret_cast<const unsigned*>(p)); }

// Half an e8m0 scale, 2^(e - 128), exactly (subnormal below e = 2), as GGML computes it.
__device__ __forceinline__ float e8m0_half(unsigned e) {
    return e < 2 ? __int_as_float(0x00200000 << e) : __int_as_float((e - 1) << 23);
}

// Byte i (0..11, known only at run time) of 3 words, by selects (no local-memory indexing).
__device__ __forceinline__ unsigned byte_dyn(const unsigned* s, int i) {
    const unsigned word = i < 4 ? s[0] : (i < 8 ? s[1] : s[2]);
    return (word >> (8 * (i & 3))) & 0xffu;
}

// The 6-bit scale and min of sub-block j from a K-quant's 12 scale bytes (s: 3 words).
__device__ __forceinline__ void scale_min_k4(int j, const unsigned* s, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(byte_dyn(s, j) & 63);
        mn = (float)(byte_dyn(s, j + 4) & 63);
    } else {
        sc = (float)((byte_dyn(s, j + 4) & 0xF) | ((byte_dyn(s, j - 4) >> 6) << 4));
        mn = (float)((byte_dyn(s, j + 4) >> 4) | ((byte_dyn(s, j) >> 6) << 4));
    }
}

#define KILN_LO4 0x0F0F0F0Fu
// Bits 0..3 of t to bit 0 of bytes 0..3.
__device__ __forceinline__ unsigned spread4(unsigned t) { return ((t & 0xFu) * 0x00204081u) & 0x01010101u; }

// Four nibbles (low bits of each byte of n) looked up in a 16-entry signed-byte table t (4 words).
__device__ __forceinline__ unsigned lut16(unsigned n, const unsigned* t) {
    const unsigned p = n | (n >> 4);
    const unsigned sel = ((p & 0xFFu) | ((p >> 8) & 0xFF00u)) & 0x7777u;
    const unsigned lo = __byte_perm(t[0], t[1], sel), hi = __byte_perm(t[2], t[3], sel);
    const unsigned m = ((n >> 3) & 0x01010101u) * 0xFFu;
    return (lo & ~m) | (hi & m);
}

// Unit u of a block: codes q (element order, four a word), scales s and offsets b a 16 elements.
template <int F>
__device__ __forceinline__ void unit(const u8* body, const u8* meta, int u, int* q, float* s, float* b) {
    if (F == Q8_0) {
        const uint4 a = ld16(body), c = ld16(body + 16);
        q[0] = a.x, q[1] = a.y, q[2] = a.z, q[3] = a.w, q[4] = c.x, q[5] = c.y, q[6] = c.z, q[7] = c.w;
        s[0] = s[1] = half_at(meta);
        b[0] = b[1] = 0.0f;
    } else if (F == Q4_0 || F == Q4_1 || F == IQ4NL || F == MXFP4 || F == Q4Z32) {
        // Byte j: element j (low nibble) and j + 16 (high nibble).
        const uint4 a = ld16(body);
        const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = w[i] & KILN_LO4;
            q[4 + i] = (w[i] >> 4) & KILN_LO4;
        }
        if (F == IQ4NL || F == MXFP4) {
            const unsigned* tab = reinterpret_cast<const unsigned*>(F == IQ4NL ? kIq4nl : kMxfp4);
            const unsigned t[4] = {tab[0], tab[1], tab[2], tab[3]};
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = lut16(q[i], t);
        }
        if (F == Q4_0) {
            const float d = half_at(meta);
            s[0] = s[1] = d;
            b[0] = b[1] = -8.0f * d;
        } else if (F == Q4_1) {
            s[0] = s[1] = half_at(meta);
            b[0] = b[1] = half_at(meta + 2);
        } else if (F == Q4Z32) {
            const float d = half_at(meta);
            s[0] = s[1] = d;
            b[0] = b[1] = -d * (float)(meta[2] & 0x1F);
        } else {
            s[0] = s[1] = F == IQ4NL ? half_at(meta) : e8m0_half(*meta);
            b[0] = b[1] = 0.0f;
        }
    } else if (F == Q4Z) {
        // Four runs of Q4_0's byte order; unit u: runs 2 u and 2 u + 1. Meta: d, then z.
        const uint4 a = ld16(body + 32 * u), c = ld16(body + 32 * u + 16);
        const unsigned w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                q[8 * r + i] = w[4 * r + i] & KILN_LO4;
                q[8 * r + 4 + i] = (w[4 * r + i] >> 4) & KILN_LO4;
            }
        const float d = half_at(meta), off = -d * (float)(meta[2] & 0x1F);
#pragma unroll
        for (int h = 0; h < 4; ++h) s[h] = d, b[h] = off;
    } else if (F == Q5_0 || F == Q5_1) {
        const unsigned w[4] = {ld4(body), ld4(body + 4), ld4(body + 8), ld4(body + 12)};
        const unsigned qh = ld4(body + 16);  // bit e: element e's fifth bit
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = (w[i] & KILN_LO4) | (spread4(qh >> (4 * i)) << 4);
            q[4 + i] = ((w[i] >> 4) & KILN_LO4) | (spread4(qh >> (16 + 4 * i)) << 4);
        }
        const float d = half_at(meta);
        s[0] = s[1] = d;
        b[0] = b[1] = F == Q5_1 ? half_at(meta + 2) : -16.0f * d;
    } else if (F == Q2K || F == Q3K) {
        // Q2_K body: 16 scale bytes (4-bit scale, 4-bit min a 16-element sub-block), 64 quant
        // bytes; meta d, dmin. Q3_K body: hmask[32], 64 quant bytes; meta: 12 packed 6-bit
        // scales, d. Element 128 u + 32 t + l: bits 2 t of quant byte 32 u + l; Q3_K's third bit
        // is bit 4 u + t of hmask byte l (value q - 4 without it, so code q | bit << 2, offset -4).
        const u8* qs = body + (F == Q2K ? 16 : 32) + 32 * u;
        const uint4 a = ld16(qs), c = ld16(qs + 16);
        const unsigned w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        unsigned hm[8];
        if (F == Q3K) {
            const uint4 e = ld16(body), f = ld16(body + 16);
            hm[0] = e.x, hm[1] = e.y, hm[2] = e.z, hm[3] = e.w, hm[4] = f.x, hm[5] = f.y, hm[6] = f.z, hm[7] = f.w;
        }
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned v = (w[i] >> (2 * t)) & 0x03030303u;
                if (F == Q3K) v |= ((hm[i] >> (4 * u + t)) & 0x01010101u) << 2;
                q[8 * t + i] = v;
            }
        if (F == Q2K) {
            const float d = half_at(meta), dmin = half_at(meta + 2);
            const uint4 sc = ld16(body);
            const unsigned scw[2] = {u ? sc.z : sc.x, u ? sc.w : sc.y};  // bytes 8 u .. 8 u + 7
#pragma unroll
            for (int h = 0; h < 8; ++h) {
                const unsigned v = (scw[h >> 2] >> (8 * (h & 3))) & 0xFFu;
                s[h] = d * (float)(v & 0xF);
                b[h] = -dmin * (float)(v >> 4);
            }
        } else {
            const float d = half_at(meta + 12);
#pragma unroll
            for (int h = 0; h < 8; ++h) {
                const int i = 8 * u + h;  // sub-block of 16
                const unsigned lo = i < 8 ? (meta[i] & 0xF) : (meta[i - 8] >> 4);
                const unsigned hi = (meta[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
                s[h] = d * (float)((int)(lo | (hi << 4)) - 32);
                b[h] = -4.0f * s[h];
            }
        }
    } else if (F == Q4K || F == Q5K) {
        // d, dmin (f16 pair), 12 scale bytes, [Q5_K: 32 high-bit bytes], 128 quant bytes: unit u's
        // elements 64 u + l are the low nibbles of quant bytes 32 u + l, 64 u + 32 + l the high
        // ones (sub-blocks 2 u and 2 u + 1; Q5_K's fifth bits: bits 2 u, 2 u + 1 of byte l).
        const uint4 hd = ld16(body);
        const float d = __half2float(__ushort_as_half((unsigned short)(hd.x & 0xffff)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(hd.x >> 16)));
        const unsigned sc3[3] = {hd.y, hd.z, hd.w};
        const u8* qs = body + (F == Q5K ? 48 : 16) + 32 * u;
        const uint4 a = ld16(qs), c = ld16(qs + 16);
        const unsigned w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        unsigned hb[8];
        if (F == Q5K) {
            const uint4 e = ld16(body + 16), f = ld16(body + 32);
            hb[0] = e.x, hb[1] = e.y, hb[2] = e.z, hb[3] = e.w, hb[4] = f.x, hb[5] = f.y, hb[6] = f.z, hb[7] = f.w;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = w[i] & KILN_LO4;
            q[8 + i] = (w[i] >> 4) & KILN_LO4;
            if (F == Q5K) {
                q[i] |= ((hb[i] >> (2 * u)) & 0x01010101u) << 4;
                q[8 + i] |= ((hb[i] >> (2 * u + 1)) & 0x01010101u) << 4;
            }
        }
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float sc, mn;
            scale_min_k4(2 * u + t, sc3, sc, mn);
            s[2 * t] = s[2 * t + 1] = d * sc;
            b[2 * t] = b[2 * t + 1] = -dmin * mn;
        }
    } else {  // Q6K: ql[128], qh[64], int8 scales[16]; d in meta.
        // Element 128 u + 32 t + l: nibble t / 2 of ql byte 64 u + 32 (t % 2) + l, bits 2 t of qh
        // byte 32 u + l above it; value code - 32.
        const u8* ql = body + 64 * u;
        const u8* qhp = body + 128 + 32 * u;
        const uint4 l0 = ld16(ql), l1 = ld16(ql + 16), l2 = ld16(ql + 32), l3 = ld16(ql + 48);
        const uint4 h0 = ld16(qhp), h1 = ld16(qhp + 16);
        const unsigned lw[16] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w,
                                 l2.x, l2.y, l2.z, l2.w, l3.x, l3.y, l3.z, l3.w};
        const unsigned hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                q[8 * t + i] = ((lw[8 * (t & 1) + i] >> (4 * (t >> 1))) & KILN_LO4) |
                               (((hw[i] >> (2 * t)) & 0x03030303u) << 4);
        const float d = half_at(meta);
        const uint2 scw = __ldg(reinterpret_cast<const uint2*>(body + 192 + 8 * u));
#pragma unroll
        for (int h = 0; h < 8; ++h) {
            const int v = (int)(signed char)(((h < 4 ? scw.x : scw.y) >> (8 * (h & 3))) & 0xFFu);
            s[h] = d * (float)v;
            b[h] = -32.0f * s[h];
        }
    }
}

__device__ __forceinline__ float act_fn(float g, int act) {
    if (act == 0) return g / (1.0f + __expf(-g));
    const float c = 0.7978845608f;
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

// Up to three parts of one format stacked by rows: row r's part, and its row there.
struct Parts {
    const u8* body[3];
    const u8* meta[3];
    int rows[3];
};

__device__ __forceinline__ void part_of(const Parts& p, int r, const u8*& body, const u8*& meta, int& local) {
    if (r < p.rows[0]) {
        body = p.body[0], meta = p.meta[0], local = r;
    } else if (r < p.rows[0] + p.rows[1]) {
        body = p.body[1], meta = p.meta[1], local = r - p.rows[0];
    } else {
        body = p.body[2], meta = p.meta[2], local = r - p.rows[0] - p.rows[1];
    }
}

// Staged x (dynamic shared memory, M rows; xrow(K) bytes a row and limb). Row m's limbs a and c
// (a byte an element, element order, 16-byte slot j of a row stored at slot(j) so that the 8
// lanes of a shared-memory phase, reading units of 2, 4 or 8 slots, hit distinct banks), then
// per 16 elements the sum of the represented values 2^e * sum X, per 32 the scale 2^e (both NaN
// where x' holds a NaN or an infinity), the norm's partial sums and inverse RMS.
__host__ __device__ constexpr int xrow(int K) { return (K + 127) / 128 * 128; }
__device__ __forceinline__ int slot(int j) { return j ^ ((j >> 3) & 7); }

struct Staged {
    u8* a;
    u8* c;
    float* scale;
    float* sum;
    int rs;
};

// One thread's 8 elements v (bf16, elements 8 j .. 8 j + 7 of row m) staged, with the 3 other
// threads of its 32-element group (adjacent lanes; every lane of the warp must call it).
__device__ __forceinline__ void stage8(uint4 v, bool active, int m, int j, int K, const Staged& xs) {
    float f[8];
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const float2 t = rms_prologue::bf2_to_f2(w[p]);
        f[2 * p] = active ? t.x : 0.0f;
        f[2 * p + 1] = active ? t.y : 0.0f;
    }
    int bad = 0;
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        bad |= !isfinite(f[p]);
        amax = fmaxf(amax, fabsf(f[p]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
    bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
    // 2^e with amax * 2^-e < 2^14 (e = E - 13, E = amax's exponent), e >= -126.
    const int e = max(((__float_as_int(amax) >> 23) & 0xff) - 127 - 13, -126);
    const float to_x = __int_as_float((127 - e) << 23), sc = __int_as_float((127 + e) << 23);
    unsigned wa[2] = {0u, 0u}, wc[2] = {0u, 0u};
    int total = 0;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const int X = bad ? 0 : __float2int_rn(f[p] * to_x);
        const int c = ((X + 128) & 255) - 128, a = (X - c) >> 8;
        total += X;
        wa[p >> 2] |= (unsigned)(a & 0xff) << (8 * (p & 3));
        wc[p >> 2] |= (unsigned)(c & 0xff) << (8 * (p & 3));
    }
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    if (active) {
        const int at = m * xs.rs + 16 * slot(j >> 1) + 8 * (j & 1);
        *reinterpret_cast<uint2*>(xs.a + at) = make_uint2(wa[0], wa[1]);
        *reinterpret_cast<uint2*>(xs.c + at) = make_uint2(wc[0], wc[1]);
        const float nan = __int_as_float(0x7fc00000);
        if ((j & 3) == 0) xs.scale[m * (K / 32) + j / 4] = bad ? nan : sc;
        if ((j & 1) == 0) xs.sum[m * (K / 16) + j / 2] = bad ? nan : sc * (float)total;
    }
}

template <int M>
__device__ __forceinline__ Staged stage_x(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                          float off, int nt, int K, u8* smem) {
    const int rs = xrow(K), e8n = K / 8, items = M * e8n;
    float* sum = reinterpret_cast<float*>(smem + 2 * M * rs);
    float* scale = sum + M * (K / 16);
    float* partial = scale + M * (K / 32);
    float* inv = partial + 32 * M;
    const Staged xs{smem, smem + M * rs, scale, sum, rs};
    if (norm_w) rms_prologue::inv_rms_rows<M>(x, K, eps, nt, partial, inv);
    // A thread 8 elements (so the 4 threads of a 32-element group are adjacent lanes), its loads
    // issued B items at a time so that their latencies overlap.
    constexpr int B = 4;
    for (int base = 0; base < items; base += B * blockDim.x) {
        uint4 xv[B], nv[B];
#pragma unroll
        for (int k = 0; k < B; ++k) {
            const int i = base + k * blockDim.x + threadIdx.x;
            if (i < items) {
                xv[k] = rms_prologue::ld_v4(x + (long long)(i / e8n) * K + 8 * (i % e8n));
                if (norm_w) nv[k] = rms_prologue::ld_v4(norm_w + 8 * (i % e8n));
            }
        }
#pragma unroll
        for (int k = 0; k < B; ++k) {
            const int i = base + k * blockDim.x + threadIdx.x;
            const bool active = i < items;
            const int m = active ? i / e8n : 0, j = active ? i % e8n : 0;
            uint4 v = xv[k];
            if (active && norm_w) v = rms_prologue::scale8(v, nv[k], inv[m], off);
            stage8(v, active, m, j, K, xs);
        }
    }
    __syncthreads();
    return xs;
}

// A unit's codes, scales and offsets (unit<F>'s outputs).
template <int F>
struct Codes {
    int q[Fmt<F>::UE / 4];
    float s[Fmt<F>::UE / 16], b[Fmt<F>::UE / 16];
};

// Unit u (of the row) of row `local` of a part.
template <int F>
__device__ __forceinline__ void load_codes(const u8* body, const u8* meta, int local, int u, int K, Codes<F>& c) {
    constexpr int UPB = Fmt<F>::BE / Fmt<F>::UE;
    const long long g = (long long)local * (K / Fmt<F>::BE) + u / UPB;
    unit<F>(body + g * Fmt<F>::BODY, meta + g * Fmt<F>::META, u % UPB, c.q, c.s, c.b);
}

// Unit u's products with the M staged rows, added to acc.
template <int F, int M>
__device__ __forceinline__ void dot_codes(const Codes<F>& cd, int u, const Staged& xs, int K, float* acc) {
    constexpr int NC = Fmt<F>::UE / 32;
    // Chunk by chunk, each for every row of x: a chunk's codes are dead after it.
#pragma unroll
    for (int t = 0; t < NC; ++t) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* xa = reinterpret_cast<const uint4*>(xs.a + m * xs.rs);
            const uint4* xc = reinterpret_cast<const uint4*>(xs.c + m * xs.rs);
            const int ch = u * NC + t;
            int dot[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 a = xa[slot(2 * ch + h)], c = xc[slot(2 * ch + h)];
                const int* q = cd.q + 8 * t + 4 * h;
                int ia = __dp4a(q[0], (int)a.x, 0), ic = __dp4a(q[0], (int)c.x, 0);
                ia = __dp4a(q[1], (int)a.y, ia), ic = __dp4a(q[1], (int)c.y, ic);
                ia = __dp4a(q[2], (int)a.z, ia), ic = __dp4a(q[2], (int)c.z, ic);
                ia = __dp4a(q[3], (int)a.w, ia), ic = __dp4a(q[3], (int)c.w, ic);
                dot[h] = ia * 256 + ic;
            }
            const float sc = xs.scale[m * (K / 32) + ch];
            const float2 sm = *reinterpret_cast<const float2*>(xs.sum + m * (K / 16) + 2 * ch);
            if (Fmt<F>::SUB == 32) {
                acc[m] += (cd.s[2 * t] * sc) * (float)(dot[0] + dot[1]) + cd.b[2 * t] * (sm.x + sm.y);
            } else {
                acc[m] += ((cd.s[2 * t] * sc) * (float)dot[0] + cd.b[2 * t] * sm.x) +
                          ((cd.s[2 * t + 1] * sc) * (float)dot[1] + cd.b[2 * t + 1] * sm.y);
            }
        }
    }
}

// NR weight rows (G groups of RW: RW rows, or RW gate rows then their RW up rows) summed into
// acc[i]: lane l takes units l, l + 32, ...; with use_pre, pre holds its first unit's codes
// (loaded before x was staged). Every row's unit is loaded before any is multiplied, so a lane
// has NR units' loads in flight. The loop is unrolled to about KILN_QGEMV_UNROLL * 64 elements
// a lane, over the rows of x and of W it serves (more rows keep more sums and codes live).
template <int F, int M, int NR>
__device__ __forceinline__ void rows_dot(const u8* const* body, const u8* const* meta, const int* local,
                                         const Staged& xs, int K, float (*acc)[M], const Codes<F> (&pre)[NR],
                                         bool use_pre) {
    constexpr int PER = KILN_QGEMV_UNROLL * 64 / Fmt<F>::UE / (M * NR);
    constexpr int UNROLL = PER > 0 ? PER : 1;
    const int units = K / Fmt<F>::UE;
    int u = threadIdx.x & 31;
    if (use_pre) {
#pragma unroll
        for (int i = 0; i < NR; ++i) dot_codes<F, M>(pre[i], u, xs, K, acc[i]);
        u += 32;
    }
#pragma unroll UNROLL
    for (; u < units; u += 32) {
        Codes<F> cd[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) load_codes<F>(body[i], meta[i], local[i], u, K, cd[i]);
#pragma unroll
        for (int i = 0; i < NR; ++i) dot_codes<F, M>(cd[i], u, xs, K, acc[i]);
    }
}

// The decode product. gated: rows r (gate) and r + R (up) of the stacked parts (R = half their
// rows) give out = act(gate) * up. A warp takes RW consecutive output rows a pass (their loads in
// flight together). Before waiting on the previous kernel each warp asks L2 for its first pass's
// rows and (where the held codes leave the staging its registers) loads their first units, so
// those loads overlap the staging of x; each pass asks L2 for the next pass's rows.
template <int F, int M, int G, int RW>
__device__ __forceinline__ void qgemv_rows(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                           float off, int nt, const Parts& parts, bf16* __restrict__ out,
                                           const bf16* __restrict__ residual, int K, int ldo, int act) {
    constexpr int NR = G * RW;
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31;
    const int total = parts.rows[0] + parts.rows[1] + parts.rows[2];
    const int rows_out = total / G;
    const int first = (blockIdx.x * 8 + (threadIdx.x >> 5)) * RW;
    const int stride = gridDim.x * 8 * RW;
    constexpr bool PRELOAD = KILN_QGEMV_PRELOAD && RW == 1 && Fmt<F>::UE * M * G <= 128;
    const bool preload = PRELOAD && first < rows_out && lane < K / Fmt<F>::UE;
    const u8* body[NR];
    const u8* meta[NR];
    int local[NR];
    Codes<F> pre[NR];
    // Row i of the pass at r: output row min(r + i % RW, rows_out - 1) (the excess is not stored),
    // plus rows_out for the up half.
    auto rows_at = [&](int r) {
#pragma unroll
        for (int i = 0; i < NR; ++i)
            part_of(parts, min(r + i % RW, rows_out - 1) + (i / RW) * rows_out, body[i], meta[i], local[i]);
    };
    kiln_pdl_trigger();
    if (preload) {
        rows_at(first);
#pragma unroll
        for (int i = 0; i < NR; ++i) load_codes<F>(body[i], meta[i], local[i], lane, K, pre[i]);
    }
    kiln_pdl_wait();
    const Staged xs = stage_x<M>(x, norm_w, eps, off, nt, K, reinterpret_cast<u8*>(smem));
    for (int r = first; r < rows_out; r += stride) {
        float acc[NR][M];
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[i][m] = 0.0f;
        rows_at(r);
        rows_dot<F, M, NR>(body, meta, local, xs, K, acc, pre, r == first && preload);
#pragma unroll
        for (int i = 0; i < RW; ++i) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float v = warp_sum(acc[i][m]);
                if (G == 2) v = act_fn(v, act) * warp_sum(acc[RW + i][m]);
                if (lane == 0 && r + i < rows_out) {
                    const long long o = (long long)m * ldo + r + i;
                    out[o] = to_bf16(residual ? v + to_f32(residual[o]) : v);
                }
            }
        }
    }
}

template <int F>
__device__ __forceinline__ void dequant(const u8* __restrict__ body, const u8* __restrict__ meta,
                                        const unsigned* __restrict__ ids, bf16* __restrict__ out, int K,
                                        long long rows_out, long long row0) {
    kiln_pdl_enter();
    constexpr int UE = Fmt<F>::UE, UPB = Fmt<F>::BE / UE;
    const int units = K / UE, nb = K / Fmt<F>::BE;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows_out * units;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / units;
        const int u = (int)(i % units);
        const long long src = ids ? (long long)ids[r] : row0 + r;
        const long long g = src * nb + u / UPB;
        int q[UE / 4];
        float s[UE / 16], b[UE / 16];
        unit<F>(body + g * Fmt<F>::BODY, meta + g * Fmt<F>::META, u % UPB, q, s, b);
        uint4* o = reinterpret_cast<uint4*>(out + r * K + UE * u);
#pragma unroll
        for (int j = 0; j < UE / 8; ++j) {
            unsigned w[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int e = 8 * j + 2 * p, h = e / 16;
                const int c0 = (int)(signed char)((q[e >> 2] >> (8 * (e & 3))) & 0xff);
                const int c1 = (int)(signed char)((q[e >> 2] >> (8 * ((e + 1) & 3))) & 0xff);
                const bf16 lo = to_bf16(fmaf(s[h], (float)c0, b[h]));
                const bf16 hi = to_bf16(fmaf(s[h], (float)c1, b[h]));
                w[p] = (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
            }
            o[j] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

}  // namespace blocks_detail

#define KILN_QGEMV_RW(name, F, M, RW, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(256, KILN_QGEMV_MIN_BLOCKS) qgemv_##name##_m##M##SUFFIX( \
        const bf16* x, const bf16* norm_w, float eps, float off, int nt, blocks_detail::Parts parts,     \
        bf16* out, const bf16* residual, int K, int ldo, int gated, int act) {                          \
        if (gated)                                                                                      \
            blocks_detail::qgemv_rows<blocks_detail::F, M, 2, (RW > 1 ? RW / 2 : 1)>(                   \
                x, norm_w, eps, off, nt, parts, out, residual, K, ldo, act);                            \
        else                                                                                            \
            blocks_detail::qgemv_rows<blocks_detail::F, M, 1, RW>(x, norm_w, eps, off, nt, parts, out,  \
                                                                 residual, K, ldo, act);                \
    }
#define KILN_QGEMV(name, F, M) KILN_QGEMV_RW(name, F, M, 1, )
#define KILN_BLOCK_FORMAT(name, F)                                                                      \
    KILN_QGEMV(name, F, 1)                                                                              \
    KILN_QGEMV_RW(name, F, 1, 2, _r2)                                                                   \
    KILN_QGEMV(name, F, 2)                                                                              \
    KILN_QGEMV_RW(name, F, 2, 2, _r2)                                                                   \
    KILN_QGEMV(name, F, 3)                                                                              \
    KILN_QGEMV(name, F, 4)                                                                              \
    KILN_QGEMV(name, F, 5)                                                                              \
    KILN_QGEMV(name, F, 6)                                                                              \
    KILN_QGEMV(name, F, 7)                                                                              \
    KILN_QGEMV(name, F, 8)                                                                              \
    extern "C" __global__ void dequant_##name##_bf16(const unsigned char* body, const unsigned char* meta, \
                                                     const unsigned* ids, bf16* out, int K,             \
                                                     long long rows_out, long long row0) {              \
        blocks_detail::dequant<blocks_detail::F>(body, meta, ids, out, K, rows_out, row0);             \
    }

// One format's kernels when KILN_BLOCK_FMT is its index in this list (kernels.rs compiles the
// formats as separate units, in parallel), every format's otherwise.
#ifndef KILN_BLOCK_FMT
#define KILN_BLOCK_FMT -1
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 0
KILN_BLOCK_FORMAT(q8_0, Q8_0)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 1
KILN_BLOCK_FORMAT(q4_0, Q4_0)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 2
KILN_BLOCK_FORMAT(q4_1, Q4_1)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 3
KILN_BLOCK_FORMAT(q5_0, Q5_0)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 4
KILN_BLOCK_FORMAT(q5_1, Q5_1)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 5
KILN_BLOCK_FORMAT(iq4_nl, IQ4NL)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 6
KILN_BLOCK_FORMAT(mxfp4, MXFP4)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 7
KILN_BLOCK_FORMAT(q2_k, Q2K)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 8
KILN_BLOCK_FORMAT(q3_k, Q3K)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 9
KILN_BLOCK_FORMAT(q4_k, Q4K)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 10
KILN_BLOCK_FORMAT(q5_k, Q5K)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 11
KILN_BLOCK_FORMAT(q6_k, Q6K)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 12
KILN_BLOCK_FORMAT(q4_z, Q4Z)
#endif
#if KILN_BLOCK_FMT < 0 || KILN_BLOCK_FMT == 13
KILN_BLOCK_FORMAT(q4_z32, Q4Z32)
#endif
