// The paged KV cache: writing new keys and values through the slot mapping, and one
// causal attention kernel for a flattened batch that mixes prefill chunks and decodes.
// Cache layout, per layer: [blocks, block_size, num_kv_heads, head_dim], bf16.

// Token t's key and value rows go to slot slots[t]; slots were checked on the host.
extern "C" __global__ void write_kv(bf16* k_cache, bf16* v_cache, const bf16* k, const bf16* v, const u32* slots,
                                   u32 tokens, u32 width) {
    FOR_EACH(i, (unsigned long long)tokens * width) {
        unsigned long long t = i / width, c = i % width;
        unsigned long long dst = (unsigned long long)slots[t] * width + c;
        k_cache[dst] = k[i];
        v_cache[dst] = v[i];
    }
}

#define ATTN_WARPS 4
// Head sizes up to 32 * ATTN_MAX_R; each lane keeps ATTN_MAX_R dimensions in registers.
#define ATTN_MAX_R 8

// Grid (query rows, query heads), ATTN_WARPS warps per block. Each warp walks every
// ATTN_WARPS-th key of the row's sequence with an online softmax (running max, sum and
// weighted values in f32); the warps' partial results are merged at the end. Query row
// `row` of sequence s sits at position context_lens[s] - q_len + i and sees keys
// 0..=that position, so prefill chunks and decodes share one launch. Grouped-query heads
// read the KV head head / (num_heads / num_kv_heads). Tables were checked on the host.
// Rows of sequences with `tiled_from` query rows or more are left to prefill.cu's kernel.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention(bf16* out, const bf16* q, const bf16* k_cache, const bf16* v_cache, const u32* query_start,
                const u32* context_lens, const u32* block_tables, u32 num_seqs, u32 max_blocks, u32 num_heads,
                u32 num_kv_heads, u32 head_dim, u32 block_size, float scale, u32 tiled_from) {
    const u32 row = blockIdx.x, head = blockIdx.y;
    // The sequence of this row: the last s with query_start[s] <= row.
    u32 lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (query_start[mid] <= row) lo = mid; else hi = mid;
    }
    const u32 s = lo;
    const u32 q_len = query_start[s + 1] - query_start[s];
    if (q_len >= tiled_from) return;  // prefill.cu's tiled kernel writes this row
    const u32 keys = context_lens[s] - q_len + (row - query_start[s]) + 1;
    const u32 kv_head = head / (num_heads / num_kv_heads);
    const u32 kv_width = num_kv_heads * head_dim;
    const u32* table = block_tables + (unsigned long long)s * max_blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    const bf16* qp = q + ((unsigned long long)row * num_heads + head) * head_dim;
    float qr[ATTN_MAX_R], acc[ATTN_MAX_R];
#pragma unroll
    for (int r = 0; r < ATTN_MAX_R; r++) {
        u32 d = lane + 32 * r;
        qr[r] = d < head_dim ? bf2f(qp[d]) * scale : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (u32 j = warp; j < keys; j += ATTN_WARPS) {
        unsigned long long slot = (unsigned long long)table[j / block_size] * block_size + j % block_size;
        const bf16* kp = k_cache + slot * kv_width + kv_head * head_dim;
        const bf16* vp = v_cache + slot * kv_width + kv_head * head_dim;
        float dot = 0.0f;
#pragma unroll
        for (int r = 0; r < ATTN_MAX_R; r++) {
            u32 d = lane + 32 * r;
            if (d < head_dim) dot += qr[r] * bf2f(kp[d]);
        }
        dot = warp_sum(dot);
        float m_new = fmaxf(m, dot);
        float corr = __expf(m - m_new);
        float p = __expf(dot - m_new);
        l = l * corr + p;
#pragma unroll
        for (int r = 0; r < ATTN_MAX_R; r++) {
            u32 d = lane + 32 * r;
            acc[r] = acc[r] * corr + (d < head_dim ? p * bf2f(vp[d]) : 0.0f);
        }
        m = m_new;
    }

    __shared__ float s_m[ATTN_WARPS], s_l[ATTN_WARPS];
    __shared__ float s_acc[ATTN_WARPS][32 * ATTN_MAX_R];
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int r = 0; r < ATTN_MAX_R; r++) s_acc[warp][lane + 32 * r] = acc[r];
    __syncthreads();
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, s_m[w]);
    bf16* op = out + ((unsigned long long)row * num_heads + head) * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f, val = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) {
            if (s_l[w] > 0.0f) {
                float c = __expf(s_m[w] - mx);
                sum += s_l[w] * c;
                val += s_acc[w][d] * c;
            }
        }
        op[d] = f2bf(val / sum);
    }
}

