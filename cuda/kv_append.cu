// kv_append.cu: write this step's K and V rows into the paged caches through the slot mapping.
//
// Layout: k, v [T, Hk, Dh], each with its own token stride in elements (heads packed inside a
// token); k_cache, v_cache [num_blocks, block_size, Hk, Dh] packed, so slot s = block *
// block_size + offset is row s of a [num_blocks * block_size, Hk * Dh] matrix. slot_mapping [T]
// int32: -1 (or any slot outside the pool) skips the token.
// Launch: grid = T (one block per token), blockDim = 128; kv_append_vec moves 16-byte vectors
// (Hk * Dh, strides and pointers aligned to VEC_ELEMS), kv_append_scalar one element a thread.
#include "common.cuh"

template <bool VEC>
__device__ __forceinline__ void append_token(scalar_t* k_cache, scalar_t* v_cache,
                                             const scalar_t* k, const scalar_t* v,
                                             const int* slot_mapping, int row_elems,
                                             long long num_slots, long long k_stride,
                                             long long v_stride) {
    long long t = blockIdx.x;
    long long slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const scalar_t* ks = k + t * k_stride;
    const scalar_t* vs = v + t * v_stride;
    scalar_t* kd = k_cache + slot * row_elems;
    scalar_t* vd = v_cache + slot * row_elems;
    if (VEC) {
        for (int j = threadIdx.x * VEC_ELEMS; j < row_elems; j += blockDim.x * VEC_ELEMS) {
            stg16(kd + j, *reinterpret_cast<const Vec16*>(ks + j));
            stg16(vd + j, *reinterpret_cast<const Vec16*>(vs + j));
        }
    } else {
        for (int j = threadIdx.x; j < row_elems; j += blockDim.x) {
            kd[j] = ks[j];
            vd[j] = vs[j];
        }
    }
}

extern "C" __global__ void kv_append_vec(scalar_t* k_cache, scalar_t* v_cache, const scalar_t* k,
                                         const scalar_t* v, const int* slot_mapping,
                                         int row_elems, long long num_slots, long long k_stride,
                                         long long v_stride) {
    append_token<true>(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots, k_stride,
                       v_stride);
}

extern "C" __global__ void kv_append_scalar(scalar_t* k_cache, scalar_t* v_cache,
                                            const scalar_t* k, const scalar_t* v,
                                            const int* slot_mapping, int row_elems,
                                            long long num_slots, long long k_stride,
                                            long long v_stride) {
    append_token<false>(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots, k_stride,
                        v_stride);
}
