// Split-KV decode attention over the paged cache: CUDA cores, 16-byte vector loads, one CTA per
// (row, kv head, partition) serving the whole GQA group.
//
// Semantics match `paged_attention_bf16` (reference.cu): row r attends keys
// max(0, pos[r] + 1 - window) ..= pos[r] of its sequence (window <= 0: from 0),
// score = (q . k) * scale, then tanh(score / softcap) * softcap when softcap > 0,
// online softmax in f32, GQA head h -> kv head h / (heads / kv_heads).
//
// Common layout (all pointers are device pointers):
//   q:        row r, head h at q + r * q_stride + h * HEAD_DIM            (bf16)
//   k_cache, v_cache: [num_slots, kv_stride >= kv_heads * HEAD_DIM]   (bf16; the _fp8 entries E4M3,
//             kv_elem.cuh: 8-byte loads widened to the bf16 the bf16 entries read)
//   slot of key p of sequence s = tables[s * table_width + p / block_size] * block_size + p % block_size
//   pos[r]:     position of row r;  row_seq[r]: sequence (block-table row) of row r
//   out:      row r, head h at out + r * out_stride + h * HEAD_DIM          (bf16)
// Alignment assumptions: q, out, k_cache, v_cache 16-byte aligned; q_stride and
// out_stride multiples of 8 elements (true for packed qkv rows with HEAD_DIM >= 64).
//
// Entry points (each for HEAD_DIM 64, 128, 256: suffixes _hd64, _hd128, _hd256):
//
//   decode_attention_hdN(q, q_stride, k_cache, v_cache, pos, row_seq, tables, table_width,
//                        block_size, heads, kv_heads, kv_stride, scale, window, softcap, partition_size,
//                        part_out, part_ml, counters, out, out_stride, sinks)
//     sinks: null, or a sink logit a query head [heads] (bf16) that joins every softmax's
//       denominator (gpt-oss), as reference.cu's.
//     grid (rows, kv_heads, num_parts), block 128 threads, no dynamic shared memory
//     (static shared memory: (GB * 128 + KPI * GB * HD + 3 * GB + 128) * 4 bytes, GB = 4: < 19 KB).
//     num_parts == gridDim.z == 1: the whole range 0..=pos (window-limited) is processed,
//       partition_size is ignored, the normalized result goes to `out`;
//       part_out / part_ml are not touched (may be null).
//     num_parts > 1: the row's range [lo, hi) is split into num_parts partitions of
//       per = max(partition_size, ceil((hi - lo) / num_parts) rounded up to 16) keys;
//       partition z covers [lo + z * per, lo + (z + 1) * per) ∩ [lo, hi), so a grid recorded for
//       the longest context still spreads a short one over its blocks. It writes, for every head h of the group,
//         part_out[((row * heads + h) * num_parts + z) * HEAD_DIM + d] = sum_k exp(s_k - m) * v_k[d]
//           (UNNORMALIZED: not divided by l)
//         part_ml[((row * heads + h) * num_parts + z) * 2 + 0] = m  (running max of the scores)
//         part_ml[((row * heads + h) * num_parts + z) * 2 + 1] = l  (sum_k exp(s_k - m))
//       An empty partition writes only m = -inf, l = 0 (the reduce skips it).
//       counters != null (rows * kv_heads zeroed words, left zeroed): the last partition of each
//       (row, kv head) to finish combines them into `out` itself; counters == null: `out` is not
//       touched; run decode_attention_reduce_hdN afterwards.
//     Group size heads / kv_heads may be anything >= 1 (groups larger than KILN_DECODE_GB = 4
//     are processed in passes of 4 heads, re-reading K/V; measured on H200 for the 8B shape,
//     GB = 4 beats GB = 8 by ~2x through occupancy, 122 vs 191 registers).
//
//   decode_attention_vpre_hdN: the same, with each chunk's first
//     round of values loaded together with its keys (more registers; for split steps).
//
//   decode_attention_reduce_hdN(part_out, part_ml, heads, num_parts, out, out_stride)
//     grid (rows, heads), block 128 threads (any multiple of 32 works), no dynamic smem.
//
#include "common.cuh"
#include "kv_elem.cuh"

