// Mixture-of-Experts layers of decode-sized steps on the device, with no host step (so a decode
// step with them is recorded as a CUDA graph): route each row (moe_route_bf16), group the (row,
// pick) pairs by expert (moe_group), run each picked expert once over its pairs — the gate and up
// rows with the activation (moe_gate_up_bf16), then the down rows (moe_down_bf16) — and sum each
// row's picks in its routing order with the shared expert's output (moe_combine_bf16).
//
// Only the picked experts' weights are read, each once a step however many rows picked it. Every
// (row, pick) product is one warp's dot in a fixed lane order, so a row's result does not depend on
// the other rows of the step. Experts are bf16 [2I, H] (gate rows, then up rows) and [H, I], found
// through per-layer pointer tables (0: an expert this rank does not hold, which adds nothing).
#include "common.cuh"
#include "vec8.cuh"

#define MOE_ROUTE_THREADS 128

// A routed row's weights from its logits val[] and picks (largest first), written with the picks
// to ids / weights [row * top_k ..] and counted (see moe_route_bf16). mx, sum_all: the row's max
// logit and sum of exp(logit - mx) (softmax over every expert only). One thread.
__device__ __forceinline__ void moe_finish_row(const float* val, const int* picks, int row, int top_k, int scoring,
                                               int normalize, float scale, float mx, float sum_all,
                                               int* __restrict__ ids, float* __restrict__ weights,
                                               unsigned long long* __restrict__ counts,
                                               const unsigned int* __restrict__ slots, unsigned int pad_slot) {
    float w[32];
    float total = 0.0f;
    const float first = val[picks[0]];
    float topk_sum = 0.0f;
    if (scoring == 1)
        for (int j = 0; j < top_k; ++j) topk_sum += expf(val[picks[j]] - first);
    for (int j = 0; j < top_k; ++j) {
        const float v = val[picks[j]];
        float wj;
        if (scoring == 0 || scoring == 4) wj = expf(v - mx) / sum_all;
        else if (scoring == 1) wj = expf(v - first) / topk_sum;
        else wj = 1.0f / (1.0f + expf(-v));
        w[j] = wj;
        total += wj;
    }
    if (normalize) {
        if (scoring == 2) total += 1e-6f;
        else if (scoring == 3) total += 1e-20f;
        if (total > 0.0f)
            for (int j = 0; j < top_k; ++j) w[j] /= total;
    }
    const bool count = counts && (!slots || slots[row] != pad_slot);
    for (int j = 0; j < top_k; ++j) {
        ids[row * top_k + j] = picks[j];
        weights[row * top_k + j] = scale != 1.0f ? w[j] * scale : w[j];
        if (count) atomicAdd(counts + picks[j], 1ull);
    }
}

// A routing key: the logit, or for sigmoid scores (2, 3) its sigmoid plus the selection bias; NaN as -inf.
__device__ __forceinline__ float moe_key(float v, int e, int scoring, const float* __restrict__ sel_bias) {
    float k = v;
    if (scoring == 2 || scoring == 3) k = 1.0f / (1.0f + expf(-v)) + (sel_bias ? sel_bias[e] : 0.0f);
    return (k != k) ? NEG_INF : k;
}

// (value, index) b replaces a as the better pick: larger, ties to the lower index (INT_MAX: none).
__device__ __forceinline__ bool moe_better(float bv, int bi, float av, int ai) {
    return bi != 0x7fffffff && (ai == 0x7fffffff || bv > av || (bv == av && bi < ai));
}

