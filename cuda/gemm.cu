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

// ------------------------------------------------------------------------------------ stream_gemm
// out[T, N] = x[T, K] @ w[N, K]^T (+ out when accumulate) for decode-sized T: the "stream" candidate
// of minillm/ops/gemm.py. Where cuBLAS's kernels tile 128 or more rows and leave most of the card idle
// at T <= 256, this one takes SG_BM rows a block (16 to 128), SG_BN columns, and may cut K into
// gridDim.z slices, so that enough blocks stream the weights at once to keep HBM busy.
//   - Block: SG_WM x SG_WN warps; a warp owns (SG_BM / SG_WM) x (SG_BN / SG_WN) of the tile, in
//     m16n8k16 MMAs (bf16 or f16 inputs, fp32 accumulators), fragments by ldmatrix.
//   - K runs in tiles of SG_BK = 64 through SG_STAGES shared-memory stages filled by cp.async (16-byte
//     copies, L1 bypassed); rows of x at or past T load as zeros and are never stored. Shared rows are
//     padded to 144 bytes so the 8 row addresses of an ldmatrix fall in 8 different 4-bank groups.
//   - One slice (gridDim.z == 1): the block rounds its sums (+ out) into out. Several slices: each
//     block writes its fp32 partial tile to ws[z, T, N], then counts itself in counters[tile]; the last
//     block of a tile to arrive sums the slices in slice order (so the result does not depend on which
//     block came last), adds out when accumulating, rounds once, and sets the counter back to zero, so
//     the next launch (or graph replay) finds it zeroed without a memset.
// Requires: N % SG_BN == 0, K % (gridDim.z * SG_BK) == 0, x's row stride and the pointers 16-byte
// aligned, out packed [T, N]; 16-bit scalar_t only. Launch: grid (N / SG_BN, ceil(T / SG_BM), slices),
// SG_WM * SG_WN * 32 threads, dynamic shared memory SG_STAGES * (SG_BM + SG_BN) * 144 bytes.
#if MINILLM_DTYPE != 0

#ifndef SG_BM
#define SG_BM 64
#endif
#ifndef SG_BN
#define SG_BN 128
#endif
#ifndef SG_WM
#define SG_WM 2
#endif
#ifndef SG_WN
#define SG_WN 2
#endif
#ifndef SG_STAGES
#define SG_STAGES 3
#endif
#ifndef SG_OUT_F32
#define SG_OUT_F32 0
#endif

#define SG_BK 64
#define SG_LD (SG_BK + 8)                       // elements per shared row (144 bytes)
#define SG_THREADS (32 * SG_WM * SG_WN)
#define SG_MT (SG_BM / (16 * SG_WM))            // m16 tiles per warp
#define SG_NT (SG_BN / (8 * SG_WN))             // n8 tiles per warp (even: B loads 16 columns at once)

static_assert(SG_MT >= 1 && SG_MT * 16 * SG_WM == SG_BM, "SG_BM must be a multiple of 16 * SG_WM");
static_assert(SG_BN * SG_BK / 8 % SG_THREADS == 0, "every thread copies as many chunks of w");
static_assert(SG_NT >= 2 && SG_NT % 2 == 0 && SG_NT * 8 * SG_WN == SG_BN, "SG_BN must be a multiple of 16 * SG_WN");

#if SG_OUT_F32
typedef float sg_out_t;
#else
typedef scalar_t sg_out_t;
#endif

