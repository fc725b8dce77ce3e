// sampling.cu: token selection over float32 logits: greedy, temperature, top-k, top-p, min-p,
// penalties and log-softmax.
//
// Layout: logits [B, V] float32 packed; per-row parameters [B]; ids out [B] int32.
// sample: grid = B, blockDim = SAMPLE_THREADS (1024), one block per row. The rule is the one of
// minillm/ops/numpy.py. A row with neither top-k nor top-p walks its kept tokens in id order
// (sample_in_id_order: one pass, a block scan). Otherwise:
// order the row by (logit descending, id ascending), p = softmax(logit / T),
// keep the prefix allowed by top-k, min-p (p >= min_p * p_max) and top-p (mass strictly before a
// token < top_p times the mass top-k and min-p kept: vLLM renormalises before top-p), and take
// the first kept token whose cumulative mass exceeds u * kept mass.
// No full sort: every rule is "the first token in that order whose inclusive cumulative count or
// mass reaches a target", found by
//   1. a histogram of the row over NUM_BINS bins of (max - logit/T) (1/32 nat each; the order of
//      bins is the order of tokens), giving the bin that holds the answer;
//   2. if that bin holds more than SORT_CAP tokens, 8-bit radix steps over the 64-bit key
//      (order-preserving logit bits, then the inverted id) restricted to the bin, until few enough;
//   3. gathering the candidates into shared memory, a bitonic sort by the key, and a scan.
// Each step re-reads the row (L2-resident for one block); weights e = exp(logit/T - max/T) are
// recomputed with the same expression everywhere, so a token's weight is the same in every pass.
// log_softmax: grid = B, blockDim = 1024. apply_penalties: 1-D grid over the N (row, token)
// entries, 256 threads a block; entries are distinct so no two threads touch one logit.
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define NUM_BINS 1024
#define BIN_SCALE 32.0f
#define SORT_CAP 4096
#define RADIX_BINS 256
#define NO_WINNER 0x7fffffff
#define ROW_UNROLL 8          // loads in flight a thread in the passes over a row

#define MODE_COUNT_GE 0
#define MODE_MASS_GE 1
#define MODE_MASS_GT 2

struct SampleShared {
    unsigned int bin_cnt[NUM_BINS];
    float bin_mass[NUM_BINS];
    unsigned long long keys[SORT_CAP];
    unsigned int radix_cnt[RADIX_BINS];
    float radix_mass[RADIX_BINS];
    float scratch_f[33];
    unsigned int scratch_u[33];
    int win;
    int last;
    int gather_count;
    unsigned int base_cnt;
    float base_mass;
    unsigned int n;
    unsigned int res_rank;
    float res_mass;
    int res_id;
    float red_val[32];
    int red_id[32];
};

struct Pick {
    bool found;
    unsigned int rank;   // 1-based position of the token in the order
    float mass;          // inclusive cumulative weight up to and including the token
    int id;
};

// Row context shared by the passes.
struct Row {
    const float* x;
    int vocab;
    float temperature;
    float smax;          // max logit / T
};

__device__ __forceinline__ unsigned int order_key(float x) {
    unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_to_float(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Larger key = earlier in the order: logit descending, then id ascending.
__device__ __forceinline__ unsigned long long full_key(float logit, int id) {
    return ((unsigned long long)order_key(logit) << 32) | (unsigned long long)(0xffffffffu - (unsigned int)id);
}

__device__ __forceinline__ float scaled_logit(float logit, float temperature) {
    return __fdiv_rn(logit, temperature);
}

__device__ __forceinline__ float weight_of(float s, float smax) {
    return expf(__fsub_rn(s, smax));
}

__device__ __forceinline__ int bin_of(float s, float smax) {
    float d = __fmul_rn(__fsub_rn(smax, s), BIN_SCALE);
    return d < (float)(NUM_BINS - 1) ? (int)d : NUM_BINS - 1;
}

__device__ __forceinline__ bool reached(int mode, unsigned int cnt, float mass, float target) {
    if (mode == MODE_COUNT_GE) return (float)cnt >= target;
    if (mode == MODE_MASS_GE) return mass >= target;
    return mass > target;
}

__device__ __forceinline__ bool prefix_matches(unsigned long long key, unsigned long long prefix,
                                               int pbits) {
    return pbits == 0 || (key >> (64 - pbits)) == prefix;
}

// Exclusive prefix sum over the block in thread order. scratch holds 33 values.
template <typename V>
__device__ __forceinline__ V block_exclusive_scan(V v, V* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    V inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        V y = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        V w = lane < num_warps ? scratch[lane] : (V)0;
        V wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            V y = __shfl_up_sync(FULL_MASK, wi, o);
            if (lane >= o) wi += y;
        }
        scratch[lane] = wi - w;
    }
    __syncthreads();
    return scratch[warp] + (inc - v);
}

