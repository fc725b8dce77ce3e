// prefill_attention.cu: causal attention of ragged query chunks over a paged KV cache with a cached
// prefix, on the tensor cores (fp16 / bf16, HEAD_DIM 64 or 128), FlashAttention-2 style.
//
// Layout (as paged_attention.cu): one layer's k_cache / v_cache [num_blocks, block_size, Hk,
// HEAD_DIM] packed, block_size a power of two (passed as its log2); block_tables [B, max_blocks]
// int32 with a row stride; seq_lens [B] int32 (context length after this step's tokens);
// query_start_loc [B+1] int32; q [T, Hq, HEAD_DIM] with a token stride in elements (heads packed
// inside a token, 16-byte aligned rows); out likewise (4-byte aligned). Query token i of sequence b
// sits at position seq_lens[b] - q_len_b + i and attends to positions 0..that position. GQA: query
// head h reads KV head h / GQA. Scores are scaled in log2 units (scale_log2 = scale * log2(e)) so
// the softmax uses exp2. Compiled per (dtype, HEAD_DIM, GQA[, PA_WARPS, PA_MT]) with -D defines.
//
// Launch: 1-D grid of num_q_tiles * Hk * B blocks of PA_WARPS * 32 threads; dynamic shared memory
// (PA_BM + 2 * PA_STAGES * 64) * (HEAD_DIM + 8) * 2 bytes, with an FP8 cache (PA_BM + 2 * 64) *
// (HEAD_DIM + 8) * 2 + 2 * PA_STAGES * 64 * HEAD_DIM (past 48 KB the function attribute must be
// raised). One block owns PA_BM query rows of one KV head: the GQA query heads that share the KV
// head are packed as rows (row r = query token tok0 + r / GQA, head kvh * GQA + r % GQA), so every
// K/V tile is read from memory once for all of them. A warp owns 16 * PA_MT rows; with PA_KSPLIT
// key groups, PA_KSPLIT warps share each row set and each takes its part of every K/V tile, their
// softmax states merged through shared memory at the end (more warps on one block's rows).
//   - Q goes to shared memory once; K/V tiles of 64 keys are gathered through the block table by
//     cp.async (16-byte pieces of the token rows, zero-filled past the block's last key) into
//     PA_STAGES stages: the next PA_STAGES - 1 tiles stream in while one is computed, one barrier
//     a tile. The table entries of a tile are read before the barrier that precedes its copies.
//   - Shared rows are padded by 16 bytes, so the 8 row addresses of every ldmatrix hit 8
//     different 4-bank groups. S = Q K^T and O += P V run on mma.sync.m16n8k16 with fp32
//     accumulators; Q and K fragments come by ldmatrix, V by ldmatrix.trans, P stays in registers.
//   - Online softmax in registers, PA_BC keys at a time (running max and sum per row; the sum is
//     reduced over the four lanes of a row only at the end; O is rescaled only when some row's
//     maximum moved). Masking runs only on the steps that reach past the warp's first query
//     position; steps wholly in a warp's future are skipped.
//   - Work order: block rank 0 takes the last query tile of every (sequence, KV head), rank 1 the
//     one before, ...: the blocks with the most K/V tiles start first. When the grid fits in two
//     blocks per multiprocessor (first_wave = the multiprocessor count), the blocks after the first
//     `first_wave` are handed out shortest first, so that a multiprocessor holding a long block also
//     gets a short one (this assumes the hardware places one block on every multiprocessor before
//     any gets a second; if it does not, the order only changes which blocks share one).
//
// Key splits (num_splits > 1, blockIdx.y = split): a small grid at a long context (a short chunk
// over a long prefix: 16 blocks on 132 multiprocessors, each streaming every key) splits each
// block's K/V tiles into num_splits even runs, one block each (flash-decoding applied to prefill
// tiles). Each writes its rows' partials (normalised output, max in log2 units, sum) to part_o
// [T, Hq, S, HEAD_DIM] / part_ml [T, Hq, S, 2] fp32 (T: the step's token rows; a split with no
// tiles writes max -inf, sum 0), and prefill_attention_reduce (grid (Hq, T), 128 threads) merges
// them into out.
//
// FP8 caches (KV_FP8=1: uint8 E4M3 bits, kv_scales [2] = k_scale, v_scale in device memory, as in
// paged_attention.cu): the tiles' bytes stream into PA_STAGES byte stages by the same cp.async
// pipeline (half the bytes of a 16-bit cache), and each tile is widened once, after it lands, into
// one fp16 K and V tile (cvt.rn.f16x2.e4m3x2: exact, every E4M3 value is an fp16) that the MMAs
// read as above. The MMAs then run in fp16 whatever the activations' dtype: bf16 Q rows are
// converted to fp16 in shared memory once (exact within fp16's range; larger values saturate at
// +-65504), and P goes in fp16. k_scale multiplies the scores through scale_log2, v_scale the
// output. One key group only (PA_KSPLIT 1).
//
// Shapes (minillm/ops/prefill_attention.py): "flash" = 4 warps x 32 rows, 2 stages, two blocks a
// multiprocessor; "flash-8w" = 8 warps in 2 key groups x 4 warps x 32 rows, 3 stages, one block.
// Registers at HEAD_DIM 128: O is 2 x 16 x 4 fp32 = 128, S of a 32-key step 2 x 4 x 4 = 32; nvcc 13.0
// fits either shape in 255 registers without spills (a 64-key step spills). With 32 rows a warp
// every K/V fragment feeds two MMAs: 48 KB of ldmatrix reads (Q, K, V) per 64 keys and 1 MFLOP.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GQA
#define GQA 2
#endif
#ifndef PA_WARPS
#define PA_WARPS 4                // warps of a block
#endif
#ifndef PA_MT
#define PA_MT 2                   // 16-row MMA tiles of one warp
#endif
#ifndef PA_KSPLIT
#define PA_KSPLIT 1               // warp groups sharing the rows, each taking a part of every K/V tile
#endif
#ifndef PA_STAGES
#define PA_STAGES 2               // K/V tiles in shared memory (PA_STAGES - 1 load while one is used)
#endif
#ifndef PA_MIN_BLOCKS
#define PA_MIN_BLOCKS 2           // blocks a multiprocessor must hold (caps the registers)
#endif