// The warp's best (value, index), in every lane.
__device__ __forceinline__ void moe_warp_best(float& bv, int& bi) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (moe_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// The group limit (groups > 1; kiln_tensor::moe::route) of DeepSeek-V3 (scoring 3, top2: a group
// scored by the sum of its two largest keys) and DeepSeek-V2 (scoring 4: by its largest): the
// experts split into `groups` equal runs; the keys outside the best `keep` groups become -inf (ties:
// the lower group). One warp, every lane; groups <= 64 and dividing num_experts (the launcher
// checks).
__device__ void moe_limit_groups(float* key, int num_experts, int groups, int keep, bool top2, int lane) {
    const int size = num_experts / groups;
    float gs[2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int g = lane + 32 * s;
        float a = NEG_INF, b = NEG_INF;
        for (int e = g * size; g < groups && e < (g + 1) * size; ++e) {
            const float k = key[e];
            if (k > a) {
                b = a;
                a = k;
            } else if (k > b) {
                b = k;
            }
        }
        gs[s] = (size < 2 || !top2) ? a : a + b;
    }
    unsigned long long chosen = 0;
    for (int j = 0; j < keep; ++j) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int g = lane + 32 * s;
            if (g < groups && !((chosen >> g) & 1ull) && moe_better(gs[s], g, bv, bi)) {
                bv = gs[s];
                bi = g;
            }
        }
        moe_warp_best(bv, bi);
        if (bi != 0x7fffffff) chosen |= 1ull << bi;
    }
    __syncwarp();
    for (int e = lane; e < num_experts; e += 32)
        if (!((chosen >> (e / size)) & 1ull)) key[e] = NEG_INF;
    __syncwarp();
}

// The whole block groups the step's pairs by expert (every thread calls it; blockDim.x >= 32):
// see moe_group. picks[p]: pair p's expert (global or shared memory); cnt and cursor are
// num_experts ints of shared memory, held num_experts bytes. The offsets are an exclusive scan by
// the first warp (a lane a run of consecutive experts).
__device__ __forceinline__ void moe_group_block(const int* picks, int pairs, int num_experts,
                                                const unsigned long long* __restrict__ gate_up, int* cnt,
                                                int* cursor, unsigned char* held, int* __restrict__ used_count,
                                                int* __restrict__ used, int* __restrict__ offsets,
                                                int* __restrict__ order, int* __restrict__ pos) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        cnt[e] = 0;
        held[e] = gate_up[e] != 0ull;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = picks[p];
        if (e >= 0 && e < num_experts && held[e]) atomicAdd(cnt + e, 1);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int per = (num_experts + 31) / 32;
        const int e0 = min(lane * per, num_experts), e1 = min(e0 + per, num_experts);
        int rows_here = 0, used_here = 0;
        for (int e = e0; e < e1; ++e) {
            rows_here += cnt[e];
            used_here += cnt[e] > 0;
        }
        int rows_incl = rows_here, used_incl = used_here;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int r = __shfl_up_sync(0xffffffffu, rows_incl, off);
            const int u = __shfl_up_sync(0xffffffffu, used_incl, off);
            if (lane >= off) {
                rows_incl += r;
                used_incl += u;
            }
        }
        int off = rows_incl - rows_here, u = used_incl - used_here;
        for (int e = e0; e < e1; ++e) {
            cursor[e] = off;
            if (cnt[e] == 0) continue;
            used[u] = e;
            offsets[u] = off;
            off += cnt[e];
            ++u;
        }
        if (lane == 31) {
            offsets[used_incl] = rows_incl;
            *used_count = used_incl;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = picks[p];
        int q = -1;
        if (e >= 0 && e < num_experts && held[e]) {
            q = atomicAdd(cursor + e, 1);
            order[q] = p;
        }
        if (pos) pos[p] = q;
    }
}

// An expert's activation of its gate and up sums (biases added): act 0-2 kiln_act(gate) * up,
// 3 gpt-oss's clamped SwiGLU.
__device__ __forceinline__ float moe_act(float g, float u, int act, float alpha, float limit) {
    if (act == 3) {
        const float gc = fminf(g, limit);
        const float uc = fminf(fmaxf(u, -limit), limit);
        return (uc + 1.0f) * (gc / (1.0f + expf(-alpha * gc)));
    }
    return kiln_act(g, act) * u;
}


