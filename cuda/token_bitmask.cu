// token_bitmask.cu: structured outputs: set the logits of tokens a grammar forbids to -inf.
//
// Layout: logits [B, V] float32 packed; bitmask [N, W] int32 packed with W >= ceil(V / 32): bit j
// of word w in a mask row is token 32 w + j, 1 = allowed, 0 = forbidden; rows [N] int32 names the
// logits row each mask row applies to (mask i to row rows[i]), so the host uploads only the
// constrained rows' masks. Entries outside [0, B) are skipped, so a fixed-size rows array padded
// with -1 serves a captured graph; rows not named are not touched.
// The rule is the one of minillm/ops/numpy.py:apply_token_bitmask.
// Launch: grid = (blocks_per_row, N), BITMASK_THREADS (256) threads a block; thread i of block x
// walks tokens x * 256 + i, stepping by blocks_per_row * 256 (the launcher sizes blocks_per_row
// to fill the device about eight times over). A warp's 32 tokens share one bitmask word (a
// broadcast load) and write only its forbidden logits, 128 contiguous bytes at most; logits are
// never read. No shared memory, no synchronisation: capturable in a CUDA graph.
// Floats only: MINILLM_DTYPE does not change this file.
#include "common.cuh"

#define BITMASK_THREADS 256

extern "C" __global__ void __launch_bounds__(BITMASK_THREADS)
apply_token_bitmask_kernel(float* __restrict__ logits, const int* __restrict__ bitmask,
                           const int* __restrict__ rows, int batch, int vocab, int words_per_row) {
    const int row = rows[blockIdx.y];
    if (row < 0 || row >= batch) return;                     // uniform over the block
    float* out = logits + (long long)row * vocab;
    const unsigned int* bits = reinterpret_cast<const unsigned int*>(bitmask) + (long long)blockIdx.y * words_per_row;
    const int step = gridDim.x * BITMASK_THREADS;
    for (int t = blockIdx.x * BITMASK_THREADS + threadIdx.x; t < vocab; t += step) {
        const unsigned int word = bits[t >> 5];
        if (!((word >> (t & 31)) & 1u)) out[t] = -MINILLM_INF;
    }
}