// ---------------------------------------------------------------------------------
// The fast path for head sizes 64, 128 and 256 with 1, 2, 4 or 8 query heads per KV
// head. Grid (query rows, KV heads, key splits), PA_WARPS warps per block:
//  * the query heads of one KV head are handled together, so each key and value row
//    is read once for all of them (grouped-query attention reads K/V G times less);
//  * scores are computed key-per-lane (a warp takes 32 keys at a time, each lane the
//    dot products of its key with every query of the group), then values are summed
//    dimension-per-lane with coalesced loads, the probabilities passed by shuffles;
//  * a long context with few rows is split over blocks (flash-decoding): each split
//    writes its running max, sum and weighted values in f32, and
//    paged_attention_merge combines them. With one split the block writes the output;
//  * rows of sequences with `tiled_from` query rows or more are prefill.cu's: skipped
//    here (their merged output is garbage, overwritten by the tiled kernel after).

#define PA_WARPS 4

// DPL consecutive bf16 values at p (aligned to DPL * 2 bytes) as floats.
template <int DPL>
__device__ __forceinline__ void load_dims(const bf16* p, float* f) {
    if (DPL == 2) {
        u32 r = *(const u32*)p;
        f[0] = __uint_as_float(r << 16); f[1] = __uint_as_float(r & 0xffff0000u);
    } else if (DPL == 4) {
        uint2 r = *(const uint2*)p;
        f[0] = __uint_as_float(r.x << 16); f[1] = __uint_as_float(r.x & 0xffff0000u);
        f[2] = __uint_as_float(r.y << 16); f[3] = __uint_as_float(r.y & 0xffff0000u);
    } else {
        unpack8(*(const uint4*)p, f);
    }
}

template <int HD, int G>
__device__ __forceinline__ void attend_split(bf16* out, float* part_m, float* part_l, float* part_acc, const bf16* q,
                                             const bf16* k_cache, const bf16* v_cache, const u32* query_start,
                                             const u32* context_lens, const u32* block_tables, u32 num_seqs,
                                             u32 max_blocks, u32 num_heads, u32 num_kv_heads, u32 block_size,
                                             float scale, u32 splits, u32 tiled_from) {
    constexpr int DPL = HD / 32;
    const u32 row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    u32 lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (query_start[mid] <= row) lo = mid; else hi = mid;
    }
    const u32 s = lo;
    const u32 q_len = query_start[s + 1] - query_start[s];
    if (q_len >= tiled_from) return;  // prefill.cu's tiled kernel writes this row after
    const u32 keys = context_lens[s] - q_len + (row - query_start[s]) + 1;
    // This row's share of its keys: whole tiles of 32, so the splits stay balanced
    // whatever the context (a captured graph fixes only the number of splits).
    const u32 chunk = ((keys + splits - 1) / splits + 31) / 32 * 32;
    const u32 begin = min(keys, split * chunk);
    const u32 end = min(keys, begin + chunk);
    const u32 kv_width = num_kv_heads * HD;
    const u32* table = block_tables + (unsigned long long)s * max_blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    __shared__ float s_q[G][HD];
    for (u32 i = threadIdx.x; i < G * HD; i += blockDim.x) {
        u32 g = i / HD, d = i % HD;
        s_q[g][d] = bf2f(q[((unsigned long long)row * num_heads + kvh * G + g) * HD + d]) * scale;
    }
    __syncthreads();

    float m[G], l[G], acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; e++) acc[g][e] = 0.0f;
    }

    for (u32 t0 = begin + warp * 32; t0 < end; t0 += PA_WARPS * 32) {
        const u32 j = t0 + lane;
        const bool valid = j < end;
        unsigned long long slot = 0;
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] = 0.0f;
        if (valid) {
            slot = (unsigned long long)table[j / block_size] * block_size + j % block_size;
            const uint4* k4 = (const uint4*)(k_cache + slot * kv_width + kvh * HD);
#pragma unroll 8
            for (int c = 0; c < HD / 8; c++) {
                float kf[8];
                unpack8(k4[c], kf);
#pragma unroll
                for (int g = 0; g < G; g++) {
#pragma unroll
                    for (int e = 0; e < 8; e++) sc[g] += s_q[g][c * 8 + e] * kf[e];
                }
            }
        }
        // Online softmax over this tile of 32 keys, per query head.
