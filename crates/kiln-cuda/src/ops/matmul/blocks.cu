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
//   qgemv_<fmt>_m{M}(x, norm_w, eps, off, nt, parts, out, residual, K, ldo, gated, act)
//     out[r * ldo + n] = sum_k x'[r, k] * W[n, k] (+ residual[r * ldo + n] when residual != 0),
//     r < M (1..8); x' = x, or rms_norm(x) * (off + norm_w) rounded to bf16 as add_rms_norm_bf16
//     with nt threads rounds it (rms_prologue.cuh) when norm_w != 0. W: up to three parts of this
//     format stacked by rows (Parts). gated != 0: out[., n] = act(x'.W[n]) * (x'.W[R + n]) over
//     R = half the rows (act 0 SiLU, 1 GELU tanh), as a packed gate/up product.
//     Every block stages x' in shared memory as exact integers (stage_x: each 32 elements X_e * 2^e
//     with |X| < 2^14, split into two signed bytes X = 256 a + c, so the integer products are
//     exact and only x' values below 2^-13 of their 32-element group's largest lose bits). Warp w
//     of the grid takes output rows w, w + 8 gridDim.x, ... (gated: each with its up row); lane l
//     units l, l + 32, ... of each, their loads running a ring of units ahead of the products
//     across rows (qgemv_ring); it sums each 16 or 32 elements' code . a and code . c with dp4a,
//     then s * 2^e * (256 sum_a + sum_c) + b * sum(x') in f32; the M sums (two for gated) are
//     reduced across the warp and rounded once at the store. Block 256 threads, any grid (the
//     host launches one wave: KILN_QGEMV_MIN_BLOCKS an SM); dynamic shared memory blocks.rs's
//     qgemv_smem(M, K); K % 256 == 0 for K-quants, % 128 for Q4_Z, % 32 otherwise; x, norm_w
//     16-byte aligned; out must not overlap x.
//   dequant_<fmt>_bf16(body, meta, ids, out, K, rows_out, row0, rows)
//     out[r, :] = W[ids ? ids[r] : row0 + r, :] as bf16 (fmaf(s, code, b) rounded once), r <
//     rows_out: a thread per unit (the rows of an embedding lookup, or a slab of rows for the
//     tensor-core GEMM of larger batches); `rows`, the part's rows, only fp8.cu's reads.
#include "common.cuh"
#include "rms_prologue.cuh"
#include "block_parts.cuh"
#include <cuda_fp16.h>

// Tuning knobs (KILN_KERNEL_DEFINES): registers of loaded weight bytes a lane keeps in flight
// (the ring's depth in units: this over a unit's words, 1..8; on an H100, 8B-shaped decode at
// 16 / 24 / 32 / 40 / 64 words: q4_k 353 / 348 / 350 / 346 / 333 tok/s, q8_0 257 / 262 / 262 /
// - / 248), and the resident blocks an SM the compiler must allow (register cap; the host
// launches that many blocks an SM, one wave; 3 measured 309 against 348 tok/s).
#ifndef KILN_QGEMV_RING_WORDS
#define KILN_QGEMV_RING_WORDS 32
#endif
#ifndef KILN_QGEMV_MIN_BLOCKS
#define KILN_QGEMV_MIN_BLOCKS 2
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

// A unit's bytes as loaded (32-bit words: NW of its body, NM of its meta), so that the loads of
// units ahead can be in flight while earlier ones are multiplied (the ring of qgemv_ring).
template <int F> struct RawN;
template <> struct RawN<Q8_0> { static constexpr int NW = 8, NM = 1; };
template <> struct RawN<Q4_0> { static constexpr int NW = 4, NM = 1; };
template <> struct RawN<Q4_1> { static constexpr int NW = 4, NM = 1; };
template <> struct RawN<Q5_0> { static constexpr int NW = 5, NM = 1; };
template <> struct RawN<Q5_1> { static constexpr int NW = 5, NM = 1; };
template <> struct RawN<IQ4NL> { static constexpr int NW = 4, NM = 1; };
template <> struct RawN<MXFP4> { static constexpr int NW = 4, NM = 1; };
template <> struct RawN<Q2K> { static constexpr int NW = 12, NM = 1; };
template <> struct RawN<Q3K> { static constexpr int NW = 16, NM = 4; };
template <> struct RawN<Q4K> { static constexpr int NW = 12, NM = 0; };
template <> struct RawN<Q5K> { static constexpr int NW = 20, NM = 0; };
template <> struct RawN<Q6K> { static constexpr int NW = 26, NM = 1; };
template <> struct RawN<Q4Z> { static constexpr int NW = 8, NM = 1; };
template <> struct RawN<Q4Z32> { static constexpr int NW = 4, NM = 1; };

