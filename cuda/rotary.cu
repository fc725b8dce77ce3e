// rotary.cu: neox-style rotary embedding of q and k in one launch.
//
// Layout: q [T, Hq, Dh] and k [T, Hk, Dh], each with its own token stride in elements (heads
// packed inside a token, so views into a fused qkv buffer work); outputs q_out / k_out with their
// own token strides (they may be q and k themselves: each thread reads its pair before writing).
// positions [T] int32; cos_sin [max_pos, Dh] float32 with cos in the first Dh/2 columns and sin
// in the last Dh/2 (the model precomputes it, llama3 scaling included).
// Launch: grid = T (one block per token), blockDim = 128; a thread rotates CHUNK consecutive pairs
// (x[i], x[i + Dh/2]) of one head. CHUNK = VEC_ELEMS (16-byte loads, needs Dh/2, strides and
// pointers aligned to it) for rotary_vec, 1 for rotary_scalar.
#include "common.cuh"

template <int CHUNK>
__device__ __forceinline__ void load_chunk(const scalar_t* p, float* out) {
    if (CHUNK == VEC_ELEMS) {
        vec_to_floats(*reinterpret_cast<const Vec16*>(p), out);
    } else {
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) out[e] = to_float(p[e]);
    }
}

template <int CHUNK>
__device__ __forceinline__ void store_chunk(scalar_t* p, const float* in) {
    if (CHUNK == VEC_ELEMS) {
        stg16(p, floats_to_vec(in));
    } else {
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) p[e] = from_float(in[e]);
    }
}

template <int CHUNK>
__device__ __forceinline__ void rotary_token(scalar_t* q_out, scalar_t* k_out, const scalar_t* q,
                                             const scalar_t* k, const int* positions,
                                             const float* cos_sin, int num_heads,
                                             int num_kv_heads, int head_dim, long long q_stride,
                                             long long k_stride, long long qo_stride,
                                             long long ko_stride) {
    long long t = blockIdx.x;
    int half = head_dim / 2;
    int chunks = half / CHUNK;
    const float* cs = cos_sin + (long long)positions[t] * head_dim;
    int total = (num_heads + num_kv_heads) * chunks;
    for (int w = threadIdx.x; w < total; w += blockDim.x) {
        int head = w / chunks, c = (w % chunks) * CHUNK;
        const scalar_t* src;
        scalar_t* dst;
        if (head < num_heads) {
            src = q + t * q_stride + (long long)head * head_dim;
            dst = q_out + t * qo_stride + (long long)head * head_dim;
        } else {
            src = k + t * k_stride + (long long)(head - num_heads) * head_dim;
            dst = k_out + t * ko_stride + (long long)(head - num_heads) * head_dim;
        }
        float x1[CHUNK], x2[CHUNK];
        load_chunk<CHUNK>(src + c, x1);
        load_chunk<CHUNK>(src + half + c, x2);
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) {
            float cosv = cs[c + e], sinv = cs[half + c + e];
            // Separate roundings (no fused multiply-add) to agree with the fp32 reference.
            float y1 = __fsub_rn(__fmul_rn(x1[e], cosv), __fmul_rn(x2[e], sinv));
            float y2 = __fadd_rn(__fmul_rn(x2[e], cosv), __fmul_rn(x1[e], sinv));
            x1[e] = y1;
            x2[e] = y2;
        }
        store_chunk<CHUNK>(dst + c, x1);
        store_chunk<CHUNK>(dst + half + c, x2);
    }
}

#define ROTARY_KERNEL(NAME, CHUNK)                                                               \
    extern "C" __global__ void NAME(scalar_t* q_out, scalar_t* k_out, const scalar_t* q,         \
                                    const scalar_t* k, const int* positions,                     \
                                    const float* cos_sin, int num_heads, int num_kv_heads,       \
                                    int head_dim, long long q_stride, long long k_stride,        \
                                    long long qo_stride, long long ko_stride) {                  \
        rotary_token<CHUNK>(q_out, k_out, q, k, positions, cos_sin, num_heads, num_kv_heads,     \
                            head_dim, q_stride, k_stride, qo_stride, ko_stride);                 \
    }

ROTARY_KERNEL(rotary_vec, VEC_ELEMS)
ROTARY_KERNEL(rotary_scalar, 1)
