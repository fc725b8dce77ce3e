// embedding.cu: gather rows of the embedding table.
//
// Layout: ids [T] int32, table [V, D] packed, out [T, D] packed. An id outside [0, V) writes a
// zero row rather than reading outside the table (the engine validates ids before this).
// Launch: grid = T (one block per token), blockDim = 128; embedding_vec copies 16-byte vectors
// (D aligned to VEC_ELEMS), embedding_scalar one element a thread.
#include "common.cuh"

extern "C" __global__ void embedding_vec(scalar_t* out, const int* ids, const scalar_t* table,
                                         int vocab, int dim) {
    long long t = blockIdx.x;
    int id = ids[t];
    bool valid = id >= 0 && id < vocab;
    const scalar_t* src = table + (long long)(valid ? id : 0) * dim;
    scalar_t* dst = out + t * dim;
    for (int j = threadIdx.x * VEC_ELEMS; j < dim; j += blockDim.x * VEC_ELEMS) {
        Vec16 v = ldg16(src + j);
        if (!valid) v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
        stg16(dst + j, v);
    }
}

extern "C" __global__ void embedding_scalar(scalar_t* out, const int* ids, const scalar_t* table,
                                            int vocab, int dim) {
    long long t = blockIdx.x;
    int id = ids[t];
    bool valid = id >= 0 && id < vocab;
    const scalar_t* src = table + (long long)(valid ? id : 0) * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        out[t * dim + j] = valid ? src[j] : from_float(0.0f);
    }
}