#if MINILLM_DTYPE != 0 && (HEAD_DIM == 64 || HEAD_DIM == 128)
#define PA_BN 64                                  // keys of a K/V tile (one barrier each)
#ifndef PA_BC
#define PA_BC (HEAD_DIM == 128 || PA_KSPLIT > 1 ? 32 : 64)   // keys of one softmax step (S in registers)
#endif
#define PA_THREADS (PA_WARPS * 32)
#define PA_ROW_WARPS (PA_WARPS / PA_KSPLIT)       // warps of one key group (they split the rows)
#define PA_SPAN (PA_BN / PA_KSPLIT)               // keys of a tile that one key group takes
#define PA_ROWS_W (16 * PA_MT)                    // query rows of a warp
#define PA_BM (PA_ROWS_W * PA_ROW_WARPS)          // query rows of a block
#define PA_TOKENS (PA_BM / GQA)                   // query tokens of a block
#define PA_VALID_ROWS (PA_TOKENS * GQA)           // rows past this are idle (GQA not dividing PA_BM)
#define PA_LD (HEAD_DIM + 8)                      // padded shared row, in elements
#define PA_PARTS (HEAD_DIM / 8)                   // 16-byte pieces of a row
#define PA_CP_ELEMS (16 / (int)sizeof(cache_t))   // cache elements of one 16-byte copy
#define PA_CP_PARTS (HEAD_DIM / PA_CP_ELEMS)      // 16-byte pieces of a cache row
#define PA_KEYS_PER_PASS (PA_THREADS / PA_CP_PARTS)   // K/V rows one pass of the block copies
// MMA operands: fp16 for fp16 activations and for every FP8 cache (its values widen exactly to
// fp16), bf16 otherwise.
#define PA_MMA_F16 (MINILLM_DTYPE == 1 || KV_FP8)
#define PA_NT (PA_BC / 8)                         // 8-key MMA tiles of S
#define PA_DT (HEAD_DIM / 8)                      // 8-column MMA tiles of O

static_assert(PA_WARPS % PA_KSPLIT == 0 && PA_BN % PA_KSPLIT == 0, "key groups must split warps and tiles");
static_assert(PA_SPAN % PA_BC == 0 && PA_BC % 16 == 0, "softmax steps must tile a key group's span");
static_assert(PA_STAGES >= 2, "the next tile needs a stage of its own");
static_assert(PA_TOKENS >= 1, "GQA must not exceed the rows of a block");
static_assert(PA_THREADS % PA_CP_PARTS == 0 && PA_BN % PA_KEYS_PER_PASS == 0, "K/V copy passes must tile");
static_assert(!KV_FP8 || PA_KSPLIT == 1, "FP8 caches take one key group");
static_assert((PA_BM * PA_PARTS) % PA_THREADS == 0, "Q copy passes must tile");

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Wait until at most PA_STAGES - 2 copy groups are in flight (the oldest, tile j, has landed).
__device__ __forceinline__ void cp_async_wait_tile() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PA_STAGES - 2) : "memory");
}

