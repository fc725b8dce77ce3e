// norm.cu: RMSNorm and the fused residual-add + RMSNorm.
//
// embedding_rms_norm_*: the embedding gather and the first layer's RMSNorm in one launch (ids [T]
// int32, table [V, D] packed; an id outside [0, V) reads as a zero row, as embedding.cu writes it):
// s_out = the gathered rows, out = their RMSNorm, the same bits as embedding then rms_norm.
// Layout: x [T, D] with a row stride (elements; rows need not be packed), or for rms_norm also
// [T, H, D] with packed heads and a token stride; residual [T, D] with a row stride, weight [D] (scalar_t, or float32 for the *_wf32 kernels); outputs [T, D] packed.
// Launch: one block per row, blockDim = a multiple of 32 (about D / VEC_ELEMS threads), grid = T.
// The *_vec kernels move 16-byte vectors and need D, both strides and every pointer aligned to
// VEC_ELEMS elements; the *_scalar kernels take any shape.
// Rounding follows minillm/ops/numpy.py: s = round(x + residual); n = round(s / rms(s));
// out = round(weight * n), fp32 in between. Every load is a plain (coherent) load because the
// outputs may alias the inputs (in-place use), which each thread reads before it writes.
#include "common.cuh"

__device__ __forceinline__ Vec16 ld16(const scalar_t* p) {
    return *reinterpret_cast<const Vec16*>(p);
}

template <bool W_F32>
__device__ __forceinline__ float weight_at(const void* w, int i) {
    if (W_F32) return reinterpret_cast<const float*>(w)[i];
    return to_float(reinterpret_cast<const scalar_t*>(w)[i]);
}

// Pass 1 over one row: sum of squares of s (s = x, or round(x + residual) written to s_out).
template <bool ADD, bool VEC>
__device__ __forceinline__ float sum_squares(const scalar_t* xr, const scalar_t* rr, scalar_t* sr,
                                             int dim) {
    float ss = 0.0f;
    if (VEC) {
        for (int j = threadIdx.x; j < dim / VEC_ELEMS; j += blockDim.x) {
            float a[VEC_ELEMS];
            vec_to_floats(ld16(xr + j * VEC_ELEMS), a);
            if (ADD) {
                float b[VEC_ELEMS];
                vec_to_floats(ld16(rr + j * VEC_ELEMS), b);
#pragma unroll
                for (int e = 0; e < VEC_ELEMS; ++e) a[e] = round_to_scalar(__fadd_rn(a[e], b[e]));
                stg16(sr + j * VEC_ELEMS, floats_to_vec(a));
            }
#pragma unroll
            for (int e = 0; e < VEC_ELEMS; ++e) ss += a[e] * a[e];
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float a = to_float(xr[i]);
            if (ADD) {
                a = round_to_scalar(__fadd_rn(a, to_float(rr[i])));
                sr[i] = from_float(a);
            }
            ss += a * a;
        }
    }
    return ss;
}

// Pass 2: out = round(weight * round(s * inv)); src is x (plain) or s_out (fused add).
template <bool W_F32, bool VEC>
__device__ __forceinline__ void scale_row(scalar_t* orow, const scalar_t* src, const void* weight,
                                          int dim, float inv) {
    if (VEC) {
        for (int j = threadIdx.x; j < dim / VEC_ELEMS; j += blockDim.x) {
            float a[VEC_ELEMS];
            vec_to_floats(ld16(src + j * VEC_ELEMS), a);
#pragma unroll
            for (int e = 0; e < VEC_ELEMS; ++e) {
                float n = round_to_scalar(__fmul_rn(a[e], inv));
                a[e] = __fmul_rn(weight_at<W_F32>(weight, j * VEC_ELEMS + e), n);
            }
            stg16(orow + j * VEC_ELEMS, floats_to_vec(a));
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float n = round_to_scalar(__fmul_rn(to_float(src[i]), inv));
            orow[i] = from_float(__fmul_rn(weight_at<W_F32>(weight, i), n));
        }
    }
}

template <bool ADD, bool W_F32, bool VEC>
__device__ __forceinline__ void rms_norm_row(scalar_t* out, scalar_t* s_out, const scalar_t* x,
                                             const scalar_t* residual, const void* weight,
                                             int dim, long long x_stride, long long r_stride,
                                             float eps, int heads) {
    __shared__ float scratch[32];
    long long row = blockIdx.x;
    // heads > 1: x is [T, heads, dim] with packed heads and a token stride (per-head q/k norm
    // straight from the fused qkv buffer); row r is head r % heads of token r / heads.
    const scalar_t* xr = x + (row / heads) * x_stride + (row % heads) * (long long)dim;
    const scalar_t* rr = ADD ? residual + row * r_stride : nullptr;
    scalar_t* sr = ADD ? s_out + row * dim : nullptr;
    float ss = sum_squares<ADD, VEC>(xr, rr, sr, dim);
    float total = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(__fadd_rn(total / (float)dim, eps));
    scale_row<W_F32, VEC>(out + row * dim, ADD ? sr : xr, weight, dim, inv);
}