// Routing of one row a block: scoring 0 = softmax over every expert, then the top_k largest;
// 1 = the top_k largest logits, then a softmax over those; 2 = sigmoids, picked by sigmoid plus
// sel_bias (may be null), weighed by the sigmoids; 3 = as 2 within the best keep_groups of groups
// (moe_limit_groups); 4 = as 0 within the best groups by their largest logit. Then, if normalize, the weights divided by their sum (plus 1e-6 for 2, 1e-20
// for 3), times scale. Ties go to the lower expert, NaN logits pick last (as
// kiln_tensor::moe::route). Writes ids / weights [rows, top_k] (top_k <= num_experts) and, where
// counts is not null, adds one to counts[e] a pick of every row whose slots[row] is not pad_slot
// (a padding row of a recorded batch; slots null: every row counts).
// Dynamic shared memory: num_experts * 9 bytes.
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route_bf16(
    const bf16* __restrict__ logits, int num_experts, int top_k, int scoring, int groups, int keep_groups,
    int normalize, float scale, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights, unsigned long long* __restrict__ counts, const unsigned int* __restrict__ slots,
    unsigned int pad_slot) {
    kiln_pdl_enter();
    extern __shared__ float moe_route_smem[];
    float* val = moe_route_smem;
    float* key = val + num_experts;
    unsigned char* taken = reinterpret_cast<unsigned char*>(key + num_experts);
    __shared__ float red_v[MOE_ROUTE_THREADS / 32];
    __shared__ int red_i[MOE_ROUTE_THREADS / 32];
    __shared__ int picks[32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bf16* lr = logits + (long long)row * num_experts;
    float local_max = NEG_INF;
    for (int e = tid; e < num_experts; e += blockDim.x) {
        const float v = to_f32(lr[e]);
        val[e] = v;
        key[e] = moe_key(v, e, scoring, sel_bias);
        taken[e] = 0;
        if (v == v) local_max = fmaxf(local_max, v);
    }
    __syncthreads();
    if ((scoring == 3 || scoring == 4) && groups > 1) {
        if (warp == 0) moe_limit_groups(key, num_experts, groups, keep_groups, scoring == 3, lane);
        __syncthreads();
    }
    for (int j = 0; j < top_k; ++j) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int e = tid; e < num_experts; e += blockDim.x) {
            if (taken[e]) continue;
            if (moe_better(key[e], e, bv, bi)) {
                bv = key[e];
                bi = e;
            }
        }
        moe_warp_best(bv, bi);
        if (lane == 0) {
            red_v[warp] = bv;
            red_i[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < MOE_ROUTE_THREADS / 32; ++w) {
                if (moe_better(red_v[w], red_i[w], bv, bi)) {
                    bv = red_v[w];
                    bi = red_i[w];
                }
            }
            picks[j] = bi;
            taken[bi] = 1;
        }
        __syncthreads();
    }
    // The softmax over every expert needs the row's max and sum of exponentials.
    float mx = NEG_INF, sum_all = 0.0f;
    if (scoring == 0 || scoring == 4) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, off));
        if (lane == 0) red_v[warp] = local_max;
        __syncthreads();
        for (int w = 0; w < MOE_ROUTE_THREADS / 32; ++w) mx = fmaxf(mx, red_v[w]);
        __syncthreads();
        float s = 0.0f;
        for (int e = tid; e < num_experts; e += blockDim.x) s += expf(val[e] - mx);
        sum_all = block_sum(s);
    }
    if (tid != 0) return;
    moe_finish_row(val, picks, row, top_k, scoring, normalize, scale, mx, sum_all, ids, weights, counts, slots,
                   pad_slot);
}

