// Sampling helpers over f32 logits [rows, vocab]: penalties and logit bias applied in
// place, and per-row reductions (one block per row): max and log-sum-exp for
// log-probabilities, the argmax for greedy decoding, the top k for top_logprobs.

// Per (row, token) of a sequence's history, each pair once: the repetition penalty for a
// token seen in prompt or output, then frequency and presence penalties for its output
// count (the engine's CPU sampler's order).
extern "C" __global__ void apply_penalties(float* logits, u32 vocab, const u32* rows, const u32* tokens,
                                           const u32* counts, const u32* seen, const float* repetition,
                                           const float* frequency, const float* presence, u32 n) {
    FOR_EACH(i, n) {
        u32 r = rows[i];
        float* l = logits + (unsigned long long)r * vocab + tokens[i];
        float v = *l;
        if (seen[i] && repetition[r] != 1.0f) v = v > 0.0f ? v / repetition[r] : v * repetition[r];
        if (counts[i] > 0) v -= frequency[r] * (float)counts[i] + presence[r];
        *l = v;
    }
}

// logits[rows[i], tokens[i]] += values[i]; a token listed twice gets both.
extern "C" __global__ void add_at(float* logits, u32 vocab, const u32* rows, const u32* tokens, const float* values,
                                  u32 n) {
    FOR_EACH(i, n) atomicAdd(logits + (unsigned long long)rows[i] * vocab + tokens[i], values[i]);
}

// The larger of two (value, index) pairs; the lower index among equals, as the CPU's
// argmax (first maximum) does.
__device__ __forceinline__ void better(float& v, u32& i, float v2, u32 i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// Block-wide argmax of (v, i); every thread gets the result.
__device__ __forceinline__ void block_argmax(float& v, u32& i) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        u32 i2 = __shfl_xor_sync(0xffffffffu, i, o);
        better(v, i, v2, i2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sv[lane] : NEG_INF;
        i = lane < (int)(blockDim.x >> 5) ? si[lane] : 0xffffffffu;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(0xffffffffu, v, o);
            u32 i2 = __shfl_xor_sync(0xffffffffu, i, o);
            better(v, i, v2, i2);
        }
        if (lane == 0) {
            sv[0] = v;
            si[0] = i;
        }
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads();
}

extern "C" __global__ void row_argmax(const float* logits, u32 vocab, u32* out) {
    const float* row = logits + (unsigned long long)blockIdx.x * vocab;
    float v = NEG_INF;
    u32 i = 0xffffffffu;
    for (u32 c = threadIdx.x; c < vocab; c += blockDim.x) better(v, i, row[c], c);
    block_argmax(v, i);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

// Each row's maximum and log-sum-exp, so that log P(t) = logit(t) - max - lse.
extern "C" __global__ void row_max_lse(const float* logits, u32 vocab, float* max_out, float* lse_out) {
    const float* row = logits + (unsigned long long)blockIdx.x * vocab;
    float m = NEG_INF;
    for (u32 c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, row[c]);
    m = block_max(m);
    float s = 0.0f;
    for (u32 c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(row[c] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        max_out[blockIdx.x] = m;
        lse_out[blockIdx.x] = logf(s);
    }
}

#define TOPK_MAX 20

// The k (at most TOPK_MAX) largest logits of each row, largest first: k rounds of an
// argmax that skips the indices already taken.
extern "C" __global__ void row_topk(const float* logits, u32 vocab, u32 k, u32* idx_out) {
    const float* row = logits + (unsigned long long)blockIdx.x * vocab;
    __shared__ u32 taken[TOPK_MAX];
    for (u32 round = 0; round < k; round++) {
        float v = NEG_INF;
        u32 i = 0xffffffffu;
        for (u32 c = threadIdx.x; c < vocab; c += blockDim.x) {
            bool skip = false;
            for (u32 t = 0; t < round; t++) skip |= taken[t] == c;
            if (!skip) better(v, i, row[c], c);
        }
        block_argmax(v, i);
        if (threadIdx.x == 0) {
            taken[round] = i;
            idx_out[(unsigned long long)blockIdx.x * k + round] = i;
        }
        __syncthreads();
    }
}

// out[i] = src[at[i]]: a few logits fetched without downloading the matrix.
extern "C" __global__ void gather_f32(float* out, const float* src, const u32* at, unsigned long long n) {
    FOR_EACH(i, n) out[i] = src[at[i]];
}
