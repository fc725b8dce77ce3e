// paged_attention.cu: attention of ragged query chunks over a paged KV cache.
//
// Layout: one layer's k_cache / v_cache [num_blocks, block_size, Hk, HEAD_DIM] packed (block_size
// a power of two, passed as its log2); block_tables [B, max_blocks] int32 with a row stride;
// seq_lens [B] int32 (context length after this step's tokens); query_start_loc [B+1] int32;
// q [T, Hq, HEAD_DIM] with a token stride in elements (heads packed inside a token); out likewise.
// Query row i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to positions
// 0..that position. GQA: query head h reads KV head h / GQA. Scores are kept in log2 units
// (scale_log2 = scale * log2(e)) so the softmax uses exp2.
// Compiled per (dtype, HEAD_DIM, GQA[, KV_FP8]) with -DHEAD_DIM=.. -DGQA=.. (defaults below for nvcc).
// FP8 caches (KV_FP8=1: uint8 E4M3 bits, kv_scales [2] = k_scale, v_scale in device memory, so a
// captured graph sees a later calibration): dequantised in registers, each pair of E4M3 bytes by
// one cvt.rn.f16x2.e4m3x2 (exact: every E4M3 value is a normal fp16) and then fp16 to float.
// Scores and outputs are linear in K and V, so k_scale joins scale_log2 and v_scale the final
// normalisation instead of multiplying every element.
// Non-FP8 builds never read kv_scales (it may be null).
//
// paged_decode: one query token per sequence. grid = (num_splits, Hk, B), 128 threads (4 warps).
//   A block owns one KV head of one sequence (all GQA query heads of it, so K/V are read once)
//   over one partition of the context (flash-decoding: partitions of max(ceil(len / splits),
//   min_partition) tokens, rounded to the warp chunk; empty ones write an empty partial). Within
//   a warp, LPT lanes share a token row (HEAD_DIM / KV_VEC loads of KV_VEC elements: 16 bytes, or
//   with FP8 16 elements where HEAD_DIM allows and GQA <= 2, else VEC_ELEMS bytes), 32 / LPT
//   tokens are in flight side by side and each lane keeps DEC_U tokens' K and V loads in flight.
//   Each K and V vector is widened to float once and used for all GQA heads. Up to GQA 4 the
//   kernel fits 128 registers (four blocks a multiprocessor). Each warp copies its next chunks
//   into shared memory by cp.async (DEC_STAGES buffers) instead of loading into registers, where
//   the stages fit and a block holds a whole chunk.
//   num_splits == 1 writes out directly; otherwise partials (normalised output, max, sum) go to
//   part_o [B, Hq, S, HEAD_DIM] / part_ml [B, Hq, S, 2] and paged_decode_reduce (grid (Hq, B),
//   128 threads) combines them. A row with seq_lens[b] == 0 is skipped, its output row left as
//   it was (the padding rows of minillm/mixed_graphs.py's captured grids; without splits only).
// paged_prefill_mma (fp16 / bf16, HEAD_DIM 64 or 128): grid = (ceil(max_query_len / 64), Hq, B),
//   128 threads; each warp owns 16 query rows, K/V tiles of 64 tokens go to shared memory by
//   cp.async (zero-filled past the end; FP8 tiles are loaded 16 bytes at a time, widened exactly
//   to fp16 / bf16 and stored), S = Q K^T and O += P V run on mma.sync.m16n8k16 with fp32 accumulators and an online
//   softmax; block x is reversed so the longest tiles start first.
// paged_prefill_simple (any dtype / HEAD_DIM): same grid with 16-row query tiles; K/V tiles of
//   PF_BK tokens converted to fp32 in shared memory, one lane per key for scores and one lane per
//   output dimension for P V.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GQA
#define GQA 2
#endif

#if HEAD_DIM % VEC_ELEMS != 0
#error "HEAD_DIM must be a multiple of the 16-byte vector width"
#endif

// KV_VEC: cache elements one lane loads at once in decode. KVVec holds them (16 bytes, or
// VEC_ELEMS bytes for FP8 rows too short for 16 or too many GQA heads for the registers).
#if KV_FP8 && HEAD_DIM % 16 == 0 && GQA <= 2
#define KV_VEC 16
#else
#define KV_VEC VEC_ELEMS
#endif
#if KV_FP8
#define KV_VEC_WORDS (KV_VEC / 4)     // one byte an element
#else
#define KV_VEC_WORDS 4                // 16 bytes
#endif

struct alignas(KV_VEC_WORDS * 4) KVVec {
    unsigned int w[KV_VEC_WORDS];
};

__device__ __forceinline__ KVVec ldg_kv(const cache_t* p) {
    KVVec r;
#if KV_VEC_WORDS == 4
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3]) : "l"(p));
#elif KV_VEC_WORDS == 2
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(p));
#else
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r.w[0]) : "l"(p));
#endif
    return r;
}

// One KV vector copied from global to shared memory without passing through registers.
__device__ __forceinline__ void cp_async_kv(KVVec* dst, const void* src) {
#if KV_VEC_WORDS == 4
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_u32(dst)), "l"(src), "n"(KV_VEC_WORDS * 4)
                 : "memory");
#endif
}

// A KV vector as KV_VEC floats: the values (bf16 / fp16 / fp32), or for FP8 the E4M3 values,
// widened a pair at a time by one hardware conversion (the caller's factors carry the scale).
// Decode widens each vector once and uses it for every GQA query head of its KV head.
__device__ __forceinline__ void kv_to_floats(const KVVec& v, float (&f)[KV_VEC]) {
#if KV_FP8
#pragma unroll
    for (int w = 0; w < KV_VEC_WORDS; ++w) e4m3x4_to_floats(v.w[w], &f[4 * w]);
#else
    vec_to_floats(reinterpret_cast<const Vec16&>(v), f);
#endif
}

// A layer's factor on q.k (x) and on p.v / sum (y): 1 and 1 unless FP8.
struct KVFactors {
    float x, y;
};

__device__ __forceinline__ KVFactors kv_factors(const float* kv_scales) {
#if KV_FP8
    return KVFactors{kv_scales[0], kv_scales[1]};
#else
    return KVFactors{1.0f, 1.0f};
#endif
}

__host__ __device__ constexpr int pow2_divisor_upto32(int n) {
    int p = 1;
    while (p < 32 && n % (2 * p) == 0) p *= 2;
    return p;
}

