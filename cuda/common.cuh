// common.cuh: storage types, conversions, 16-byte vectors and reductions shared by the kernels.
//
// Every .cu file is compiled once per activation dtype with MINILLM_DTYPE set to 0 (float32),
// 1 (float16) or 2 (bfloat16); `scalar_t` is the storage type of activations. KV caches hold
// `cache_t`: scalar_t, or with KV_FP8=1 one byte of FP8 E4M3 bits (kv_cache_dtype="fp8"), stored as
// e4m3(x / scale) with saturation and read as float(bits) * scale (minillm/fp8.py is the rule).
// 16-bit values travel as raw `unsigned short` bits and convert through PTX `cvt`, so no CUDA
// header is needed: NVRTC (through CuPy) and nvcc take the same text. The Python loader inlines
// this file in place of its #include line. Arithmetic is always fp32.
#pragma once

#ifndef MINILLM_DTYPE
#define MINILLM_DTYPE 2
#endif

// VEC_ELEMS: elements of scalar_t in one 16-byte vector (a preprocessor constant).
#if MINILLM_DTYPE == 0
typedef float scalar_t;
#define VEC_ELEMS 4
#else
typedef unsigned short scalar_t;
#define VEC_ELEMS 8
#endif

#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8
typedef unsigned char cache_t;
#else
typedef scalar_t cache_t;
#endif

#define MINILLM_INF __int_as_float(0x7f800000)
#define FULL_MASK 0xffffffffu

struct alignas(16) Vec16 {
    unsigned int w[4];
};

// 8 bytes (the CUDA vector types are left out so that no header is needed).
struct alignas(8) Vec8 {
    unsigned int w[2];
};

__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ float f16_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned short float_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// scalar_t <-> float, rounding to nearest even as NumPy's astype does.
__device__ __forceinline__ float to_float(scalar_t x) {
#if MINILLM_DTYPE == 0
    return x;
#elif MINILLM_DTYPE == 1
    return f16_bits_to_float(x);
#else
    return bf16_bits_to_float(x);
#endif
}

__device__ __forceinline__ scalar_t from_float(float f) {
#if MINILLM_DTYPE == 0
    return f;
#elif MINILLM_DTYPE == 1
    return float_to_f16_bits(f);
#else
    return float_to_bf16_bits(f);
#endif
}

// Round a float through scalar_t (the reference's `.astype(dtype)` between two fp32 steps).
__device__ __forceinline__ float round_to_scalar(float f) {
    return to_float(from_float(f));
}

// Element i (0 <= i < VEC_ELEMS) of a 16-byte vector as float; i must be a compile-time constant
// after unrolling so the vector stays in registers.
__device__ __forceinline__ float vec_get(const Vec16& v, int i) {
#if MINILLM_DTYPE == 0
    return __uint_as_float(v.w[i]);
#else
    unsigned int word = v.w[i >> 1];
    unsigned short h = (i & 1) ? (unsigned short)(word >> 16) : (unsigned short)(word & 0xffffu);
    return to_float(h);
#endif
}

// Unpack a 16-byte vector into VEC_ELEMS floats.
__device__ __forceinline__ void vec_to_floats(const Vec16& v, float* out) {
#pragma unroll
    for (int i = 0; i < VEC_ELEMS; ++i) out[i] = vec_get(v, i);
}

// Pack VEC_ELEMS floats into a 16-byte vector of scalar_t.
__device__ __forceinline__ Vec16 floats_to_vec(const float* in) {
    Vec16 v;
#if MINILLM_DTYPE == 0
#pragma unroll
    for (int i = 0; i < 4; ++i) v.w[i] = __float_as_uint(in[i]);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned int lo = from_float(in[2 * i]);
        unsigned int hi = from_float(in[2 * i + 1]);
        v.w[i] = lo | (hi << 16);
    }
#endif
    return v;
}

// ---- FP8 E4M3 (PTX cvt, sm_89+) ----------------------------------------------------------------

// Two floats -> two E4M3 bytes, `lo` in the low byte: round to nearest even, saturated to +-448
// (.satfinite: infinities and overflows clamp to the largest finite value, NaN stays NaN).
__device__ __forceinline__ unsigned short floats_to_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ unsigned char float_to_e4m3(float f) {
    return (unsigned char)(floats_to_e4m3x2(f, 0.0f) & 0xffu);
}