// What one block computes: query tile `tile` (from the chunk's start) of KV head kvh of sequence
// b, or tile < 0 when the sequence has no such tile.
struct PrefillWork {
    int b, kvh, tile;
};

// Rank r of the work order covers, for every (sequence, KV head), the r-th query tile counted
// from the chunk's end; the first `first_wave` blocks take ranks in order, later ones from the
// other end (see the header).
__device__ __forceinline__ PrefillWork prefill_work(const int* query_start_loc, int num_seqs,
                                                    int num_kv_heads, int num_q_tiles, int first_wave) {
    const int per_rank = num_seqs * num_kv_heads;
    const int total = per_rank * num_q_tiles;
    int order = blockIdx.x;
    if (first_wave > 0 && order >= first_wave) order = total - 1 - (order - first_wave);
    const int rank = order / per_rank, rem = order - rank * per_rank;
    PrefillWork w;
    w.kvh = rem % num_kv_heads;
    w.b = rem / num_kv_heads;
    const int q_len = query_start_loc[w.b + 1] - query_start_loc[w.b];
    w.tile = (q_len + PA_TOKENS - 1) / PA_TOKENS - 1 - rank;
    return w;
}

// cp.async the block's Q rows into q_s (rows past the chunk, or idle rows, zero-filled).
__device__ __forceinline__ void prefill_load_q(scalar_t* q_s, const scalar_t* q, long long q_stride,
                                               int q_start, int q_len, int tok0, int kvh) {
#pragma unroll
    for (int i = 0; i < PA_BM * PA_PARTS / PA_THREADS; ++i) {
        const int c = threadIdx.x + i * PA_THREADS;
        const int r = c / PA_PARTS, part = c % PA_PARTS, tok = tok0 + r / GQA;
        const bool valid = r < PA_VALID_ROWS && tok < q_len;
        const scalar_t* src = q;
        if (valid) src = q + (long long)(q_start + tok) * q_stride + (long long)(kvh * GQA + r % GQA) * HEAD_DIM + part * 8;
        cp_async16(smem_u32(q_s + r * PA_LD + part * 8), src, valid ? 16 : 0);
    }
}

#define PA_KV_PASSES (PA_BN / PA_KEYS_PER_PASS)    // K/V rows one thread copies per tile

// Physical blocks of the keys this thread copies for the tile at kt (read before they are needed,
// so the table reads' latency hides behind the barrier).
__device__ __forceinline__ void prefill_kv_blocks(int (&blk)[PA_KV_PASSES], const int* bt, int kt, int kv_end,
                                                  int block_size_log2) {
    const int key0 = threadIdx.x / PA_CP_PARTS;
#pragma unroll
    for (int i = 0; i < PA_KV_PASSES; ++i) {
        const int t = kt + key0 + i * PA_KEYS_PER_PASS;
        blk[i] = t < kv_end ? bt[t >> block_size_log2] : 0;
    }
}

// cp.async keys / values kt..kt+PA_BN-1 of one KV head into ks / vs (zero-filled from kv_end):
// rows of PA_LD elements, or with an FP8 cache rows of HEAD_DIM bytes (the byte stages).
__device__ __forceinline__ void prefill_load_kv(cache_t* ks, cache_t* vs, const int (&blk)[PA_KV_PASSES],
                                                const cache_t* k_cache, const cache_t* v_cache, int kt,
                                                int kv_end, int block_size_log2, long long tok_stride,
                                                long long head_off) {
    const int part = threadIdx.x % PA_CP_PARTS, key0 = threadIdx.x / PA_CP_PARTS;
    const int in_block = (1 << block_size_log2) - 1;
#pragma unroll
    for (int i = 0; i < PA_KV_PASSES; ++i) {
        const int key = key0 + i * PA_KEYS_PER_PASS, t = kt + key;
        const bool valid = t < kv_end;
        const long long src = valid ? ((((long long)blk[i]) << block_size_log2) | (t & in_block)) * tok_stride
                                          + head_off + part * PA_CP_ELEMS
                                    : 0;
        const int off = key * (KV_FP8 ? HEAD_DIM : PA_LD) + part * PA_CP_ELEMS;
        cp_async16(smem_u32(ks + off), k_cache + src, valid ? 16 : 0);
        cp_async16(smem_u32(vs + off), v_cache + src, valid ? 16 : 0);
    }
}

