// Causal attention of prefill chunks over the paged KV cache (attention.cu's layout) on
// the tensor cores, head sizes 64 and 128. A block takes a tile of up to 64 query rows
// of one sequence for one query head, its 4 warps 16 rows each, and walks
// the keys the tile's last row sees in tiles of 64, staged in shared memory (keys as
// rows, values transposed so that both feed mma's B fragments with 32-bit loads).
// Scores are S = Q·Kᵀ on mma m16n8k16 (f32), scaled and causally masked, an online
// softmax per row keeps its running max and sum across the four threads that hold the
// row, and the probabilities, rounded to bf16, multiply the values on the tensor cores
// straight from the score fragments' registers (an m16n8 accumulator pair is the A
// fragment of the next m16n8k16). `tiles` lists (sequence, first row in it) per block:
// a decode row in a mixed batch is a tile of one.

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_PAD 8  // bf16 of padding per staged row: fragment loads fall in 32 banks

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) { return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16); }

template <int HD>
__device__ __forceinline__ void prefill_tile(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                                             const u32* tiles, const u32* query_start, const u32* context_lens,
                                             const u32* block_tables, u32 max_blocks, u32 num_heads,
                                             u32 num_kv_heads, u32 block_size, float scale) {
    __shared__ __align__(16) bf16 ks[FA_KEYS][HD + FA_PAD];
    __shared__ __align__(16) bf16 vt[HD][FA_KEYS + FA_PAD];
    const u32 s = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1], head = blockIdx.y;
    const u32 first = query_start[s], q_len = query_start[s + 1] - first;
    const u32 rows = min((u32)FA_ROWS, q_len - r0);
    const u32 p0 = context_lens[s] - q_len + r0;  // position of the tile's first row
    const u32 keys = p0 + rows;                    // the last row sees keys 0..keys-1
    const u32 kvh = head / (num_heads / num_kv_heads), kv_width = num_kv_heads * HD;
    const u32* table = block_tables + (unsigned long long)s * max_blocks;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const u32 wr = 16 * warp;  // this warp's first row in the tile

    // The warp's 16 query rows as A fragments, one per 16 dimensions.
    u32 qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 r = wr + g + 8 * (i & 1), d = 16 * kk + 2 * t + 8 * (i >> 1);
            qa[kk][i] = r < rows ? *(const u32*)(q + ((unsigned long long)(first + r0 + r) * num_heads + head) * HD + d)
                                 : 0u;
        }
    }
    float o[HD / 8][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (u32 kb = 0; kb < keys; kb += FA_KEYS) {
        // Stage 64 keys and values, 8 dimensions at a time; keys past the end as zeros.
        for (u32 i = tid; i < FA_KEYS * HD / 8; i += blockDim.x) {
            const u32 j = i / (HD / 8), d = 8 * (i % (HD / 8));
            uint4 kv = {0u, 0u, 0u, 0u}, vv = {0u, 0u, 0u, 0u};
            if (kb + j < keys) {
                const u32 key = kb + j;
                const unsigned long long slot = (unsigned long long)table[key / block_size] * block_size + key % block_size;
                const unsigned long long at = slot * kv_width + kvh * HD + d;
                kv = *(const uint4*)(k_cache + at);
                vv = *(const uint4*)(v_cache + at);
            }
            *(uint4*)&ks[j][d] = kv;
            const u32 words[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 8; e++) vt[d + e][j] = (bf16)(words[e / 2] >> (16 * (e % 2)));
        }
        __syncthreads();

        // Scores of the warp's rows against the 64 keys: 8 tiles of 8 keys.
        float sc[FA_KEYS / 8][4];
#pragma unroll
        for (int ni = 0; ni < FA_KEYS / 8; ni++) {
#pragma unroll
            for (int e = 0; e < 4; e++) sc[ni][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const u32 b[2] = {*(const u32*)&ks[8 * ni + g][16 * kk + 2 * t],
                                  *(const u32*)&ks[8 * ni + g][16 * kk + 2 * t + 8]};
                mma_bf16(sc[ni], qa[kk], b);
            }
        }
        // Scale, mask (keys after the row's position, or past the end), online softmax.
        float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int ni = 0; ni < FA_KEYS / 8; ni++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const u32 key = kb + 8 * ni + 2 * t + (e & 1), pos = p0 + wr + g + 8 * (e >> 1);
                sc[ni][e] = key <= pos && key < keys ? sc[ni][e] * scale : NEG_INF;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], sc[ni][e]);
            }
        }
        float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            // The row's four threads share their maxima.
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
            const float m_new = fmaxf(m[h], tile_max[h]);
            // A row with no key yet (m_new still -inf) keeps zeros.
            corr[h] = m_new == NEG_INF ? 1.0f : __expf(m[h] - m_new);
            m[h] = m_new;
        }
#pragma unroll
        for (int ni = 0; ni < FA_KEYS / 8; ni++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                const float p = m[h] == NEG_INF ? 0.0f : __expf(sc[ni][e] - m[h]);
                sc[ni][e] = p;
                sum[h] += p;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
            l[h] = l[h] * corr[h] + sum[h];
        }
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) {
            o[nd][0] *= corr[0];
            o[nd][1] *= corr[0];
            o[nd][2] *= corr[1];
            o[nd][3] *= corr[1];
        }
        // O += P·V: the score tiles 2kk and 2kk + 1 are the A fragment of keys 16kk..16kk+15.
#pragma unroll
        for (int kk = 0; kk < FA_KEYS / 16; kk++) {
            const u32 pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                               pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                               pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                const u32 b[2] = {*(const u32*)&vt[8 * nd + g][16 * kk + 2 * t],
                                  *(const u32*)&vt[8 * nd + g][16 * kk + 2 * t + 8]};
                mma_bf16(o[nd], pa, b);
            }
        }
        __syncthreads();  // before the next tile is staged over this one
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        const u32 r = wr + g + 8 * h;
        if (r >= rows) continue;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        bf16* orow = out + ((unsigned long long)(first + r0 + r) * num_heads + head) * HD;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
            *(u32*)(orow + 8 * nd + 2 * t) = pack_bf16(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
    }
}

#define PREFILL_ATTENTION(HD)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) prefill_attention_hd##HD(                                      \
        bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache, const u32* tiles, const u32* query_start, \
        const u32* context_lens, const u32* block_tables, u32 max_blocks, u32 num_heads, u32 num_kv_heads,          \
        u32 block_size, float scale) {                                                                               \
        prefill_tile<HD>(out, q, k_cache, v_cache, tiles, query_start, context_lens, block_tables, max_blocks,      \
                         num_heads, num_kv_heads, block_size, scale);                                                \
    }

PREFILL_ATTENTION(64)
PREFILL_ATTENTION(128)