#pragma unroll
        for (int g = 0; g < G; g++) {
            float x = valid ? sc[g] : NEG_INF;
            float m_new = fmaxf(m[g], warp_max(x));
            float corr = __expf(m[g] - m_new);
            float p = valid ? __expf(x - m_new) : 0.0f;
            l[g] = l[g] * corr + warp_sum(p);
#pragma unroll
            for (int e = 0; e < DPL; e++) acc[g][e] *= corr;
            m[g] = m_new;
            sc[g] = p;
        }
        // Values, dimension-per-lane: lane owns dims lane*DPL .. +DPL of every key.
        // Eight keys' loads are issued before any is used, so eight are in flight.
        const u32 n = min(32u, end - t0);
        for (u32 j0 = 0; j0 < n; j0 += 8) {
            float vf[8][DPL];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                unsigned long long sl = __shfl_sync(0xffffffffu, slot, (j0 + u) & 31);
                if (j0 + u < n) {
                    load_dims<DPL>(v_cache + sl * kv_width + kvh * HD + lane * DPL, vf[u]);
                } else {
#pragma unroll
                    for (int e = 0; e < DPL; e++) vf[u][e] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float p = __shfl_sync(0xffffffffu, sc[g], (j0 + u) & 31);
#pragma unroll
                    for (int e = 0; e < DPL; e++) acc[g][e] += p * vf[u][e];
                }
            }
        }
    }

    // Merge the warps.
    __shared__ float s_m[PA_WARPS][G], s_l[PA_WARPS][G];
    __shared__ float s_acc[PA_WARPS][G][HD];
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_l[warp][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < DPL; e++) s_acc[warp][g][lane * DPL + e] = acc[g][e];
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < G * HD; i += blockDim.x) {
        u32 g = i / HD, d = i % HD;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < PA_WARPS; w++) {
            if (s_l[w][g] > 0.0f) mx = fmaxf(mx, s_m[w][g]);
        }
        float sum = 0.0f, val = 0.0f;
#pragma unroll
        for (int w = 0; w < PA_WARPS; w++) {
            if (s_l[w][g] > 0.0f) {
                float c = __expf(s_m[w][g] - mx);
                sum += s_l[w][g] * c;
                val += s_acc[w][g][d] * c;
            }
        }
        unsigned long long head = (unsigned long long)row * num_heads + kvh * G + g;
        if (splits == 1) {
            out[head * HD + d] = f2bf(val / sum);
        } else {
            unsigned long long part = head * splits + split;
            part_acc[part * HD + d] = val;
            if (d == 0) {
                part_m[part] = mx;
                part_l[part] = sum;
            }
        }
    }
}

