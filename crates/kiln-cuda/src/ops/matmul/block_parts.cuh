// The stacked weight of the block decode kernels (blocks.cu, fp8.cu): up to three parts of one
// format stacked by rows, as blocks.rs's `Parts` lays them out (three body pointers, three meta
// pointers, three row counts).
#pragma once

namespace block_parts {

struct Parts {
    const unsigned char* body[3];
    const unsigned char* meta[3];
    int rows[3];
};

// Row r's part (its bodies and metas) and its row there.
__device__ __forceinline__ void part_of(const Parts& p, int r, const unsigned char*& body,
                                        const unsigned char*& meta, int& local) {
    if (r < p.rows[0]) {
        body = p.body[0], meta = p.meta[0], local = r;
    } else if (r < p.rows[0] + p.rows[1]) {
        body = p.body[1], meta = p.meta[1], local = r - p.rows[0];
    } else {
        body = p.body[2], meta = p.meta[2], local = r - p.rows[0] - p.rows[1];
    }
}

}  // namespace block_parts