#if KV_FP8
// 16 E4M3 bytes -> 16 fp16 values (exact), in order: byte i is element i.
__device__ __forceinline__ void widen_e4m3x16(const Vec16& b, Vec16& lo, Vec16& hi) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        Vec16& dst = w < 2 ? lo : hi;
        dst.w[(w & 1) * 2] = e4m3x2_to_f16x2((unsigned short)(b.w[w] & 0xffffu));
        dst.w[(w & 1) * 2 + 1] = e4m3x2_to_f16x2((unsigned short)(b.w[w] >> 16));
    }
}

// The landed byte tile (k8, v8: [PA_BN][HEAD_DIM]) widened into the fp16 MMA tiles ks, vs.
__device__ __forceinline__ void prefill_widen_kv(scalar_t* ks, scalar_t* vs, const cache_t* k8, const cache_t* v8) {
#pragma unroll 1                                   // unrolled: no faster on the H200 (RESULTS.md)
    for (int i = threadIdx.x; i < PA_BN * PA_CP_PARTS; i += PA_THREADS) {
        const int key = i / PA_CP_PARTS, part = i % PA_CP_PARTS;
        Vec16 lo, hi;
        widen_e4m3x16(*reinterpret_cast<const Vec16*>(k8 + key * HEAD_DIM + part * 16), lo, hi);
        *reinterpret_cast<Vec16*>(ks + key * PA_LD + part * 16) = lo;
        *reinterpret_cast<Vec16*>(ks + key * PA_LD + part * 16 + 8) = hi;
        widen_e4m3x16(*reinterpret_cast<const Vec16*>(v8 + key * HEAD_DIM + part * 16), lo, hi);
        *reinterpret_cast<Vec16*>(vs + key * PA_LD + part * 16) = lo;
        *reinterpret_cast<Vec16*>(vs + key * PA_LD + part * 16 + 8) = hi;
    }
}

#if MINILLM_DTYPE == 2
// The landed bf16 Q rows as fp16 in place (the MMAs of an FP8 cache run in fp16): exact within
// fp16's range, saturated at +-65504 past it, NaN kept.
__device__ __forceinline__ void prefill_q_to_f16(scalar_t* q_s) {
    for (int i = threadIdx.x; i < PA_BM * (HEAD_DIM / 2); i += PA_THREADS) {
        unsigned int* p = reinterpret_cast<unsigned int*>(q_s + (i / (HEAD_DIM / 2)) * PA_LD) + i % (HEAD_DIM / 2);
        float lo = bf16_bits_to_float((unsigned short)(*p & 0xffffu));
        float hi = bf16_bits_to_float((unsigned short)(*p >> 16));
        lo = fabsf(lo) > 65504.0f ? copysignf(65504.0f, lo) : lo;
        hi = fabsf(hi) > 65504.0f ? copysignf(65504.0f, hi) : hi;
        *p = pack_16x2<PA_MMA_F16>(lo, hi);
    }
}
#endif
#endif

// s[mi][n] = Q rows (16 mi ..) of this warp times keys (8 n ..) of the tile, unscaled.
__device__ __forceinline__ void prefill_scores(float (&s)[PA_MT][PA_NT][4], unsigned int q_addr,
                                               unsigned int k_addr) {
#pragma unroll
    for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
        for (int n = 0; n < PA_NT; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        unsigned int qa[PA_MT][4];
#pragma unroll
        for (int mi = 0; mi < PA_MT; ++mi) ldsm_x4(q_addr + (mi * 16 * PA_LD + kk * 16) * 2, qa[mi]);
#pragma unroll
        for (int nj = 0; nj < PA_BC / 16; ++nj) {
            unsigned int r[4];
            ldsm_x4(k_addr + (nj * 16 * PA_LD + kk * 16) * 2, r);
#pragma unroll
            for (int mi = 0; mi < PA_MT; ++mi) {
                mma_16816<PA_MMA_F16>(s[mi][2 * nj], qa[mi], r[0], r[1]);
                mma_16816<PA_MMA_F16>(s[mi][2 * nj + 1], qa[mi], r[2], r[3]);
            }
        }
    }
}

// -inf for keys after a row's position. Row row0 + 16 mi + 8 h of the block (this thread's rows)
// is query token row / GQA of the block, at position pos_tok0 + row / GQA.
__device__ __forceinline__ void prefill_mask(float (&s)[PA_MT][PA_NT][4], int pos_tok0, int row0, int kt, int tq) {
#pragma unroll
    for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int last_key = pos_tok0 + (row0 + mi * 16 + h * 8) / GQA - kt - tq * 2;   // relative
#pragma unroll
            for (int n = 0; n < PA_NT; ++n) {
                if (n * 8 > last_key) s[mi][n][2 * h] = -MINILLM_INF;
                if (n * 8 + 1 > last_key) s[mi][n][2 * h + 1] = -MINILLM_INF;
            }
        }
    }
}