// f(i, logit) for this thread's ids of the row (i = threadIdx.x, + blockDim.x, ...), in ascending
// order, with ROW_UNROLL loads in flight before their uses.
template <typename F>
__device__ __forceinline__ void for_each_logit(const Row& r, F&& f) {
    const int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + (ROW_UNROLL - 1) * stride < r.vocab; i += ROW_UNROLL * stride) {
        float v[ROW_UNROLL];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) v[u] = r.x[i + u * stride];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) f(i + u * stride, v[u]);
    }
    for (; i < r.vocab; i += stride) f(i, r.x[i]);
}

// Max logit and its smallest id over the row; every thread gets both.
__device__ void row_argmax(const Row& r, SampleShared& sh, float* best_val, int* best_id) {
    float bv = -MINILLM_INF;
    int bi = 0x7fffffff;
    for_each_logit(r, [&](int i, float v) {
        if (v > bv) { bv = v; bi = i; }     // ascending i: the first maximum is kept
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sh.red_val[warp] = bv; sh.red_id[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < (int)(blockDim.x >> 5) ? sh.red_val[lane] : -MINILLM_INF;
        bi = lane < (int)(blockDim.x >> 5) ? sh.red_id[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { sh.red_val[0] = bv; sh.red_id[0] = bi; }
    }
    __syncthreads();
    *best_val = sh.red_val[0];
    *best_id = sh.red_id[0] == 0x7fffffff ? 0 : sh.red_id[0];
    __syncthreads();
}

// Level 1: the first bin whose inclusive cumulative reaches the target; -1 if none. Sets
// sh.base_cnt / sh.base_mass (cumulative before the bin) and sh.n (tokens in it).
__device__ int pick_bin(SampleShared& sh, int mode, float target) {
    int t = threadIdx.x;
    unsigned int c = sh.bin_cnt[t];
    float m = sh.bin_mass[t];
    unsigned int c_ex = block_exclusive_scan<unsigned int>(c, sh.scratch_u);
    float m_ex = block_exclusive_scan<float>(m, sh.scratch_f);
    if (t == 0) sh.win = NO_WINNER;
    __syncthreads();
    if (c > 0 && reached(mode, c_ex + c, m_ex + m, target)) atomicMin(&sh.win, t);
    __syncthreads();
    int bin = sh.win;
    if (bin != NO_WINNER && t == bin) { sh.base_cnt = c_ex; sh.base_mass = m_ex; sh.n = c; }
    __syncthreads();
    return bin == NO_WINNER ? -1 : bin;
}

// One radix step: narrow the candidates of `bin` matching `prefix` by the next 8 key bits.
__device__ void radix_step(const Row& r, SampleShared& sh, int bin, int mode, float target,
                           unsigned long long* prefix, int* pbits) {
    int t = threadIdx.x;
    if (t < RADIX_BINS) { sh.radix_cnt[t] = 0u; sh.radix_mass[t] = 0.0f; }
    __syncthreads();
    int shift = 56 - *pbits;
    const unsigned long long pre = *prefix;
    const int bits = *pbits;
    for_each_logit(r, [&](int i, float logit) {
        float s = scaled_logit(logit, r.temperature);
        if (bin_of(s, r.smax) != bin) return;
        unsigned long long key = full_key(logit, i);
        if (!prefix_matches(key, pre, bits)) return;
        int d = (int)((key >> shift) & 255ull);
        atomicAdd(&sh.radix_cnt[d], 1u);
        atomicAdd(&sh.radix_mass[d], weight_of(s, r.smax));
    });
    __syncthreads();
    // Thread t looks at digit 255 - t: larger digits come first in the order.
    unsigned int c = t < RADIX_BINS ? sh.radix_cnt[RADIX_BINS - 1 - t] : 0u;
    float m = t < RADIX_BINS ? sh.radix_mass[RADIX_BINS - 1 - t] : 0.0f;
    unsigned int c_ex = block_exclusive_scan<unsigned int>(c, sh.scratch_u);
    float m_ex = block_exclusive_scan<float>(m, sh.scratch_f);
    if (t == 0) { sh.win = NO_WINNER; sh.last = -1; }
    __syncthreads();
    unsigned int base_cnt = sh.base_cnt;
    float base_mass = sh.base_mass;
    if (c > 0) {
        if (reached(mode, base_cnt + c_ex + c, base_mass + m_ex + m, target)) atomicMin(&sh.win, t);
        atomicMax(&sh.last, t);
    }
    __syncthreads();
    // Rounding can leave the target just out of reach inside the bin: take its last digit then.
    int w = sh.win != NO_WINNER ? sh.win : sh.last;
    __syncthreads();
    if (t == w) { sh.base_cnt = base_cnt + c_ex; sh.base_mass = base_mass + m_ex; sh.n = c; }
    __syncthreads();
    *prefix = (*prefix << 8) | (unsigned long long)(RADIX_BINS - 1 - w);
    *pbits += 8;
}

// Collect the candidates into sh.keys and sort them by key, descending. Returns their count.
__device__ int gather_sorted(const Row& r, SampleShared& sh, int bin, unsigned long long prefix,
                             int pbits) {
    int t = threadIdx.x;
    if (t == 0) sh.gather_count = 0;
    __syncthreads();
    for_each_logit(r, [&](int i, float logit) {
        if (bin_of(scaled_logit(logit, r.temperature), r.smax) != bin) return;
        unsigned long long key = full_key(logit, i);
        if (!prefix_matches(key, prefix, pbits)) return;
        int pos = atomicAdd(&sh.gather_count, 1);
        if (pos < SORT_CAP) sh.keys[pos] = key;
    });
    __syncthreads();
    int n = min(sh.gather_count, SORT_CAP);
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + t; i < size; i += blockDim.x) sh.keys[i] = 0ull;   // 0 sorts last
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = t; i < size; i += blockDim.x) {
                int ixj = i ^ j;
                if (ixj > i) {
                    unsigned long long a = sh.keys[i], b = sh.keys[ixj];
                    bool descending = (i & k) == 0;
                    if (descending ? (a < b) : (a > b)) { sh.keys[i] = b; sh.keys[ixj] = a; }
                }
            }
            __syncthreads();
        }
    }
    return n;
}