// The (row, pick) pairs grouped by expert, in one block: used[0 .. *used_count) are the picked
// experts this rank holds (gate_up[e] != 0), ascending; offsets[u] .. offsets[u + 1] index
// order[], which lists the pairs (row * top_k + j) of expert used[u]; where pos is not null,
// pos[p] is pair p's index in order[] (-1: an expert not held).
// Dynamic shared memory: 2 * num_experts ints and num_experts bytes.
extern "C" __global__ void __launch_bounds__(256) moe_group(const int* __restrict__ ids, int pairs, int num_experts,
                                                           const unsigned long long* __restrict__ gate_up,
                                                           int* __restrict__ used_count, int* __restrict__ used,
                                                           int* __restrict__ offsets, int* __restrict__ order,
                                                           int* __restrict__ pos) {
    kiln_pdl_enter();
    extern __shared__ int moe_group_smem[];
    int* cnt = moe_group_smem;
    int* cursor = cnt + num_experts;
    unsigned char* held = reinterpret_cast<unsigned char*>(cursor + num_experts);
    moe_group_block(ids, pairs, num_experts, gate_up, cnt, cursor, held, used_count, used, offsets, order, pos);
}

// One warp's dot of a bf16 weight row w [len] with a bf16 row x [len] (len a multiple of 8, both
// 16-byte aligned): lane l takes the 8-element pieces l, l + 32, ..., four in flight. Every lane
// returns the sum.
__device__ __forceinline__ float moe_warp_dot(const bf16* __restrict__ w, const bf16* __restrict__ x, int len,
                                              int lane) {
    float acc = 0.0f;
    for (int c0 = lane * 8; c0 < len; c0 += 4 * 256) {
        uint4 wv[4], xv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int c = c0 + q * 256;
            wv[q] = c < len ? *reinterpret_cast<const uint4*>(w + c) : make_uint4(0, 0, 0, 0);
            xv[q] = c < len ? *reinterpret_cast<const uint4*>(x + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float wf[8], xf[8];
            vec8::unpack8(wv[q], wf);
            vec8::unpack8(xv[q], xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xf[e], acc);
        }
    }
    return warp_sum(acc);
}

// Grid (experts bound, units / 8); block 256: warp w of block (b, y) takes unit i = 8 y + w of
// expert used[b] for each of its pairs p (row p / top_k):
//   h[p, i] = act(gate_i . x + bg_i, up_i . x + bu_i)   (bf16)
// with act 0-2 as kiln_act(gate) * up, 3 = gpt-oss's clamped SwiGLU (alpha, limit).
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_bf16(
    const bf16* __restrict__ x, int hidden, int inter, int top_k, const unsigned long long* __restrict__ gate_up,
    const unsigned long long* __restrict__ gate_up_bias, const int* __restrict__ used_count,
    const int* __restrict__ used, const int* __restrict__ offsets, const int* __restrict__ order, int act,
    float alpha, float limit, bf16* __restrict__ h) {
    kiln_pdl_enter();
    const int b = blockIdx.x;
    if (b >= *used_count) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.y * 8 + warp;
    if (i >= inter) return;
    const int e = used[b];
    const bf16* w = reinterpret_cast<const bf16*>(gate_up[e]);
    const bf16* bias = reinterpret_cast<const bf16*>(gate_up_bias[e]);
    const bf16* wg = w + (long long)i * hidden;
    const bf16* wu = w + (long long)(inter + i) * hidden;
    for (int q = offsets[b]; q < offsets[b + 1]; ++q) {
        const int p = order[q];
        const bf16* xr = x + (long long)(p / top_k) * hidden;
        float g = moe_warp_dot(wg, xr, hidden, lane);
        float u = moe_warp_dot(wu, xr, hidden, lane);
        if (lane == 0) {
            if (bias) {
                g += to_f32(bias[i]);
                u += to_f32(bias[inter + i]);
            }
            h[(long long)p * inter + i] = to_bf16(moe_act(g, u, act, alpha, limit));
        }
    }
}