// Two E4M3 bytes (bits 0..7 and 8..15 of b) -> their values as fp16, packed (the low byte's in
// the low half), in one hardware conversion (sm_89+). Exact: every E4M3 value, subnormals
// included, is a normal fp16 (2^-9 up to 448), and the NaN codes give NaN.
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2(unsigned short b) {
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(b));
    return h2;
}

// Packed fp16 pair -> two floats (exact).
__device__ __forceinline__ void f16x2_to_floats(unsigned int h2, float* lo, float* hi) {
    asm("{ .reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h; }"
        : "=f"(*lo), "=f"(*hi) : "r"(h2));
}

// Four E4M3 bytes of a word (byte i is element i) -> four floats, exactly: two pair conversions
// and four fp16 widenings, no per-byte shifts or masks.
__device__ __forceinline__ void e4m3x4_to_floats(unsigned int w, float* out) {
    f16x2_to_floats(e4m3x2_to_f16x2((unsigned short)(w & 0xffffu)), &out[0], &out[1]);
    f16x2_to_floats(e4m3x2_to_f16x2((unsigned short)(w >> 16)), &out[2], &out[3]);
}

// The E4M3 byte in the low 8 bits of b (higher bits ignored) -> its value, exactly.
__device__ __forceinline__ float e4m3_to_float(unsigned int b) {
    float lo, hi;
    f16x2_to_floats(e4m3x2_to_f16x2((unsigned short)(b & 0xffu)), &lo, &hi);
    return lo;
}

// A cache element as float: dequantised (bits * scale) for FP8, the value itself otherwise.
__device__ __forceinline__ float cache_to_float(cache_t c, float scale) {
#if KV_FP8
    return e4m3_to_float(c) * scale;
#else
    return to_float(c);
#endif
}

// VEC_ELEMS values -> their VEC_ELEMS cache elements at dst: E4M3 bytes of x / scale (division
// rounded to nearest, as the NumPy twin divides) for FP8, else the values rounded to scalar_t.
__device__ __forceinline__ void store_cache_vec(cache_t* dst, const float* x, float scale) {
#if KV_FP8
    unsigned int w[VEC_ELEMS / 4];
#pragma unroll
    for (int i = 0; i < VEC_ELEMS / 4; ++i) {
        unsigned int lo = floats_to_e4m3x2(__fdiv_rn(x[4 * i], scale), __fdiv_rn(x[4 * i + 1], scale));
        unsigned int hi = floats_to_e4m3x2(__fdiv_rn(x[4 * i + 2], scale), __fdiv_rn(x[4 * i + 3], scale));
        w[i] = lo | (hi << 16);
    }
#if VEC_ELEMS == 8
    Vec8 packed;
    packed.w[0] = w[0];
    packed.w[1] = w[1];
    *reinterpret_cast<Vec8*>(dst) = packed;
#else
    *reinterpret_cast<unsigned int*>(dst) = w[0];
#endif
#else
    *reinterpret_cast<Vec16*>(dst) = floats_to_vec(x);
#endif
}

// Read-only 16-byte global load (the data is not written during the kernel).
__device__ __forceinline__ Vec16 ldg16(const void* p) {
    Vec16 r;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
        : "l"(p));
    return r;
}

__device__ __forceinline__ void stg16(void* p, const Vec16& v) {
    *reinterpret_cast<Vec16*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block; every thread gets the total. `scratch` holds 32 floats; blockDim.x is a
// multiple of 32. Contains __syncthreads, so every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < num_warps ? scratch[lane] : -MINILLM_INF;
    return warp_max(t);
}

// Split-K attention partials of one (query row, head) merged into dst[0..D): each split's output
// (normalised by its own sum) weighted by its sum * 2^(its max - the largest max), where partial s
// is part_o[(base + s) * D ..] and part_ml[(base + s) * 2 ..] = (max in log2 units, sum); a split
// with max -inf (no keys) weighs nothing. Thread i of the block writes dims i, i + blockDim.x, ...
template <int D>
__device__ __forceinline__ void merge_split_partials(scalar_t* dst, const float* part_o, const float* part_ml,
                                                     long long base, int num_splits) {
    float mx = -MINILLM_INF;
    for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float sum = 0.0f, acc = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float ms = part_ml[(base + s) * 2];
            const float w = ms == -MINILLM_INF ? 0.0f : part_ml[(base + s) * 2 + 1] * exp2f(ms - mx);
            sum += w;
            acc += w * part_o[(base + s) * D + d];
        }
        dst[d] = from_float(sum > 0.0f ? acc / sum : 0.0f);
    }
}