// Pass 1 of embedding_rms_norm: the row gathered into sr (zeros when !valid) and its sum of
// squares, in sum_squares' order.
template <bool VEC>
__device__ __forceinline__ float gather_sum_squares(const scalar_t* xr, scalar_t* sr, int dim, bool valid) {
    float ss = 0.0f;
    if (VEC) {
        for (int j = threadIdx.x; j < dim / VEC_ELEMS; j += blockDim.x) {
            Vec16 v = ld16(xr + j * VEC_ELEMS);
            if (!valid) v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
            stg16(sr + j * VEC_ELEMS, v);
            float a[VEC_ELEMS];
            vec_to_floats(v, a);
#pragma unroll
            for (int e = 0; e < VEC_ELEMS; ++e) ss += a[e] * a[e];
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const scalar_t x = valid ? xr[i] : from_float(0.0f);
            sr[i] = x;
            const float a = to_float(x);
            ss += a * a;
        }
    }
    return ss;
}

template <bool W_F32, bool VEC>
__device__ __forceinline__ void embedding_rms_norm_row(scalar_t* out, scalar_t* s_out, const int* ids,
                                                       const scalar_t* table, int vocab, const void* weight,
                                                       int dim, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const int id = ids[row];
    const bool valid = id >= 0 && id < vocab;
    scalar_t* sr = s_out + row * dim;
    float ss = gather_sum_squares<VEC>(table + (long long)(valid ? id : 0) * dim, sr, dim, valid);
    float total = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(__fadd_rn(total / (float)dim, eps));
    scale_row<W_F32, VEC>(out + row * dim, sr, weight, dim, inv);      // each thread reads what it wrote
}

#define EMBEDDING_RMS_NORM_KERNEL(NAME, W_F32, VEC)                                              \
    extern "C" __global__ void NAME(scalar_t* out, scalar_t* s_out, const int* ids,             \
                                    const scalar_t* table, int vocab, const void* weight,       \
                                    int dim, float eps) {                                       \
        embedding_rms_norm_row<W_F32, VEC>(out, s_out, ids, table, vocab, weight, dim, eps);    \
    }

#define RMS_NORM_KERNEL(NAME, W_F32, VEC)                                                        \
    extern "C" __global__ void NAME(scalar_t* out, const scalar_t* x, const void* weight,       \
                                    int dim, long long x_stride, float eps, int heads) {       \
        rms_norm_row<false, W_F32, VEC>(out, nullptr, x, nullptr, weight, dim, x_stride, 0,    \
                                        eps, heads);                                           \
    }

#define ADD_RMS_NORM_KERNEL(NAME, W_F32, VEC)                                                    \
    extern "C" __global__ void NAME(scalar_t* out, scalar_t* s_out, const scalar_t* x,         \
                                    const scalar_t* residual, const void* weight, int dim,     \
                                    long long x_stride, long long r_stride, float eps) {       \
        rms_norm_row<true, W_F32, VEC>(out, s_out, x, residual, weight, dim, x_stride,         \
                                       r_stride, eps, 1);                                      \
    }

RMS_NORM_KERNEL(rms_norm_vec, false, true)
RMS_NORM_KERNEL(rms_norm_vec_wf32, true, true)
RMS_NORM_KERNEL(rms_norm_scalar, false, false)
RMS_NORM_KERNEL(rms_norm_scalar_wf32, true, false)
ADD_RMS_NORM_KERNEL(add_rms_norm_vec, false, true)
ADD_RMS_NORM_KERNEL(add_rms_norm_vec_wf32, true, true)
ADD_RMS_NORM_KERNEL(add_rms_norm_scalar, false, false)
ADD_RMS_NORM_KERNEL(add_rms_norm_scalar_wf32, true, false)
EMBEDDING_RMS_NORM_KERNEL(embedding_rms_norm_vec, false, true)
EMBEDDING_RMS_NORM_KERNEL(embedding_rms_norm_vec_wf32, true, true)
EMBEDDING_RMS_NORM_KERNEL(embedding_rms_norm_scalar, false, false)
EMBEDDING_RMS_NORM_KERNEL(embedding_rms_norm_scalar_wf32, true, false)