__host__ __device__ constexpr int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
// Up to GQA 4 the decode state fits 128 registers a thread: four blocks a multiprocessor (the
// compiler is held to it so that another toolchain cannot drop to three).
#define DEC_MIN_BLOCKS (GQA <= 4 ? 4 : 1)
constexpr int DEC_VECS = HEAD_DIM / KV_VEC;                // KV vectors in one K row
constexpr int DEC_LPT = pow2_divisor_upto32(DEC_VECS);    // lanes sharing one token
constexpr int DEC_NV = DEC_VECS / DEC_LPT;                // vectors per lane per row
constexpr int DEC_TPW = 32 / DEC_LPT;                     // tokens side by side in a warp
// Tokens per lane per step; FP8 keeps a warp step within 16 tokens so that a chunk stays inside
// one block of the default size (one block-table read per chunk).
// fp16 / bf16 take steps of at most 4 tokens a lane, so that three stages of chunks fit the 48 KB (with
// 8, a chunk of the Qwen3 shape is 32 KB and nothing stages); DEC_MAX_U overrides (tests, probes).
#ifndef DEC_MAX_U
#define DEC_MAX_U (!KV_FP8 && sizeof(cache_t) == 2 ? 4 : 8)
#endif
constexpr int DEC_U = KV_FP8 ? clamp_int(16 / (GQA * DEC_NV), 1, clamp_int(16 / DEC_TPW, 1, DEC_MAX_U))
                             : clamp_int(16 / (GQA * DEC_NV), 1, DEC_MAX_U);
constexpr int DEC_CHUNK = DEC_TPW * DEC_U;                // tokens per warp step
constexpr int DEC_ELEMS = DEC_NV * KV_VEC;                // elements of a row held by a lane

// DEC_STAGES > 0 (blocks at least a chunk long): each warp copies its next DEC_STAGES - 1 chunks'
// K/V into shared memory by cp.async while it works on the current one, so loads stay in flight
// through the arithmetic without holding registers; each lane reads back only what it copied
// itself (no barrier). With its loads held in registers the kernel waited on memory, FP8 most
// (benchmarks/RESULTS.md); bf16 staged takes 3.0 % less time over the throughput workload's
// batches on an H100. 16-bit caches above GQA 2 keep their loads in registers: staged, the GQA 4
// build spills (tests/test_cuda_compile.py). At most DEC_MAX_STAGES, as many as fit the 48 KB of
// static shared memory, none where two do not fit (fp32 rows at 8 tokens a lane).
#ifndef DEC_MAX_STAGES
#define DEC_MAX_STAGES (KV_FP8 || GQA <= 2 ? 3 : 0)
#endif
constexpr int DEC_SLOTS = 2 * DEC_U * DEC_NV;              // K then V vectors a lane copies a chunk
constexpr int DEC_STAGE_BYTES = DEC_WARPS * DEC_SLOTS * 32 * (int)sizeof(KVVec);
constexpr int DEC_FIT_STAGES = clamp_int(49152 / DEC_STAGE_BYTES, 0, DEC_MAX_STAGES);
constexpr int DEC_STAGES = DEC_FIT_STAGES >= 2 ? DEC_FIT_STAGES : 0;
constexpr int DEC_STAGE_VECS = DEC_STAGES > 0 ? DEC_STAGES * DEC_WARPS * DEC_SLOTS * 32 : 1;

// The new token's rows in paged_decode_append: its GQA query rows, and its K / V as stored.
struct alignas(16) DecodeFresh {
    scalar_t q[GQA][HEAD_DIM];
    cache_t kv[2][HEAD_DIM];
};

// The block's shared memory for decode, used in turn: the new token's rows (staged builds), the
// chunks in flight, then the four warps' states as decode_write combines them.
union alignas(16) DecodeShared {
    DecodeFresh fresh;
    KVVec stage[DEC_STAGE_VECS];       // [DEC_STAGES, DEC_WARPS, DEC_SLOTS, 32 lanes]
    struct {
        float acc[DEC_WARPS][GQA][HEAD_DIM];
        float m[DEC_WARPS][GQA];
        float l[DEC_WARPS][GQA];
    } red;
};

__device__ __forceinline__ DecodeShared& decode_shared() {
    __shared__ DecodeShared sh;
    return sh;
}

// Where paged_decode_append keeps the new token's rows: inside decode_shared() where the staged
// chunks make that the larger buffer (a barrier then parts them from the chunks), else apart.
template <bool SHARED = (DEC_STAGES > 0)>
__device__ __forceinline__ DecodeFresh& decode_fresh() {
    if constexpr (SHARED) {
        return decode_shared().fresh;
    } else {
        __shared__ DecodeFresh fresh;
        return fresh;
    }
}

// Element offset of vector j of this lane inside a row.
__device__ __forceinline__ int lane_vec_offset(int j, int li) { return (j * DEC_LPT + li) * KV_VEC; }

// Online-softmax state of GQA query heads over some tokens: max (log2 units), sum, output.
struct DecodeState {
    float m[GQA];
    float l[GQA];
    float acc[GQA][DEC_ELEMS];
};

// Fold one step of DEC_U tokens (scores s, values vv) into the state of this lane: first the
// softmax weights of every GQA head, then each value vector widened once and added to every head.
__device__ __forceinline__ void decode_fold(DecodeState& st, const float (&s)[DEC_U][GQA],
                                            const KVVec (&vv)[DEC_U][DEC_NV]) {
    float p[DEC_U][GQA];
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
        float mx = st.m[g];
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) mx = fmaxf(mx, s[u][g]);
        // No finite score yet: exp2 against 0 keeps the state empty (alpha 0, p 0) without NaN.
        float ref = mx == -MINILLM_INF ? 0.0f : mx;
        float alpha = fast_exp2(st.m[g] - ref);
        st.l[g] *= alpha;
#pragma unroll
        for (int e = 0; e < DEC_ELEMS; ++e) st.acc[g][e] *= alpha;
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) {
            p[u][g] = fast_exp2(s[u][g] - ref);
            st.l[g] += p[u][g];
        }
        st.m[g] = mx;
    }
#pragma unroll
    for (int u = 0; u < DEC_U; ++u) {
#pragma unroll
        for (int j = 0; j < DEC_NV; ++j) {
            float vf[KV_VEC];
            kv_to_floats(vv[u][j], vf);
#pragma unroll
            for (int g = 0; g < GQA; ++g) {
#pragma unroll
                for (int e = 0; e < KV_VEC; ++e) st.acc[g][j * KV_VEC + e] += p[u][g] * vf[e];
            }
        }
    }
}

// Merge the states of lanes `o` apart (the other token slots of the warp).
__device__ __forceinline__ void decode_merge_lanes(DecodeState& st) {
#pragma unroll
    for (int o = DEC_LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
            float mo = __shfl_xor_sync(FULL_MASK, st.m[g], o);
            float lo = __shfl_xor_sync(FULL_MASK, st.l[g], o);
            float mn = fmaxf(st.m[g], mo);
            float fa = st.m[g] == -MINILLM_INF ? 0.0f : exp2f(st.m[g] - mn);
            float fb = mo == -MINILLM_INF ? 0.0f : exp2f(mo - mn);
            st.l[g] = st.l[g] * fa + lo * fb;
#pragma unroll
            for (int e = 0; e < DEC_ELEMS; ++e) {
                float ao = __shfl_xor_sync(FULL_MASK, st.acc[g][e], o);
                st.acc[g][e] = st.acc[g][e] * fa + ao * fb;
            }
            st.m[g] = mn;
        }
    }
}