// ---- one head row held by a group of D / VEC_ELEMS lanes (lane j: its 16-byte vector j) -------
// Used where a kernel normalises and rotates q / k heads itself (rotary.cu's fused append, the
// decode kernel that does the append). D / VEC_ELEMS must be a power of two <= 32 and D a
// multiple of 2 * VEC_ELEMS; every lane of the warp must take part (the shuffles).

// Sum over the D / VEC_ELEMS lanes of a group, in the butterfly order of warp_sum (lanes past a
// one-warp block's row add zeros there, which changes no bit).
template <int D>
__device__ __forceinline__ float head_group_sum(float v) {
#pragma unroll
    for (int o = D / VEC_ELEMS / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// RMSNorm of the row as rms_norm_vec computes it (weight [D] in scalar_t), each value rounded to
// scalar_t as its output is.
template <int D>
__device__ __forceinline__ void head_norm(float (&a)[VEC_ELEMS], const scalar_t* weight, int j, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) ss += a[e] * a[e];
    float total = head_group_sum<D>(ss);
    float inv = 1.0f / sqrtf(__fadd_rn(total / (float)D, eps));
    float w[VEC_ELEMS];
    vec_to_floats(*reinterpret_cast<const Vec16*>(weight + j * VEC_ELEMS), w);
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) a[e] = round_to_scalar(__fmul_rn(w[e], round_to_scalar(__fmul_rn(a[e], inv))));
}

// Neox rotary of the row at the position whose table row is cs ([D]: cos | sin), rotary_vec's
// arithmetic (separate roundings), rounded to scalar_t; partners x[i], x[i + D/2] sit in lanes j
// and j ^ (lanes / 2).
template <int D>
__device__ __forceinline__ void head_rotate(float (&a)[VEC_ELEMS], const float* cs, int j) {
    constexpr int lanes = D / VEC_ELEMS, half = D / 2;
    const bool first = j < lanes / 2;
    const int c = (first ? j : j - lanes / 2) * VEC_ELEMS;      // column in the first half
    float other[VEC_ELEMS];
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) other[e] = __shfl_xor_sync(FULL_MASK, a[e], lanes / 2);
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) {
        float cosv = cs[c + e], sinv = cs[half + c + e];
        float x1 = first ? a[e] : other[e], x2 = first ? other[e] : a[e];
        float y = first ? __fsub_rn(__fmul_rn(x1, cosv), __fmul_rn(x2, sinv))
                        : __fadd_rn(__fmul_rn(x2, cosv), __fmul_rn(x1, sinv));
        a[e] = round_to_scalar(y);
    }
}

// The shared-memory address of p (a pointer into shared memory) for cp.async and ldmatrix.
__device__ __forceinline__ unsigned int smem_u32(const void* p) {
    unsigned int r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// ---- warp-level tensor-core pieces (the attention kernels' tiles: ldmatrix, mma.sync) ----------

__device__ __forceinline__ void ldsm_x4(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c[16x8] += a[16x16] * b[16x8], fp32 accumulators; the operands fp16 (F16) or bf16.
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned int (&a)[4], unsigned int b0,
                                          unsigned int b1) {
    if constexpr (F16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats -> a packed pair of fp16 (F16) or bf16 values, `lo` in the low half (the lower column).
template <bool F16>
__device__ __forceinline__ unsigned int pack_16x2(float lo, float hi) {
    unsigned int r;
    if constexpr (F16) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// Two floats -> a packed pair of 16-bit activations (scalar_t of a 16-bit dtype).
__device__ __forceinline__ unsigned int pack2(float lo, float hi) { return pack_16x2<MINILLM_DTYPE == 1>(lo, hi); }

// 2^x on the special-function unit (exp2(-inf) = 0; results below 2^-126 flush to 0, far under the
// fp32 resolution of a softmax sum that is at least 1).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16-byte global -> shared copy; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
