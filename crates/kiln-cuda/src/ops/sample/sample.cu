// Sampling on the GPU: bias, penalties, masks, temperature, top-k, top-p, min-p and the draw,
// with the host sampler's semantics (kiln-sampling's `sampler` module documentation, its
// "device order" section for the draw), so only ids and log-probabilities cross to the host.
//
//   extern "C" __global__ void sample_bf16(const bf16* logits, int V, float* scratch,
//                                          const unsigned* meta, unsigned* out)
//
// Launch: grid.x = rows, block 1024 threads (any multiple of 32 up to 1024), no dynamic smem.
// logits [rows, V] bf16; scratch [rows, V] f32 (the processed logits, written here);
// meta: HDR words per row (layout below), then the lists the headers point into (word offsets
// from the start of meta); out: OUT words per row:
//   [0] status (0: sampled, 1: every processed logit is -inf), [1] token, [2] logprob (f32 bits),
//   [3] number of top entries n, [4 + 2j] top id j, [5 + 2j] its logprob (f32 bits), j < n.
// Header words: temperature, top_k (0 off), top_p, min_p (f32 bits), u (f64 bits, low word
// first), repetition, frequency, presence penalties (f32 bits), bias offset and length (pairs:
// token, f32 bits; distinct tokens), penalty offset and length (pairs: token, generated count
// | in_prompt << 31; distinct tokens), mask offset (ceil(V / 32) allowed-id bit words, or
// 0xffffffff for none), top_logprobs (<= 20).
//
// Steps (one block per row): load and mask -> bias -> penalties (float operations rounded one
// by one, as the host does them) -> clean (NaN -> -inf, +inf -> FLT_MAX), max, argmax ->
// log-normalizer (f32 exponentials, f64 sum) -> top logprobs (per-thread sorted lists merged
// by block argmax) -> greedy, or: top_k (the k-th largest logit's order key found 4 bits per
// pass, ties at it kept in id order), weights exp((l - max) / T), top_p (the boundary weight's
// key found 4 bits per pass from f64 masses; ties at it kept in id order while the mass before
// them is below the target), min_p (w >= min_p: the top weight is exactly 1), then the draw:
// the first survivor in id order whose running f64 weight sum exceeds u * sum(w).
#include "common.cuh"

namespace sample_detail {

constexpr int HDR = 16;
constexpr int OUT = 44;
constexpr int MAX_TOP = 20;
constexpr unsigned NONE = 0xffffffffu;

enum Header {
    H_TEMP = 0,
    H_TOPK = 1,
    H_TOPP = 2,
    H_MINP = 3,
    H_U_LO = 4,
    H_U_HI = 5,
    H_REP = 6,
    H_FREQ = 7,
    H_PRES = 8,
    H_BIAS_OFF = 9,
    H_BIAS_LEN = 10,
    H_PEN_OFF = 11,
    H_PEN_LEN = 12,
    H_MASK_OFF = 13,
    H_TOPL = 14,
};

#define POS_INF __int_as_float(0x7f800000)
#define FLT_MAX_BITS __int_as_float(0x7f7fffff)

// The order-preserving key of a float (larger float, larger key); -0 reads as +0.
__device__ __forceinline__ unsigned key_of(float x) {
    const unsigned u = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float float_of(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Plus {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

struct Min {
    __device__ __forceinline__ unsigned operator()(unsigned a, unsigned b) const { return a < b ? a : b; }
};

struct Max {
    __device__ __forceinline__ unsigned operator()(unsigned a, unsigned b) const { return a > b ? a : b; }
};

// A reduction over the block in a fixed order; every thread gets the result. `sh` holds 32.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* sh, Op op, T identity) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < num_warps ? sh[lane] : identity;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

// The exclusive prefix sum of `v` over the threads in thread order, and the total.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* sh, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    T x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    T before = __shfl_up_sync(0xffffffffu, x, 1);
    if (lane == 0) before = T(0);
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < num_warps ? sh[lane] : T(0);
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        sh[lane] = w;
    }
    __syncthreads();
    if (warp > 0) before = sh[warp - 1] + before;
    *total = sh[num_warps - 1];
    __syncthreads();
    return before;
}

// Is (v2, i2) ahead of (v1, i1): higher value, ties to the lower id; NONE is never ahead.
__device__ __forceinline__ bool better(float v2, unsigned i2, float v1, unsigned i1) {
    if (i2 == NONE) return false;
    if (i1 == NONE) return true;
    return v2 > v1 || (v2 == v1 && i2 < i1);
}

// The best (value, id) of the block; every thread gets it.
__device__ __forceinline__ void block_best(float& v, unsigned& i, float* sv, unsigned* si) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < num_warps ? sv[lane] : NEG_INF;
        i = lane < num_warps ? si[lane] : NONE;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, off);
            const unsigned oi = __shfl_xor_sync(0xffffffffu, i, off);
            if (better(ov, oi, v, i)) {
                v = ov;
                i = oi;
            }
        }
        if (lane == 0) {
            sv[0] = v;
            si[0] = i;
        }
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads();
}

