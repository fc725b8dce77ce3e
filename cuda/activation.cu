// activation.cu: SiLU-and-mul of the fused gate/up projection, and the bias broadcast that
// linear() uses before a beta=1 GEMM (so the bias is added inside cuBLAS's fp32 epilogue and the
// result is rounded once, as the reference does).
//
// silu_and_mul: x [T, 2I] with a row stride in elements, [gate | up] per row -> out [T, I]
// packed: out = round(silu(gate) * up), fp32 in between. Launch: 1-D grid over T * I / CHUNK
// work items, 256 threads a block; CHUNK = VEC_ELEMS for silu_and_mul_vec (I, stride and
// pointers aligned to it), 1 for silu_and_mul_scalar.
// bias_broadcast: out [T, N] packed = bias [N] on every row. Launch: 1-D grid over T * N.
#include "common.cuh"

__device__ __forceinline__ float silu_mul(float g, float u) {
    // g / (1 + exp(-g)) * u with separate roundings, as NumPy evaluates it.
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

extern "C" __global__ void silu_and_mul_vec(scalar_t* out, const scalar_t* x, long long rows,
                                            int inter, long long x_stride) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int per_row = inter / VEC_ELEMS;
    if (idx >= rows * per_row) return;
    long long t = idx / per_row;
    int j = (int)(idx % per_row) * VEC_ELEMS;
    const scalar_t* xr = x + t * x_stride;
    float g[VEC_ELEMS], u[VEC_ELEMS];
    vec_to_floats(*reinterpret_cast<const Vec16*>(xr + j), g);
    vec_to_floats(*reinterpret_cast<const Vec16*>(xr + inter + j), u);
#pragma unroll
    for (int e = 0; e < VEC_ELEMS; ++e) g[e] = silu_mul(g[e], u[e]);
    stg16(out + t * inter + j, floats_to_vec(g));
}

extern "C" __global__ void silu_and_mul_scalar(scalar_t* out, const scalar_t* x, long long rows,
                                               int inter, long long x_stride) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * inter) return;
    long long t = idx / inter;
    int j = (int)(idx % inter);
    const scalar_t* xr = x + t * x_stride;
    out[t * inter + j] = from_float(silu_mul(to_float(xr[j]), to_float(xr[inter + j])));
}

extern "C" __global__ void bias_broadcast(scalar_t* out, const scalar_t* bias, long long rows,
                                          int n) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * n) return;
    out[idx] = bias[idx % n];
}