// Grid (experts bound, hidden / 8); block 256: warp w of block (b, y) takes output j = 8 y + w of
// expert used[b] for each of its pairs p:  y[p, j] = down_j . h[p] + bd_j   (f32).
extern "C" __global__ void __launch_bounds__(256) moe_down_bf16(
    const bf16* __restrict__ h, int hidden, int inter, const unsigned long long* __restrict__ down,
    const unsigned long long* __restrict__ down_bias, const int* __restrict__ used_count,
    const int* __restrict__ used, const int* __restrict__ offsets, const int* __restrict__ order,
    float* __restrict__ y) {
    kiln_pdl_enter();
    const int b = blockIdx.x;
    if (b >= *used_count) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.y * 8 + warp;
    if (j >= hidden) return;
    const int e = used[b];
    const bf16* wd = reinterpret_cast<const bf16*>(down[e]) + (long long)j * inter;
    const bf16* bias = reinterpret_cast<const bf16*>(down_bias[e]);
    const float bj = bias ? to_f32(bias[j]) : 0.0f;
    for (int q = offsets[b]; q < offsets[b + 1]; ++q) {
        const int p = order[q];
        const float v = moe_warp_dot(wd, h + (long long)p * inter, inter, lane);
        if (lane == 0) y[(long long)p * hidden + j] = v + bj;
    }
}

// Grid (rows, hidden / 256); block 256: out[r, j] = sum over r's picks in routing order of
// weight * y[pair, j] (picks of experts this rank does not hold add nothing), then
// + sigmoid(shared_gate[r]) * shared[r, j] where there is a shared expert (shared_gate null: 1).
extern "C" __global__ void __launch_bounds__(256) moe_combine_bf16(
    const float* __restrict__ y, const int* __restrict__ ids, const float* __restrict__ weights, int top_k,
    int hidden, int num_experts, const unsigned long long* __restrict__ gate_up, const bf16* __restrict__ shared,
    const bf16* __restrict__ shared_gate, bf16* __restrict__ out) {
    kiln_pdl_enter();
    const int r = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    // The row's picks, read once for the block (weight 0: an expert not held, which adds nothing).
    __shared__ float s_w[32];
    if (threadIdx.x < top_k) {
        const int p = r * top_k + threadIdx.x;
        const int e = ids[p];
        s_w[threadIdx.x] = (e >= 0 && e < num_experts && gate_up[e]) ? weights[p] : 0.0f;
    }
    __syncthreads();
    if (j >= hidden) return;
    float acc = 0.0f;
#pragma unroll 8
    for (int s = 0; s < top_k; ++s) {
        const int p = r * top_k + s;
        if (s_w[s] != 0.0f) acc += s_w[s] * y[(long long)p * hidden + j];
    }
    if (shared) {
        const float g = shared_gate ? 1.0f / (1.0f + expf(-to_f32(shared_gate[r]))) : 1.0f;
        acc += g * to_f32(shared[(long long)r * hidden + j]);
    }
    out[(long long)r * hidden + j] = to_bf16(acc);
}

// Larger steps (prefill): the pairs' rows gathered in expert order for grouped tensor-core
// products. Grid (rows, hidden / 2048); block 256: xs[q] = x[order[q] / top_k], 16 bytes a thread.
extern "C" __global__ void __launch_bounds__(256) moe_gather_bf16(const bf16* __restrict__ x,
                                                                 const int* __restrict__ order, int top_k,
                                                                 int hidden, bf16* __restrict__ xs) {
    kiln_pdl_enter();
    const int q = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= hidden) return;
    const bf16* src = x + (long long)(order[q] / top_k) * hidden + c;
    *reinterpret_cast<uint4*>(xs + (long long)q * hidden + c) = *reinterpret_cast<const uint4*>(src);
}

// The activation of the gathered pairs' gate/up rows gu [q, 2 * inter] (gate | up), with the
// expert's biases: h[q, i] as moe_gate_up_bf16 computes it. Grid (rows, inter / 256); block 256.
extern "C" __global__ void __launch_bounds__(256) moe_act_bf16(
    const bf16* __restrict__ gu, const int* __restrict__ ids, const int* __restrict__ order, int inter,
    const unsigned long long* __restrict__ gate_up_bias, int act, float alpha, float limit, bf16* __restrict__ h) {
    kiln_pdl_enter();
    const int q = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const bf16* bias = reinterpret_cast<const bf16*>(gate_up_bias[ids[order[q]]]);
    const bf16* row = gu + (long long)q * 2 * inter;
    float g = to_f32(row[i]), u = to_f32(row[inter + i]);
    if (bias) {
        g += to_f32(bias[i]);
        u += to_f32(bias[inter + i]);
    }
    h[(long long)q * inter + i] = to_bf16(moe_act(g, u, act, alpha, limit));
}