// The first sorted candidate whose cumulative reaches the target (the last one if rounding
// leaves it out of reach); fills sh.res_*.
__device__ void pick_sorted(const Row& r, SampleShared& sh, int n, int mode, float target) {
    int t = threadIdx.x;
    float e[SORT_CAP / SAMPLE_THREADS];
    float local = 0.0f;
#pragma unroll
    for (int q = 0; q < SORT_CAP / SAMPLE_THREADS; ++q) {
        int j = t * (SORT_CAP / SAMPLE_THREADS) + q;
        float logit = key_to_float((unsigned int)(sh.keys[j < n ? j : 0] >> 32));
        e[q] = j < n ? weight_of(scaled_logit(logit, r.temperature), r.smax) : 0.0f;
        local += e[q];
    }
    float ex = block_exclusive_scan<float>(local, sh.scratch_f);
    unsigned int base_cnt = sh.base_cnt;
    float base_mass = sh.base_mass;
    if (t == 0) sh.win = NO_WINNER;
    __syncthreads();
    float running = base_mass + ex;
#pragma unroll
    for (int q = 0; q < SORT_CAP / SAMPLE_THREADS; ++q) {
        int j = t * (SORT_CAP / SAMPLE_THREADS) + q;
        running += e[q];
        if (j < n && reached(mode, base_cnt + j + 1, running, target)) { atomicMin(&sh.win, j); break; }
    }
    __syncthreads();
    int w = sh.win != NO_WINNER ? sh.win : n - 1;
    running = base_mass + ex;
#pragma unroll
    for (int q = 0; q < SORT_CAP / SAMPLE_THREADS; ++q) {
        int j = t * (SORT_CAP / SAMPLE_THREADS) + q;
        running += e[q];
        if (j == w) {
            sh.res_rank = base_cnt + j + 1;
            sh.res_mass = running;
            sh.res_id = (int)(0xffffffffu - (unsigned int)(sh.keys[j] & 0xffffffffull));
        }
    }
    __syncthreads();
}

