// prefill_attention_wgmma.cu: causal attention of ragged query chunks over a paged KV cache on
// Hopper's warpgroup MMAs (sm_90a), with one producer warpgroup feeding two consumer warpgroups.
//
// Arguments and layout as prefill_attention.cu (k_cache / v_cache [num_blocks, block_size, Hk,
// HEAD_DIM], block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1], q / out [T, Hq,
// HEAD_DIM] with token strides; GQA query heads packed as rows of their KV head), HEAD_DIM 128,
// fp16 / bf16 activations and caches. Launch: one block of 384 threads per (query tile of WG_BM
// rows, KV head, sequence), ordered as prefill_attention.cu orders them (longest first), times
// num_splits key splits (blockIdx.y: prefill_attention.cu's even runs of K/V tiles, its partials
// part_o / part_ml and its reduce kernel; num_splits 1 writes out directly); dynamic shared memory
// WG_SMEM bytes. The body needs sm_90a (NVRTC -arch=sm_90a); built for plain sm_90 the file holds
// no kernel.
//
//   - Warpgroup 0 (the producer) gathers each K/V tile of WG_BN keys through the block table with
//     cp.async (16-byte pieces, zero-filled past the sequence's last key) into WG_STAGES stages, in
//     the 128-byte-swizzled layout the MMAs read: a tile is two [WG_BN keys][64 dims] halves of
//     128-byte rows, piece c of row r stored at piece c ^ (r % 8). Each producer thread's copies of
//     tile j arrive on full[j % WG_STAGES] when they land (cp.async.mbarrier.arrive), so the
//     producer runs up to WG_STAGES tiles ahead; it waits on empty[stage] before it overwrites a
//     stage. Each producer lane reads one block-table entry a tile, a tile ahead, and its warp
//     shares them by shuffles, so no copy waits on a block-table read. The consumers fence the
//     landed tile for the async proxy before their MMAs read it.
//   - Warpgroups 1 and 2 (the consumers) own 64 query rows each: S = Q K^T is one chain of
//     wgmma.m64n128k16 with both operands in shared memory (Q loaded once, swizzled the same way),
//     the online softmax runs on the accumulators in registers, and O += P V takes P from
//     registers and V as a transposed (MN-major) shared operand. Tile j's S = Q K^T is issued with
//     tile j - 1's P V behind it and tile j's softmax is written between the two waits (ptxas of
//     CUDA 13.0 moves the second wait up to the first, so a warpgroup's softmax overlaps the
//     other warpgroup's MMAs rather than its own). O is rescaled and the new P packed once the
//     P V is done. Each consumer thread arrives on empty[stage] when its warpgroup's MMAs of the
//     tile are done.
//   - Accumulator and P registers are fenced around every wait (an empty asm that reads and writes
//     them), so the compiler moves no use of them across an MMA still in flight.
//   - setmaxnreg moves registers from the producer (56) to the consumers (224): a consumer holds S,
//     O (64 fp32 each) and P (32) at once; one block a multiprocessor.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GQA
#define GQA 2
#endif

#if MINILLM_DTYPE != 0 && HEAD_DIM == 128 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_BM 128                         // query rows of a block (two consumer warpgroups of 64)
#define WG_BN 128                         // keys of a K/V tile
#define WG_STAGES 3
#define WG_THREADS 384
#define WG_TOKENS (WG_BM / GQA)           // query tokens of a block
#define WG_VALID_ROWS (WG_TOKENS * GQA)   // rows past this are idle (GQA not dividing WG_BM)
#define WG_HALF_BYTES (WG_BN * 128)       // one [WG_BN][64] half of a K or V tile
#define WG_TILE_BYTES (2 * WG_HALF_BYTES)
#define WG_Q_BYTES (2 * WG_BM * 128)
#define WG_SMEM (WG_Q_BYTES + 2 * WG_STAGES * WG_TILE_BYTES + 1024)   // + alignment slack

#if MINILLM_DTYPE == 1
#define WG_TYPE "f16"
#else
#define WG_TYPE "bf16"
#endif