// Entry points per head size and group size: the group's arrays live in registers,
// sized exactly (a run-time group size would size them for the largest).
#define PAGED_ATTENTION(HD, G)                                                                                        \
    extern "C" __global__ void __launch_bounds__(PA_WARPS * 32) paged_attention_hd##HD##_g##G(                       \
        bf16* out, float* part_m, float* part_l, float* part_acc, const bf16* q, const bf16* k_cache,               \
        const bf16* v_cache, const u32* query_start, const u32* context_lens, const u32* block_tables, u32 num_seqs, \
        u32 max_blocks, u32 num_heads, u32 num_kv_heads, u32 block_size, float scale, u32 splits,                   \
        u32 tiled_from) {                                                                                            \
        attend_split<HD, G>(out, part_m, part_l, part_acc, q, k_cache, v_cache, query_start, context_lens,          \
                            block_tables, num_seqs, max_blocks, num_heads, num_kv_heads, block_size, scale,         \
                            splits, tiled_from);                                                                     \
    }
#define PAGED_ATTENTION_GROUPS(HD) \
    PAGED_ATTENTION(HD, 1) PAGED_ATTENTION(HD, 2) PAGED_ATTENTION(HD, 4) PAGED_ATTENTION(HD, 8)

PAGED_ATTENTION_GROUPS(64)
PAGED_ATTENTION_GROUPS(128)
PAGED_ATTENTION_GROUPS(256)

// Combines the splits of paged_attention_hd*: grid (query rows, query heads). A split
// that saw no keys has a zero sum and is skipped.
extern "C" __global__ void paged_attention_merge(bf16* out, const float* part_m, const float* part_l,
                                                 const float* part_acc, u32 num_heads, u32 head_dim, u32 splits) {
    unsigned long long head = (unsigned long long)blockIdx.x * num_heads + blockIdx.y;
    unsigned long long base = head * splits;
    float mx = NEG_INF;
    for (u32 s = 0; s < splits; s++) {
        if (part_l[base + s] > 0.0f) mx = fmaxf(mx, part_m[base + s]);
    }
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f, val = 0.0f;
        for (u32 s = 0; s < splits; s++) {
            float l = part_l[base + s];
            if (l > 0.0f) {
                float c = __expf(part_m[base + s] - mx);
                sum += l * c;
                val += part_acc[(base + s) * head_dim + d] * c;
            }
        }
        out[head * head_dim + d] = f2bf(val / sum);
    }
}

// Bidirectional attention within equal-length sequences (a vision tower's patches):
// q, k, v and out are [seqs * len, heads * head_dim]. Grid (len, heads, seqs), one
// block per query row and head; the row's scores live in dynamic shared memory
// (len floats, then the query's head_dim), every reduction in f32.
extern "C" __global__ void dense_attention(bf16* out, const bf16* q, const bf16* k, const bf16* v, u32 len,
                                           u32 heads, u32 head_dim, float scale) {
    extern __shared__ float smem[];
    float* scores = smem;
    float* query = smem + len;
    const u32 i = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    const unsigned long long width = (unsigned long long)heads * head_dim;
    const unsigned long long first = (unsigned long long)s * len;
    const bf16* qrow = q + (first + i) * width + (unsigned long long)h * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) query[d] = bf2f(qrow[d]);
    __syncthreads();
    float m = NEG_INF;
    for (u32 t = threadIdx.x; t < len; t += blockDim.x) {
        const bf16* krow = k + (first + t) * width + (unsigned long long)h * head_dim;
        float dot = 0.0f;
        for (u32 d = 0; d < head_dim; ++d) dot += query[d] * bf2f(krow[d]);
        scores[t] = dot * scale;
        m = fmaxf(m, dot * scale);
    }
    m = block_max(m);
    float sum = 0.0f;
    for (u32 t = threadIdx.x; t < len; t += blockDim.x) {
        float e = __expf(scores[t] - m);
        scores[t] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum);
    bf16* orow = out + (first + i) * width + (unsigned long long)h * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 t = 0; t < len; ++t) acc += scores[t] * bf2f(v[(first + t) * width + (unsigned long long)h * head_dim + d]);
        orow[d] = f2bf(acc * inv);
    }
}
