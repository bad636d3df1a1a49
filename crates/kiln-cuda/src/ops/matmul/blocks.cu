// Products with block-quantized weights kept on the device in their file's formats (GGUF's
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K … Q6_K), dequantized in registers.
//
// Layout (blocks.rs repacks each GGUF matrix at upload, byte for byte, no bytes added): every
// block's bytes are split into a body (its quants, and for K-quants its scales) and a meta part
// (its f16 scale(s)/e8m0 exponent), stored as two arrays over all blocks of the matrix, block g =
// row * blocks_per_row + b: body at body + g * BODY, meta at meta + g * META. Bodies are 16 bytes
// or a multiple of 16 (so 128-bit loads), except Q5_0/Q5_1's 20 (quants, then the 4 high-bit
// bytes; 32-bit loads).
//
// Work unit: a chunk of 32 consecutive elements of a row (a whole block for the 32-element
// formats, 1/8 of a 256-element K-quant super-block). codes<F>(body, meta, sub, cf, s, b) gives
// the chunk's weights as w = s[h] * cf + b[h] per 16-element half h (see "Codes" below).
//
//   qgemv_<fmt>_m{M}(x, norm_w, eps, off, nt, parts, out, residual, K, ldo, gated, act)
//     out[r * ldo + n] = sum_k x'[r, k] * W[n, k] (+ residual[r * ldo + n] when residual != 0),
//     r < M (1..8); x' = x, or rms_norm(x) * (off + norm_w) rounded to bf16 as add_rms_norm_bf16
//     with nt threads rounds it (rms_prologue.cuh) when norm_w != 0. W: up to three parts of this
//     format stacked by rows (Parts). gated != 0: out[., n] = act(x'.W[n]) * (x'.W[R + n]) over
//     R = half the rows (act 0 SiLU, 1 GELU tanh), as a packed gate/up product.
//     Every block stages x' in shared memory (stage_x), then its 8 warps take weight rows r, r +
//     8 * gridDim.x, ... (the host launches at most one wave); lane l takes chunks l, l + 32, ...
//     and keeps M sums (two for gated), reduced across the warp. f32 throughout, one rounding at
//     the store. Block 256 threads; dynamic shared memory M * (K * 2.25 + 132) bytes
//     (blocks.rs: qgemv_smem); K % 256 == 0 for K-quants, % 32 otherwise; x, norm_w 16-byte
//     aligned; out must not overlap x.
//   dequant_<fmt>_bf16(body, meta, ids, out, K, rows_out, row0)
//     out[r, :] = W[ids ? ids[r] : row0 + r, :] as bf16, r < rows_out: a thread per chunk (the
//     rows of an embedding lookup, or a slab of rows for the tensor-core GEMM of larger batches).
#include "common.cuh"
#include "rms_prologue.cuh"
#include <cuda_fp16.h>

// Tuning knobs (KILN_KERNEL_DEFINES): chunks of a lane unrolled (their loads in flight
// together), and the resident blocks an SM the compiler must allow (register cap).
#ifndef KILN_QGEMV_UNROLL
#define KILN_QGEMV_UNROLL 2
#endif
#ifndef KILN_QGEMV_MIN_BLOCKS
#define KILN_QGEMV_MIN_BLOCKS 2
#endif
#define KILN_QSTR(x) #x
#define KILN_QUNROLL(n) _Pragma(KILN_QSTR(unroll n))