#define KILN_DECODE_THREADS 128
#ifndef KILN_DECODE_GB
#define KILN_DECODE_GB 4      // heads of a GQA group served per pass (registers: 8 * GB accumulators)
#endif
#define KILN_DECODE_CHUNK 128 // keys per chunk (== threads)
// 1: a chunk's first values are loaded together with its keys in every decode kernel. The
// *_vpre_* kernels always do it: the host launches them for split steps (few rows, short
// partitions), where on the H200 it gave +1.9 % at batch 1; with 64 rows (one partition of the
// whole context a block, more registers per thread) it cost 9 %.
#ifndef KILN_DECODE_VPRE
#define KILN_DECODE_VPRE 0
#endif
// Keys (and values) in flight a thread over an FP8 cache (a power of two, <= 8).
#ifndef KILN_DECODE_FP8_U
#define KILN_DECODE_FP8_U 4
#endif
// 1: the first chunk's slots are computed, and its keys and values asked of L2, before the PDL wait.
#ifndef KILN_DECODE_PREWAIT
#define KILN_DECODE_PREWAIT 1
#endif

__device__ __forceinline__ float bf16lo(unsigned int u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16hi(unsigned int u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
    float s = bf16lo(a.x) * bf16lo(b.x);
    s = fmaf(bf16hi(a.x), bf16hi(b.x), s);
    s = fmaf(bf16lo(a.y), bf16lo(b.y), s);
    s = fmaf(bf16hi(a.y), bf16hi(b.y), s);
    s = fmaf(bf16lo(a.z), bf16lo(b.z), s);
    s = fmaf(bf16hi(a.z), bf16hi(b.z), s);
    s = fmaf(bf16lo(a.w), bf16lo(b.w), s);
    s = fmaf(bf16hi(a.w), bf16hi(b.w), s);
    return s;
}

// ---------------------------------------------------------------------------------------
// Split-KV decode.
//
// Thread layout: LPK = HD / 8 lanes cover one K/V row with one 16-byte load each; the CTA
// covers KPI = 128 / LPK keys per step (16 / 8 / 4 for HD 64 / 128 / 256). Keys are
// processed in chunks of 128: (A) scores for all heads of the group -> shared memory,
// (B) per-head chunk max / exp / sum (online softmax state in shared memory),
// (C) P.V into per-thread accumulators acc[head][8], rescaled by the chunk correction.
// At the end the KPI key-subgroups are summed in a fixed order (deterministic).
// ---------------------------------------------------------------------------------------
// The last block of a (row, kv head) to finish combines the partitions of its heads (as
// decode_reduce_impl does, same order and math), so no second kernel runs. counters[row *
// kv_heads + kvh] counts finished partitions; the last block sets it back to zero.
template <int HD>
__device__ __forceinline__ void decode_combine_last(const float* part_out, const float* part_ml,
                                                    unsigned int* counters, int heads, int kv_heads, int active,
                                                    bf16* __restrict__ out, long long out_stride,
                                                    const bf16* __restrict__ sinks) {
    __shared__ int s_last;
    const int row = blockIdx.x, kvh = blockIdx.y, nparts = gridDim.z;
    __threadfence();  // this block's partials are visible before the count moves
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int* c = counters + (long long)row * kv_heads + kvh;
        const bool last = atomicAdd(c, 1u) == (unsigned)nparts - 1;
        if (last) *c = 0u;  // every partition is in: nobody touches it again this launch
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // Partitions >= active are empty (m = -inf) and would be skipped. Each thread combines 4
    // consecutive dims of one head; the loads of all partitions are independent, in flight together.
    const int G = heads / kv_heads;
    for (int idx = threadIdx.x * 4; idx < G * HD; idx += blockDim.x * 4) {
        const int h = kvh * G + idx / HD, d = idx % HD;
        const long long base = ((long long)row * heads + h) * nparts;
        float M = NEG_INF;
#pragma unroll 8
        for (int zz = 0; zz < active; ++zz) M = fmaxf(M, __ldcg(part_ml + (base + zz) * 2));
        float L = 0.0f, a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll 4
        for (int zz = 0; zz < active; ++zz) {
            const float m = __ldcg(part_ml + (base + zz) * 2), l = __ldcg(part_ml + (base + zz) * 2 + 1);
            const float4 o = __ldcg(reinterpret_cast<const float4*>(part_out + (base + zz) * HD + d));
            if (m != NEG_INF) {
                const float e = __expf(m - M);
                L += e * l;
                a0 += e * o.x;
                a1 += e * o.y;
                a2 += e * o.z;
                a3 += e * o.w;
            }
        }
        if (sinks) L += __expf(to_f32(sinks[h]) - M);
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        bf16* op = out + (long long)row * out_stride + (long long)h * HD + d;
        op[0] = to_bf16(a0 * inv);
        op[1] = to_bf16(a1 * inv);
        op[2] = to_bf16(a2 * inv);
        op[3] = to_bf16(a3 * inv);
    }
}

template <int HD, bool VPRE, typename KV>
__device__ __forceinline__ void decode_impl(const bf16* __restrict__ q, long long q_stride,
                                            const KV* k_cache, const KV* v_cache,
                                            const unsigned int* __restrict__ pos,
                                            const unsigned int* __restrict__ row_seq,
                                            const unsigned int* __restrict__ tables, int table_width,
                                            int block_size, int heads, int kv_heads, int kv_stride, float scale,
                                            int window, float softcap, int partition_size, float* __restrict__ part_out,
                                            float* __restrict__ part_ml, unsigned int* __restrict__ counters,
                                            bf16* __restrict__ out, long long out_stride,
                                            const bf16* __restrict__ sinks) {
    constexpr int LPK = HD / 8;
    constexpr int KPI = KILN_DECODE_THREADS / LPK;
    constexpr int GB = KILN_DECODE_GB;
    constexpr int CH = KILN_DECODE_CHUNK;
    // Keys in flight per thread: an E4M3 key is half a bf16 key's bytes, so its loads are 8
    // bytes a lane; KILN_DECODE_FP8_U puts more of them in flight (4, the bf16 kernel's, by
    // default: an FP8 cache measured 0.81x a bf16 cache's decode at a 32k context on an H100
    // with it).
    constexpr int U = sizeof(KV) == 1 ? KILN_DECODE_FP8_U : 4;
    static_assert(LPK <= 32 && LPK >= GB, "head dim");

    __shared__ float s_p[GB][CH];
    __shared__ __align__(16) float s_o[KPI][GB][HD];  // per key-subgroup sums, added in a fixed order
    __shared__ float s_m[GB], s_l[GB], s_corr[GB];
    __shared__ unsigned int s_slot[CH];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = tid / LPK, ln = tid % LPK;
    const int row = blockIdx.x, kvh = blockIdx.y, z = blockIdx.z, nparts = gridDim.z;
    const int G = heads / kv_heads;
    const int p = (int)pos[row];
    const unsigned int* table = tables + (long long)row_seq[row] * table_width;
    int lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
    int hi = p + 1;
    int active = 1;  // partitions holding keys
    if (nparts > 1) {
        // The row's own keys split evenly (in multiples of 16, at least
        // partition_size each): the grid is fixed for a recorded step, the
        // context is not.
        const int per = max(partition_size, ((hi - lo + nparts - 1) / nparts + 15) & ~15);
        active = (hi - lo + per - 1) / per;
        lo += z * per;
        hi = min(hi, lo + per);
    }
    const long long kv_row = kv_stride;  // a slot's row: the pool's, maybe wider than kv_heads * HD

    // Before waiting for the previous kernel (programmatic dependent launch): the first chunk's
    // slots (positions and block tables come from host copies, never from a kernel) and an L2
    // prefetch of its key and value rows (a prefetch returns nothing, so the row the previous
    // kernel may still be writing is read again after the wait).
    const KV* kbase = k_cache + (long long)kvh * HD + ln * 8;
    const KV* vbase = v_cache + (long long)kvh * HD + ln * 8;
    if (KILN_DECODE_PREWAIT && lo < hi && tid < CH) {
        const int cn = min(CH, hi - lo);
        unsigned int slot = 0;
        if (tid < cn) {
            const int key = lo + tid;
            slot = table[key / block_size] * (unsigned int)block_size + (unsigned int)(key % block_size);
            const long long off = (long long)slot * kv_row + (long long)kvh * HD;
#pragma unroll
            for (int b = 0; b < HD * (int)sizeof(KV); b += 128) {
                kiln_prefetch_l2(reinterpret_cast<const char*>(k_cache + off) + b);
                kiln_prefetch_l2(reinterpret_cast<const char*>(v_cache + off) + b);
            }
        }
        s_slot[tid] = slot;
    }
    kiln_pdl_wait();

    if (lo >= hi) {  // empty partition (only when nparts > 1): the reduce skips m = -inf
        for (int g = tid; g < G; g += blockDim.x) {
            const long long pi = ((long long)row * heads + kvh * G + g) * nparts + z;
            part_ml[pi * 2 + 0] = NEG_INF;
            part_ml[pi * 2 + 1] = 0.0f;
        }
        if (counters != nullptr) decode_combine_last<HD>(part_out, part_ml, counters, heads, kv_heads, active, out, out_stride, sinks);
        return;
    }

    for (int hb = 0; hb < G; hb += GB) {
        const int gn = min(GB, G - hb);
        uint4 qr[GB];
#pragma unroll
        for (int g = 0; g < GB; ++g) {
            if (g < gn) {
                const bf16* qp = q + (long long)row * q_stride + (long long)(kvh * G + hb + g) * HD + ln * 8;
                qr[g] = *reinterpret_cast<const uint4*>(qp);
            } else {
                qr[g] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float acc[GB][8];
#pragma unroll
        for (int g = 0; g < GB; ++g)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
        if (tid < GB) {
            s_m[tid] = NEG_INF;
            s_l[tid] = 0.0f;
        }

        for (int c0 = lo; c0 < hi; c0 += CH) {
            const int cn = min(CH, hi - c0);
            if (tid < CH && !(KILN_DECODE_PREWAIT && c0 == lo && hb == 0)) {  // else filled before the wait
                unsigned int slot = 0;
                if (tid < cn) {
                    const int key = c0 + tid;
                    slot = table[key / block_size] * (unsigned int)block_size + (unsigned int)(key % block_size);
                }
                s_slot[tid] = slot;
            }
            __syncthreads();

            // The first round of values, in flight together with the keys.
            uint4 v0[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = u * KPI + sub;
                v0[u] = (VPRE || KILN_DECODE_VPRE) && k < cn
                            ? kv_elem::load8(vbase + (long long)s_slot[k] * kv_row)
                            : make_uint4(0u, 0u, 0u, 0u);
            }

            // (A) scores
            for (int k0 = 0; k0 < cn; k0 += KPI * U) {
                uint4 kv[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int k = k0 + u * KPI + sub;
                    if (k < cn)
                        kv[u] = kv_elem::load8(kbase + (long long)s_slot[k] * kv_row);
                    else
                        kv[u] = make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (k0 + u * KPI >= cn) break;  // uniform across the CTA
                    const int k = k0 + u * KPI + sub;
                    float d[GB];
#pragma unroll
                    for (int g = 0; g < GB; ++g) d[g] = (g < gn) ? dot8(qr[g], kv[u]) : 0.0f;
#pragma unroll
                    for (int off = LPK / 2; off > 0; off >>= 1)
#pragma unroll
                        for (int g = 0; g < GB; ++g) d[g] += __shfl_xor_sync(0xffffffffu, d[g], off);
                    if (k < cn) {
#pragma unroll
                        for (int g = 0; g < GB; ++g) {
                            if (g == ln && g < gn) {
                                float s = d[g] * scale;
                                if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
                                s_p[g][k] = s;
                            }
                        }
                    }
                }
            }
            __syncthreads();

            // (B) online softmax per head: warp w serves heads w, w + 4
            for (int g = warp; g < gn; g += KILN_DECODE_THREADS / 32) {
                float mx = NEG_INF;
                for (int k = lane; k < cn; k += 32) mx = fmaxf(mx, s_p[g][k]);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                const float m_old = s_m[g];
                const float m_new = fmaxf(m_old, mx);  // finite: the chunk has >= 1 valid key
                float sum = 0.0f;
                for (int k = lane; k < cn; k += 32) {
                    const float e = __expf(s_p[g][k] - m_new);
                    s_p[g][k] = e;
                    sum += e;
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    const float corr = __expf(m_old - m_new);  // m_old = -inf -> 0
                    s_corr[g] = corr;
                    s_l[g] = s_l[g] * corr + sum;
                    s_m[g] = m_new;
                }
            }
            __syncthreads();

            // (C) P.V
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                if (g < gn) {
                    const float corr = s_corr[g];
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] *= corr;
                }
            }
            for (int k0 = 0; k0 < cn; k0 += KPI * U) {
                uint4 vv[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int k = k0 + u * KPI + sub;
                    if ((VPRE || KILN_DECODE_VPRE) && k0 == 0)
                        vv[u] = v0[u];
                    else if (k < cn)
                        vv[u] = kv_elem::load8(vbase + (long long)s_slot[k] * kv_row);
                    else
                        vv[u] = make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int k = k0 + u * KPI + sub;
                    if (k < cn) {
                        float v[8];
                        v[0] = bf16lo(vv[u].x); v[1] = bf16hi(vv[u].x);
                        v[2] = bf16lo(vv[u].y); v[3] = bf16hi(vv[u].y);
                        v[4] = bf16lo(vv[u].z); v[5] = bf16hi(vv[u].z);
                        v[6] = bf16lo(vv[u].w); v[7] = bf16hi(vv[u].w);
#pragma unroll
                        for (int g = 0; g < GB; ++g) {
                            if (g < gn) {
                                const float pr = s_p[g][k];
#pragma unroll
                                for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(pr, v[i], acc[g][i]);
                            }
                        }
                    }
                }
            }
            __syncthreads();  // s_slot / s_p are rewritten by the next chunk
        }

        // Sum the KPI key-subgroups in a fixed order.
#pragma unroll
        for (int g = 0; g < GB; ++g) {
            if (g < gn) {
#pragma unroll
                for (int i = 0; i < 8; ++i) s_o[sub][g][ln * 8 + i] = acc[g][i];
            }
        }
        __syncthreads();

        for (int idx = tid; idx < gn * HD; idx += blockDim.x) {
            const int g = idx / HD, d = idx % HD;
            const int h = kvh * G + hb + g;
            float o = s_o[0][g][d];
#pragma unroll
            for (int s = 1; s < KPI; ++s) o += s_o[s][g][d];
            if (nparts == 1) {
                const float sink = sinks ? __expf(to_f32(sinks[h]) - s_m[g]) : 0.0f;
                out[(long long)row * out_stride + (long long)h * HD + d] = to_bf16(o / (s_l[g] + sink));
            } else {
                const long long pi = ((long long)row * heads + h) * nparts + z;
                part_out[pi * HD + d] = o;
                if (d == 0) {
                    part_ml[pi * 2 + 0] = s_m[g];
                    part_ml[pi * 2 + 1] = s_l[g];
                }
            }
        }
        __syncthreads();  // s_o / s_m / s_l are reused by the next pass
    }
    if (nparts > 1 && counters != nullptr) decode_combine_last<HD>(part_out, part_ml, counters, heads, kv_heads, active, out, out_stride, sinks);
}

// Combine the partitions of decode_impl: out = sum_z exp(m_z - M) o_z / sum_z exp(m_z - M) l_z.
template <int HD>
__device__ __forceinline__ void decode_reduce_impl(const float* __restrict__ part_out,
                                                   const float* __restrict__ part_ml, int heads, int num_parts,
                                                   bf16* __restrict__ out, long long out_stride,
                                                   const bf16* __restrict__ sinks) {
    const int row = blockIdx.x, h = blockIdx.y;
    const long long base = ((long long)row * heads + h) * num_parts;
    float M = NEG_INF;
    for (int zz = 0; zz < num_parts; ++zz) M = fmaxf(M, part_ml[(base + zz) * 2]);
    float L = 0.0f;
    for (int zz = 0; zz < num_parts; ++zz) {
        const float m = part_ml[(base + zz) * 2];
        if (m != NEG_INF) L += __expf(m - M) * part_ml[(base + zz) * 2 + 1];
    }
    if (sinks) L += __expf(to_f32(sinks[h]) - M);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.0f;
        for (int zz = 0; zz < num_parts; ++zz) {
            const float m = part_ml[(base + zz) * 2];
            if (m != NEG_INF) a += __expf(m - M) * part_out[(base + zz) * HD + d];
        }
        out[(long long)row * out_stride + (long long)h * HD + d] = to_bf16(a * inv);
    }
}

