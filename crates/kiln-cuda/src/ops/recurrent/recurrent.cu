// Recurrent token mixers over per-sequence state slots (kiln_tensor::recurrent): the causal
// depthwise convolution with its past inputs, and the gated delta rule of Qwen3.5's DeltaNet.
// Every sequence runs its tokens in order, as the CPU reference does (token by token, f32 state);
// the delta rule's chunk-parallel form for long prefills is in delta_chunk.cu.
//
// State: f32, per slot `conv` values (the last K-1 inputs, oldest first, [K-1][channels]) then
// `rec` values (one k_dim x v_dim matrix a value head, row-major [head][i][j]); slot s of a
// layer at state + s * (conv + rec) (the caller offsets `state` to the layer).
//
// Sequence metadata `seqs` (i32, 6 a sequence, then the number of snapshots): row_start, rows,
// slot, source slot (the slot whose state the sequence starts from: its own, or a snapshot to
// restore), fresh (1: start from zeros), first snapshot index; `snaps` (i32, 2 a snapshot,
// grouped by sequence: sequence s has those from its first to the next sequence's first, or to
// the count): tokens into the step, slot. A sequence of slot -1 (a recorded decode step's padding,
// or every sequence while a recording warms up) has no state: its outputs are zeros and no state
// is read or written.
#include "common.cuh"
#include "recurrent.cuh"

#define KILN_CONV_MAX_K 8

// The convolution, one thread a channel: grid (sequences, ceil(channels / blockDim.x)).
// mode 0 (DeltaNet): input x[row * x_stride + c], out f32 [row][channels] = silu(conv).
// mode 1 (short conv): x rows are b | c | x (channels each): input b * x, out bf16
//   [row][channels] = c * conv.
// w [channels][k] f32.
extern "C" __global__ void recurrent_conv(const bf16* __restrict__ x, long long x_stride,
                                          const float* __restrict__ w, int k, int channels,
                                          int mode, float* __restrict__ state, long long slot_len,
                                          const int* __restrict__ seqs,
                                          const int* __restrict__ snaps, int num_seqs,
                                          float* __restrict__ out_f32, bf16* __restrict__ out_bf16) {
    kiln_pdl_enter();
    const int s = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (s >= num_seqs || c >= channels) return;
    const int* m = seqs + 6 * s;
    const int row0 = m[0], rows = m[1], slot = m[2], src = m[3], fresh = m[4];
    const int snap0 = m[5], snap1 = s + 1 < num_seqs ? seqs[6 * (s + 1) + 5] : seqs[6 * num_seqs];
    if (slot < 0) {
        for (int t = 0; t < rows; ++t) {
            if (mode == 0) out_f32[(long long)(row0 + t) * channels + c] = 0.0f;
            else out_bf16[(long long)(row0 + t) * channels + c] = to_bf16(0.0f);
        }
        return;
    }
    float win[KILN_CONV_MAX_K];
    const float* from = state + (long long)src * slot_len;
    for (int j = 0; j < k - 1; ++j) win[j] = fresh ? 0.0f : from[(long long)j * channels + c];
    float wc[KILN_CONV_MAX_K];
    for (int j = 0; j < k; ++j) wc[j] = w[(long long)c * k + j];
    for (int t = 0; t < rows; ++t) {
        const bf16* row = x + (long long)(row0 + t) * x_stride;
        const float in = mode == 0 ? to_f32(row[c]) : to_f32(row[c]) * to_f32(row[2 * channels + c]);
        win[k - 1] = in;
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) acc += wc[j] * win[j];
        for (int j = 0; j < k - 1; ++j) win[j] = win[j + 1];
        if (mode == 0) {
            out_f32[(long long)(row0 + t) * channels + c] = recurrent_detail::silu(acc);
        } else {
            out_bf16[(long long)(row0 + t) * channels + c] = to_bf16(acc * to_f32(row[channels + c]));
        }
        for (int q = snap0; q < snap1; ++q) {
            if (snaps[2 * q] == t + 1) {
                float* to = state + (long long)snaps[2 * q + 1] * slot_len;
                for (int j = 0; j < k - 1; ++j) to[(long long)j * channels + c] = win[j];
            }
        }
    }
    float* own = state + (long long)slot * slot_len;
    for (int j = 0; j < k - 1; ++j) own[(long long)j * channels + c] = win[j];
}