// ---- mbarriers (shared::cta) ----
__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- warpgroup MMAs ----
// Shared-memory matrix descriptor of a 128-byte-swizzled operand at smem address addr: leading
// and stride byte offsets lbo / sbo (bytes).
__device__ __forceinline__ unsigned long long wg_desc(unsigned int addr, unsigned int lbo, unsigned int sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keep the compiler from moving reads or writes of accumulator registers across a wait.
__device__ __forceinline__ void wg_fence_regs(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for P's registers (read by an MMA in flight until the wait).
__device__ __forceinline__ void wg_fence_regs_u(unsigned int (&a)[8][4]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(a[i][k])::"memory");
}

#define WG_D64                                                                                         \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "  \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "   \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "   \
    "%59, %60, %61, %62, %63}"
#define WG_D64_OPS(d)                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),    \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),           \
    "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),         \
    "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),         \
    "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),         \
    "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),         \
    "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),         \
    "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),         \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d[64x128] (+)= A[64x16] B[16x128], A and B K-major in shared memory; scale_d 0 overwrites d.
__device__ __forceinline__ void wg_mma_ss(float (&d)[64], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TYPE "." WG_TYPE " " WG_D64
        ", %64, %65, p, 1, 1, 0, 0; }"
        : WG_D64_OPS(d)
        : "l"(a), "l"(b), "r"(scale_d));
}

// d[64x128] += A[64x16] B[16x128], A in registers (mma.m16n8k16's A fragments a warp), B
// MN-major (transposed) in shared memory.
__device__ __forceinline__ void wg_mma_rs(float (&d)[64], const unsigned int (&a)[4], unsigned long long b) {
    asm volatile(
        "{ .reg .pred p; setp.eq.u32 p, 1, 1;\n\t"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TYPE "." WG_TYPE " " WG_D64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
        : WG_D64_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Offset of 16-byte piece c (0..7) of row r in a 128-byte-swizzled [rows][64] half.
__device__ __forceinline__ unsigned int swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

struct WgWork {
    int b, kvh, tile;
};

// prefill_attention.cu's order: rank r covers, for every (sequence, KV head), the r-th query tile
// counted from the chunk's end (the longest blocks first).
__device__ __forceinline__ WgWork wg_work(const int* query_start_loc, int num_seqs, int num_kv_heads) {
    const int per_rank = num_seqs * num_kv_heads;
    const int rank = blockIdx.x / per_rank, rem = blockIdx.x - rank * per_rank;
    WgWork w;
    w.kvh = rem % num_kv_heads;
    w.b = rem / num_kv_heads;
    const int q_len = query_start_loc[w.b + 1] - query_start_loc[w.b];
    w.tile = (q_len + WG_TOKENS - 1) / WG_TOKENS - 1 - rank;
    return w;
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
prefill_attention_wgmma(scalar_t* __restrict__ out, long long out_stride, const scalar_t* __restrict__ q,
                        long long q_stride, const scalar_t* __restrict__ k_cache,
                        const scalar_t* __restrict__ v_cache, const int* __restrict__ block_tables,
                        long long bt_stride, const int* __restrict__ seq_lens,
                        const int* __restrict__ query_start_loc, int num_seqs, int num_kv_heads,
                        int block_size_log2, float scale_log2, float* __restrict__ part_o,
                        float* __restrict__ part_ml, int num_splits) {
    extern __shared__ unsigned char wg_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * WG_STAGES];     // full[s], then empty[s]
    const unsigned int base = (smem_u32(wg_raw) + 1023u) & ~1023u;     // swizzle atoms: 1024-byte aligned
    const unsigned int q_sm = base;                                     // [2 halves][WG_BM][128 B]
    const unsigned int kv_sm = base + WG_Q_BYTES;                       // [stage][K, V][2 halves][WG_BN][128 B]
    const unsigned int full0 = smem_u32(bars), empty0 = full0 + 8 * WG_STAGES;

    const WgWork w = wg_work(query_start_loc, num_seqs, num_kv_heads);
    if (w.tile < 0) return;                                             // block-uniform, before any barrier
    const int q_start = query_start_loc[w.b], q_len = query_start_loc[w.b + 1] - q_start;
    const int tok0 = w.tile * WG_TOKENS;
    const int pos0 = seq_lens[w.b] - q_len;                             // position of the chunk's token 0
    const int kv_end = pos0 + min(tok0 + WG_TOKENS, q_len);             // keys [0, kv_end) reach this block
    // This split's run of tiles [j0, j0 + num_tiles) (blockIdx.y; all of them without splits).
    const int all_tiles = (kv_end + WG_BN - 1) / WG_BN;
    const int per_split = (all_tiles + num_splits - 1) / num_splits;
    const int j0 = min(all_tiles, (int)blockIdx.y * per_split);
    const int num_tiles = min(all_tiles - j0, per_split);

    if (threadIdx.x == 0) {
        for (int s = 0; s < WG_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 128);
            mbar_init(empty0 + 8 * s, 256);
        }
    }
    __syncthreads();

    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
    if (wg == 0) {
        // ---------------- producer ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
        const int* bt = block_tables + (long long)w.b * bt_stride;
        const long long tok_stride = (long long)num_kv_heads * HEAD_DIM;
        const long long head_off = (long long)w.kvh * HEAD_DIM;
        // Warp w copies keys 32 w .. 32 w + 31 of each tile, two keys an instruction (16 pieces of
        // 16 bytes each); lane m holds the cache row of key 32 w + m (-1 past kv_end), and the next
        // tile's rows are loaded while this tile's copies are issued.
        const int pwarp = t >> 5, lane = t & 31;
        const int piece = lane & 15, half = piece >> 3, c = piece & 7, sub = lane >> 4;
        const int in_block = (1 << block_size_log2) - 1;
        auto row_of = [&](int j) {
            const int pos = (j0 + j) * WG_BN + pwarp * 32 + lane;
            return pos < kv_end ? (bt[pos >> block_size_log2] << block_size_log2) | (pos & in_block) : -1;
        };
        int row = row_of(0);
        for (int j = 0; j < num_tiles; ++j) {
            const int next = j + 1 < num_tiles ? row_of(j + 1) : -1;
            const int s = j % WG_STAGES;
            if (j >= WG_STAGES) mbar_wait(empty0 + 8 * s, ((j / WG_STAGES) + 1) & 1);
            const unsigned int k_dst = kv_sm + s * 2 * WG_TILE_BYTES + half * WG_HALF_BYTES;
            const unsigned int v_dst = k_dst + WG_TILE_BYTES;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int key = pwarp * 32 + 2 * i + sub;
                const int r = __shfl_sync(FULL_MASK, row, 2 * i + sub);
                const long long src = r >= 0 ? (long long)r * tok_stride + head_off + piece * 8 : 0;
                cp_async16(k_dst + swz(key, c), k_cache + src, r >= 0 ? 16 : 0);
                cp_async16(v_dst + swz(key, c), v_cache + src, r >= 0 ? 16 : 0);
            }
            // full[s] counts this thread's arrival once its copies so far have landed.
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full0 + 8 * s) : "memory");
            row = next;
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }

    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    const int cw = wg - 1;                                 // rows 64 cw .. of the block
    // Q rows of the whole block by both consumer warpgroups (256 threads, 8 pieces each).