// moe_combine_bf16 for the grouped products' outputs ys [q, hidden] bf16 (in expert order; pair p
// at pos[p], -1: not held) with each expert's down bias added here. Grid (rows, hidden / 256).
extern "C" __global__ void __launch_bounds__(256) moe_combine_sorted_bf16(
    const bf16* __restrict__ ys, const int* __restrict__ pos, const int* __restrict__ ids,
    const float* __restrict__ weights, int top_k, int hidden, const unsigned long long* __restrict__ down_bias,
    const bf16* __restrict__ shared, const bf16* __restrict__ shared_gate, bf16* __restrict__ out) {
    kiln_pdl_enter();
    const int r = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= hidden) return;
    float acc = 0.0f;
    for (int s = 0; s < top_k; ++s) {
        const int p = r * top_k + s;
        const int q = pos[p];
        if (q < 0) continue;
        const bf16* bias = reinterpret_cast<const bf16*>(down_bias[ids[p]]);
        const float v = to_f32(ys[(long long)q * hidden + j]) + (bias ? to_f32(bias[j]) : 0.0f);
        acc += weights[p] * v;
    }
    if (shared) {
        const float g = shared_gate ? 1.0f / (1.0f + expf(-to_f32(shared_gate[r]))) : 1.0f;
        acc += g * to_f32(shared[(long long)r * hidden + j]);
    }
    out[(long long)r * hidden + j] = to_bf16(acc);
}

// ---------------------------------------------------------------------------------------------
// MXFP4 experts (gpt-oss as llama.cpp ships it), decode-sized steps: moe_gate_up_bf16 and
// moe_down_bf16 over blocks as blocks.rs lays MXFP4 on the device — block g = row * (K / 32) + b
// of a part: its 16 code bytes at body + 16 g (element j < 16 the low nibble of byte j, 16 + j its
// high nibble), its e8m0 exponent at meta + g; w = e2m1(code) * 2^(e - 127), computed as the
// doubled e2m1 value times 2^(e - 128) (as GGML does). Tables: gate body / meta, up body / meta,
// down body / meta, a pointer an expert each (0: not held).

// Half an e8m0 scale, 2^(e - 128), exactly (subnormal below e = 2).
__device__ __forceinline__ float moe_e8m0_half(unsigned e) {
    return e < 2 ? __int_as_float(0x00200000 << e) : __int_as_float((e - 1) << 23);
}

// The doubled e2m1 values by code, in shared memory (lanes index it freely).
__device__ __forceinline__ void moe_fp4_table(float* lut) {
    if (threadIdx.x < 16) {
        const int c = threadIdx.x & 7;
        const float mag = c < 4 ? (float)c : (float)((2 + (c & 1)) << ((c >> 1) - 1));
        lut[threadIdx.x] = threadIdx.x & 8 ? -mag : mag;
    }
    __syncthreads();
}