// The partition [t_begin, t_end) of this block's split.
__device__ __forceinline__ void decode_partition(int ctx, int num_splits, int min_partition,
                                                 int* t_begin, int* t_end) {
    int part = (ctx + num_splits - 1) / num_splits;
    part = max(part, min_partition);
    part = (part + DEC_CHUNK - 1) / DEC_CHUNK * DEC_CHUNK;
    *t_begin = min(ctx, (int)blockIdx.x * part);
    *t_end = min(ctx, *t_begin + part);
}

// Combine the four warps' states in shared memory and write the result or the split's partial.
// out_mul scales the normalised output (an FP8 cache's v_scale; else 1).
__device__ __forceinline__ void decode_write(const DecodeState& st, scalar_t* out, long long out_row,
                                             float* part_o, float* part_ml, int b, int kvh,
                                             int num_heads, int num_splits, float out_mul) {
    auto& red_acc = decode_shared().red.acc;
    auto& red_m = decode_shared().red.m;
    auto& red_l = decode_shared().red.l;
    if (DEC_STAGES > 0) __syncthreads();    // every warp is done with its staged chunks
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int sub = lane / DEC_LPT, li = lane % DEC_LPT;
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
#pragma unroll
            for (int j = 0; j < DEC_NV; ++j) {
#pragma unroll
                for (int e = 0; e < KV_VEC; ++e)
                    red_acc[warp][g][lane_vec_offset(j, li) + e] = st.acc[g][j * KV_VEC + e];
            }
            if (li == 0) { red_m[warp][g] = st.m[g]; red_l[warp][g] = st.l[g]; }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < GQA * HEAD_DIM; idx += DEC_THREADS) {
        int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float mx = -MINILLM_INF;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) mx = fmaxf(mx, red_m[w][g]);
        float sum = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            float f = red_m[w][g] == -MINILLM_INF ? 0.0f : exp2f(red_m[w][g] - mx);
            sum += red_l[w][g] * f;
            o += red_acc[w][g][d] * f;
        }
        int h = kvh * GQA + g;
        float val = sum > 0.0f ? o / sum * out_mul : 0.0f;
        if (num_splits == 1) {
            out[out_row + (long long)h * HEAD_DIM + d] = from_float(val);
        } else {
            long long pi = ((long long)b * num_heads + h) * num_splits + blockIdx.x;
            part_o[pi * HEAD_DIM + d] = val;
            if (d == 0) { part_ml[pi * 2] = mx; part_ml[pi * 2 + 1] = sum; }
        }
    }
}

// q . k of one query head and one token row over the LPT lanes that share the row (every lane gets it).
__device__ __forceinline__ float decode_dot(const float (&q)[DEC_ELEMS], const float (&kf)[DEC_NV][KV_VEC]) {
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < DEC_NV; ++j) {
#pragma unroll
        for (int e = 0; e < KV_VEC; ++e) dot += q[j * KV_VEC + e] * kf[j][e];
    }
#pragma unroll
    for (int o = DEC_LPT / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
    return dot;
}

// Scores of one step of DEC_U tokens for every GQA head (each K vector widened once for all of
// them; tokens not valid score -inf), then their fold into the lane's state.
__device__ __forceinline__ void decode_step(DecodeState& st, const float (&qf)[GQA][DEC_ELEMS],
                                            const KVVec (&kv)[DEC_U][DEC_NV], const KVVec (&vv)[DEC_U][DEC_NV],
                                            const bool (&valid)[DEC_U], float score_mul) {
    float s[DEC_U][GQA];
#pragma unroll
    for (int u = 0; u < DEC_U; ++u) {
        float kf[DEC_NV][KV_VEC];
#pragma unroll
        for (int j = 0; j < DEC_NV; ++j) kv_to_floats(kv[u][j], kf[j]);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
            const float dot = decode_dot(qf[g], kf);         // every lane: the shuffles need the warp
            s[u][g] = valid[u] ? dot * score_mul : -MINILLM_INF;
        }
    }
    decode_fold(st, s, vv);
}

// Load this lane's K and V vectors of DEC_U tokens. k_lane / v_lane point at this lane's first
// element of token row 0 of the layer's caches; a row is row_bytes long (a layer's pool has fewer
// than 2^32 token rows: one 32 x 32 -> 64-bit multiply-add per pointer). A token past t_end reads
// the partition's last token instead, which keeps the loads unpredicated: its score is masked, so
// its finite V adds 0 (only an infinite V element there would read as NaN rather than inf).
// ONE_BLOCK: the chunk lies in block chunk_blk, else each token reads the table.
template <bool ONE_BLOCK>
__device__ __forceinline__ void decode_load(KVVec (&kv)[DEC_U][DEC_NV], KVVec (&vv)[DEC_U][DEC_NV],
                                            bool (&valid)[DEC_U], const char* k_lane,
                                            const char* v_lane, const int* bt, int c0,
                                            int chunk_blk, int t_end, int sub,
                                            int block_size_log2, unsigned int row_bytes) {
    unsigned int mask = (1u << block_size_log2) - 1u;
#pragma unroll
    for (int u = 0; u < DEC_U; ++u) {
        int t = c0 + u * DEC_TPW + sub;
        valid[u] = t < t_end;
        t = min(t, t_end - 1);
        int blk = ONE_BLOCK ? chunk_blk : bt[t >> block_size_log2];
        unsigned int row = ((unsigned int)blk << block_size_log2) | ((unsigned int)t & mask);
        unsigned long long off = (unsigned long long)row * row_bytes;
#pragma unroll
        for (int j = 0; j < DEC_NV; ++j) {
            const int jb = j * DEC_LPT * KV_VEC * (int)sizeof(cache_t);
            kv[u][j] = ldg_kv(reinterpret_cast<const cache_t*>(k_lane + off + jb));
            vv[u][j] = ldg_kv(reinterpret_cast<const cache_t*>(v_lane + off + jb));
        }
    }
}

// Fold this warp's chunks of [c0, t_end) into the lane's state, DEC_CHUNK tokens a warp step.
// ONE_BLOCK (blocks at least a chunk long): one table read per chunk, fetched one step ahead.
template <bool ONE_BLOCK>
__device__ __forceinline__ void decode_tokens(DecodeState& st, const float (&qf)[GQA][DEC_ELEMS],
                                              const char* k_lane, const char* v_lane, const int* bt,
                                              int c0, int t_end, int sub, int block_size_log2,
                                              unsigned int row_bytes, float score_mul) {
    const int step = DEC_WARPS * DEC_CHUNK;
    int next_blk = (ONE_BLOCK && c0 < t_end) ? bt[c0 >> block_size_log2] : 0;
    for (; c0 < t_end; c0 += step) {
        int chunk_blk = next_blk;
        if (ONE_BLOCK && c0 + step < t_end) next_blk = bt[(c0 + step) >> block_size_log2];
        KVVec kv[DEC_U][DEC_NV], vv[DEC_U][DEC_NV];
        bool valid[DEC_U];
        decode_load<ONE_BLOCK>(kv, vv, valid, k_lane, v_lane, bt, c0, chunk_blk, t_end, sub,
                               block_size_log2, row_bytes);
        decode_step(st, qf, kv, vv, valid, score_mul);
    }
}