// ---------------------------------------------------------------------------------------
// Flash prefill: tensor cores via mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32.
// Fragment layouts (groupID g = lane >> 2, t4 = lane & 3):
//   A (16x16, row-major) regs: {a[g][2t4..+1]}, {a[g+8][2t4..]}, {a[g][2t4+8..]}, {a[g+8][2t4+8..]}
//   B (16x8, k x n)      regs: {b[2t4..+1][g]}, {b[2t4+8..+9][g]}
//   C (16x8 f32): c0,c1 = c[g][2t4..+1], c2,c3 = c[g+8][2t4..+1]
//
// CTA = one tile of <= KILN_FA_TILE_ROWS (128) query rows x one head, 4 warps.
//   HD 64 / 128: each warp owns 32 rows (two m16 tiles), so every K/V fragment read from
//     shared memory feeds two MMAs (halves the shared-memory traffic per flop).
//   HD 256: each warp owns 16 rows; the tile is processed in two passes of 64 rows
//     (register budget: the 16 x 256 f32 accumulator alone is 128 registers per thread).
// Keys are processed in chunks of 64 with K/V double-buffered through cp.async: the chunk
// j + 1 is in flight while chunk j is computed (one __syncthreads per chunk). The cache
// slots of a chunk are computed once (64 threads, one block-table lookup each) two chunks
// ahead into shared memory. A warp skips the chunks that are fully masked for all its rows
// (causal diagonal, sliding window) and masks only the chunks that need it. Softmax uses
// exp2 with log2(e) folded into the score multiplier.
// Shared memory (bf16, row stride HD + 8 elements so ldmatrix rows hit distinct banks):
//   Qs[128][HD+8], Ks[2][64][HD+8], Vs[2][64][HD+8], slots[2][64] (u32)
//   SMEM_BYTES(hd) = 2 * (128 + 4 * 64) * (hd + 8) + 512 = 768 * (hd + 8) + 512
// ---------------------------------------------------------------------------------------