// Online softmax of one step: update max m and partial sum l of each row, rescale o, and turn the
// scores into P as mma A fragments (pa[mi][kk]: keys 16 kk ..). Once the rows' maxima settle
// (early in a long context) alpha is exactly 1 for every row of the warp and o is left alone.
__device__ __forceinline__ void prefill_softmax(float (&s)[PA_MT][PA_NT][4], float (&m)[PA_MT][2],
                                                float (&l)[PA_MT][2], float (&o)[PA_MT][PA_DT][4],
                                                unsigned int (&pa)[PA_MT][PA_BC / 16][4], float scale_log2) {
    float alpha[PA_MT][2];
    bool rescale = false;
#pragma unroll
    for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[mi][h];
#pragma unroll
            for (int n = 0; n < PA_NT; ++n) mx = fmaxf(mx, fmaxf(s[mi][n][2 * h], s[mi][n][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            // A row with every key so far masked keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
            const float ref = mx == -MINILLM_INF ? 0.0f : mx * scale_log2;
            alpha[mi][h] = fast_exp2(m[mi][h] * scale_log2 - ref);
            rescale |= mx != m[mi][h];
            m[mi][h] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < PA_NT; ++n) {
                const float p0 = fast_exp2(fmaf(s[mi][n][2 * h], scale_log2, -ref));
                const float p1 = fast_exp2(fmaf(s[mi][n][2 * h + 1], scale_log2, -ref));
                sum += p0 + p1;
                pa[mi][n >> 1][(n & 1) * 2 + h] = pack_16x2<PA_MMA_F16>(p0, p1);
            }
            l[mi][h] = l[mi][h] * alpha[mi][h] + sum;
        }
    }
    if (__any_sync(FULL_MASK, rescale)) {
#pragma unroll
        for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
            for (int d = 0; d < PA_DT; ++d) {
                o[mi][d][0] *= alpha[mi][0];
                o[mi][d][1] *= alpha[mi][0];
                o[mi][d][2] *= alpha[mi][1];
                o[mi][d][3] *= alpha[mi][1];
            }
        }
    }
}

// o[mi] += P[mi] V over the tile's keys.
__device__ __forceinline__ void prefill_pv(float (&o)[PA_MT][PA_DT][4], const unsigned int (&pa)[PA_MT][PA_BC / 16][4],
                                           unsigned int v_addr) {
#pragma unroll
    for (int kk = 0; kk < PA_BC / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
            unsigned int r[4];
            ldsm_x4_trans(v_addr + (kk * 16 * PA_LD + dp * 16) * 2, r);
#pragma unroll
            for (int mi = 0; mi < PA_MT; ++mi) {
                mma_16816<PA_MMA_F16>(o[mi][2 * dp], pa[mi][kk], r[0], r[1]);
                mma_16816<PA_MMA_F16>(o[mi][2 * dp + 1], pa[mi][kk], r[2], r[3]);
            }
        }
    }
}

// Normalise and store this thread's rows (rows past the chunk, or idle rows, are not written): into
// out, or with PARTIAL as split `split`'s partials (see the header): the output normalised by the
// split's own sum, and (max in log2 units, sum) once per row.
template <bool PARTIAL>
__device__ __forceinline__ void prefill_store(scalar_t* out, long long out_stride, float* part_o, float* part_ml,
                                              float (&o)[PA_MT][PA_DT][4], float (&m)[PA_MT][2],
                                              float (&l)[PA_MT][2], int wrow0, int q_start, int q_len, int tok0,
                                              int kvh, int g, int tq, int num_heads, int split, int num_splits,
                                              float scale_log2, float v_scale) {
#pragma unroll
    for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mi][h];
            sum += __shfl_xor_sync(FULL_MASK, sum, 1);
            sum += __shfl_xor_sync(FULL_MASK, sum, 2);
            const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
            const int r = wrow0 + mi * 16 + h * 8 + g, tok = tok0 + r / GQA;
            if (r >= PA_VALID_ROWS || tok >= q_len) continue;
            const int head = kvh * GQA + r % GQA;
            if constexpr (PARTIAL) {
                const long long part = ((long long)(q_start + tok) * num_heads + head) * num_splits + split;
                float* dst = part_o + part * HEAD_DIM + tq * 2;
#pragma unroll
                for (int d = 0; d < PA_DT; ++d)
                    *reinterpret_cast<float2*>(dst + d * 8) = make_float2(o[mi][d][2 * h] * inv, o[mi][d][2 * h + 1] * inv);
                if (tq == 0) {   // (the sum is the probabilities', so v_scale is in the output alone)
                    const float mx = m[mi][h] == -MINILLM_INF ? -MINILLM_INF : m[mi][h] * scale_log2;
                    *reinterpret_cast<float2*>(part_ml + part * 2) = make_float2(mx, sum);
                }
            } else {
                scalar_t* dst = out + (long long)(q_start + tok) * out_stride + (long long)head * HEAD_DIM + tq * 2;
#pragma unroll
                for (int d = 0; d < PA_DT; ++d)
                    *reinterpret_cast<unsigned int*>(dst + d * 8) = pack2(o[mi][d][2 * h] * inv, o[mi][d][2 * h + 1] * inv);
            }
        }
    }
}