#pragma unroll
    for (int i = 0; i < WG_BM * 16 / 256; ++i) {
        const int idx = (threadIdx.x - 128) + i * 256;
        const int r = idx >> 4, piece = idx & 15, tok = tok0 + r / GQA;
        const bool valid = r < WG_VALID_ROWS && tok < q_len;
        const scalar_t* src = q;
        if (valid) src = q + (long long)(q_start + tok) * q_stride + (long long)(w.kvh * GQA + r % GQA) * HEAD_DIM + piece * 8;
        cp_async16(q_sm + (piece >> 3) * (WG_BM * 128) + swz(r, piece & 7), src, valid ? 16 : 0);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    fence_async_shared();
    asm volatile("bar.sync 1, 256;" ::: "memory");       // the consumers only

    const int warp = t >> 5, lane = t & 31, g = lane >> 2, tq = lane & 3;
    const int row_a = cw * 64 + warp * 16 + g;           // this thread's rows: row_a, row_a + 8
    const int last_a = pos0 + tok0 + row_a / GQA;         // the last key position each row sees
    const int last_b = pos0 + tok0 + (row_a + 8) / GQA;
    const int wg_min_pos = pos0 + tok0 + (cw * 64) / GQA;  // the warpgroup's first row's position

    float o[64], s[64];
    unsigned int p[8][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float m_a = -MINILLM_INF, m_b = -MINILLM_INF, l_a = 0.0f, l_b = 0.0f;
    const unsigned int q_wg = q_sm + cw * 64 * 128;

    // S = Q K^T of tile j (issued, not waited for): 8 steps of 16 dims, 4 in each 64-dim half, 32
    // bytes apart in a swizzled row.
    auto issue_scores = [&](int j) {
        const unsigned int k_sm = kv_sm + (j % WG_STAGES) * 2 * WG_TILE_BYTES;
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            const unsigned int off = (k & 3) << 5;
            wg_mma_ss(s, wg_desc(q_wg + (k >> 2) * (WG_BM * 128) + off, 16, 1024),
                      wg_desc(k_sm + (k >> 2) * WG_HALF_BYTES + off, 16, 1024), k > 0);
        }
        wg_commit();
    };
    // O += P V of tile j (issued): 8 steps of 16 keys (two 8-key groups, 1024 bytes apart); the two
    // 64-dim halves of V are the MN-major operand's leading blocks (WG_HALF_BYTES apart).
    auto issue_pv = [&](int j) {
        const unsigned int v_sm = kv_sm + (j % WG_STAGES) * 2 * WG_TILE_BYTES + WG_TILE_BYTES;
#pragma unroll
        for (int k = 0; k < WG_BN / 16; ++k) wg_mma_rs(o, p[k], wg_desc(v_sm + k * 2048, WG_HALF_BYTES, 1024));
        wg_commit();
    };
    // Tile j's scores (landed in s) masked, the rows' maxima moved, s turned into exp2 values in
    // place and their sums taken; returns nothing, sets the rescale factors.
    float alpha_a = 1.0f, alpha_b = 1.0f, sum_a = 0.0f, sum_b = 0.0f;
    auto softmax = [&](int j) {
        const int kt = (j0 + j) * WG_BN;
        if (kt + WG_BN - 1 > wg_min_pos) {     // only tiles that reach past the warpgroup's first row
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                const int key = kt + n * 8 + tq * 2;
                if (key > last_a) s[4 * n] = -MINILLM_INF;
                if (key + 1 > last_a) s[4 * n + 1] = -MINILLM_INF;
                if (key > last_b) s[4 * n + 2] = -MINILLM_INF;
                if (key + 1 > last_b) s[4 * n + 3] = -MINILLM_INF;
            }
        }
        // The raw scores' maxima in four independent chains, scaled once (scale_log2 > 0).
        float ma0 = s[0], ma1 = s[1], mb0 = s[2], mb1 = s[3];
#pragma unroll
        for (int n = 1; n < 16; ++n) {
            ma0 = fmaxf(ma0, s[4 * n]);
            ma1 = fmaxf(ma1, s[4 * n + 1]);
            mb0 = fmaxf(mb0, s[4 * n + 2]);
            mb1 = fmaxf(mb1, s[4 * n + 3]);
        }
        float mx_a = fmaxf(m_a, fmaxf(ma0, ma1) * scale_log2), mx_b = fmaxf(m_b, fmaxf(mb0, mb1) * scale_log2);
        mx_a = fmaxf(mx_a, __shfl_xor_sync(FULL_MASK, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(FULL_MASK, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(FULL_MASK, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(FULL_MASK, mx_b, 2));
        const float ref_a = mx_a == -MINILLM_INF ? 0.0f : mx_a, ref_b = mx_b == -MINILLM_INF ? 0.0f : mx_b;
        alpha_a = fast_exp2(m_a - ref_a);
        alpha_b = fast_exp2(m_b - ref_b);
        m_a = mx_a;
        m_b = mx_b;
        sum_a = 0.0f;
        sum_b = 0.0f;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            s[4 * n] = fast_exp2(fmaf(s[4 * n], scale_log2, -ref_a));
            s[4 * n + 1] = fast_exp2(fmaf(s[4 * n + 1], scale_log2, -ref_a));
            s[4 * n + 2] = fast_exp2(fmaf(s[4 * n + 2], scale_log2, -ref_b));
            s[4 * n + 3] = fast_exp2(fmaf(s[4 * n + 3], scale_log2, -ref_b));
            sum_a += s[4 * n] + s[4 * n + 1];
            sum_b += s[4 * n + 2] + s[4 * n + 3];
        }
    };
    // Once no MMA reads P or writes O: O rescaled, the sums updated, s packed into P (A fragments).
    auto rescale_and_pack = [&]() {
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            o[4 * n] *= alpha_a;
            o[4 * n + 1] *= alpha_a;
            o[4 * n + 2] *= alpha_b;
            o[4 * n + 3] *= alpha_b;
            p[n >> 1][(n & 1) * 2] = pack_16x2<MINILLM_DTYPE == 1>(s[4 * n], s[4 * n + 1]);
            p[n >> 1][(n & 1) * 2 + 1] = pack_16x2<MINILLM_DTYPE == 1>(s[4 * n + 2], s[4 * n + 3]);
        }
    };
    auto wait_tile = [&](int j) {
        mbar_wait(full0 + 8 * (j % WG_STAGES), (j / WG_STAGES) & 1);
        fence_async_shared();                              // the producer's copies, for the MMAs' reads
    };

    // Tile j's scores and softmax run while tile j - 1's P V is on the tensor cores.
    if (num_tiles > 0) {                                   // a split past the keys: no tiles
        wait_tile(0);
        wg_fence();
        issue_scores(0);
        wg_wait0();
        wg_fence_regs(s);
        softmax(0);
        rescale_and_pack();
        for (int j = 1; j < num_tiles; ++j) {
            wait_tile(j);
            wg_fence();
            issue_scores(j);
            issue_pv(j - 1);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");   // the scores are in
            wg_fence_regs(s);
            softmax(j);
            wg_wait0();                                                        // P V of tile j - 1 is done
            wg_fence_regs(o);
            wg_fence_regs_u(p);
            mbar_arrive(empty0 + 8 * ((j - 1) % WG_STAGES));
            rescale_and_pack();
        }
        wg_fence();
        issue_pv(num_tiles - 1);
        wg_wait0();
        wg_fence_regs(o);
        mbar_arrive(empty0 + 8 * ((num_tiles - 1) % WG_STAGES));
    }

    // Normalise and store rows a and b (sums over the quad first).
    l_a += __shfl_xor_sync(FULL_MASK, l_a, 1);
    l_a += __shfl_xor_sync(FULL_MASK, l_a, 2);
    l_b += __shfl_xor_sync(FULL_MASK, l_b, 1);
    l_b += __shfl_xor_sync(FULL_MASK, l_b, 2);
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    const int tok_a = tok0 + row_a / GQA, tok_b = tok0 + (row_a + 8) / GQA;
    const bool ok_a = row_a < WG_VALID_ROWS && tok_a < q_len, ok_b = row_a + 8 < WG_VALID_ROWS && tok_b < q_len;
    if (num_splits > 1) {
        // Split blockIdx.y's partials (prefill_attention.cu's layout): the output normalised by the
        // split's own sum, and (max in log2 units, sum) once per row; prefill_attention_reduce merges.
        const int heads = num_kv_heads * GQA;
        const long long part_a = ((long long)(q_start + tok_a) * heads + w.kvh * GQA + row_a % GQA) * num_splits + blockIdx.y;
        const long long part_b = ((long long)(q_start + tok_b) * heads + w.kvh * GQA + (row_a + 8) % GQA) * num_splits + blockIdx.y;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            const int col = n * 8 + tq * 2;
            if (ok_a) *reinterpret_cast<float2*>(part_o + part_a * HEAD_DIM + col) = make_float2(o[4 * n] * inv_a, o[4 * n + 1] * inv_a);
            if (ok_b) *reinterpret_cast<float2*>(part_o + part_b * HEAD_DIM + col) = make_float2(o[4 * n + 2] * inv_b, o[4 * n + 3] * inv_b);
        }
        if (tq == 0 && ok_a) *reinterpret_cast<float2*>(part_ml + part_a * 2) = make_float2(m_a, l_a);
        if (tq == 0 && ok_b) *reinterpret_cast<float2*>(part_ml + part_b * 2) = make_float2(m_b, l_b);
        return;
    }
    scalar_t* out_a = out + (long long)(q_start + tok_a) * out_stride + (long long)(w.kvh * GQA + row_a % GQA) * HEAD_DIM;
    scalar_t* out_b = out + (long long)(q_start + tok_b) * out_stride + (long long)(w.kvh * GQA + (row_a + 8) % GQA) * HEAD_DIM;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const int col = n * 8 + tq * 2;
        if (ok_a) *reinterpret_cast<unsigned int*>(out_a + col) = pack2(o[4 * n] * inv_a, o[4 * n + 1] * inv_a);
        if (ok_b) *reinterpret_cast<unsigned int*>(out_b + col) = pack2(o[4 * n + 2] * inv_b, o[4 * n + 3] * inv_b);
    }
}
#endif
