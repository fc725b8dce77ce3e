// gemm.cu: the kernels around the projection GEMMs of minillm/ops/gemm.py.
//
// splitk_reduce: the second half of a split-K product. ws [S, T * N] float32 packed holds the S
// partial products of K slices (one strided-batched cuBLAS GEMM wrote them); out [T * N] packed in
// scalar_t gets round(sum_s ws[s] (+ out when accumulate)): the slices are summed in fp32 in slice
// order, the bias already in out (beta = 1) is added last, and the result is rounded once, as the
// fp32 epilogue of one GEMM does. Launch: 1-D grid over T * N / VEC4 items (VEC4 = 4 consecutive
// outputs, float4 loads) when T * N % 4 == 0, else over T * N single outputs; 256 threads a block.
// max_abs_diff: stats[0] = max |a - b|, stats[1] = max |b| over n packed scalar_t elements, as
// float bits in uint32 (non-negative floats order like their bits; a NaN anywhere gives NaN bits,
// larger than every number). The tuner checks each candidate's output against the default's with
// it. Launch: 1-D grid over n, 256 threads; stats zeroed first.
#include "common.cuh"

__device__ __forceinline__ float finish(float acc, const scalar_t* out, long long i, int accumulate) {
    return accumulate ? acc + to_float(out[i]) : acc;
}

extern "C" __global__ void splitk_reduce_vec4(scalar_t* out, const float* ws, long long mn, int splits,
                                              int accumulate) {
    long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // group of 4 outputs
    if (q * 4 >= mn) return;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < splits; ++s) {
        float4 p = reinterpret_cast<const float4*>(ws + (long long)s * mn)[q];
        acc.x += p.x;
        acc.y += p.y;
        acc.z += p.z;
        acc.w += p.w;
    }
    long long i = q * 4;
    out[i] = from_float(finish(acc.x, out, i, accumulate));
    out[i + 1] = from_float(finish(acc.y, out, i + 1, accumulate));
    out[i + 2] = from_float(finish(acc.z, out, i + 2, accumulate));
    out[i + 3] = from_float(finish(acc.w, out, i + 3, accumulate));
}

extern "C" __global__ void splitk_reduce_scalar(scalar_t* out, const float* ws, long long mn, int splits,
                                                int accumulate) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= mn) return;
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) acc += ws[(long long)s * mn + i];
    out[i] = from_float(finish(acc, out, i, accumulate));
}

extern "C" __global__ void max_abs_diff(unsigned int* stats, const scalar_t* a, const scalar_t* b,
                                        long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float diff = 0.0f, mag = 0.0f;
    if (i < n) {
        float y = to_float(b[i]);
        diff = fabsf(to_float(a[i]) - y);
        mag = fabsf(y);
    }
    // NaN compares false: keep it by comparing bits, which order non-negative floats and put NaN last.
    unsigned int d = __float_as_uint(diff), m = __float_as_uint(mag);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        d = max(d, __shfl_xor_sync(FULL_MASK, d, o));
        m = max(m, __shfl_xor_sync(FULL_MASK, m, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(stats, d);
        atomicMax(stats + 1, m);
    }
}