// decode_tokens<true> with the chunks staged through shared memory in STAGES buffers (DEC_STAGES).
template <int STAGES>
__device__ __forceinline__ void decode_tokens_staged(DecodeState& st, const float (&qf)[GQA][DEC_ELEMS],
                                                     const char* k_lane, const char* v_lane, const int* bt,
                                                     int c0, int t_end, int sub, int block_size_log2,
                                                     unsigned int row_bytes, float score_mul) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int sb_vecs = DEC_WARPS * DEC_SLOTS * 32;        // vectors of one stage buffer
    // This lane's vector of slot 0 in stage buffer 0; slot s of buffer sb is sb * sb_vecs + s * 32 on.
    KVVec* stage = decode_shared().stage + warp * DEC_SLOTS * 32 + lane;
    const int step = DEC_WARPS * DEC_CHUNK;
    const unsigned int mask = (1u << block_size_log2) - 1u;
    // Copy chunk c (in table block blk) into stage buffer sb; tokens past t_end copy the last one.
    auto issue = [&](int c, int blk, int sb) {
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) {
            const int t = min(c + u * DEC_TPW + sub, t_end - 1);
            const unsigned int row = ((unsigned int)blk << block_size_log2) | ((unsigned int)t & mask);
            const unsigned long long off = (unsigned long long)row * row_bytes;
#pragma unroll
            for (int j = 0; j < DEC_NV; ++j) {
                const int jb = j * DEC_LPT * KV_VEC * (int)sizeof(cache_t);
                cp_async_kv(stage + sb * sb_vecs + (u * DEC_NV + j) * 32, k_lane + off + jb);
                cp_async_kv(stage + sb * sb_vecs + ((DEC_U + u) * DEC_NV + j) * 32, v_lane + off + jb);
            }
        }
    };
    int ci = c0;                                              // the next chunk to copy
#pragma unroll
    for (int sb = 0; sb < STAGES - 1; ++sb) {
        if (ci < t_end) issue(ci, bt[ci >> block_size_log2], sb);
        asm volatile("cp.async.commit_group;" ::: "memory");
        ci += step;
    }
    int next_blk = ci < t_end ? bt[ci >> block_size_log2] : 0;
    int sb = 0;                                               // the stage holding chunk c0
    for (; c0 < t_end; c0 += step) {
        const int sb_issue = sb == 0 ? STAGES - 1 : sb - 1;      // read in the last step
        if (ci < t_end) issue(ci, next_blk, sb_issue);
        asm volatile("cp.async.commit_group;" ::: "memory");
        ci += step;
        if (ci < t_end) next_blk = bt[ci >> block_size_log2];
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES > 1 ? STAGES - 1 : 0) : "memory");
        KVVec kv[DEC_U][DEC_NV], vv[DEC_U][DEC_NV];
        bool valid[DEC_U];
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) {
            valid[u] = c0 + u * DEC_TPW + sub < t_end;
#pragma unroll
            for (int j = 0; j < DEC_NV; ++j) {
                kv[u][j] = stage[sb * sb_vecs + (u * DEC_NV + j) * 32];
                vv[u][j] = stage[sb * sb_vecs + ((DEC_U + u) * DEC_NV + j) * 32];
            }
        }
        decode_step(st, qf, kv, vv, valid, score_mul);
        sb = sb + 1 == STAGES ? 0 : sb + 1;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// This lane's elements of the GQA query rows of KV head kvh (rows HEAD_DIM apart at qh, global or
// shared memory) as floats.
__device__ __forceinline__ void decode_load_q(float (&qf)[GQA][DEC_ELEMS], const scalar_t* qh, int li) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
#pragma unroll
        for (int j = 0; j < DEC_NV; ++j) {
#pragma unroll
            for (int p = 0; p < KV_VEC / VEC_ELEMS; ++p)
                vec_to_floats(*reinterpret_cast<const Vec16*>(qh + g * HEAD_DIM + lane_vec_offset(j, li) + p * VEC_ELEMS),
                              &qf[g][j * KV_VEC + p * VEC_ELEMS]);
        }
    }
}

__device__ __forceinline__ void decode_state_init(DecodeState& st) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
        st.m[g] = -MINILLM_INF;
        st.l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < DEC_ELEMS; ++e) st.acc[g][e] = 0.0f;
    }
}

// Fold the cached keys [t_begin, t_attend) of this block's partition into the lanes' states.
__device__ __forceinline__ void decode_cached(DecodeState& st, const float (&qf)[GQA][DEC_ELEMS],
                                              const cache_t* k_cache, const cache_t* v_cache, const int* bt,
                                              int kvh, int num_kv_heads, int t_begin, int t_attend,
                                              int block_size_log2, float score_mul) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane / DEC_LPT, li = lane % DEC_LPT;
    const unsigned int row_bytes = (unsigned int)(num_kv_heads * HEAD_DIM * sizeof(cache_t));
    const long long lane_off = (long long)kvh * HEAD_DIM + lane_vec_offset(0, li);
    const char* k_lane = reinterpret_cast<const char*>(k_cache + lane_off);
    const char* v_lane = reinterpret_cast<const char*>(v_cache + lane_off);
    const int c0 = t_begin + warp * DEC_CHUNK;
    if ((1 << block_size_log2) >= DEC_CHUNK && DEC_STAGES > 0)
        decode_tokens_staged<DEC_STAGES>(st, qf, k_lane, v_lane, bt, c0, t_attend, sub, block_size_log2, row_bytes,
                                         score_mul);
    else if ((1 << block_size_log2) >= DEC_CHUNK)
        decode_tokens<true>(st, qf, k_lane, v_lane, bt, c0, t_attend, sub, block_size_log2, row_bytes, score_mul);
    else
        decode_tokens<false>(st, qf, k_lane, v_lane, bt, c0, t_attend, sub, block_size_log2, row_bytes, score_mul);
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS, DEC_MIN_BLOCKS)
paged_decode(scalar_t* out, long long out_stride, float* part_o, float* part_ml,
             const scalar_t* q, long long q_stride, const cache_t* k_cache,
             const cache_t* v_cache, const int* block_tables, long long bt_stride,
             const int* seq_lens, const int* query_start_loc, int num_kv_heads,
             int block_size_log2, float scale_log2, int num_splits, int min_partition,
             const float* kv_scales) {
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int seq_len = seq_lens[b];
    if (seq_len <= 0) return;          // a padding row of a captured mixed step: nothing read or written
    const int li = (threadIdx.x & 31) % DEC_LPT;
    const long long q_row = query_start_loc[b];
    int t_begin, t_end;
    decode_partition(seq_len, num_splits, min_partition, &t_begin, &t_end);
    const KVFactors kv_mul = kv_factors(kv_scales);
    DecodeState st;
    decode_state_init(st);
    float qf[GQA][DEC_ELEMS];
    decode_load_q(qf, q + q_row * q_stride + (long long)kvh * GQA * HEAD_DIM, li);
    decode_cached(st, qf, k_cache, v_cache, block_tables + (long long)b * bt_stride, kvh, num_kv_heads, t_begin,
                  t_end, block_size_log2, scale_log2 * kv_mul.x);
    decode_merge_lanes(st);
    decode_write(st, out, q_row * out_stride, part_o, part_ml, b, kvh, num_kv_heads * GQA, num_splits, kv_mul.y);
}

