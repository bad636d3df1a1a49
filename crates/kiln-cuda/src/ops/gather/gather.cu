// Row and column gathers of bf16 activations: embedding lookups (rows of the table by token
// id), rows by index (the rows that need logits) and column blocks (splitting a packed
// projection).
#include "common.cuh"

// One row of d bf16 by the block: 16 bytes a thread where both rows allow it.
__device__ __forceinline__ void copy_row_bf16(const bf16* __restrict__ src, bf16* __restrict__ dst, int d) {
    if ((d & 7) == 0 && ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15ull) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* o = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < d / 8; i += blockDim.x) o[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
    }
}

// out[t, :] = table[ids[t], :]. One block per token.
extern "C" __global__ void embedding_bf16(const bf16* __restrict__ table, const unsigned int* __restrict__ ids,
                                          bf16* __restrict__ out, int d) {
    kiln_pdl_enter();
    const long long row = ids[blockIdx.x];
    copy_row_bf16(table + row * d, out + (long long)blockIdx.x * d, d);
}

// Rows `rows` of x [n, d] into out [len(rows), d].
extern "C" __global__ void gather_rows_bf16(const bf16* __restrict__ x, const unsigned int* __restrict__ rows,
                                            bf16* __restrict__ out, int d) {
    kiln_pdl_enter();
    copy_row_bf16(x + (long long)rows[blockIdx.x] * d, out + (long long)blockIdx.x * d, d);
}

// Columns [0, width) of every row of src (row stride src_stride) into dst [rows, width].
extern "C" __global__ void copy_cols_bf16(const bf16* __restrict__ src, long long src_stride, bf16* __restrict__ dst,
                                          int width, long long rows) {
    kiln_pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * width;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width, c = i % width;
        dst[i] = src[r * src_stride + c];
    }
}