namespace blocks_detail {

enum Format { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4NL, MXFP4, Q2K, Q3K, Q4K, Q5K, Q6K };

template <int F> struct Fmt;
template <> struct Fmt<Q8_0> { static constexpr int BE = 32, BODY = 32, META = 2; };
template <> struct Fmt<Q4_0> { static constexpr int BE = 32, BODY = 16, META = 2; };
template <> struct Fmt<Q4_1> { static constexpr int BE = 32, BODY = 16, META = 4; };
template <> struct Fmt<Q5_0> { static constexpr int BE = 32, BODY = 20, META = 2; };
template <> struct Fmt<Q5_1> { static constexpr int BE = 32, BODY = 20, META = 4; };
template <> struct Fmt<IQ4NL> { static constexpr int BE = 32, BODY = 16, META = 2; };
template <> struct Fmt<MXFP4> { static constexpr int BE = 32, BODY = 16, META = 1; };
template <> struct Fmt<Q2K> { static constexpr int BE = 256, BODY = 80, META = 4; };
template <> struct Fmt<Q3K> { static constexpr int BE = 256, BODY = 96, META = 14; };
template <> struct Fmt<Q4K> { static constexpr int BE = 256, BODY = 144, META = 0; };
template <> struct Fmt<Q5K> { static constexpr int BE = 256, BODY = 176, META = 0; };
template <> struct Fmt<Q6K> { static constexpr int BE = 256, BODY = 208, META = 2; };

__constant__ signed char kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// e2m1 values doubled (the scale is halved to match), sign in bit 3.
__constant__ signed char kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

typedef unsigned char u8;

__device__ __forceinline__ float half_at(const u8* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
__device__ __forceinline__ uint4 ld16(const u8* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ unsigned ld4(const u8* p) { return __ldg(reinterpret_cast<const unsigned*>(p)); }
__device__ __forceinline__ unsigned byte_of(const unsigned* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xffu; }

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

// ---------------------------------------------------------------------------------------------
// Codes. A chunk's 32 weights are w = s[h] * code + b[h] (h = 0 for its elements 0..15, 1 for
// 16..31), the codes produced without integer-to-float conversions: a small unsigned q is OR-ed
// into the mantissa of a power of two (bf16 128.0 = 0x4300, so 0x4300 | q is 128 + q for q < 128;
// f32 256.0 = 0x43800000 with q << 15 is 256 + q for q < 256), and the offset is folded into b.
// Codes come in the x-pair order: cf[4g + j] is element 4g + {0, 2, 1, 3}[j] of the chunk, so two
// bf16 codes of one 32-bit word (bytes 0 and 2 of a quant word, or 1 and 3) line up with the pair
// words x is staged in (the same order).
// ---------------------------------------------------------------------------------------------

#define KILN_MAGIC2 0x43004300u
__device__ __forceinline__ float lo_f(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// Codes of group g from quant word v: nibbles at shift sh (bytes 0, 2 -> a; 1, 3 -> b), extra
// high bits already at bit 4 / 20 of each.
__device__ __forceinline__ void nib_codes(unsigned v, int sh, unsigned xa, unsigned xb, float* cf) {
    const unsigned a = ((v >> sh) & 0x000F000Fu) | xa | KILN_MAGIC2;
    const unsigned b = ((v >> (sh + 8)) & 0x000F000Fu) | xb | KILN_MAGIC2;
    cf[0] = lo_f(a);
    cf[1] = hi_f(a);
    cf[2] = lo_f(b);
    cf[3] = hi_f(b);
}

// Table codes (IQ4_NL, MXFP4) of group g: element e's nibble, as the table's value.
__device__ __forceinline__ void table_codes(unsigned v, int sh, const signed char* table, float* cf) {
    cf[0] = (float)table[(v >> sh) & 0xF];
    cf[1] = (float)table[(v >> (sh + 16)) & 0xF];
    cf[2] = (float)table[(v >> (sh + 8)) & 0xF];
    cf[3] = (float)table[(v >> (sh + 24)) & 0xF];
}

template <int F>
__device__ __forceinline__ void codes(const u8* body, const u8* meta, int sub, float* cf, float* s, float* b) {
    if (F == Q8_0) {
        const uint4 a = ld16(body), c = ld16(body + 16);
        const unsigned q[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        const float d = half_at(meta);
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            const unsigned v = q[g] ^ 0x80808080u;  // byte + 128: 0..255
            cf[4 * g + 0] = __uint_as_float(((v << 15) & 0x7F8000u) | 0x43800000u);
            cf[4 * g + 1] = __uint_as_float(((v >> 1) & 0x7F8000u) | 0x43800000u);
            cf[4 * g + 2] = __uint_as_float(((v << 7) & 0x7F8000u) | 0x43800000u);
            cf[4 * g + 3] = __uint_as_float(((v >> 9) & 0x7F8000u) | 0x43800000u);
        }
        s[0] = s[1] = d;
        b[0] = b[1] = -384.0f * d;  // code 256 + (q + 128)
    } else if (F == Q4_0 || F == Q4_1 || F == IQ4NL || F == MXFP4) {
        // Byte j: element j (low nibble) and j + 16 (high nibble).
        const uint4 a = ld16(body);
        const unsigned q[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            if (F == IQ4NL) table_codes(q[g & 3], g < 4 ? 0 : 4, kIq4nl, cf + 4 * g);
            else if (F == MXFP4) table_codes(q[g & 3], g < 4 ? 0 : 4, kMxfp4, cf + 4 * g);
            else nib_codes(q[g & 3], g < 4 ? 0 : 4, 0u, 0u, cf + 4 * g);
        }
        if (F == Q4_0) {
            const float d = half_at(meta);
            s[0] = s[1] = d;
            b[0] = b[1] = -136.0f * d;
        } else if (F == Q4_1) {
            const float d = half_at(meta), m = half_at(meta + 2);
            s[0] = s[1] = d;
            b[0] = b[1] = m - 128.0f * d;
        } else {
            s[0] = s[1] = F == IQ4NL ? half_at(meta) : e8m0_half(*meta);
            b[0] = b[1] = 0.0f;
        }
    } else if (F == Q5_0 || F == Q5_1) {
        const unsigned q[4] = {ld4(body), ld4(body + 4), ld4(body + 8), ld4(body + 12)};
        const unsigned qh = ld4(body + 16);  // bit e: element e's fifth bit
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            const unsigned t = qh >> (4 * g);
            const unsigned xa = ((t << 4) & 0x10u) | ((t << 18) & 0x100000u);
            const unsigned xb = ((t << 3) & 0x10u) | ((t << 17) & 0x100000u);
            nib_codes(q[g & 3], g < 4 ? 0 : 4, xa, xb, cf + 4 * g);
        }
        const float d = half_at(meta);
        s[0] = s[1] = d;
        b[0] = b[1] = F == Q5_1 ? half_at(meta + 2) - 128.0f * d : -144.0f * d;
    } else if (F == Q2K || F == Q3K) {
        // Q2_K body: 16 scale bytes (4-bit scale, 4-bit min a 16-element sub-block), 64 quant
        // bytes; meta d, dmin. Q3_K body: hmask[32], 64 quant bytes; meta: 12 packed 6-bit scales,
        // d. Chunk sub: quant bytes 32 (sub / 4) .. + 31 at bit 2 (sub % 4); Q3_K's third bit is
        // bit sub of hmask byte l.
        const u8* qs = body + (F == Q2K ? 16 : 32) + 32 * (sub >> 2);
        const uint4 a = ld16(qs), c = ld16(qs + 16);
        const unsigned q[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        const int sh = 2 * (sub & 3);
        if (F == Q2K) {
#pragma unroll
            for (int g = 0; g < 8; ++g) {
                const unsigned ca = ((q[g] >> sh) & 0x00030003u) | KILN_MAGIC2;
                const unsigned cb = ((q[g] >> (sh + 8)) & 0x00030003u) | KILN_MAGIC2;
                cf[4 * g + 0] = lo_f(ca);
                cf[4 * g + 1] = hi_f(ca);
                cf[4 * g + 2] = lo_f(cb);
                cf[4 * g + 3] = hi_f(cb);
            }
            const float d = half_at(meta), dmin = half_at(meta + 2);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned sc = body[2 * sub + h];
                s[h] = d * (float)(sc & 0xF);
                b[h] = -128.0f * s[h] - dmin * (float)(sc >> 4);
            }
        } else {
            const uint4 e = ld16(body), f = ld16(body + 16);
            const unsigned hm[8] = {e.x, e.y, e.z, e.w, f.x, f.y, f.z, f.w};
#pragma unroll
            for (int g = 0; g < 8; ++g) {
                const unsigned ca = ((q[g] >> sh) & 0x00030003u) | (((hm[g] >> sub) & 0x00010001u) << 2) | KILN_MAGIC2;
                const unsigned cb =
                    ((q[g] >> (sh + 8)) & 0x00030003u) | (((hm[g] >> (sub + 8)) & 0x00010001u) << 2) | KILN_MAGIC2;
                cf[4 * g + 0] = lo_f(ca);
                cf[4 * g + 1] = hi_f(ca);
                cf[4 * g + 2] = lo_f(cb);
                cf[4 * g + 3] = hi_f(cb);
            }
            const float d = half_at(meta + 12);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 2 * sub + h;  // sub-block of 16
                const unsigned lo = i < 8 ? (meta[i] & 0xF) : (meta[i - 8] >> 4);
                const unsigned hi = (meta[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
                s[h] = d * (float)((int)(lo | (hi << 4)) - 32);
                b[h] = -132.0f * s[h];  // code 128 + (q + 4)
            }
        }
    } else if (F == Q4K || F == Q5K) {
        // d, dmin (f16 pair), 12 scale bytes, [Q5_K: 32 high-bit bytes], 128 quant bytes: chunk
        // sub = 2 g + hi takes the low (hi = 0) or high nibbles of quant bytes 32 g .. 32 g + 31.
        const unsigned dm = ld4(body);
        const float d = __half2float(__ushort_as_half((unsigned short)(dm & 0xffff)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dm >> 16)));
        const unsigned sc3[3] = {ld4(body + 4), ld4(body + 8), ld4(body + 12)};
        float sc, mn;
        scale_min_k4(sub, sc3, sc, mn);
        const float d1 = d * sc, m1 = dmin * mn;
        const int sh = 4 * (sub & 1);
        const u8* qs = body + (F == Q5K ? 48 : 16) + 32 * (sub >> 1);
        const uint4 a = ld16(qs), c = ld16(qs + 16);
        const unsigned q[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        if (F == Q4K) {
#pragma unroll
            for (int g = 0; g < 8; ++g) nib_codes(q[g], sh, 0u, 0u, cf + 4 * g);
        } else {
            const uint4 e = ld16(body + 16), f = ld16(body + 32);
            const unsigned h[8] = {e.x, e.y, e.z, e.w, f.x, f.y, f.z, f.w};  // bit sub of byte l
#pragma unroll
            for (int g = 0; g < 8; ++g)
                nib_codes(q[g], sh, ((h[g] >> sub) & 0x00010001u) << 4, ((h[g] >> (sub + 8)) & 0x00010001u) << 4,
                          cf + 4 * g);
        }
        s[0] = s[1] = d1;
        b[0] = b[1] = -128.0f * d1 - m1;
    } else {  // Q6K: ql[128], qh[64], int8 scales[16]; d in meta. Chunk sub = 4 hh + t.
        const int hh = sub >> 2, t = sub & 3;
        const u8* ql = body + 64 * hh + 32 * (t & 1);
        const u8* qhp = body + 128 + 32 * hh;
        const uint4 a = ld16(ql), c = ld16(ql + 16), e = ld16(qhp), f = ld16(qhp + 16);
        const unsigned q[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
        const unsigned h[8] = {e.x, e.y, e.z, e.w, f.x, f.y, f.z, f.w};
        const int ns = 4 * (t >> 1), hs = 2 * t;
#pragma unroll
        for (int g = 0; g < 8; ++g)
            nib_codes(q[g], ns, ((h[g] >> hs) & 0x00030003u) << 4, ((h[g] >> (hs + 8)) & 0x00030003u) << 4,
                      cf + 4 * g);
        const float d = half_at(meta);
        s[0] = d * (float)(signed char)body[192 + 8 * hh + 2 * t];
        s[1] = d * (float)(signed char)body[192 + 8 * hh + 2 * t + 1];
        b[0] = -160.0f * s[0];  // code 128 + (q + 32)
        b[1] = -160.0f * s[1];
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

// Dot of one chunk's codes with x row m's staged chunk c: the two halves' sums.
__device__ __forceinline__ void dot_chunk(const float* cf, const uint4* xc, int sw, float& h0, float& h1) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const uint4 p = xc[q ^ sw];
        float h = 0.0f;
        h = fmaf(cf[8 * q + 0], lo_f(p.x), h);
        h = fmaf(cf[8 * q + 1], hi_f(p.x), h);
        h = fmaf(cf[8 * q + 2], lo_f(p.y), h);
        h = fmaf(cf[8 * q + 3], hi_f(p.y), h);
        h = fmaf(cf[8 * q + 4], lo_f(p.z), h);
        h = fmaf(cf[8 * q + 5], hi_f(p.z), h);
        h = fmaf(cf[8 * q + 6], lo_f(p.w), h);
        h = fmaf(cf[8 * q + 7], hi_f(p.w), h);
        if (q < 2) h0 += h;
        else h1 += h;
    }
}

// Staged x (dynamic shared memory, M rows): the rows' bf16 values (normalized first when norm_w is
// given, rounded as the unfused norm rounds) as pair words — 16-byte slot s of a row holds elements
// 8 s .. 8 s + 7 as (0, 2), (1, 3), (4, 6), (5, 7) — slot 4 c + q of chunk c stored at
// 4 c + (q ^ ((c >> 1) & 3)) so that the 8 lanes of a shared-memory phase (chunks c .. c + 7)
// hit distinct banks; then each row's sums over 16 elements (xsum) for the codes' offsets.
template <int M>
__device__ __forceinline__ void stage_x(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                        float off, int nt, int K, uint4* xs, float* xsum, float* partial,
                                        float* inv) {
    const int slots = K / 8;
    if (norm_w) rms_prologue::inv_rms_rows<M>(x, K, eps, nt, partial, inv);
    for (int base = 0; base < M * slots; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool active = i < M * slots;
        const int m = active ? i / slots : 0, s = active ? i % slots : 0;
        float sum8 = 0.0f;
        if (active) {
            uint4 v = rms_prologue::ld_v4(x + (long long)m * K + 8 * s);
            if (norm_w) v = rms_prologue::scale8(v, rms_prologue::ld_v4(norm_w + 8 * s), inv[m], off);
            const uint4 p = make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632),
                                       __byte_perm(v.z, v.w, 0x5410), __byte_perm(v.z, v.w, 0x7632));
            const int c = s >> 2, q = s & 3;
            xs[m * slots + 4 * c + (q ^ ((c >> 1) & 3))] = p;
            sum8 = ((lo_f(v.x) + hi_f(v.x)) + (lo_f(v.y) + hi_f(v.y))) + ((lo_f(v.z) + hi_f(v.z)) + (lo_f(v.w) + hi_f(v.w)));
        }
        const float other = __shfl_xor_sync(0xffffffffu, sum8, 1);
        if (active && (s & 1) == 0) xsum[m * (K / 16) + s / 2] = sum8 + other;
    }
    __syncthreads();
}

// The decode product. gated: rows r (gate) and r + R (up) of the stacked parts (R = half their
// rows) give out = act(gate) * up.
template <int F, int M>
__device__ __forceinline__ void qgemv(const bf16* __restrict__ x, const bf16* __restrict__ norm_w, float eps,
                                      float off, int nt, const Parts& parts, bf16* __restrict__ out,
                                      const bf16* __restrict__ residual, int K, int ldo, int gated, int act) {
    extern __shared__ uint4 smem[];
    kiln_pdl_enter();
    const int slots = K / 8;
    uint4* xs = smem;
    float* xsum = reinterpret_cast<float*>(xs + M * slots);
    float* partial = xsum + M * (K / 16);
    float* inv = partial + 32 * M;
    stage_x<M>(x, norm_w, eps, off, nt, K, xs, xsum, partial, inv);
    constexpr int BE = Fmt<F>::BE, CPB = BE / 32;
    const int lane = threadIdx.x & 31, nb = K / BE, chunks = K / 32;
    const int total = parts.rows[0] + parts.rows[1] + parts.rows[2];
    const int rows_out = gated ? total / 2 : total;
    for (int r = blockIdx.x * 8 + (threadIdx.x >> 5); r < rows_out; r += gridDim.x * 8) {
        const u8 *gb, *gm, *ub = nullptr, *um = nullptr;
        int gl, ul = 0;
        part_of(parts, r, gb, gm, gl);
        if (gated) part_of(parts, r + rows_out, ub, um, ul);
        float acc[M], accu[M];
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = accu[m] = 0.0f;
        KILN_QUNROLL(KILN_QGEMV_UNROLL)
        for (int c = lane; c < chunks; c += 32) {
            const int sw = (c >> 1) & 3;
            float cf[32], s[2], b[2];
            const long long g = (long long)gl * nb + c / CPB;
            codes<F>(gb + g * Fmt<F>::BODY, gm + g * Fmt<F>::META, c % CPB, cf, s, b);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float h0 = 0.0f, h1 = 0.0f;
                dot_chunk(cf, xs + m * slots + 4 * c, sw, h0, h1);
                const float2 xm = *reinterpret_cast<const float2*>(xsum + m * (K / 16) + 2 * c);
                acc[m] += (s[0] * h0 + b[0] * xm.x) + (s[1] * h1 + b[1] * xm.y);
            }
            if (gated) {
                const long long gu = (long long)ul * nb + c / CPB;
                codes<F>(ub + gu * Fmt<F>::BODY, um + gu * Fmt<F>::META, c % CPB, cf, s, b);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float h0 = 0.0f, h1 = 0.0f;
                    dot_chunk(cf, xs + m * slots + 4 * c, sw, h0, h1);
                    const float2 xm = *reinterpret_cast<const float2*>(xsum + m * (K / 16) + 2 * c);
                    accu[m] += (s[0] * h0 + b[0] * xm.x) + (s[1] * h1 + b[1] * xm.y);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = warp_sum(acc[m]);
            if (gated) v = act_fn(v, act) * warp_sum(accu[m]);
            if (lane == 0) {
                const long long o = (long long)m * ldo + r;
                out[o] = to_bf16(residual ? v + to_f32(residual[o]) : v);
            }
        }
    }
}

template <int F>
__device__ __forceinline__ void dequant(const u8* __restrict__ body, const u8* __restrict__ meta,
                                        const unsigned* __restrict__ ids, bf16* __restrict__ out, int K,
                                        long long rows_out, long long row0) {
    kiln_pdl_enter();
    constexpr int BE = Fmt<F>::BE, CPB = BE / 32;
    const int chunks = K / 32, nb = K / BE;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows_out * chunks;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / chunks;
        const int c = (int)(i % chunks);
        const long long src = ids ? (long long)ids[r] : row0 + r;
        const long long g = src * nb + c / CPB;
        float cf[32], s[2], b[2];
        codes<F>(body + g * Fmt<F>::BODY, meta + g * Fmt<F>::META, c % CPB, cf, s, b);
        // Back to element order: cf[4 g + j] is element 4 g + {0, 2, 1, 3}[j].
        unsigned u[16];
#pragma unroll
        for (int grp = 0; grp < 8; ++grp) {
            const int h = grp < 4 ? 0 : 1;
            const bf16 e0 = to_bf16(fmaf(s[h], cf[4 * grp + 0], b[h]));
            const bf16 e2 = to_bf16(fmaf(s[h], cf[4 * grp + 1], b[h]));
            const bf16 e1 = to_bf16(fmaf(s[h], cf[4 * grp + 2], b[h]));
            const bf16 e3 = to_bf16(fmaf(s[h], cf[4 * grp + 3], b[h]));
            u[2 * grp] = (unsigned)__bfloat16_as_ushort(e0) | ((unsigned)__bfloat16_as_ushort(e1) << 16);
            u[2 * grp + 1] = (unsigned)__bfloat16_as_ushort(e2) | ((unsigned)__bfloat16_as_ushort(e3) << 16);
        }
        uint4* o = reinterpret_cast<uint4*>(out + r * K + 32 * c);
#pragma unroll
        for (int q = 0; q < 4; ++q) o[q] = make_uint4(u[4 * q], u[4 * q + 1], u[4 * q + 2], u[4 * q + 3]);
    }
}

}  // namespace blocks_detail

#define KILN_QGEMV(name, F, M)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, KILN_QGEMV_MIN_BLOCKS) qgemv_##name##_m##M(                             \
        const bf16* x, const bf16* norm_w, float eps, float off, int nt, blocks_detail::Parts parts,     \
        bf16* out, const bf16* residual, int K, int ldo, int gated, int act) {                          \
        blocks_detail::qgemv<blocks_detail::F, M>(x, norm_w, eps, off, nt, parts, out, residual, K, ldo, \
                                                  gated, act);                                          \
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
                                                     long long rows_out, long long row0) {              \
        blocks_detail::dequant<blocks_detail::F>(body, meta, ids, out, K, rows_out, row0);             \
    }

KILN_BLOCK_FORMAT(q8_0, Q8_0)
KILN_BLOCK_FORMAT(q4_0, Q4_0)
KILN_BLOCK_FORMAT(q4_1, Q4_1)
KILN_BLOCK_FORMAT(q5_0, Q5_0)
KILN_BLOCK_FORMAT(q5_1, Q5_1)
KILN_BLOCK_FORMAT(iq4_nl, IQ4NL)
KILN_BLOCK_FORMAT(mxfp4, MXFP4)
KILN_BLOCK_FORMAT(q2_k, Q2K)
KILN_BLOCK_FORMAT(q3_k, Q3K)
KILN_BLOCK_FORMAT(q4_k, Q4K)
KILN_BLOCK_FORMAT(q5_k, Q5K)
KILN_BLOCK_FORMAT(q6_k, Q6K)