// ---------------------------------------------------------------------------------------------
// paged_decode_append: paged_decode of a decode-only step that also does the layer's per-head q/k
// RMSNorm (q_norm / k_norm [HEAD_DIM] in scalar_t, or null: none), rotary and KV append of the
// step's token, which rotary.cu's qk_norm_rotary_kv_append does in a launch of its own; one graph
// node a layer fewer. q, k, v [B, H*, HEAD_DIM] raw (views of the qkv projection, token strides
// q_stride / k_stride / v_stride); positions [B] int32, cos_sin [max_pos, HEAD_DIM] float32,
// slot_mapping [B] int32 as rotary.cu takes them (a slot outside [0, num_slots) is not stored).
// Every split block of (b, kvh) normalises and rotates its GQA query rows into shared memory (the
// same rounded values the separate kernel writes to q); the one split whose partition holds the
// new token (position seq_lens[b] - 1) also builds that token's K and V as the cache stores them
// (E4M3 bytes for FP8), writes them to the cache, and folds them into its attention from shared
// memory: no block reads the slot it writes (the cache loads are non-coherent). The cache and
// outputs hold the same bits as the two launches, except that the new token enters the softmax
// before the cached ones (a different fp32 summation order).
#define DA_LANES (HEAD_DIM / VEC_ELEMS)
#if HEAD_DIM % (2 * VEC_ELEMS) == 0 && DA_LANES <= 32 && (DA_LANES & (DA_LANES - 1)) == 0

// The new token's q rows into q_s, and (owner) its K / V rows into kv_s and the cache.
__device__ __forceinline__ void decode_append_rows(scalar_t (&q_s)[GQA][HEAD_DIM], cache_t (&kv_s)[2][HEAD_DIM],
                                                   cache_t* k_cache, cache_t* v_cache, const scalar_t* q_row,
                                                   const scalar_t* k_row, const scalar_t* v_row,
                                                   const scalar_t* q_norm, const scalar_t* k_norm, float eps,
                                                   const float* cs, long long slot, bool store, bool owner,
                                                   long long cache_row, KVFactors scales) {
    const int j = threadIdx.x % DA_LANES, group = threadIdx.x / DA_LANES;
    constexpr int num_groups = DEC_THREADS / DA_LANES;
    const int num_tasks = GQA + (owner ? 2 : 0);                  // q heads, then k, v
    // Every lane runs every round (the shuffles need the whole warp); a lane past the tasks idles.
    for (int base = 0; base < num_tasks; base += num_groups) {
        const int task = min(base + group, num_tasks - 1);
        const bool active = base + group < num_tasks;
        const bool is_q = task < GQA, is_v = task == GQA + 1;
        const scalar_t* src = is_q ? q_row + task * HEAD_DIM : (is_v ? v_row : k_row);
        float a[VEC_ELEMS], r[VEC_ELEMS];
        vec_to_floats(ldg16(src + j * VEC_ELEMS), a);
#pragma unroll
        for (int e = 0; e < VEC_ELEMS; ++e) r[e] = a[e];
        // v rows normalise and rotate too (unused): the shuffles need every lane of the warp.
        if (q_norm != nullptr) head_norm<HEAD_DIM>(r, is_q ? q_norm : k_norm, j, eps);
        head_rotate<HEAD_DIM>(r, cs, j);
        if (!active) continue;
        if (is_q) {
            *reinterpret_cast<Vec16*>(&q_s[task][j * VEC_ELEMS]) = floats_to_vec(r);
        } else if (is_v) {                                            // v: as it came
            store_cache_vec(&kv_s[1][j * VEC_ELEMS], a, scales.y);
            if (store) store_cache_vec(v_cache + slot * cache_row + j * VEC_ELEMS, a, scales.y);
        } else {
            store_cache_vec(&kv_s[0][j * VEC_ELEMS], r, scales.x);
            if (store) store_cache_vec(k_cache + slot * cache_row + j * VEC_ELEMS, r, scales.x);
        }
    }
}

// Fold the new token (its K / V as stored, in kv_s) into warp 0's states, as decode_fold folds a
// step whose only valid token sits in slot 0 (lanes of the other slots add nothing).
__device__ __forceinline__ void decode_fold_new(DecodeState& st, const float (&qf)[GQA][DEC_ELEMS],
                                                const cache_t (&kv_s)[2][HEAD_DIM], float score_mul) {
    const int lane = threadIdx.x & 31, sub = lane / DEC_LPT, li = lane % DEC_LPT;
    float p[GQA];
    {
        float kf[DEC_NV][KV_VEC];
#pragma unroll
        for (int j = 0; j < DEC_NV; ++j) kv_to_floats(*reinterpret_cast<const KVVec*>(&kv_s[0][lane_vec_offset(j, li)]), kf[j]);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
            const float dot = decode_dot(qf[g], kf);
            const float s = sub == 0 ? dot * score_mul : -MINILLM_INF;
            const float mx = fmaxf(st.m[g], s);
            const float ref = mx == -MINILLM_INF ? 0.0f : mx;
            const float alpha = fast_exp2(st.m[g] - ref);
            p[g] = fast_exp2(s - ref);
            st.l[g] = st.l[g] * alpha + p[g];
#pragma unroll
            for (int e = 0; e < DEC_ELEMS; ++e) st.acc[g][e] *= alpha;
            st.m[g] = mx;
        }
    }