// Each thread's contiguous range of ids, for passes that go in id order.
struct Chunk {
    int lo, hi;
    __device__ __forceinline__ Chunk(int V) {
        const int n = (V + (int)blockDim.x - 1) / (int)blockDim.x;
        lo = min(V, (int)threadIdx.x * n);
        hi = min(V, lo + n);
    }
};

// The id limit that keeps the first `need` ids satisfying `tie` in id order (those below it);
// V when there are no more than `need` of them.
template <typename Tie>
__device__ unsigned tie_limit(int V, unsigned need, Tie tie, unsigned* shu) {
    const Chunk c(V);
    unsigned mine = 0;
    for (int i = c.lo; i < c.hi; i++) mine += tie(i) ? 1u : 0u;
    unsigned total;
    const unsigned before = block_exclusive_scan(mine, shu, &total);
    if (total <= need) return (unsigned)V;
    unsigned limit = 0;
    if (before < need && need <= before + mine) {
        unsigned seen = before;
        for (int i = c.lo; i < c.hi; i++) {
            if (tie(i) && ++seen == need) {
                limit = (unsigned)i + 1;
                break;
            }
        }
    }
    return block_reduce(limit, shu, Max(), 0u);
}

}  // namespace sample_detail

extern "C" __global__ void __launch_bounds__(1024)
    sample_bf16(const bf16* __restrict__ logits, int V, float* __restrict__ scratch,
                const unsigned* __restrict__ meta, unsigned* __restrict__ out) {
    kiln_pdl_enter();
    using namespace sample_detail;
    __shared__ double shd[32];
    __shared__ unsigned shu[32];
    __shared__ float sv[32];
    __shared__ unsigned si[32];
    const unsigned* h = meta + (long long)blockIdx.x * HDR;
    const bf16* src = logits + (long long)blockIdx.x * V;
    float* row = scratch + (long long)blockIdx.x * V;
    unsigned* o = out + (long long)blockIdx.x * OUT;
    const int tid = threadIdx.x, nt = blockDim.x;

    // Load, with the mask's forbidden ids at -inf.
    const unsigned* mask = h[H_MASK_OFF] == NONE ? nullptr : meta + h[H_MASK_OFF];
    for (int i = tid; i < V; i += nt) {
        float l = to_f32(src[i]);
        if (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1u)) l = NEG_INF;
        row[i] = l;
    }
    __syncthreads();
    // Logit bias: -100 or less bans.
    const unsigned* bias = meta + h[H_BIAS_OFF];
    for (unsigned j = tid; j < h[H_BIAS_LEN]; j += nt) {
        const unsigned t = bias[2 * j];
        const float b = __uint_as_float(bias[2 * j + 1]);
        if (t < (unsigned)V) row[t] = b <= -100.0f ? NEG_INF : __fadd_rn(row[t], b);
    }
    __syncthreads();
    // Penalties: repetition once per distinct token seen, then frequency and presence for
    // generated tokens.
    const float rep = __uint_as_float(h[H_REP]), freq = __uint_as_float(h[H_FREQ]);
    const float pres = __uint_as_float(h[H_PRES]);
    const unsigned* pen = meta + h[H_PEN_OFF];
    for (unsigned j = tid; j < h[H_PEN_LEN]; j += nt) {
        const unsigned t = pen[2 * j], count = pen[2 * j + 1] & 0x7fffffffu;
        const bool in_prompt = (pen[2 * j + 1] >> 31) != 0;
        if (t >= (unsigned)V) continue;
        float l = row[t];
        if (rep != 1.0f && (in_prompt || count > 0)) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
        if ((freq != 0.0f || pres != 0.0f) && count > 0) {
            l = __fsub_rn(l, __fmul_rn(freq, (float)count));
            l = __fsub_rn(l, pres);
        }
        row[t] = l;
    }
    __syncthreads();
    // Clean; the max and the lowest id holding it.
    float best = NEG_INF;
    unsigned best_id = NONE;
    unsigned num_cand = 0;
    for (int i = tid; i < V; i += nt) {
        float l = row[i];
        if (l != l) {
            l = NEG_INF;
            row[i] = l;
        } else if (l == POS_INF) {
            l = FLT_MAX_BITS;
            row[i] = l;
        }
        if (l != NEG_INF) {
            num_cand++;
            if (best_id == NONE || l > best) {
                best = l;
                best_id = (unsigned)i;
            }
        }
    }
    block_best(best, best_id, sv, si);
    if (best_id == NONE) {
        if (tid == 0) {
            o[0] = 1;
            o[1] = 0;
            o[2] = 0;
            o[3] = 0;
        }
        return;
    }
    num_cand = block_reduce(num_cand, shu, Plus(), 0u);
    const float mx = best;
    // log Z = max + ln sum exp(l - max).
    double z = 0.0;
    for (int i = tid; i < V; i += nt) {
        const float l = row[i];
        if (l != NEG_INF) z += (double)expf(l - mx);
    }
    z = block_reduce(z, shd, Plus(), 0.0);
    const double log_z = (double)mx + log(z);

    // Top logprobs: each thread's best in a sorted list, merged k times by block argmax.
    const unsigned k_top = min(h[H_TOPL], (unsigned)MAX_TOP);
    unsigned num_top = 0;
    if (k_top > 0) {
        float tv[MAX_TOP];
        unsigned ti[MAX_TOP];
        unsigned n = 0;
        for (int i = tid; i < V; i += nt) {
            const float l = row[i];
            if (l == NEG_INF || (n == k_top && !(l > tv[k_top - 1]))) continue;
            // Ids rise per thread: an equal value goes after those held (ties to lower ids).
            unsigned pos = n < k_top ? n : k_top - 1;
            while (pos > 0 && tv[pos - 1] < l) {
                tv[pos] = tv[pos - 1];
                ti[pos] = ti[pos - 1];
                pos--;
            }
            tv[pos] = l;
            ti[pos] = (unsigned)i;
            if (n < k_top) n++;
        }
        unsigned head = 0;
        for (unsigned r = 0; r < k_top; r++) {
            float v = head < n ? tv[head] : NEG_INF;
            unsigned id = head < n ? ti[head] : NONE;
            block_best(v, id, sv, si);
            if (id == NONE) break;
            if (head < n && ti[head] == id) head++;
            if (tid == 0) {
                o[4 + 2 * r] = id;
                o[5 + 2 * r] = __float_as_uint((float)((double)v - log_z));
            }
            num_top++;
        }
    }

    const float temp = __uint_as_float(h[H_TEMP]);
    unsigned token = best_id;
    if (temp != 0.0f) {
        // top_k over the logits: tk is the k-th largest key; ties at it below tk_limit stay.
        const unsigned top_k = h[H_TOPK];
        const bool use_k = top_k > 0 && top_k < num_cand;
        unsigned tk = 0, tk_limit = (unsigned)V;
        if (use_k) {
            unsigned num_above = 0;
            for (int shift = 28; shift >= 0; shift -= 4) {
                unsigned c[15];
#pragma unroll
                for (int d = 0; d < 15; d++) c[d] = 0;
                for (int i = tid; i < V; i += nt) {
                    const float l = row[i];
                    if (l == NEG_INF) continue;
                    const unsigned k = key_of(l);
#pragma unroll
                    for (int d = 0; d < 15; d++) c[d] += k >= tk + ((unsigned)(d + 1) << shift) ? 1u : 0u;
                }
                unsigned pick = 0, above = num_above;
#pragma unroll
                for (int d = 0; d < 15; d++) {
                    const unsigned total = block_reduce(c[d], shu, Plus(), 0u);
                    if (total >= top_k) {
                        pick = d + 1;
                    } else if (pick == (unsigned)d) {
                        above = total;
                    }
                }
                num_above = above;
                tk += pick << shift;
            }
            const unsigned key_k = tk;
            tk_limit = tie_limit(
                V, top_k - num_above,
                [&](int i) {
                    const float l = row[i];
                    return l != NEG_INF && key_of(l) == key_k;
                },
                shu);
        }
        auto kept_k = [&](int i, float l) {
            if (l == NEG_INF) return false;
            if (!use_k) return true;
            const unsigned k = key_of(l);
            return k > tk || (k == tk && (unsigned)i < tk_limit);
        };
        auto weight = [&](float l) { return expf(__fdiv_rn(l - mx, temp)); };

        // top_p over the weights: tp is the boundary weight's key.
        const float top_p = __uint_as_float(h[H_TOPP]);
        const bool use_p = top_p < 1.0f;
        unsigned tp = 0, tp_limit = (unsigned)V;
        if (use_p) {
            double total = 0.0;
            for (int i = tid; i < V; i += nt) {
                const float l = row[i];
                if (kept_k(i, l)) total += (double)weight(l);
            }
            total = block_reduce(total, shd, Plus(), 0.0);
            const double target = (double)top_p * total;
            double mass_above = 0.0;
            for (int shift = 28; shift >= 0; shift -= 4) {
                double m[15];
#pragma unroll
                for (int d = 0; d < 15; d++) m[d] = 0.0;
                for (int i = tid; i < V; i += nt) {
                    const float l = row[i];
                    if (!kept_k(i, l)) continue;
                    const float w = weight(l);
                    const unsigned k = key_of(w);
#pragma unroll
                    for (int d = 0; d < 15; d++) {
                        if (k >= tp + ((unsigned)(d + 1) << shift)) m[d] += (double)w;
                    }
                }
                unsigned pick = 0;
                double above = mass_above;
#pragma unroll
                for (int d = 0; d < 15; d++) {
                    const double mass = block_reduce(m[d], shd, Plus(), 0.0);
                    if (mass >= target) {
                        pick = d + 1;
                    } else if (pick == (unsigned)d) {
                        above = mass;
                    }
                }
                mass_above = above;
                tp += pick << shift;
            }
            // Tie m (in id order) stays iff mass_above + m * w < target.
            const float wt = float_of(tp);
            unsigned need = (unsigned)V;
            if (wt > 0.0f) {
                const double x = ceil((target - mass_above) / (double)wt);
                need = x < (double)V ? (unsigned)max(x, 1.0) : (unsigned)V;
            }
            const unsigned key_p = tp;
            tp_limit = tie_limit(
                V, need,
                [&](int i) {
                    const float l = row[i];
                    return kept_k(i, l) && key_of(weight(l)) == key_p;
                },
                shu);
        }
        const float min_p = __uint_as_float(h[H_MINP]);
        // The survivor's weight, or -1 for a token dropped.
        auto kept_weight = [&](int i) {
            const float l = row[i];
            if (!kept_k(i, l)) return -1.0f;
            const float w = weight(l);
            if (use_p) {
                const unsigned k = key_of(w);
                if (!(k > tp || (k == tp && (unsigned)i < tp_limit))) return -1.0f;
            }
            if (min_p > 0.0f && !(w >= min_p)) return -1.0f;
            return w;
        };
        // The draw, in id order.
        const Chunk c(V);
        double mine = 0.0;
        for (int i = c.lo; i < c.hi; i++) {
            const float w = kept_weight(i);
            if (w > 0.0f) mine += (double)w;
        }
        double sum_w;
        const double before = block_exclusive_scan(mine, shd, &sum_w);
        const double u = __hiloint2double((int)h[H_U_HI], (int)h[H_U_LO]);
        const double target = u * sum_w;
        unsigned first = NONE, last = 0;
        bool any = false;
        double run = before;
        for (int i = c.lo; i < c.hi; i++) {
            const float w = kept_weight(i);
            if (!(w > 0.0f)) continue;
            run += (double)w;
            last = (unsigned)i;
            any = true;
            if (run > target) {
                first = (unsigned)i;
                break;
            }
        }
        first = block_reduce(first, shu, Min(), NONE);
        // Only through rounding: the last survivor of positive weight.
        last = block_reduce(any ? last : 0u, shu, Max(), 0u);
        token = first != NONE ? first : last;
    }
    if (tid == 0) {
        o[0] = 0;
        o[1] = token;
        o[2] = __float_as_uint((float)((double)row[token] - log_z));
        o[3] = num_top;
    }
}