// The convolution for steps with many tokens a sequence: its outputs need no order (each is the
// window of its token's last k inputs), so recurrent_conv_rows computes them all at once, one
// thread a (row, channel): grid (rows, ceil(channels / blockDim.x)); row_seq [row]: the row's
// sequence. Inputs before the step come from the state of the sequence's source slot (zeros when
// fresh). Then recurrent_conv_state writes the windows the state keeps — the snapshots', then the
// sequence's own — one thread a (sequence, channel), as recurrent_conv's grid; it reads the
// source slot's inputs into registers before any write, so a sequence continuing its own slot
// reads its old window. Same modes, inputs and outputs as recurrent_conv.
namespace recurrent_detail {
// The input of token m of sequence row0.. (m < 0: the state's inputs before the step, oldest
// first, from slot `from`; zero when fresh).
__device__ __forceinline__ float conv_input(const bf16* __restrict__ x, long long x_stride, int channels,
                                            int mode, const float* __restrict__ from, int fresh, int k,
                                            int row0, int m, int c) {
    if (m < 0) return fresh ? 0.0f : from[(long long)(k - 1 + m) * channels + c];
    const bf16* row = x + (long long)(row0 + m) * x_stride;
    return mode == 0 ? to_f32(row[c]) : to_f32(row[c]) * to_f32(row[2 * channels + c]);
}
}  // namespace recurrent_detail

extern "C" __global__ void recurrent_conv_rows(const bf16* __restrict__ x, long long x_stride,
                                               const float* __restrict__ w, int k, int channels,
                                               int mode, const float* __restrict__ state,
                                               long long slot_len, const int* __restrict__ seqs,
                                               const int* __restrict__ row_seq,
                                               float* __restrict__ out_f32, bf16* __restrict__ out_bf16) {
    kiln_pdl_enter();
    const long long r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int* m = seqs + 6 * row_seq[r];
    const int row0 = m[0], slot = m[2], src = m[3], fresh = m[4];
    float acc = 0.0f;
    if (slot >= 0) {
        const int t = (int)(r - row0);
        const float* from = state + (long long)src * slot_len;
        for (int j = 0; j < k; ++j)
            acc += w[(long long)c * k + j] *
                   recurrent_detail::conv_input(x, x_stride, channels, mode, from, fresh, k, row0, t - (k - 1) + j, c);
    }
    if (mode == 0) {
        out_f32[r * channels + c] = slot >= 0 ? recurrent_detail::silu(acc) : 0.0f;
    } else {
        const float gate = slot >= 0 ? to_f32(x[r * x_stride + channels + c]) : 0.0f;
        out_bf16[r * channels + c] = to_bf16(acc * gate);
    }
}

extern "C" __global__ void recurrent_conv_state(const bf16* __restrict__ x, long long x_stride, int k,
                                                int channels, int mode, float* __restrict__ state,
                                                long long slot_len, const int* __restrict__ seqs,
                                                const int* __restrict__ snaps, int num_seqs) {
    kiln_pdl_enter();
    const int s = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (s >= num_seqs || c >= channels) return;
    const int* m = seqs + 6 * s;
    const int row0 = m[0], rows = m[1], slot = m[2], src = m[3], fresh = m[4];
    const int snap0 = m[5], snap1 = s + 1 < num_seqs ? seqs[6 * (s + 1) + 5] : seqs[6 * num_seqs];
    if (slot < 0) return;
    const float* from = state + (long long)src * slot_len;
    // The old window first: the writes below may land on the source slot.
    float old[KILN_CONV_MAX_K];
    for (int j = 0; j < k - 1; ++j) old[j] = fresh ? 0.0f : from[(long long)j * channels + c];
    // Window after T tokens: inputs T - (k - 1) .. T - 1.
    auto window_into = [&](float* to, int T) {
        for (int j = 0; j < k - 1; ++j) {
            const int mi = T - (k - 1) + j;
            to[(long long)j * channels + c] =
                mi < 0 ? old[k - 1 + mi]
                       : recurrent_detail::conv_input(x, x_stride, channels, mode, from, 1, k, row0, mi, c);
        }
    };
    for (int q = snap0; q < snap1; ++q)
        if (snaps[2 * q] >= 1 && snaps[2 * q] <= rows) window_into(state + (long long)snaps[2 * q + 1] * slot_len, snaps[2 * q]);
    window_into(state + (long long)slot * slot_len, rows);
}