// One warp's dot of MXFP4 row `row` of a part (K / 32 blocks a row) with x [K] bf16 (K % 32 == 0,
// x 16-byte aligned): lane l takes blocks l, l + 32, ...; every lane returns the sum.
__device__ __forceinline__ float moe_warp_dot_mxfp4(const unsigned char* __restrict__ body,
                                                    const unsigned char* __restrict__ meta, long long row,
                                                    const bf16* __restrict__ x, int k, int lane,
                                                    const float* lut) {
    const int nb = k >> 5;
    const unsigned char* rb = body + row * nb * 16;
    const unsigned char* rm = meta + row * nb;
    float acc = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        const uint4 q = __ldg(reinterpret_cast<const uint4*>(rb + (long long)b * 16));
        const float s = moe_e8m0_half(rm[b]);
        const uint4* xp = reinterpret_cast<const uint4*>(x + b * 32);
        float lo[16], hi[16];
        {
            float t[8];
            vec8::unpack8(xp[0], t);
#pragma unroll
            for (int e = 0; e < 8; ++e) lo[e] = t[e];
            vec8::unpack8(xp[1], t);
#pragma unroll
            for (int e = 0; e < 8; ++e) lo[8 + e] = t[e];
            vec8::unpack8(xp[2], t);
#pragma unroll
            for (int e = 0; e < 8; ++e) hi[e] = t[e];
            vec8::unpack8(xp[3], t);
#pragma unroll
            for (int e = 0; e < 8; ++e) hi[8 + e] = t[e];
        }
        const unsigned qw[4] = {q.x, q.y, q.z, q.w};
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned byte = (qw[j >> 2] >> (8 * (j & 3))) & 0xffu;
            part = fmaf(lut[byte & 15u], lo[j], part);
            part = fmaf(lut[byte >> 4], hi[j], part);
        }
        acc = fmaf(s, part, acc);
    }
    return warp_sum(acc);
}

// As moe_gate_up_bf16, the expert's gate and up rows MXFP4 (two parts of inter rows each).
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_mxfp4(
    const bf16* __restrict__ x, int hidden, int inter, int top_k, const unsigned long long* __restrict__ gate_body,
    const unsigned long long* __restrict__ gate_meta, const unsigned long long* __restrict__ up_body,
    const unsigned long long* __restrict__ up_meta, const unsigned long long* __restrict__ gate_up_bias,
    const int* __restrict__ used_count, const int* __restrict__ used, const int* __restrict__ offsets,
    const int* __restrict__ order, int act, float alpha, float limit, bf16* __restrict__ h) {
    __shared__ float lut[16];
    moe_fp4_table(lut);
    kiln_pdl_enter();
    const int b = blockIdx.x;
    if (b >= *used_count) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.y * 8 + warp;
    if (i >= inter) return;
    const int e = used[b];
    const unsigned char* gb = reinterpret_cast<const unsigned char*>(gate_body[e]);
    const unsigned char* gm = reinterpret_cast<const unsigned char*>(gate_meta[e]);
    const unsigned char* ub = reinterpret_cast<const unsigned char*>(up_body[e]);
    const unsigned char* um = reinterpret_cast<const unsigned char*>(up_meta[e]);
    const bf16* bias = reinterpret_cast<const bf16*>(gate_up_bias[e]);
    for (int q = offsets[b]; q < offsets[b + 1]; ++q) {
        const int p = order[q];
        const bf16* xr = x + (long long)(p / top_k) * hidden;
        float g = moe_warp_dot_mxfp4(gb, gm, i, xr, hidden, lane, lut);
        float u = moe_warp_dot_mxfp4(ub, um, i, xr, hidden, lane, lut);
        if (lane == 0) {
            if (bias) {
                g += to_f32(bias[i]);
                u += to_f32(bias[inter + i]);
            }
            h[(long long)p * inter + i] = to_bf16(moe_act(g, u, act, alpha, limit));
        }
    }
}

// As moe_down_bf16, the expert's down rows MXFP4.
extern "C" __global__ void __launch_bounds__(256) moe_down_mxfp4(
    const bf16* __restrict__ h, int hidden, int inter, const unsigned long long* __restrict__ down_body,
    const unsigned long long* __restrict__ down_meta, const unsigned long long* __restrict__ down_bias,
    const int* __restrict__ used_count, const int* __restrict__ used, const int* __restrict__ offsets,
    const int* __restrict__ order, float* __restrict__ y) {
    __shared__ float lut[16];
    moe_fp4_table(lut);
    kiln_pdl_enter();
    const int b = blockIdx.x;
    if (b >= *used_count) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.y * 8 + warp;
    if (j >= hidden) return;
    const int e = used[b];
    const unsigned char* db = reinterpret_cast<const unsigned char*>(down_body[e]);
    const unsigned char* dm = reinterpret_cast<const unsigned char*>(down_meta[e]);
    const bf16* bias = reinterpret_cast<const bf16*>(down_bias[e]);
    const float bj = bias ? to_f32(bias[j]) : 0.0f;
    for (int q = offsets[b]; q < offsets[b + 1]; ++q) {
        const int p = order[q];
        const float v = moe_warp_dot_mxfp4(db, dm, j, h + (long long)p * inter, inter, lane, lut);
        if (lane == 0) y[(long long)p * hidden + j] = v + bj;
    }
}

