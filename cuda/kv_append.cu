// kv_append.cu: write this step's K and V rows into the paged caches through the slot mapping,
// and the absolute maxima of K and V that calibrate an FP8 cache's scales.
//
// Layout: k, v [T, Hk, Dh], each with its own token stride in elements (heads packed inside a
// token); k_cache, v_cache [num_blocks, block_size, Hk, Dh] packed, so slot s = block *
// block_size + offset is row s of a [num_blocks * block_size, Hk * Dh] matrix. slot_mapping [T]
// int32: -1 (or any slot outside the pool) skips the token. With KV_FP8=1 the caches are uint8
// E4M3 bits and kv_scales [2] float32 holds (k_scale, v_scale): an element is stored as
// e4m3(x / scale), division rounded to nearest, saturated to +-448 (minillm/fp8.py's rule, bit
// for bit); otherwise kv_scales is not read (it may be null).
// Launch: grid = T (one block per token), blockDim = 128; kv_append_vec moves 16-byte vectors of
// k / v (Hk * Dh, strides and pointers aligned to VEC_ELEMS; an FP8 cache then takes VEC_ELEMS
// bytes per vector), kv_append_scalar one element a thread.
// kv_absmax: grid = T, blockDim = 128; absmax [2] float32 (zeroed by the caller) gets max|k| and
// max|v| over all tokens through an atomicMax on the float bits (non-negative floats order as
// their bits do).
#include "common.cuh"

template <bool VEC>
__device__ __forceinline__ void append_token(cache_t* k_cache, cache_t* v_cache,
                                             const scalar_t* k, const scalar_t* v,
                                             const int* slot_mapping, int row_elems,
                                             long long num_slots, long long k_stride,
                                             long long v_stride, const float* kv_scales) {
    long long t = blockIdx.x;
    long long slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const scalar_t* ks = k + t * k_stride;
    const scalar_t* vs = v + t * v_stride;
    cache_t* kd = k_cache + slot * row_elems;
    cache_t* vd = v_cache + slot * row_elems;
#if KV_FP8
    const float k_scale = kv_scales[0], v_scale = kv_scales[1];
#endif
    if (VEC) {
        for (int j = threadIdx.x * VEC_ELEMS; j < row_elems; j += blockDim.x * VEC_ELEMS) {
#if KV_FP8
            float a[VEC_ELEMS];
            vec_to_floats(*reinterpret_cast<const Vec16*>(ks + j), a);
            store_cache_vec(kd + j, a, k_scale);
            vec_to_floats(*reinterpret_cast<const Vec16*>(vs + j), a);
            store_cache_vec(vd + j, a, v_scale);
#else
            stg16(kd + j, *reinterpret_cast<const Vec16*>(ks + j));
            stg16(vd + j, *reinterpret_cast<const Vec16*>(vs + j));
#endif
        }
    } else {
        for (int j = threadIdx.x; j < row_elems; j += blockDim.x) {
#if KV_FP8
            kd[j] = float_to_e4m3(__fdiv_rn(to_float(ks[j]), k_scale));
            vd[j] = float_to_e4m3(__fdiv_rn(to_float(vs[j]), v_scale));
#else
            kd[j] = ks[j];
            vd[j] = vs[j];
#endif
        }
    }
}

extern "C" __global__ void kv_append_vec(cache_t* k_cache, cache_t* v_cache, const scalar_t* k,
                                         const scalar_t* v, const int* slot_mapping,
                                         int row_elems, long long num_slots, long long k_stride,
                                         long long v_stride, const float* kv_scales) {
    append_token<true>(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots, k_stride,
                       v_stride, kv_scales);
}

extern "C" __global__ void kv_append_scalar(cache_t* k_cache, cache_t* v_cache,
                                            const scalar_t* k, const scalar_t* v,
                                            const int* slot_mapping, int row_elems,
                                            long long num_slots, long long k_stride,
                                            long long v_stride, const float* kv_scales) {
    append_token<false>(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots, k_stride,
                        v_stride, kv_scales);
}

extern "C" __global__ void kv_absmax(float* absmax, const scalar_t* k, const scalar_t* v,
                                     int row_elems, long long k_stride, long long v_stride) {
    __shared__ float scratch[32];
    long long t = blockIdx.x;
    float mk = 0.0f, mv = 0.0f;
    for (int j = threadIdx.x; j < row_elems; j += blockDim.x) {
        mk = fmaxf(mk, fabsf(to_float(k[t * k_stride + j])));
        mv = fmaxf(mv, fabsf(to_float(v[t * v_stride + j])));
    }
    mk = block_max(mk, scratch);
    mv = block_max(mv, scratch);
    if (threadIdx.x == 0) {
        atomicMax(reinterpret_cast<unsigned int*>(absmax), __float_as_uint(mk));
        atomicMax(reinterpret_cast<unsigned int*>(absmax) + 1, __float_as_uint(mv));
    }
}