#if PA_KSPLIT > 1
// Per thread of a row warp: O fragments, then m, then l (floats), stored lane-minor.
#define PA_PART_FLOATS (PA_MT * PA_DT * 4 + PA_MT * 4)
static_assert(PA_ROW_WARPS * PA_PART_FLOATS * 32 * 4 <= 2 * PA_STAGES * PA_BN * PA_LD * 2,
              "key-group partials must fit the K/V stages");

// Merge the softmax states of the key groups (the K/V stages hold the partials): group 0 ends
// with the state over all keys. Every thread of the block calls it (it holds barriers).
__device__ __forceinline__ void prefill_merge_groups(float* part, float (&o)[PA_MT][PA_DT][4], float (&m)[PA_MT][2],
                                                     float (&l)[PA_MT][2], int kgroup, int rwarp, int lane,
                                                     bool warp_active, float scale_log2) {
    cp_async_wait_all();
    __syncthreads();                                   // every warp is done with the K/V stages
    float* mine = part + rwarp * PA_PART_FLOATS * 32 + lane;
#pragma unroll 1
    for (int grp = 1; grp < PA_KSPLIT; ++grp) {
        if (kgroup == grp && warp_active) {
#pragma unroll
            for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
                for (int d = 0; d < PA_DT; ++d) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) mine[((mi * PA_DT + d) * 4 + e) * 32] = o[mi][d][e];
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mine[(PA_MT * PA_DT * 4 + mi * 2 + h) * 32] = m[mi][h];
                    mine[(PA_MT * PA_DT * 4 + PA_MT * 2 + mi * 2 + h) * 32] = l[mi][h];
                }
            }
        }
        __syncthreads();
        if (kgroup == 0 && warp_active) {
#pragma unroll
            for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float m2 = mine[(PA_MT * PA_DT * 4 + mi * 2 + h) * 32];
                    const float l2 = mine[(PA_MT * PA_DT * 4 + PA_MT * 2 + mi * 2 + h) * 32];
                    const float mx = fmaxf(m[mi][h], m2);
                    const float ref = mx == -MINILLM_INF ? 0.0f : mx * scale_log2;
                    const float a1 = fast_exp2(m[mi][h] * scale_log2 - ref), a2 = fast_exp2(m2 * scale_log2 - ref);
                    m[mi][h] = mx;
                    l[mi][h] = l[mi][h] * a1 + l2 * a2;
#pragma unroll
                    for (int d = 0; d < PA_DT; ++d) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int k = (mi * PA_DT + d) * 4 + 2 * h + e;
                            o[mi][d][2 * h + e] = o[mi][d][2 * h + e] * a1 + mine[k * 32] * a2;
                        }
                    }
                }
            }
        }
        if (grp + 1 < PA_KSPLIT) __syncthreads();      // the next group reuses the buffer
    }
}
#endif