// The first token in the order whose inclusive cumulative count or weight reaches the target.
__device__ Pick select_first(const Row& r, SampleShared& sh, int mode, float target) {
    Pick p;
    p.found = false;
    p.rank = 0; p.mass = 0.0f; p.id = 0;
    int bin = pick_bin(sh, mode, target);
    if (bin < 0) return p;
    unsigned long long prefix = 0ull;
    int pbits = 0;
    while (sh.n > SORT_CAP && pbits < 64) {
        radix_step(r, sh, bin, mode, target, &prefix, &pbits);
    }
    int n = gather_sorted(r, sh, bin, prefix, pbits);
    if (n == 0) return p;
    pick_sorted(r, sh, n, mode, target);
    p.found = true;
    p.rank = sh.res_rank;
    p.mass = sh.res_mass;
    p.id = sh.res_id;
    __syncthreads();
    return p;
}

// Weights of the whole row: the level-1 histogram, Z and the min-p set's count and weight.
__device__ void row_histogram(const Row& r, SampleShared& sh, float min_p, float* z,
                              unsigned int* mp_cnt, float* mp_mass) {
    int t = threadIdx.x;
    sh.bin_cnt[t] = 0u;
    sh.bin_mass[t] = 0.0f;
    __syncthreads();
    float zs = 0.0f, mm = 0.0f;
    unsigned int mc = 0u;
    for_each_logit(r, [&](int, float logit) {
        float s = scaled_logit(logit, r.temperature);
        float e = weight_of(s, r.smax);
        int b = bin_of(s, r.smax);
        atomicAdd(&sh.bin_cnt[b], 1u);
        atomicAdd(&sh.bin_mass[b], e);
        zs += e;
        // p >= min_p * p_max with p_max = 1 / Z is e >= min_p.
        if (e >= min_p) { mc += 1u; mm += e; }
    });
    *z = block_sum(zs, sh.scratch_f);
    *mp_mass = block_sum(mm, sh.scratch_f);
    *mp_cnt = (unsigned int)(block_sum((float)mc, sh.scratch_f) + 0.5f);
    __syncthreads();
}

