// rotary.cu: neox-style rotary embedding of q and k in one launch, and the fused per-head q/k
// RMSNorm + rotary + KV append of a layer.
//
// Layout: q [T, Hq, Dh] and k [T, Hk, Dh], each with its own token stride in elements (heads
// packed inside a token, so views into a fused qkv buffer work); outputs q_out / k_out with their
// own token strides (they may be q and k themselves: each thread reads its pair before writing).
// positions [T] int32; cos_sin [max_pos, Dh] float32 with cos in the first Dh/2 columns and sin
// in the last Dh/2 (the model precomputes it, llama3 scaling included).
// Launch: grid = T (one block per token), blockDim = 128; a thread rotates CHUNK consecutive pairs
// (x[i], x[i + Dh/2]) of one head. CHUNK = VEC_ELEMS (16-byte loads, needs Dh/2, strides and
// pointers aligned to it) for rotary_vec, 1 for rotary_scalar.
//
// qk_norm_rotary_kv_append / rotary_kv_append (compiled per HEAD_DIM, and with KV_FP8=1 for an FP8
// cache): one launch does what rms_norm (per head, Qwen3's q_norm / k_norm; the first kernel only),
// rotary and kv_append do in three or four, with the same roundings, so the results are the
// same bits. q, k, v [T, H*, HEAD_DIM] with token strides (views of the fused qkv buffer); q_out
// [T, Hq, HEAD_DIM] with its token stride; weights q_norm / k_norm [HEAD_DIM] in scalar_t; caches,
// slot_mapping and kv_scales as in kv_append.cu.
// Launch: grid = T, blockDim = 128. A group of FG_LANES = HEAD_DIM / VEC_ELEMS lanes (a power of
// two <= 32) owns one head row, lane j its 16-byte vector j; the block's groups walk the tasks
// [q heads | k heads | v heads] with common.cuh's head_norm / head_rotate (the RMS a shuffle sum
// within the group in the order of rms_norm's one-warp block_sum; rotary partners in lanes j and
// j ^ FG_LANES/2).
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif

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

// ---------------------------------------------------------------------------------------------
// Fused per-head q/k RMSNorm + rotary + KV append.
#define FG_LANES (HEAD_DIM / VEC_ELEMS)
#if HEAD_DIM % (2 * VEC_ELEMS) == 0 && FG_LANES <= 32 && (FG_LANES & (FG_LANES - 1)) == 0

template <bool QK_NORM>
__device__ __forceinline__ void fused_token(scalar_t* q_out, cache_t* k_cache, cache_t* v_cache,
                                            const scalar_t* q, const scalar_t* k, const scalar_t* v,
                                            const scalar_t* q_norm, const scalar_t* k_norm, float eps,
                                            const int* positions, const float* cos_sin,
                                            const int* slot_mapping, const float* kv_scales,
                                            int num_heads, int num_kv_heads, long long q_stride,
                                            long long k_stride, long long v_stride,
                                            long long qo_stride, long long num_slots) {
    const long long t = blockIdx.x;
    const int j = threadIdx.x % FG_LANES, group = threadIdx.x / FG_LANES;
    const int num_groups = blockDim.x / FG_LANES;
    const int num_tasks = num_heads + 2 * num_kv_heads;
    const long long slot = slot_mapping[t];
    const bool store_kv = slot >= 0 && slot < num_slots;
    const float* cs = cos_sin + (long long)positions[t] * HEAD_DIM;
#if KV_FP8
    const float k_scale = kv_scales[0], v_scale = kv_scales[1];
#else
    const float k_scale = 1.0f, v_scale = 1.0f;
#endif
    const long long row = (long long)num_kv_heads * HEAD_DIM;
    // Every lane runs every round (the shuffles need the whole warp); a lane past the tasks idles.
    for (int base = 0; base < num_tasks; base += num_groups) {
        const int task = min(base + group, num_tasks - 1);
        const bool active = base + group < num_tasks;
        const bool is_q = task < num_heads, is_v = task >= num_heads + num_kv_heads;
        const int head = is_q ? task : task - num_heads - (is_v ? num_kv_heads : 0);
        const scalar_t* src = is_q ? q + t * q_stride : (is_v ? v + t * v_stride : k + t * k_stride);
        float a[VEC_ELEMS];
        vec_to_floats(*reinterpret_cast<const Vec16*>(src + (long long)head * HEAD_DIM + j * VEC_ELEMS), a);
        if (QK_NORM) head_norm<HEAD_DIM>(a, is_q ? q_norm : k_norm, j, eps);   // v rows compute it too, unused
        float r[VEC_ELEMS];
#pragma unroll
        for (int e = 0; e < VEC_ELEMS; ++e) r[e] = a[e];
        head_rotate<HEAD_DIM>(r, cs, j);
        if (!active) continue;
        const int col = head * HEAD_DIM + j * VEC_ELEMS;
        if (is_q) {
            stg16(q_out + t * qo_stride + col, floats_to_vec(r));
        } else if (store_kv) {
            if (is_v) {
                vec_to_floats(*reinterpret_cast<const Vec16*>(src + col), a);   // v: as it came
                store_cache_vec(v_cache + slot * row + col, a, v_scale);
            } else {
                store_cache_vec(k_cache + slot * row + col, r, k_scale);
            }
        }
    }
}

#define FUSED_KERNEL(NAME, QK_NORM)                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                            \
    NAME(scalar_t* q_out, cache_t* k_cache, cache_t* v_cache, const scalar_t* q,                 \
         const scalar_t* k, const scalar_t* v, const scalar_t* q_norm, const scalar_t* k_norm,   \
         float eps, const int* positions, const float* cos_sin, const int* slot_mapping,         \
         const float* kv_scales, int num_heads, int num_kv_heads, long long q_stride,            \
         long long k_stride, long long v_stride, long long qo_stride, long long num_slots) {     \
        fused_token<QK_NORM>(q_out, k_cache, v_cache, q, k, v, q_norm, k_norm, eps, positions,    \
                             cos_sin, slot_mapping, kv_scales, num_heads, num_kv_heads,          \
                             q_stride, k_stride, v_stride, qo_stride, num_slots);                \
    }

FUSED_KERNEL(qk_norm_rotary_kv_append, true)
FUSED_KERNEL(rotary_kv_append, false)
#endif