template <int F>
struct Raw {
    unsigned w[RawN<F>::NW];
    unsigned m[RawN<F>::NM > 0 ? RawN<F>::NM : 1];
};

__device__ __forceinline__ unsigned ld2(const u8* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ float half_lo(unsigned w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float half_hi(unsigned w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }

// The bytes of unit u (of its block) that unit_codes reads.
template <int F>
__device__ __forceinline__ void raw_load(const u8* body, const u8* meta, int u, Raw<F>& r) {
    auto put16 = [&](int i, const u8* p) {
        const uint4 v = ld16(p);
        r.w[i] = v.x, r.w[i + 1] = v.y, r.w[i + 2] = v.z, r.w[i + 3] = v.w;
    };
    if (F == Q8_0) {
        put16(0, body), put16(4, body + 16);
        r.m[0] = ld2(meta);
    } else if (F == Q4_0 || F == IQ4NL) {
        put16(0, body);
        r.m[0] = ld2(meta);
    } else if (F == Q4_1 || F == Q4Z32) {
        put16(0, body);
        r.m[0] = ld4(meta);
    } else if (F == MXFP4) {
        put16(0, body);
        r.m[0] = __ldg(meta);
    } else if (F == Q5_0 || F == Q5_1) {
#pragma unroll
        for (int i = 0; i < 5; ++i) r.w[i] = ld4(body + 4 * i);
        r.m[0] = F == Q5_0 ? ld2(meta) : ld4(meta);
    } else if (F == Q2K) {
        put16(0, body), put16(4, body + 16 + 32 * u), put16(8, body + 32 + 32 * u);
        r.m[0] = ld4(meta);
    } else if (F == Q3K) {
        put16(0, body), put16(4, body + 16), put16(8, body + 32 + 32 * u), put16(12, body + 48 + 32 * u);
        // 14 meta bytes, only 2-byte aligned.
#pragma unroll
        for (int i = 0; i < 3; ++i) r.m[i] = ld2(meta + 4 * i) | (ld2(meta + 4 * i + 2) << 16);
        r.m[3] = ld2(meta + 12);
    } else if (F == Q4K) {
        put16(0, body), put16(4, body + 16 + 32 * u), put16(8, body + 32 + 32 * u);
    } else if (F == Q5K) {
        put16(0, body), put16(4, body + 16), put16(8, body + 32);
        put16(12, body + 48 + 32 * u), put16(16, body + 64 + 32 * u);
    } else if (F == Q6K) {
#pragma unroll
        for (int i = 0; i < 4; ++i) put16(4 * i, body + 64 * u + 16 * i);
        put16(16, body + 128 + 32 * u), put16(20, body + 144 + 32 * u);
        const uint2 sc = __ldg(reinterpret_cast<const uint2*>(body + 192 + 8 * u));
        r.w[24] = sc.x, r.w[25] = sc.y;
        r.m[0] = ld2(meta);
    } else {  // Q4Z
        put16(0, body + 32 * u), put16(4, body + 32 * u + 16);
        r.m[0] = ld4(meta);
    }
}

// Unit u of a block from its loaded bytes: codes q (element order, four a word), scales s and
// offsets b a 16 elements.
template <int F>
__device__ __forceinline__ void unit_codes(const Raw<F>& r, int u, int* q, float* s, float* b) {
    const unsigned* w = r.w;
    if (F == Q8_0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = w[i];
        s[0] = s[1] = half_lo(r.m[0]);
        b[0] = b[1] = 0.0f;
    } else if (F == Q4_0 || F == Q4_1 || F == IQ4NL || F == MXFP4 || F == Q4Z32) {
        // Byte j: element j (low nibble) and j + 16 (high nibble).
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
            const float d = half_lo(r.m[0]);
            s[0] = s[1] = d;
            b[0] = b[1] = -8.0f * d;
        } else if (F == Q4_1) {
            s[0] = s[1] = half_lo(r.m[0]);
            b[0] = b[1] = half_hi(r.m[0]);
        } else if (F == Q4Z32) {
            const float d = half_lo(r.m[0]);
            s[0] = s[1] = d;
            b[0] = b[1] = -d * (float)((r.m[0] >> 16) & 0x1F);
        } else {
            s[0] = s[1] = F == IQ4NL ? half_lo(r.m[0]) : e8m0_half(r.m[0] & 0xFFu);
            b[0] = b[1] = 0.0f;
        }
    } else if (F == Q4Z) {
        // Four runs of Q4_0's byte order; unit u: runs 2 u and 2 u + 1. Meta: d, then z.
#pragma unroll
        for (int g = 0; g < 2; ++g)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                q[8 * g + i] = w[4 * g + i] & KILN_LO4;
                q[8 * g + 4 + i] = (w[4 * g + i] >> 4) & KILN_LO4;
            }
        const float d = half_lo(r.m[0]), off = -d * (float)((r.m[0] >> 16) & 0x1F);
#pragma unroll
        for (int h = 0; h < 4; ++h) s[h] = d, b[h] = off;
    } else if (F == Q5_0 || F == Q5_1) {
        const unsigned qh = w[4];  // bit e: element e's fifth bit
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = (w[i] & KILN_LO4) | (spread4(qh >> (4 * i)) << 4);
            q[4 + i] = ((w[i] >> 4) & KILN_LO4) | (spread4(qh >> (16 + 4 * i)) << 4);
        }
        const float d = half_lo(r.m[0]);
        s[0] = s[1] = d;
        b[0] = b[1] = F == Q5_1 ? half_hi(r.m[0]) : -16.0f * d;
    } else if (F == Q2K || F == Q3K) {
        // Q2_K body: 16 scale bytes (4-bit scale, 4-bit min a 16-element sub-block), 64 quant
        // bytes; meta d, dmin. Q3_K body: hmask[32], 64 quant bytes; meta: 12 packed 6-bit
        // scales, d. Element 128 u + 32 t + l: bits 2 t of quant byte 32 u + l; Q3_K's third bit
        // is bit 4 u + t of hmask byte l (value q - 4 without it, so code q | bit << 2, offset -4).
        const unsigned* qw = w + (F == Q2K ? 4 : 8);
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned v = (qw[i] >> (2 * t)) & 0x03030303u;
                if (F == Q3K) v |= ((w[i] >> (4 * u + t)) & 0x01010101u) << 2;
                q[8 * t + i] = v;
            }
        if (F == Q2K) {
            const float d = half_lo(r.m[0]), dmin = half_hi(r.m[0]);
            const unsigned scw[2] = {u ? w[2] : w[0], u ? w[3] : w[1]};  // bytes 8 u .. 8 u + 7
#pragma unroll
            for (int h = 0; h < 8; ++h) {
                const unsigned v = (scw[h >> 2] >> (8 * (h & 3))) & 0xFFu;
                s[h] = d * (float)(v & 0xF);
                b[h] = -dmin * (float)(v >> 4);
            }
        } else {
            const float d = half_lo(r.m[3]);
#pragma unroll
            for (int h = 0; h < 8; ++h) {
                // Sub-block i = 8 u + h of 16: low 4 bits in byte h's nibble u, high 2 bits at
                // 2 (i >> 2) of byte 8 + (i & 3).
                const unsigned lo = ((r.m[h >> 2] >> (8 * (h & 3))) >> (4 * u)) & 0xF;
                const unsigned hi = ((r.m[2] >> (8 * (h & 3))) >> (2 * (2 * u + (h >> 2)))) & 3;
                s[h] = d * (float)((int)(lo | (hi << 4)) - 32);
                b[h] = -4.0f * s[h];
            }
        }
    } else if (F == Q4K || F == Q5K) {
        // d, dmin (f16 pair), 12 scale bytes, [Q5_K: 32 high-bit bytes], 128 quant bytes: unit u's
        // elements 64 u + l are the low nibbles of quant bytes 32 u + l, 64 u + 32 + l the high
        // ones (sub-blocks 2 u and 2 u + 1; Q5_K's fifth bits: bits 2 u, 2 u + 1 of byte l).
        const float d = half_lo(w[0]), dmin = half_hi(w[0]);
        const unsigned sc3[3] = {w[1], w[2], w[3]};
        const unsigned* qw = w + (F == Q5K ? 12 : 4);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = qw[i] & KILN_LO4;
            q[8 + i] = (qw[i] >> 4) & KILN_LO4;
            if (F == Q5K) {
                q[i] |= ((w[4 + i] >> (2 * u)) & 0x01010101u) << 4;
                q[8 + i] |= ((w[4 + i] >> (2 * u + 1)) & 0x01010101u) << 4;
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
        const unsigned* lw = w;
        const unsigned* hw = w + 16;
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                q[8 * t + i] = ((lw[8 * (t & 1) + i] >> (4 * (t >> 1))) & KILN_LO4) |
                               (((hw[i] >> (2 * t)) & 0x03030303u) << 4);
        const float d = half_lo(r.m[0]);
#pragma unroll
        for (int h = 0; h < 8; ++h) {
            const int v = (int)(signed char)((w[24 + (h >> 2)] >> (8 * (h & 3))) & 0xFFu);
            s[h] = d * (float)v;
            b[h] = -32.0f * s[h];
        }
    }
}