#pragma unroll
    for (int j = 0; j < DEC_NV; ++j) {
        float vf[KV_VEC];
        kv_to_floats(*reinterpret_cast<const KVVec*>(&kv_s[1][lane_vec_offset(j, li)]), vf);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
#pragma unroll
            for (int e = 0; e < KV_VEC; ++e) st.acc[g][j * KV_VEC + e] += p[g] * vf[e];
        }
    }
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS, DEC_MIN_BLOCKS)
paged_decode_append(scalar_t* out, long long out_stride, float* part_o, float* part_ml,
                    const scalar_t* q, long long q_stride, const scalar_t* k, long long k_stride,
                    const scalar_t* v, long long v_stride, const scalar_t* q_norm, const scalar_t* k_norm,
                    float eps, const int* positions, const float* cos_sin, const int* slot_mapping,
                    long long num_slots, cache_t* k_cache, cache_t* v_cache, const int* block_tables,
                    long long bt_stride, const int* seq_lens, const int* query_start_loc, int num_kv_heads,
                    int block_size_log2, float scale_log2, int num_splits, int min_partition,
                    const float* kv_scales) {
    auto& q_s = decode_fresh().q;
    auto& kv_s = decode_fresh().kv;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int seq_len = seq_lens[b];
    if (seq_len <= 0) return;          // a padding row: nothing read or written
    const int li = (threadIdx.x & 31) % DEC_LPT;
    const long long t = query_start_loc[b];
    int t_begin, t_end;
    decode_partition(seq_len, num_splits, min_partition, &t_begin, &t_end);
    const bool owner = t_begin < seq_len && seq_len - 1 < t_end;     // this split holds the new token
    const long long slot = slot_mapping[t];
    const KVFactors kv_mul = kv_factors(kv_scales);                  // the FP8 scales: append and read
    decode_append_rows(q_s, kv_s, k_cache + (long long)kvh * HEAD_DIM, v_cache + (long long)kvh * HEAD_DIM,
                       q + t * q_stride + (long long)kvh * GQA * HEAD_DIM, k + t * k_stride + (long long)kvh * HEAD_DIM,
                       v + t * v_stride + (long long)kvh * HEAD_DIM, q_norm, k_norm, eps,
                       cos_sin + (long long)positions[t] * HEAD_DIM, slot, owner && slot >= 0 && slot < num_slots,
                       owner, (long long)num_kv_heads * HEAD_DIM, kv_mul);
    __syncthreads();
    const float score_mul = scale_log2 * kv_mul.x;
    DecodeState st;
    decode_state_init(st);
    float qf[GQA][DEC_ELEMS];
    decode_load_q(qf, &q_s[0][0], li);
    // The new token first (nothing of it stays live through the cached keys' loop).
    if (owner && threadIdx.x < 32) decode_fold_new(st, qf, kv_s, score_mul);
    if (DEC_STAGES > 0) __syncthreads();   // q_s / kv_s share their memory with the chunks in flight
    decode_cached(st, qf, k_cache, v_cache, block_tables + (long long)b * bt_stride, kvh, num_kv_heads, t_begin,
                  owner ? seq_len - 1 : t_end, block_size_log2, score_mul);
    decode_merge_lanes(st);
    decode_write(st, out, t * out_stride, part_o, part_ml, b, kvh, num_kv_heads * GQA, num_splits, kv_mul.y);
}
#endif

extern "C" __global__ void __launch_bounds__(128)
paged_decode_reduce(scalar_t* out, long long out_stride, const float* part_o,
                    const float* part_ml, const int* query_start_loc, int num_heads,
                    int num_splits) {
    const int h = blockIdx.x, b = blockIdx.y;
    scalar_t* dst = out + (long long)query_start_loc[b] * out_stride + (long long)h * HEAD_DIM;
    merge_split_partials<HEAD_DIM>(dst, part_o, part_ml, ((long long)b * num_heads + h) * num_splits, num_splits);
}

// ---------------------------------------------------------------------------------------------
// Prefill, CUDA cores: any dtype and head size.
#define PF_BQ 16
#define PF_THREADS 128
constexpr int PF_BK = HEAD_DIM <= 128 ? 32 : 8;
constexpr int PF_DPL = (HEAD_DIM + 31) / 32;    // output dimensions per lane
constexpr int PF_ROWS = PF_BQ / (PF_THREADS / 32);  // query rows per warp

// Row-major [rows, HEAD_DIM] fp32 copy of keys/values kt..kt+PF_BK-1 (zeros past kv_end).
__device__ __forceinline__ void prefill_load_tile(float* ks, float* vs, const cache_t* k_cache,
                                                  const cache_t* v_cache, const int* bt, int kt,
                                                  int kv_end, int block_size_log2,
                                                  long long tok_stride, long long head_off,
                                                  float k_scale, float v_scale) {
    int mask = (1 << block_size_log2) - 1;
    for (int idx = threadIdx.x; idx < PF_BK * HEAD_DIM; idx += PF_THREADS) {
        int key = idx / HEAD_DIM, d = idx % HEAD_DIM, t = kt + key;
        float kf = 0.0f, vf = 0.0f;
        if (t < kv_end) {
            long long src = ((((long long)bt[t >> block_size_log2]) << block_size_log2) | (t & mask)) * tok_stride + head_off + d;
            kf = cache_to_float(k_cache[src], k_scale);
            vf = cache_to_float(v_cache[src], v_scale);
        }
        ks[key * (HEAD_DIM + 1) + d] = kf;
        vs[key * HEAD_DIM + d] = vf;
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
paged_prefill_simple(scalar_t* out, long long out_stride, const scalar_t* q, long long q_stride,
                     const cache_t* k_cache, const cache_t* v_cache, const int* block_tables,
                     long long bt_stride, const int* seq_lens, const int* query_start_loc,
                     int num_heads, int num_kv_heads, int block_size_log2, float scale_log2,
                     const float* kv_scales) {
    __shared__ float qs[PF_BQ][HEAD_DIM];
    __shared__ float ks[PF_BK * (HEAD_DIM + 1)];
    __shared__ float vs[PF_BK * HEAD_DIM];
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (num_heads / num_kv_heads);
    const int q_start = query_start_loc[b], q_len = query_start_loc[b + 1] - q_start;
    const int ctx = seq_lens[b];
    const int tile0 = (gridDim.x - 1 - blockIdx.x) * PF_BQ;
    if (tile0 >= q_len) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int idx = threadIdx.x; idx < PF_BQ * HEAD_DIM; idx += PF_THREADS) {
        int r = idx / HEAD_DIM, d = idx % HEAD_DIM, qi = tile0 + r;
        qs[r][d] = qi < q_len ? to_float(q[(long long)(q_start + qi) * q_stride + (long long)h * HEAD_DIM + d]) : 0.0f;
    }
    float m[PF_ROWS], l[PF_ROWS], o[PF_ROWS][PF_DPL];
#pragma unroll
    for (int i = 0; i < PF_ROWS; ++i) {
        m[i] = -MINILLM_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int dd = 0; dd < PF_DPL; ++dd) o[i][dd] = 0.0f;
    }
    const int kv_end = ctx - q_len + min(tile0 + PF_BQ, q_len);
    const int* bt = block_tables + (long long)b * bt_stride;
    const long long tok_stride = (long long)num_kv_heads * HEAD_DIM;
    // This kernel dequantises into its fp32 tiles: bits * scale, as the NumPy twin reads them.
    const KVFactors kv_scale = kv_factors(kv_scales);
    for (int kt = 0; kt < kv_end; kt += PF_BK) {
        __syncthreads();
        prefill_load_tile(ks, vs, k_cache, v_cache, bt, kt, kv_end, block_size_log2, tok_stride,
                          (long long)kvh * HEAD_DIM, kv_scale.x, kv_scale.y);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < PF_ROWS; ++i) {
            int r = warp * PF_ROWS + i, qi = tile0 + r;
            if (qi >= q_len) continue;
            int pos = ctx - q_len + qi;
            float sc = -MINILLM_INF;
            if (lane < PF_BK && kt + lane <= pos) {
                float dot = 0.0f;
#pragma unroll 8
                for (int d = 0; d < HEAD_DIM; ++d) dot += qs[r][d] * ks[lane * (HEAD_DIM + 1) + d];
                sc = dot * scale_log2;
            }
            float mx = fmaxf(m[i], warp_max(sc));
            if (mx == -MINILLM_INF) continue;
            float alpha = exp2f(m[i] - mx);
            float p = exp2f(sc - mx);
            l[i] = l[i] * alpha + warp_sum(p);
#pragma unroll
            for (int dd = 0; dd < PF_DPL; ++dd) o[i][dd] *= alpha;
            for (int key = 0; key < PF_BK; ++key) {
                float pk = __shfl_sync(FULL_MASK, p, key);
#pragma unroll
                for (int dd = 0; dd < PF_DPL; ++dd) {
                    int d = lane + 32 * dd;
                    if (d < HEAD_DIM) o[i][dd] += pk * vs[key * HEAD_DIM + d];
                }
            }
            m[i] = mx;
        }
    }