// Decode entries: with and without the values' first round loaded with the keys.
#define KILN_DECODE_ENTRIES(HD, SUFFIX, VPRE, KV)                                                                \
    extern "C" __global__ void __launch_bounds__(128) decode_attention##SUFFIX##_hd##HD(                         \
        const bf16* __restrict__ q, long long q_stride, const KV* __restrict__ k_cache,                          \
        const KV* __restrict__ v_cache, const unsigned int* __restrict__ pos,                                    \
        const unsigned int* __restrict__ row_seq, const unsigned int* __restrict__ tables, int table_width,      \
        int block_size, int heads, int kv_heads, int kv_stride, float scale, int window, float softcap,          \
        int partition_size,                                                                                      \
        float* __restrict__ part_out, float* __restrict__ part_ml, unsigned int* __restrict__ counters,          \
        bf16* __restrict__ out, long long out_stride, const bf16* __restrict__ sinks) {                          \
        kiln_pdl_trigger(); /* decode_impl waits for the previous kernel */                                      \
        decode_impl<HD, VPRE, KV>(q, q_stride, k_cache, v_cache, pos, row_seq, tables, table_width, block_size,  \
                                  heads, kv_heads, kv_stride, scale, window, softcap, partition_size, part_out,  \
                                  part_ml,                                                                       \
                                  counters, out, out_stride, sinks);                                             \
    }

#define KILN_DECODE_ALL(HD)                                                                                             \
    KILN_DECODE_ENTRIES(HD, , false, bf16)                                                                       \
    KILN_DECODE_ENTRIES(HD, _vpre, true, bf16)                                                                   \
    KILN_DECODE_ENTRIES(HD, _fp8, false, kv8)                                                                    \
    KILN_DECODE_ENTRIES(HD, _vpre_fp8, true, kv8)                                                                \
    extern "C" __global__ void decode_attention_reduce_hd##HD(const float* __restrict__ part_out,                \
                                                              const float* __restrict__ part_ml, int heads,      \
                                                              int num_parts, bf16* __restrict__ out,             \
                                                              long long out_stride,                              \
                                                              const bf16* __restrict__ sinks) {                  \
        kiln_pdl_enter();                                                                                        \
        decode_reduce_impl<HD>(part_out, part_ml, heads, num_parts, out, out_stride, sinks);                     \
    }

KILN_DECODE_ALL(64)
KILN_DECODE_ALL(128)
KILN_DECODE_ALL(256)