extern "C" __global__ void __launch_bounds__(PA_THREADS, PA_MIN_BLOCKS)
prefill_attention(scalar_t* __restrict__ out, long long out_stride, const scalar_t* __restrict__ q,
                  long long q_stride, const cache_t* __restrict__ k_cache, const cache_t* __restrict__ v_cache,
                  const int* __restrict__ block_tables, long long bt_stride, const int* __restrict__ seq_lens,
                  const int* __restrict__ query_start_loc, int num_seqs, int num_kv_heads, int num_q_tiles,
                  int block_size_log2, float scale_log2, int first_wave, float* __restrict__ part_o,
                  float* __restrict__ part_ml, int num_splits, const float* __restrict__ kv_scales) {
    extern __shared__ Vec16 pa_smem[];                         // Vec16: 16-byte aligned
    scalar_t* q_s = reinterpret_cast<scalar_t*>(pa_smem);     // [PA_BM][PA_LD]
    scalar_t* k_s = q_s + PA_BM * PA_LD;                       // [PA_STAGES][PA_BN][PA_LD] (FP8: one tile)
#if KV_FP8
    scalar_t* v_s = k_s + PA_BN * PA_LD;                       // [PA_BN][PA_LD], fp16
    cache_t* k8_s = reinterpret_cast<cache_t*>(v_s + PA_BN * PA_LD);   // [PA_STAGES][PA_BN][HEAD_DIM] bytes
    cache_t* v8_s = k8_s + PA_STAGES * PA_BN * HEAD_DIM;
    cache_t* k_dst = k8_s;                                     // where the copies land
    cache_t* v_dst = v8_s;
    constexpr int copy_stage = PA_BN * HEAD_DIM;
    scale_log2 *= kv_scales[0];                                // the scores are Q (K / k_scale)^T
    const float v_scale = kv_scales[1];
#else
    scalar_t* v_s = k_s + PA_STAGES * PA_BN * PA_LD;           // [PA_STAGES][PA_BN][PA_LD]
    cache_t* k_dst = k_s;
    cache_t* v_dst = v_s;
    constexpr int copy_stage = PA_BN * PA_LD;
    constexpr float v_scale = 1.0f;
#endif

    const PrefillWork w = prefill_work(query_start_loc, num_seqs, num_kv_heads, num_q_tiles, first_wave);
    if (w.tile < 0) return;                                    // block-uniform: before any barrier
    const int q_start = query_start_loc[w.b], q_len = query_start_loc[w.b + 1] - q_start;
    const int tok0 = w.tile * PA_TOKENS;
    const int pos0 = seq_lens[w.b] - q_len;                    // position of the chunk's token 0
    const int kv_end = pos0 + min(tok0 + PA_TOKENS, q_len);    // keys [0, kv_end) reach this block
    const int all_tiles = (kv_end + PA_BN - 1) / PA_BN;
    // This split's run of tiles [j_begin, j_begin + num_tiles): all of them without splits.
    const int per_split = (all_tiles + num_splits - 1) / num_splits;
    const int j_begin = min(all_tiles, (int)blockIdx.y * per_split);
    const int num_tiles = min(all_tiles - j_begin, per_split);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kgroup = warp / PA_ROW_WARPS, rwarp = warp % PA_ROW_WARPS;   // keys kgroup * PA_SPAN.. of a tile
    const int g = lane >> 2, tq = lane & 3;
    const int wrow0 = rwarp * PA_ROWS_W;
    const int warp_tok0 = tok0 + wrow0 / GQA;
    const bool warp_active = wrow0 < PA_VALID_ROWS && warp_tok0 < q_len;
    const int warp_last_tok = min(tok0 + (min(wrow0 + PA_ROWS_W, PA_VALID_ROWS) - 1) / GQA, q_len - 1);
    const int warp_min_pos = pos0 + warp_tok0, warp_max_pos = pos0 + warp_last_tok;

    const int* bt = block_tables + (long long)w.b * bt_stride;
    const long long tok_stride = (long long)num_kv_heads * HEAD_DIM;
    const long long head_off = (long long)w.kvh * HEAD_DIM;
    int blk[PA_KV_PASSES];
    prefill_load_q(q_s, q, q_stride, q_start, q_len, tok0, w.kvh);
#pragma unroll
    for (int t = 0; t < PA_STAGES - 1; ++t) {                  // tiles 0 .. PA_STAGES - 2, one group each
        if (t < num_tiles) {
            const int kt = (j_begin + t) * PA_BN;
            prefill_kv_blocks(blk, bt, kt, kv_end, block_size_log2);
            prefill_load_kv(k_dst + t * copy_stage, v_dst + t * copy_stage, blk, k_cache, v_cache, kt,
                            kv_end, block_size_log2, tok_stride, head_off);
        }
        cp_async_commit();
    }

#if KV_FP8 && MINILLM_DTYPE == 2
    cp_async_wait_tile();       // Q landed with tile 0's group (before O's registers are live)
    __syncthreads();
    prefill_q_to_f16(q_s);      // read after the barrier that follows tile 0's widening
#endif

    // ldmatrix row addresses of this lane (the fragment layouts of mma.m16n8k16): A rows of Q, B
    // (keys x dims) of K, and B transposed from V; the K/V ones start at this key group's span.
    const unsigned int q_addr = smem_u32(q_s + (wrow0 + (lane & 15)) * PA_LD + (lane >> 4) * 8);
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) * 8;
    const unsigned int k_addr0 = smem_u32(k_s + (kgroup * PA_SPAN + k_row) * PA_LD + k_col);
    const unsigned int v_addr0 = smem_u32(v_s + (kgroup * PA_SPAN + v_row) * PA_LD + v_col);
    constexpr unsigned int stage_bytes = KV_FP8 ? 0 : PA_BN * PA_LD * 2;   // FP8: the one widened tile

    float o[PA_MT][PA_DT][4];
    float m[PA_MT][2], l[PA_MT][2];