// ---------------------------------------------------------------------------------------------
// Decode steps (rows <= 32): moe_route_bf16 and moe_group in one launch, a warp a row. Block
// 32 * rows threads; dynamic shared memory rows * num_experts * 8 bytes (each row's logits and
// keys) + (2 * num_experts + rows * top_k) ints + num_experts bytes. Same semantics and outputs as the two kernels (the weights'
// sums formed by warp shuffles instead of block sums).
extern "C" __global__ void __launch_bounds__(1024) moe_route_group_bf16(
    const bf16* __restrict__ logits, int rows, int num_experts, int top_k, int scoring, int groups,
    int keep_groups, int normalize, float scale, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights,
    unsigned long long* __restrict__ counts, const unsigned int* __restrict__ slots, unsigned int pad_slot,
    const unsigned long long* __restrict__ gate_up, int* __restrict__ used_count, int* __restrict__ used,
    int* __restrict__ offsets, int* __restrict__ order, int* __restrict__ pos) {
    kiln_pdl_enter();
    extern __shared__ float moe_rg_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* val = moe_rg_smem + (long long)warp * 2 * num_experts;
    float* key = val + num_experts;
    int* cnt = reinterpret_cast<int*>(moe_rg_smem + (long long)rows * 2 * num_experts);
    int* cursor = cnt + num_experts;
    int* pk = cursor + num_experts;  // [rows * top_k]: the picks, for the grouping
    unsigned char* held = reinterpret_cast<unsigned char*>(pk + rows * top_k);
    const int row = warp;
    if (row < rows) {
        const bf16* lr = logits + (long long)row * num_experts;
        float mx = NEG_INF;
        for (int e = lane; e < num_experts; e += 32) {
            const float v = to_f32(lr[e]);
            val[e] = v;
            key[e] = moe_key(v, e, scoring, sel_bias);
            if (v == v) mx = fmaxf(mx, v);
        }
        __syncwarp();
        if ((scoring == 3 || scoring == 4) && groups > 1)
            moe_limit_groups(key, num_experts, groups, keep_groups, scoring == 3, lane);
        int pick[32];
        for (int j = 0; j < top_k; ++j) {
            float bv = NEG_INF;
            int bi = 0x7fffffff;
            for (int e = lane; e < num_experts; e += 32) {
                const float k = key[e];
                if (k != k) continue;  // taken
                if (moe_better(k, e, bv, bi)) {
                    bv = k;
                    bi = e;
                }
            }
            moe_warp_best(bv, bi);
            pick[j] = bi;
            __syncwarp();
            if (lane == 0) key[bi] = __int_as_float(0x7fc00000);  // taken: NaN
            __syncwarp();
        }
        float sum_all = 0.0f;
        if (scoring == 0 || scoring == 4) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            float s = 0.0f;
            for (int e = lane; e < num_experts; e += 32) s += expf(val[e] - mx);
            sum_all = warp_sum(s);
        }
        if (lane == 0) {
            moe_finish_row(val, pick, row, top_k, scoring, normalize, scale, mx, sum_all, ids, weights, counts,
                           slots, pad_slot);
            for (int j = 0; j < top_k; ++j) pk[row * top_k + j] = pick[j];
        }
    }
    __syncthreads();
    // Group the pairs by expert, as moe_group.
    moe_group_block(pk, rows * top_k, num_experts, gate_up, cnt, cursor, held, used_count, used, offsets, order,
                    pos);
}