// Unit u of a block, loaded and decoded.
template <int F>
__device__ __forceinline__ void unit(const u8* body, const u8* meta, int u, int* q, float* s, float* b) {
    Raw<F> r;
    raw_load<F>(body, meta, u, r);
    unit_codes<F>(r, u, q, s, b);
}

using block_parts::part_of;
using block_parts::Parts;

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

// Loads in flight a lane: units of the ring (each G units, a gate and an up row's when gated),
// about KILN_QGEMV_RING_WORDS registers of loaded bytes (half that from 5 rows of x, whose sums
// need the registers), 1 to 8.
template <int F, int G, int M>
__host__ __device__ constexpr int ring_depth() {
    const int d = (KILN_QGEMV_RING_WORDS / (M > 4 ? 2 : 1)) / (G * (RawN<F>::NW + RawN<F>::NM));
    return d < 1 ? 1 : (d > 8 ? 8 : d);
}

// Where a warp's loads stand: its lane's unit slot k of output row `row` (unit lane + 32 k, the
// last unit where that is past the row), and that row's (and its up row's) part and local row.
template <int G>
struct Cursor {
    int k, row;
    const u8* body[G];
    const u8* meta[G];
    int local[G];
};

// The decode product. Warp w of the grid takes output rows w, w + W, ... (W the grid's warps);
// its lane l units l, l + 32, ... of each (`upl` slots a row). A warp's work is one sequence of
// (row, slot) items whose loads run D items ahead of the products through a ring of registers
// (across row boundaries, so a warp never waits for a row's first loads), the first D issued
// before waiting on the previous kernel, under the staging of x. At a row's last slot the warp
// reduces its sums and stores the row. gated: rows r (gate) and r + R (up) of the stacked parts
// (R = half their rows), out = act(gate) * up.
template <int F, int M, int G>
__device__ __forceinline__ void qgemv_ring(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                           float off, int nt, const Parts& parts, bf16* __restrict__ out,
                                           const bf16* __restrict__ residual, int K, int ldo, int act) {
    constexpr int D = ring_depth<F, G, M>();
    constexpr int UE = Fmt<F>::UE, UPB = Fmt<F>::BE / UE;
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31;
    const int rows_out = (parts.rows[0] + parts.rows[1] + parts.rows[2]) / G;
    const int warp = blockIdx.x * 8 + (threadIdx.x >> 5), warps = gridDim.x * 8;
    const int units = K / UE, upl = (units + 31) / 32, bpr = K / Fmt<F>::BE;
    const int items = warp < rows_out ? ((rows_out - 1 - warp) / warps + 1) * upl : 0;
    Cursor<G> lc;
    auto set_row = [&](int row) {
#pragma unroll
        for (int g = 0; g < G; ++g) part_of(parts, row + g * rows_out, lc.body[g], lc.meta[g], lc.local[g]);
    };
    auto load = [&](Raw<F>(&dst)[G]) {
        const int u = min(lane + 32 * lc.k, units - 1);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const long long blk = (long long)lc.local[g] * bpr + u / UPB;
            raw_load<F>(lc.body[g] + blk * Fmt<F>::BODY, lc.meta[g] + blk * Fmt<F>::META, u % UPB, dst[g]);
        }
        if (++lc.k == upl) {
            lc.k = 0;
            lc.row += warps;
            if (lc.row < rows_out) set_row(lc.row);
        }
    };
    Raw<F> ring[D][G];
    kiln_pdl_trigger();
    lc.k = 0, lc.row = warp;
    if (items > 0) set_row(warp);