#pragma unroll
    for (int mi = 0; mi < PA_MT; ++mi) {
#pragma unroll
        for (int d = 0; d < PA_DT; ++d) o[mi][d][0] = o[mi][d][1] = o[mi][d][2] = o[mi][d][3] = 0.0f;
        m[mi][0] = m[mi][1] = -MINILLM_INF;
        l[mi][0] = l[mi][1] = 0.0f;
    }

    for (int j = 0; j < num_tiles; ++j) {
        const int stage = j % PA_STAGES, ahead = j + PA_STAGES - 1;
        if (ahead < num_tiles) prefill_kv_blocks(blk, bt, (j_begin + ahead) * PA_BN, kv_end, block_size_log2);
        cp_async_wait_tile();
        __syncthreads();        // tile j is visible to all; every warp is done with tile j - 1's stage
        if (ahead < num_tiles) {
            const int next = (ahead % PA_STAGES) * copy_stage;
            prefill_load_kv(k_dst + next, v_dst + next, blk, k_cache, v_cache, (j_begin + ahead) * PA_BN, kv_end,
                            block_size_log2, tok_stride, head_off);
        }
        cp_async_commit();
#if KV_FP8
        // Tile j's bytes into the fp16 tile (every warp is past tile j - 1: the barrier above).
        prefill_widen_kv(k_s, v_s, k8_s + stage * copy_stage, v8_s + stage * copy_stage);
        __syncthreads();
#endif
        if (!warp_active) continue;
#pragma unroll
        for (int c = 0; c < PA_SPAN / PA_BC; ++c) {
            const int kt = (j_begin + j) * PA_BN + kgroup * PA_SPAN + c * PA_BC;
            if (kt > warp_max_pos) break;                    // the rest of the span is in this warp's future
            float s[PA_MT][PA_NT][4];
            prefill_scores(s, q_addr, k_addr0 + stage * stage_bytes + c * PA_BC * PA_LD * 2);
            if (kt + PA_BC - 1 > warp_min_pos) prefill_mask(s, pos0 + tok0, wrow0 + g, kt, tq);
            unsigned int pa[PA_MT][PA_BC / 16][4];
            prefill_softmax(s, m, l, o, pa, scale_log2);
            prefill_pv(o, pa, v_addr0 + stage * stage_bytes + c * PA_BC * PA_LD * 2);
        }
    }
#if PA_KSPLIT > 1
    prefill_merge_groups(reinterpret_cast<float*>(k_s), o, m, l, kgroup, rwarp, lane, warp_active, scale_log2);
    if (kgroup != 0) return;
#endif
    if (!warp_active) return;
    if (num_splits == 1)
        prefill_store<false>(out, out_stride, part_o, part_ml, o, m, l, wrow0, q_start, q_len, tok0, w.kvh, g, tq,
                             num_kv_heads * GQA, 0, 1, scale_log2, v_scale);
    else
        prefill_store<true>(out, out_stride, part_o, part_ml, o, m, l, wrow0, q_start, q_len, tok0, w.kvh, g, tq,
                            num_kv_heads * GQA, blockIdx.y, num_splits, scale_log2, v_scale);
}

// out[t, h] = the splits' partials of token row t (< query_start_loc[num_seqs]) and query head h
// merged (merge_split_partials, as paged_decode_reduce does per sequence). grid (Hq, rows), 128
// threads; rows from row0.
extern "C" __global__ void __launch_bounds__(128)
prefill_attention_reduce(scalar_t* __restrict__ out, long long out_stride, const float* __restrict__ part_o,
                         const float* __restrict__ part_ml, const int* __restrict__ query_start_loc,
                         int num_seqs, int row0, int num_heads, int num_splits) {
    const int h = blockIdx.x, t = row0 + blockIdx.y;
    if (t >= query_start_loc[num_seqs]) return;               // padding rows past the last chunk
    scalar_t* dst = out + (long long)t * out_stride + (long long)h * HEAD_DIM;
    merge_split_partials<HEAD_DIM>(dst, part_o, part_ml, ((long long)t * num_heads + h) * num_splits, num_splits);
}
#endif