__device__ __forceinline__ float warp_inclusive_scan(float v) {
    int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

__device__ __forceinline__ float kept_weight(const Row& r, float logit, float threshold) {
    float e = weight_of(scaled_logit(logit, r.temperature), r.smax);
    return e >= threshold ? e : 0.0f;
}

// Rows with neither top-k nor top-p: the kept tokens (weight e >= min_p, all when min_p is 0) in
// id order, so nothing needs ordering. Warp w owns a contiguous range of ids and its lanes read it
// 32 consecutive floats at a time (coalesced): one pass sums each warp's weight, a scan over the
// warps gives each range its cumulative interval; the range that holds u * total is then split
// over the block's warps the same way, and the one warp whose part holds it walks that part (a few
// tiles) with warp scans to find the token.
__device__ int sample_in_id_order(const Row& r, SampleShared& sh, float threshold, float u, int fallback) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    int chunk = ((r.vocab + num_warps - 1) / num_warps + 31) & ~31;
    int lo = min(warp * chunk, r.vocab), hi = min(lo + chunk, r.vocab);
    float s = 0.0f;
    int i = lo + lane;
    for (; i + (ROW_UNROLL - 1) * 32 < hi; i += ROW_UNROLL * 32) {
        float x[ROW_UNROLL];                // the loads first, then the sum in the same order as one by one
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) x[u] = r.x[i + u * 32];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) s += kept_weight(r, x[u], threshold);
    }
    for (; i < hi; i += 32) s += kept_weight(r, r.x[i], threshold);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sh.scratch_f[warp] = s;
    if (threadIdx.x == 0) sh.res_id = fallback;
    __syncthreads();
    if (warp == 0) {
        float w = warp_inclusive_scan(lane < num_warps ? sh.scratch_f[lane] : 0.0f);
        if (lane < num_warps) sh.bin_mass[lane] = w;
    }
    __syncthreads();
    const float target = u * sh.bin_mass[num_warps - 1];
    if (warp == 0) {                    // the range whose interval holds the target (none: the fallback)
        float incl = lane < num_warps ? sh.bin_mass[lane] : 0.0f;
        float excl = (lane > 0 && lane < num_warps) ? sh.bin_mass[lane - 1] : 0.0f;
        bool holds = lane < num_warps && sh.scratch_f[lane] > 0.0f && excl <= target && target < incl;
        unsigned m = __ballot_sync(0xffffffffu, holds);
        if (lane == 0) sh.win = m ? __ffs(m) - 1 : -1;
    }
    __syncthreads();
    const int win = sh.win;
    if (win < 0) return fallback;       // block-uniform
    // Level 2: every warp sums its part of that range, so only one part (a few tiles) is walked.
    const int wlo = min(win * chunk, r.vocab), whi = min(wlo + chunk, r.vocab);
    const int sub = ((whi - wlo + num_warps - 1) / num_warps + 31) & ~31;
    const int slo = min(wlo + warp * sub, whi), shi = min(slo + sub, whi);
    float s2 = 0.0f;
    for (int j = slo + lane; j < shi; j += 32) s2 += kept_weight(r, r.x[j], threshold);
    for (int o = 16; o; o >>= 1) s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    if (lane == 0) sh.radix_mass[warp] = s2;
    __syncthreads();
    if (warp == 0) {
        float before = win ? sh.bin_mass[win - 1] : 0.0f;
        float own = lane < num_warps ? sh.radix_mass[lane] : 0.0f;
        float incl = before + warp_inclusive_scan(own);
        float excl = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0) excl = before;
        unsigned m = __ballot_sync(0xffffffffu, lane < num_warps && own > 0.0f && excl <= target && target < incl);
        unsigned pos = __ballot_sync(0xffffffffu, lane < num_warps && own > 0.0f);
        // Rounding may leave the target past every part: the last part with weight is walked to its end.
        int pick = m ? __ffs(m) - 1 : (pos ? 31 - __clz(pos) : -1);
        if (lane == 0) sh.last = pick;
        if (lane == pick) sh.base_mass = excl;
    }
    __syncthreads();
    if (warp == sh.last) {              // the same answer on every lane
        float c = sh.base_mass;
        int last = -1;
        bool found = false;
        // ROW_UNROLL tiles of 32 are loaded together, so the walk waits on memory once per group.
        for (int group = slo; group < shi && !found; group += ROW_UNROLL * 32) {
            float logit[ROW_UNROLL];
#pragma unroll
            for (int u = 0; u < ROW_UNROLL; ++u) {
                int i = group + u * 32 + lane;
                logit[u] = i < shi ? r.x[i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < ROW_UNROLL; ++u) {
                int base = group + u * 32, i = base + lane;
                if (found || base >= shi) break;
                float e = i < shi ? kept_weight(r, logit[u], threshold) : 0.0f;
                float x = warp_inclusive_scan(e);
                unsigned hit = __ballot_sync(0xffffffffu, e > 0.0f && c + x > target);
                unsigned kept = __ballot_sync(0xffffffffu, e > 0.0f);
                if (hit) {
                    last = base + __ffs(hit) - 1;
                    found = true;
                } else {
                    if (kept) last = base + 31 - __clz(kept);   // rounding may end the walk short
                    c += __shfl_sync(0xffffffffu, x, 31);
                }
            }
        }
        if (lane == 0 && last >= 0) sh.res_id = last;
    }
    __syncthreads();
    return sh.res_id;
}