// The gated delta rule of one value head of one sequence: grid (sequences, v_heads), one thread
// a column j of the head's state (blockDim.x >= v_dim, a multiple of 32), the state in dynamic
// shared memory (k_dim * v_dim f32, then q and k). mixed f32 [row][2 k_heads k_dim + v_heads
// v_dim] (the convolution's output: q | k | v); x the packed projections (z at column z_col, b
// at b_col, a at a_col); out bf16 [row][v_heads v_dim]. conv_len: where the recurrence's state
// starts in a slot.
extern "C" __global__ void gated_delta_rule(const float* __restrict__ mixed, int mixed_stride,
                                            const bf16* __restrict__ x, long long x_stride,
                                            int z_col, int b_col, int a_col,
                                            const float* __restrict__ a_log,
                                            const float* __restrict__ dt_bias,
                                            const float* __restrict__ norm_w, float eps,
                                            int k_heads, int v_heads, int k_dim, int v_dim,
                                            float* __restrict__ state, long long slot_len,
                                            long long conv_len, const int* __restrict__ seqs,
                                            const int* __restrict__ snaps, int num_seqs,
                                            bf16* __restrict__ out) {
    kiln_pdl_enter();
    extern __shared__ float smem[];
    float* S = smem;                 // [k_dim][v_dim]
    float* qs = S + k_dim * v_dim;   // [k_dim]
    float* ks = qs + k_dim;          // [k_dim]
    const int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    if (s >= num_seqs) return;
    const int* m = seqs + 6 * s;
    const int row0 = m[0], rows = m[1], slot = m[2], src = m[3], fresh = m[4];
    const int snap0 = m[5], snap1 = s + 1 < num_seqs ? seqs[6 * (s + 1) + 5] : seqs[6 * num_seqs];
    const long long head_len = (long long)k_dim * v_dim;
    if (slot < 0) {
        for (int t = 0; t < rows && j < v_dim; ++t)
            out[(long long)(row0 + t) * (v_heads * v_dim) + h * v_dim + j] = to_bf16(0.0f);
        return;
    }
    const float* from = state + (long long)src * slot_len + conv_len + h * head_len;
    for (long long e = j; e < head_len; e += blockDim.x) S[e] = fresh ? 0.0f : from[e];
    const int kh = h / (v_heads / k_heads);
    const float q_scale = rsqrtf((float)k_dim);
    const float neg_a = -__expf(a_log[h]);
    __syncthreads();
    for (int t = 0; t < rows; ++t) {
        const long long r = row0 + t;
        const float* mr = mixed + r * mixed_stride;
        // q and k of the key head, L2-normalized (q also scaled by k_dim^-0.5).
        float sq = 0.0f, sk = 0.0f;
        for (int i = j; i < k_dim; i += blockDim.x) {
            const float qv = mr[kh * k_dim + i], kv = mr[k_heads * k_dim + kh * k_dim + i];
            qs[i] = qv;
            ks[i] = kv;
            sq += qv * qv;
            sk += kv * kv;
        }
        sq = block_sum(sq);
        sk = block_sum(sk);
        const float iq = rsqrtf(sq + 1e-6f) * q_scale, ik = rsqrtf(sk + 1e-6f);
        const bf16* xr = x + r * x_stride;
        const float beta = recurrent_detail::sigmoid(to_f32(xr[b_col + h]));
        const float decay = __expf(neg_a * recurrent_detail::softplus(to_f32(xr[a_col + h]) + dt_bias[h]));
        float o = 0.0f;
        if (j < v_dim) {
            const float v = mr[2 * k_heads * k_dim + h * v_dim + j];
            float mem = 0.0f;
            for (int i = 0; i < k_dim; ++i) {
                const float sv = S[i * v_dim + j] * decay;
                S[i * v_dim + j] = sv;
                mem += sv * (ks[i] * ik);
            }
            const float delta = (v - mem) * beta;
            for (int i = 0; i < k_dim; ++i) {
                const float sv = S[i * v_dim + j] + (ks[i] * ik) * delta;
                S[i * v_dim + j] = sv;
                o += sv * (qs[i] * iq);
            }
        }
        // The gated RMSNorm over the head's v_dim outputs.
        const float ss = block_sum(j < v_dim ? o * o : 0.0f);
        if (j < v_dim) {
            const float inv = rsqrtf(ss / (float)v_dim + eps);
            const float z = to_f32(xr[z_col + h * v_dim + j]);
            out[r * (long long)(v_heads * v_dim) + h * v_dim + j] =
                to_bf16(norm_w[j] * (o * inv) * recurrent_detail::silu(z));
        }
        for (int q = snap0; q < snap1; ++q) {
            if (snaps[2 * q] == t + 1 && j < v_dim) {
                float* to = state + (long long)snaps[2 * q + 1] * slot_len + conv_len + h * head_len;
                for (int i = 0; i < k_dim; ++i) to[i * v_dim + j] = S[i * v_dim + j];
            }
        }
        __syncthreads();
    }
    float* own = state + (long long)slot * slot_len + conv_len + h * head_len;
    if (j < v_dim)
        for (int i = 0; i < k_dim; ++i) own[i * v_dim + j] = S[i * v_dim + j];
}

