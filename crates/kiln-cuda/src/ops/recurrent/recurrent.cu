// Recurrent token mixers over per-sequence state slots (kiln_tensor::recurrent): the causal
// depthwise convolution with its past inputs, and the gated delta rule of Qwen3.5's DeltaNet.
// Every sequence runs its tokens in order, as the CPU reference does (token by token, f32 state);
// the chunk-parallel prefill form is not here yet.
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

#define KILN_CONV_MAX_K 8

namespace recurrent_detail {
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }
}  // namespace recurrent_detail

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