__device__ __forceinline__ void sg_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void sg_ldsm_x4(unsigned int addr, unsigned int (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c[16x8] += a[16x16] * b[16x8] (b given as its two k-halves), fp32 accumulators.
__device__ __forceinline__ void sg_mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
#if MINILLM_DTYPE == 2
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ float sg_out_to_float(sg_out_t v) {
#if SG_OUT_F32
    return v;
#else
    return to_float(v);
#endif
}

__device__ __forceinline__ sg_out_t sg_out_from_float(float v) {
#if SG_OUT_F32
    return v;
#else
    return from_float(v);
#endif
}

// Writes round(v0 (+ out[i]), v1 (+ out[i + 1])) to out[i], out[i + 1].
__device__ __forceinline__ void sg_store2(sg_out_t* out, long long i, float v0, float v1, int accumulate) {
    if (accumulate) {
        v0 += sg_out_to_float(out[i]);
        v1 += sg_out_to_float(out[i + 1]);
    }
    out[i] = sg_out_from_float(v0);
    out[i + 1] = sg_out_from_float(v1);
}

// Stage `stage` <- x[m0 : m0 + SG_BM, k : k + SG_BK] and w[n0 : n0 + SG_BN, k : k + SG_BK].
__device__ __forceinline__ void sg_load_tile(scalar_t* a_s, scalar_t* b_s, const scalar_t* x, const scalar_t* w,
                                             int m0, int n0, int k, int T, int K, int x_stride) {
    constexpr int chunks = SG_BK / 8;             // 16-byte copies per row
#pragma unroll
    for (int i = 0; i < (SG_BM * chunks + SG_THREADS - 1) / SG_THREADS; ++i) {
        const int c = threadIdx.x + i * SG_THREADS;
        if (SG_BM * chunks % SG_THREADS != 0 && c >= SG_BM * chunks) break;
        const int r = c / chunks, col = (c % chunks) * 8;
        const bool live = m0 + r < T;
        const scalar_t* src = live ? x + (long long)(m0 + r) * x_stride + k + col : x;
        cp_async16(smem_u32(a_s + r * SG_LD + col), src, live ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < SG_BN * chunks / SG_THREADS; ++i) {
        const int c = threadIdx.x + i * SG_THREADS;
        const int r = c / chunks, col = (c % chunks) * 8;
        cp_async16(smem_u32(b_s + r * SG_LD + col), w + (long long)(n0 + r) * K + k + col, 16);
    }
}

extern "C" __global__ void __launch_bounds__(SG_THREADS)
stream_gemm(sg_out_t* out, const scalar_t* x, const scalar_t* w, float* ws, unsigned int* counters, int T, int N,
            int K, int x_stride, int accumulate) {
    extern __shared__ __align__(16) unsigned char sg_smem[];
    scalar_t* a_s = reinterpret_cast<scalar_t*>(sg_smem);              // [SG_STAGES][SG_BM][SG_LD]
    scalar_t* b_s = a_s + SG_STAGES * SG_BM * SG_LD;                   // [SG_STAGES][SG_BN][SG_LD]
    __shared__ int sg_last;

    const int n0 = blockIdx.x * SG_BN, m0 = blockIdx.y * SG_BM;
    const int slices = gridDim.z, k_slice = K / slices, k_begin = blockIdx.z * k_slice;
    const int num_k_tiles = k_slice / SG_BK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / SG_WN, wn = warp % SG_WN;
    const int warp_row0 = wm * (SG_BM / SG_WM), warp_col0 = wn * (SG_BN / SG_WN);

#pragma unroll
    for (int s = 0; s < SG_STAGES - 1; ++s) {
        if (s < num_k_tiles)
            sg_load_tile(a_s + s * SG_BM * SG_LD, b_s + s * SG_BN * SG_LD, x, w, m0, n0, k_begin + s * SG_BK, T, K,
                         x_stride);
        sg_commit();
    }

    float acc[SG_MT][SG_NT][4];
#pragma unroll
    for (int mi = 0; mi < SG_MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < SG_NT; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.0f;

    // This lane's ldmatrix rows: A (rows x k) as mma's A fragment, B (columns x k) as two n8 fragments.
    const int a_row = warp_row0 + (lane & 15), a_col = (lane >> 4) * 8;
    const int b_row = warp_col0 + (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;

    for (int kt = 0; kt < num_k_tiles; ++kt) {
        asm volatile("cp.async.wait_group %0;" ::"n"(SG_STAGES - 2) : "memory");
        __syncthreads();            // tile kt landed for all; every warp is done with tile kt - 1's stage
        const int ahead = kt + SG_STAGES - 1;
        if (ahead < num_k_tiles) {
            const int st = ahead % SG_STAGES;
            sg_load_tile(a_s + st * SG_BM * SG_LD, b_s + st * SG_BN * SG_LD, x, w, m0, n0, k_begin + ahead * SG_BK,
                         T, K, x_stride);
        }
        sg_commit();
        const int st = kt % SG_STAGES;
        const unsigned int a_base = smem_u32(a_s + st * SG_BM * SG_LD + a_row * SG_LD + a_col);
        const unsigned int b_base = smem_u32(b_s + st * SG_BN * SG_LD + b_row * SG_LD + b_col);
#pragma unroll
        for (int kk = 0; kk < SG_BK / 16; ++kk) {
            unsigned int a[SG_MT][4];
#pragma unroll
            for (int mi = 0; mi < SG_MT; ++mi) sg_ldsm_x4(a_base + (mi * 16 * SG_LD + kk * 16) * 2, a[mi]);
#pragma unroll
            for (int nj = 0; nj < SG_NT / 2; ++nj) {
                unsigned int b[4];
                sg_ldsm_x4(b_base + (nj * 16 * SG_LD + kk * 16) * 2, b);
#pragma unroll
                for (int mi = 0; mi < SG_MT; ++mi) {
                    sg_mma(acc[mi][2 * nj], a[mi], b[0], b[1]);
                    sg_mma(acc[mi][2 * nj + 1], a[mi], b[2], b[3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    // Accumulator (mi, ni, h): row warp_row0 + 16 mi + (lane >> 2) + 8 h, columns warp_col0 + 8 ni + 2 (lane & 3) + {0, 1}.
    const int g = lane >> 2, c2 = 2 * (lane & 3);
    if (slices == 1) {
#pragma unroll
        for (int mi = 0; mi < SG_MT; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + warp_row0 + mi * 16 + g + 8 * h;
                if (row >= T) continue;
#pragma unroll
                for (int ni = 0; ni < SG_NT; ++ni)
                    sg_store2(out, (long long)row * N + n0 + warp_col0 + ni * 8 + c2, acc[mi][ni][2 * h],
                              acc[mi][ni][2 * h + 1], accumulate);
            }
        return;
    }

    const long long mn = (long long)T * N;
    float* part = ws + blockIdx.z * mn;
#pragma unroll
    for (int mi = 0; mi < SG_MT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + warp_row0 + mi * 16 + g + 8 * h;
            if (row >= T) continue;
#pragma unroll
            for (int ni = 0; ni < SG_NT; ++ni) {
                float* p = part + (long long)row * N + n0 + warp_col0 + ni * 8 + c2;
                p[0] = acc[mi][ni][2 * h];
                p[1] = acc[mi][ni][2 * h + 1];
            }
        }
    __threadfence();                // this block's partial is visible before it is counted
    __syncthreads();
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) sg_last = atomicAdd(counters + tile, 1u) == (unsigned int)(slices - 1);
    __syncthreads();
    if (!sg_last) return;
    __threadfence();                // the other slices' partials, counted before this block's, are read after
    const int rows = min(SG_BM, T - m0);
    for (int i = threadIdx.x; i < rows * (SG_BN / 2); i += SG_THREADS) {
        const int r = i / (SG_BN / 2), c = (i % (SG_BN / 2)) * 2;
        const long long o = (long long)(m0 + r) * N + n0 + c;
        float v0 = 0.0f, v1 = 0.0f;
        for (int s = 0; s < slices; ++s) {
            v0 += __ldcg(ws + s * mn + o);
            v1 += __ldcg(ws + s * mn + o + 1);
        }
        sg_store2(out, o, v0, v1, accumulate);
    }
    if (threadIdx.x == 0) counters[tile] = 0u;
}

#endif  // MINILLM_DTYPE != 0