// gated_delta_rule for heads of k_dim <= DELTA_KMAX and v_dim <= 256: the same arguments, launch
// grid and block (sequences, v_heads; a thread a column j, blockDim.x a multiple of 32 >= v_dim,
// at most 256), dynamic shared
// memory (blockDim.x / 32) * 2 * DELTA_KMAX + 64 floats. A thread keeps its column of the state in
// registers; each warp stages the token's L2-normed q and k in its own shared memory (no block
// barrier), and the token's next inputs are loaded while it computes. With S' = decay S:
//   mem = S'^T k,  delta = (v - mem) beta,  S = S' + k delta^T,  o = S^T q = S'^T q + delta (k.q),
// so one pass over the state gives mem and S'^T q, a second updates it; one block barrier a token
// (the gated RMSNorm's sum over the head's v_dim outputs, double-buffered).
#define DELTA_KMAX 128
extern "C" __global__ void __launch_bounds__(256) gated_delta_rule_k128(
    const float* __restrict__ mixed, int mixed_stride, const bf16* __restrict__ x, long long x_stride,
    int z_col, int b_col, int a_col, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const float* __restrict__ norm_w, float eps, int k_heads, int v_heads, int k_dim, int v_dim,
    float* __restrict__ state, long long slot_len, long long conv_len, const int* __restrict__ seqs,
    const int* __restrict__ snaps, int num_seqs, bf16* __restrict__ out) {
    kiln_pdl_enter();
    extern __shared__ float smem[];
    constexpr int PER_LANE = DELTA_KMAX / 32;
    const int s = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    float* qs = smem + warp * 2 * DELTA_KMAX;  // this warp's normed q, then k
    float* ks = qs + DELTA_KMAX;
    float* red = smem + nwarps * 2 * DELTA_KMAX;  // [2][32]: the norm's partial sums, by token parity
    if (s >= num_seqs) return;
    const int* m = seqs + 6 * s;
    const int row0 = m[0], rows = m[1], slot = m[2], src = m[3], fresh = m[4];
    const int snap0 = m[5], snap1 = s + 1 < num_seqs ? seqs[6 * (s + 1) + 5] : seqs[6 * num_seqs];
    const long long head_len = (long long)k_dim * v_dim;
    const int vw = v_heads * v_dim;
    if (slot < 0) {
        for (int t = 0; t < rows && j < v_dim; ++t) out[(long long)(row0 + t) * vw + h * v_dim + j] = to_bf16(0.0f);
        return;
    }
    const bool col = j < v_dim;
    float S[DELTA_KMAX];
    const float* from = state + (long long)src * slot_len + conv_len + h * head_len;
#pragma unroll
    for (int i = 0; i < DELTA_KMAX; ++i) S[i] = (col && i < k_dim && !fresh) ? from[(long long)i * v_dim + j] : 0.0f;
    const int kh = h / (v_heads / k_heads);
    const float q_scale = rsqrtf((float)k_dim);
    const float neg_a = -__expf(a_log[h]);
    const float bias = dt_bias[h], nw = col ? norm_w[j] : 0.0f;
    // The inputs of token t: q and k pieces (lane l: elements l, l + 32, ...), v, z, b, a.
    float qv[PER_LANE], kv[PER_LANE], vv = 0.0f, zv = 0.0f, bv = 0.0f, av = 0.0f;
    auto load = [&](int t) {
        const long long r = row0 + t;
        const float* mr = mixed + r * mixed_stride;
        const bf16* xr = x + r * x_stride;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            const int i = lane + 32 * e;
            qv[e] = i < k_dim ? mr[kh * k_dim + i] : 0.0f;
            kv[e] = i < k_dim ? mr[k_heads * k_dim + kh * k_dim + i] : 0.0f;
        }
        vv = col ? mr[2 * k_heads * k_dim + h * v_dim + j] : 0.0f;
        zv = col ? to_f32(xr[z_col + h * v_dim + j]) : 0.0f;
        bv = to_f32(xr[b_col + h]);
        av = to_f32(xr[a_col + h]);
    };
    if (rows > 0) load(0);
    for (int t = 0; t < rows; ++t) {
        // This token's inputs, then the next token's loads in flight.
        float q[PER_LANE], k[PER_LANE];
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) q[e] = qv[e], k[e] = kv[e];
        const float v = vv, z = zv, beta = recurrent_detail::sigmoid(bv);
        const float decay = __expf(neg_a * recurrent_detail::softplus(av + bias));
        if (t + 1 < rows) load(t + 1);
        float sq = 0.0f, sk = 0.0f, sqk = 0.0f;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) sq += q[e] * q[e], sk += k[e] * k[e], sqk += q[e] * k[e];
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        sqk = warp_sum(sqk);
        const float iq = rsqrtf(sq + 1e-6f) * q_scale, ik = rsqrtf(sk + 1e-6f);
        __syncwarp();  // the previous token's q and k are read
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) qs[lane + 32 * e] = q[e] * iq, ks[lane + 32 * e] = k[e] * ik;
        __syncwarp();
        float mem0 = 0.0f, mem1 = 0.0f, sq0 = 0.0f, sq1 = 0.0f;