#pragma unroll
    for (int i = 0; i < PF_ROWS; ++i) {
        int qi = tile0 + warp * PF_ROWS + i;
        if (qi >= q_len) continue;
        scalar_t* dst = out + (long long)(q_start + qi) * out_stride + (long long)h * HEAD_DIM;
#pragma unroll
        for (int dd = 0; dd < PF_DPL; ++dd) {
            int d = lane + 32 * dd;
            if (d < HEAD_DIM) dst[d] = from_float(l[i] > 0.0f ? o[i][dd] / l[i] : 0.0f);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill, tensor cores: fp16 / bf16 with HEAD_DIM a multiple of 16 up to 128.
#if MINILLM_DTYPE != 0 && HEAD_DIM % 16 == 0 && HEAD_DIM <= 128
#define PM_BQ 64
#define PM_BK 64
#define PM_THREADS 128
#define PM_LD (HEAD_DIM + 8)       // padded row: 8 rows of a fragment hit distinct banks
#define PM_MMA_F16 (MINILLM_DTYPE == 1)   // MMA operands: the activations' 16-bit type

#if KV_FP8
// Sixteen E4M3 bytes -> sixteen 16-bit values in two vectors (bytes 0..7, 8..15), exactly: every
// E4M3 value is an fp16 and a bf16. One hardware conversion a pair gives fp16 as is; bf16 goes
// on through float (two exact widenings and one exact pack a pair).
__device__ __forceinline__ void e4m3x16_to_vecs(const Vec16& bits, Vec16& lo, Vec16& hi) {
    unsigned int out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned int w = bits.w[i >> 1];
        unsigned int h2 = e4m3x2_to_f16x2((unsigned short)((i & 1) ? w >> 16 : w & 0xffffu));
#if MINILLM_DTYPE == 1
        out[i] = h2;
#else
        float a, b;
        f16x2_to_floats(h2, &a, &b);
        out[i] = pack2(a, b);
#endif
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo.w[i] = out[i];
        hi.w[i] = out[4 + i];
    }
}
#endif

// Copy keys/values kt..kt+PM_BK-1 into the padded tiles, zero-filled past kv_end. FP8: 16-byte
// loads of 16 E4M3 values, all of a thread's issued before any is widened, stored unscaled (the
// caller applies k_scale / v_scale to scores and outputs).
__device__ __forceinline__ void mma_load_tile(scalar_t* ks, scalar_t* vs, const cache_t* k_cache,
                                              const cache_t* v_cache, const int* bt, int kt,
                                              int kv_end, int block_size_log2,
                                              long long tok_stride, long long head_off) {
    int mask = (1 << block_size_log2) - 1;
#if KV_FP8
    constexpr int parts = HEAD_DIM / 16;
    constexpr int per_thread = (PM_BK * parts + PM_THREADS - 1) / PM_THREADS;
    Vec16 kb[per_thread], vb[per_thread];
#pragma unroll
    for (int i = 0; i < per_thread; ++i) {
        int c = threadIdx.x + i * PM_THREADS, key = c / parts, part = c % parts, t = kt + key;
        kb[i].w[0] = kb[i].w[1] = kb[i].w[2] = kb[i].w[3] = 0u;
        vb[i] = kb[i];
        if (c < PM_BK * parts && t < kv_end) {
            long long src = ((((long long)bt[t >> block_size_log2]) << block_size_log2) | (t & mask)) * tok_stride + head_off + part * 16;
            kb[i] = ldg16(k_cache + src);
            vb[i] = ldg16(v_cache + src);
        }
    }
#pragma unroll
    for (int i = 0; i < per_thread; ++i) {
        int c = threadIdx.x + i * PM_THREADS, key = c / parts, part = c % parts;
        if (c >= PM_BK * parts) continue;
        Vec16 lo, hi;
        e4m3x16_to_vecs(kb[i], lo, hi);
        stg16(ks + key * PM_LD + part * 16, lo);
        stg16(ks + key * PM_LD + part * 16 + 8, hi);
        e4m3x16_to_vecs(vb[i], lo, hi);
        stg16(vs + key * PM_LD + part * 16, lo);
        stg16(vs + key * PM_LD + part * 16 + 8, hi);
    }
#else
    constexpr int parts = HEAD_DIM / 8;
    for (int c = threadIdx.x; c < PM_BK * parts; c += PM_THREADS) {
        int key = c / parts, part = c % parts, t = kt + key;
        bool valid = t < kv_end;
        long long src = 0;
        if (valid) src = ((((long long)bt[t >> block_size_log2]) << block_size_log2) | (t & mask)) * tok_stride + head_off + part * 8;
        cp_async16(smem_u32(ks + key * PM_LD + part * 8), k_cache + src, valid ? 16 : 0);
        cp_async16(smem_u32(vs + key * PM_LD + part * 8), v_cache + src, valid ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned int ld_pair(const scalar_t* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

extern "C" __global__ void __launch_bounds__(PM_THREADS)
paged_prefill_mma(scalar_t* out, long long out_stride, const scalar_t* q, long long q_stride,
                  const cache_t* k_cache, const cache_t* v_cache, const int* block_tables,
                  long long bt_stride, const int* seq_lens, const int* query_start_loc,
                  int num_heads, int num_kv_heads, int block_size_log2, float scale_log2_in,
                  const float* kv_scales) {
    __shared__ alignas(16) scalar_t ks[PM_BK * PM_LD];
    __shared__ alignas(16) scalar_t vs[PM_BK * PM_LD];
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (num_heads / num_kv_heads);
    const int q_start = query_start_loc[b], q_len = query_start_loc[b + 1] - q_start;
    const int ctx = seq_lens[b];
    const int tile0 = (gridDim.x - 1 - blockIdx.x) * PM_BQ;
    if (tile0 >= q_len) return;
    const KVFactors kv_mul = kv_factors(kv_scales);   // the tiles hold unscaled E4M3 values
    const float scale_log2 = scale_log2_in * kv_mul.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int row_a = tile0 + warp * 16 + g, row_b = row_a + 8;     // query indices in the chunk
    const int pos_a = ctx - q_len + row_a, pos_b = ctx - q_len + row_b;
    const bool warp_active = tile0 + warp * 16 < q_len;
    const int warp_last_pos = ctx - q_len + tile0 + warp * 16 + 15;   // warp-uniform

    unsigned int qa[HEAD_DIM / 16][4];
    const scalar_t* qrow_a = q + (long long)(q_start + row_a) * q_stride + (long long)h * HEAD_DIM;
    const scalar_t* qrow_b = q + (long long)(q_start + row_b) * q_stride + (long long)h * HEAD_DIM;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        int c = kk * 16 + tq * 2;
        qa[kk][0] = row_a < q_len ? ld_pair(qrow_a + c) : 0u;
        qa[kk][1] = row_b < q_len ? ld_pair(qrow_b + c) : 0u;
        qa[kk][2] = row_a < q_len ? ld_pair(qrow_a + c + 8) : 0u;
        qa[kk][3] = row_b < q_len ? ld_pair(qrow_b + c + 8) : 0u;
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = -MINILLM_INF, m_b = -MINILLM_INF, l_a = 0.0f, l_b = 0.0f;

    const int kv_end = ctx - q_len + min(tile0 + PM_BQ, q_len);
    const int* bt = block_tables + (long long)b * bt_stride;
    const long long tok_stride = (long long)num_kv_heads * HEAD_DIM;
    // ldmatrix row addresses of this lane (see the fragment layouts of mma.m16n8k16).
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) * 8;
    for (int kt = 0; kt < kv_end; kt += PM_BK) {
        __syncthreads();
        mma_load_tile(ks, vs, k_cache, v_cache, bt, kt, kv_end, block_size_log2, tok_stride,
                      (long long)kvh * HEAD_DIM);
        __syncthreads();
        if (!warp_active || kt > warp_last_pos) continue;   // the whole tile is in this warp's future
        float s[PM_BK / 8][4];
#pragma unroll
        for (int n = 0; n < PM_BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
            for (int nj = 0; nj < PM_BK / 16; ++nj) {
                unsigned int r[4];
                ldsm_x4(smem_u32(ks + (nj * 16 + k_row) * PM_LD + kk * 16 + k_col), r);
                mma_16816<PM_MMA_F16>(s[2 * nj], qa[kk], r[0], r[1]);
                mma_16816<PM_MMA_F16>(s[2 * nj + 1], qa[kk], r[2], r[3]);
            }
        }
        float mx_a = -MINILLM_INF, mx_b = -MINILLM_INF;
#pragma unroll
        for (int n = 0; n < PM_BK / 8; ++n) {
            int key = kt + n * 8 + tq * 2;
            s[n][0] = key <= pos_a ? s[n][0] * scale_log2 : -MINILLM_INF;
            s[n][1] = key + 1 <= pos_a ? s[n][1] * scale_log2 : -MINILLM_INF;
            s[n][2] = key <= pos_b ? s[n][2] * scale_log2 : -MINILLM_INF;
            s[n][3] = key + 1 <= pos_b ? s[n][3] * scale_log2 : -MINILLM_INF;
            mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(FULL_MASK, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(FULL_MASK, mx_b, off));
        }
        float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        float ref_a = mn_a == -MINILLM_INF ? 0.0f : mn_a, ref_b = mn_b == -MINILLM_INF ? 0.0f : mn_b;
        float alpha_a = exp2f(m_a - ref_a), alpha_b = exp2f(m_b - ref_b);
        m_a = mn_a;
        m_b = mn_b;
        l_a *= alpha_a;
        l_b *= alpha_b;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n) {
            o[n][0] *= alpha_a; o[n][1] *= alpha_a;
            o[n][2] *= alpha_b; o[n][3] *= alpha_b;
        }
        unsigned int pa[PM_BK / 16][4];
#pragma unroll
        for (int n = 0; n < PM_BK / 8; ++n) {
            float p0 = exp2f(s[n][0] - ref_a), p1 = exp2f(s[n][1] - ref_a);
            float p2 = exp2f(s[n][2] - ref_b), p3 = exp2f(s[n][3] - ref_b);
            l_a += p0 + p1;
            l_b += p2 + p3;
            pa[n >> 1][(n & 1) * 2 + 0] = pack2(p0, p1);
            pa[n >> 1][(n & 1) * 2 + 1] = pack2(p2, p3);
        }
#pragma unroll
        for (int kk = 0; kk < PM_BK / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < HEAD_DIM / 16; ++np) {
                unsigned int r[4];
                ldsm_x4_trans(smem_u32(vs + (kk * 16 + v_row) * PM_LD + np * 16 + v_col), r);
                mma_16816<PM_MMA_F16>(o[2 * np], pa[kk], r[0], r[1]);
                mma_16816<PM_MMA_F16>(o[2 * np + 1], pa[kk], r[2], r[3]);
            }
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(FULL_MASK, l_a, off);
        l_b += __shfl_xor_sync(FULL_MASK, l_b, off);
    }
    float inv_a = l_a > 0.0f ? kv_mul.y / l_a : 0.0f, inv_b = l_b > 0.0f ? kv_mul.y / l_b : 0.0f;
    scalar_t* out_a = out + (long long)(q_start + row_a) * out_stride + (long long)h * HEAD_DIM;
    scalar_t* out_b = out + (long long)(q_start + row_b) * out_stride + (long long)h * HEAD_DIM;
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
        int c = n * 8 + tq * 2;
        if (row_a < q_len) *reinterpret_cast<unsigned int*>(out_a + c) = pack2(o[n][0] * inv_a, o[n][1] * inv_a);
        if (row_b < q_len) *reinterpret_cast<unsigned int*>(out_b + c) = pack2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}
#endif