#pragma unroll
    for (int j = 0; j < D; ++j)
        if (j < items) load(ring[j]);
    kiln_pdl_wait();
    const Staged xs = stage_x<M>(x, norm_w, eps, off, nt, K, reinterpret_cast<u8*>(smem));
    float acc[G][M];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[g][m] = 0.0f;
    int ck = 0, crow = warp;
    for (int t = 0; t < items; t += D) {
#pragma unroll
        for (int j = 0; j < D; ++j) {
            if (t + j < items) {
                const int u = lane + 32 * ck;
                // One unit's codes live at a time (a gate's, then its up row's), then the slot
                // is refilled.
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    Codes<F> cd;
                    unit_codes<F>(ring[j][g], min(u, units - 1) % UPB, cd.q, cd.s, cd.b);
                    if (u < units) dot_codes<F, M>(cd, u, xs, K, acc[g]);
                }
                if (t + j + D < items) load(ring[j]);
                if (++ck == upl) {
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float v = warp_sum(acc[0][m]);
                        if (G == 2) v = kiln_act(v, act) * warp_sum(acc[G - 1][m]);
                        if (lane == 0) {
                            const long long o = (long long)m * ldo + crow;
                            out[o] = to_bf16(residual ? v + to_f32(residual[o]) : v);
                        }
#pragma unroll
                        for (int g = 0; g < G; ++g) acc[g][m] = 0.0f;
                    }
                    ck = 0;
                    crow += warps;
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

#define KILN_QGEMV(name, F, M)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, KILN_QGEMV_MIN_BLOCKS) qgemv_##name##_m##M(       \
        const bf16* x, const bf16* norm_w, float eps, float off, int nt, blocks_detail::Parts parts,     \
        bf16* out, const bf16* residual, int K, int ldo, int gated, int act) {                          \
        if (gated)                                                                                      \
            blocks_detail::qgemv_ring<blocks_detail::F, M, 2>(x, norm_w, eps, off, nt, parts, out,      \
                                                             residual, K, ldo, act);                    \
        else                                                                                            \
            blocks_detail::qgemv_ring<blocks_detail::F, M, 1>(x, norm_w, eps, off, nt, parts, out,      \
                                                             residual, K, ldo, act);                    \
    }
#define KILN_BLOCK_FORMAT(name, F)                                                                      \
    KILN_QGEMV(name, F, 1)                                                                              \
    KILN_QGEMV(name, F, 2)                                                                              \
    KILN_QGEMV(name, F, 3)                                                                              \
    KILN_QGEMV(name, F, 4)                                                                              \
    KILN_QGEMV(name, F, 5)                                                                              \
    KILN_QGEMV(name, F, 6)                                                                              \
    KILN_QGEMV(name, F, 7)                                                                              \
    KILN_QGEMV(name, F, 8)                                                                              \
    extern "C" __global__ void dequant_##name##_bf16(const unsigned char* body, const unsigned char* meta, \
                                                     const unsigned* ids, bf16* out, int K,             \
                                                     long long rows_out, long long row0, long long) {   \
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