#pragma unroll
        for (int i = 0; i < DELTA_KMAX; i += 2) {
            if (i < k_dim) {
                S[i] *= decay;
                mem0 = fmaf(S[i], ks[i], mem0);
                sq0 = fmaf(S[i], qs[i], sq0);
            }
            if (i + 1 < k_dim) {
                S[i + 1] *= decay;
                mem1 = fmaf(S[i + 1], ks[i + 1], mem1);
                sq1 = fmaf(S[i + 1], qs[i + 1], sq1);
            }
        }
        const float delta = (v - (mem0 + mem1)) * beta;
#pragma unroll
        for (int i = 0; i < DELTA_KMAX; ++i)
            if (i < k_dim) S[i] = fmaf(ks[i], delta, S[i]);
        const float o = col ? (sq0 + sq1) + delta * (sqk * iq * ik) : 0.0f;
        // The gated RMSNorm over the head's v_dim outputs: one barrier, the sums by token parity.
        const float ss = warp_sum(o * o);
        if (lane == 0) red[(t & 1) * 32 + warp] = ss;
        __syncthreads();
        float tot = 0.0f;
        for (int w = 0; w < nwarps; ++w) tot += red[(t & 1) * 32 + w];
        if (col) {
            const float inv = rsqrtf(tot / (float)v_dim + eps);
            out[(long long)(row0 + t) * vw + h * v_dim + j] = to_bf16(nw * (o * inv) * recurrent_detail::silu(z));
        }
        for (int qn = snap0; qn < snap1; ++qn) {
            if (snaps[2 * qn] == t + 1 && col) {
                float* to = state + (long long)snaps[2 * qn + 1] * slot_len + conv_len + h * head_len;
#pragma unroll
                for (int i = 0; i < DELTA_KMAX; ++i)
                    if (i < k_dim) to[(long long)i * v_dim + j] = S[i];
            }
        }
    }
    float* own = state + (long long)slot * slot_len + conv_len + h * head_len;
    if (col) {
#pragma unroll
        for (int i = 0; i < DELTA_KMAX; ++i)
            if (i < k_dim) own[(long long)i * v_dim + j] = S[i];
    }
}