// Two blocks a multiprocessor (32 registers a thread): a batch of 256 rows runs in one wave.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 2)
sample_kernel(int* out, const float* logits, int vocab, const float* temperature,
              const int* top_k, const float* top_p, const float* min_p, const float* uniforms) {
    __shared__ SampleShared sh;
    int b = blockIdx.x;
    Row r;
    r.x = logits + (long long)b * vocab;
    r.vocab = vocab;
    r.temperature = temperature[b];
    float best_val;
    int best_id;
    row_argmax(r, sh, &best_val, &best_id);
    if (!(r.temperature > 0.0f) || best_val == -MINILLM_INF) {
        if (threadIdx.x == 0) out[b] = best_id;
        return;
    }
    r.smax = scaled_logit(best_val, r.temperature);
    float mp = min_p[b], tp = top_p[b];
    int k = top_k[b];
    if ((k <= 0 || k >= vocab) && !(tp < 1.0f)) {
        int id = sample_in_id_order(r, sh, mp > 0.0f ? mp : 0.0f, uniforms[b], best_id);
        if (threadIdx.x == 0) out[b] = id;
        return;
    }
    float z, mp_mass;
    unsigned int mp_cnt;
    row_histogram(r, sh, mp > 0.0f ? mp : MINILLM_INF, &z, &mp_cnt, &mp_mass);
    unsigned int kept = (unsigned int)vocab;   // the kept prefix: its length and weight
    float kept_mass = z;
    if (k > 0 && k < vocab) {
        Pick p = select_first(r, sh, MODE_COUNT_GE, (float)k);
        if (p.found && p.rank < kept) { kept = p.rank; kept_mass = p.mass; }
    }
    if (mp > 0.0f) {
        if (mp_cnt == 0u) { mp_cnt = 1u; mp_mass = 1.0f; }   // the top token always stays
        if (mp_cnt < kept) { kept = mp_cnt; kept_mass = mp_mass; }
    }
    if (tp < 1.0f) {
        Pick p = select_first(r, sh, MODE_MASS_GE, tp * kept_mass);
        if (p.found && p.rank < kept) { kept = p.rank; kept_mass = p.mass; }
    }
    Pick p = select_first(r, sh, MODE_MASS_GT, uniforms[b] * kept_mass);
    if (threadIdx.x == 0) out[b] = (p.found && p.rank <= kept) ? p.id : best_id;
}

extern "C" __global__ void __launch_bounds__(1024)
log_softmax_kernel(float* out, const float* logits, int vocab) {
    __shared__ float scratch[32];
    long long b = blockIdx.x;
    const float* x = logits + b * vocab;
    float* y = out + b * vocab;
    float m = -MINILLM_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, x[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(__fsub_rn(x[i], m));
    s = block_sum(s, scratch);
    float log_z = logf(s);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) y[i] = __fsub_rn(__fsub_rn(x[i], m), log_z);
}

extern "C" __global__ void apply_penalties_kernel(float* logits, int batch, int vocab,
                                                  const int* rows, const int* token_ids,
                                                  const int* output_counts, const int* in_prompt,
                                                  const float* repetition, const float* presence,
                                                  const float* frequency, int num_entries) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= num_entries) return;
    int r = rows[n], tok = token_ids[n];
    if (r < 0 || r >= batch || tok < 0 || tok >= vocab) return;
    float* p = logits + (long long)r * vocab + tok;
    float v = *p;
    int cnt = output_counts[n];
    if (cnt > 0 || in_prompt[n] > 0) {
        float rep = repetition[r];
        v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
    }
    v = __fsub_rn(v, __fmul_rn(frequency[r], (float)cnt));
    v = __fsub_rn(v, __fmul_rn(presence[r], cnt > 0 ? 1.0f : 0.0f));
    *p = v;
}
