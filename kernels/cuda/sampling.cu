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
    if (threadIdx.x == 0) out[blockIdx.x] = i < vocab ? i : 0;  // an all-NaN row still names a token
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

// ---- Sampled draws: temperature, top-k, top-p, min-p, then one token per row. ----
//
// The host's sampler orders a row by logit (then index), keeps a prefix (top-k, then the
// top-p share of those, then min-p) and walks the kept probabilities until a uniform
// draw is spent. Every one of those steps is a cut in the same order, so here each is
// found without sorting: a radix select over the logits' order-preserving bit patterns,
// one byte per pass, counting tokens (top-k) or weighing them (top-p and the draw), and
// then, among tokens with that very logit (bf16 logits tie often), the one at the right
// place in index order. Weights are exp((logit - max) / temperature) in 2^-40 fixed
// point and summed with integer atomics, so a row's result does not depend on the order
// the threads add in: a seeded request draws the same token whatever shares its batch.

typedef unsigned long long u64;

#define SAMPLE_BINS 256
#define WEIGHT_ONE 1099511627776.0f  // 2^40

// Logit bits whose unsigned order is the floats' order.
__device__ __forceinline__ u32 order_key(float l) {
    u32 b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_logit(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// One row and the cut so far: a token is kept when it comes at or before the cut in the
// order (key descending, then index ascending) and its probability is at least min_p of
// the top token's.
struct DrawRow {
    const float* logits;
    u32 vocab;
    float max;
    float temperature;
    float min_p;
    u32 cut_key;    // tokens with a lower key are dropped
    u32 cut_index;  // of the tokens with key cut_key, those after this index are dropped
};

__device__ __forceinline__ u64 weight_of(const DrawRow& r, float l) {
    float w = expf((l - r.max) / r.temperature);
    if (!(w >= r.min_p)) return 0;  // NaN too
    return (u64)__float2ull_rz(w * WEIGHT_ONE);
}

__device__ __forceinline__ bool within_cut(const DrawRow& r, u32 key, u32 c) {
    return key > r.cut_key || (key == r.cut_key && c <= r.cut_index);
}

// Adds each valid lane's `add` to hist[bin] with one shared atomic per distinct bin in
// the warp: a row's likeliest tokens share their top key bits, and an atomic per token
// would queue on those few bins. Every lane of the warp must call it. Peers (lanes with
// the same bin) sum into their lowest lane over a tree: in each round a lane adds the
// running sum of the next peer still in play, then the odd-ranked half drops out.
__device__ __forceinline__ void hist_add(u64* hist, u32 bin, u64 add, bool valid) {
    const u32 all = 0xffffffffu;
    // After the first byte most tokens no longer match the prefix: whole warps skip.
    if (__ballot_sync(all, valid) == 0) return;
    u32 lane = threadIdx.x & 31;
    u32 peers = __match_any_sync(all, valid ? bin : 0xffffffffu);
    u32 rank = __popc(peers & ((1u << lane) - 1u));
    u32 later = valid ? peers & ~(0xffffffffu >> (31 - lane)) : 0u;  // peers in higher lanes
    u64 sum = valid ? add : 0;
    while (__any_sync(all, later != 0)) {
        int next = __ffs(later) - 1;
        u64 theirs = __shfl_sync(all, sum, next < 0 ? (int)lane : next);
        if (next >= 0) sum += theirs;
        later &= __ballot_sync(all, (rank & 1u) == 0);
        rank >>= 1;
    }
    if (valid && sum != 0 && (peers & ((1u << lane) - 1u)) == 0) atomicAdd(hist + bin, sum);
}

// What a kept token adds when counting (top-k, before min-p: 1 within the cut) or weighing.
__device__ __forceinline__ u64 measure(const DrawRow& r, bool by_weight, float l, u32 key, u32 c) {
    if (!within_cut(r, key, c)) return 0;
    return by_weight ? weight_of(r, l) : 1ull;
}

// Total of the row's kept tokens; every thread gets it.
__device__ u64 kept_total(const DrawRow& r, bool by_weight, u64* scratch) {
    if (threadIdx.x == 0) *scratch = 0;
    __syncthreads();
    u64 s = 0;
    for (u32 c = threadIdx.x; c < r.vocab; c += blockDim.x) {
        float l = r.logits[c];
        s += measure(r, by_weight, l, order_key(l), c);
    }
    atomicAdd(scratch, s);
    __syncthreads();
    u64 total = *scratch;
    __syncthreads();
    return total;
}

// Where walking the kept tokens in order first reaches `target` (at least 1, at most
// the total): the key of the token it stops in, and how much the tokens with higher keys
// hold (`*shared_above` afterwards).
__device__ u32 select_key(const DrawRow& r, bool by_weight, u64 target, u64* hist, u32* shared_prefix,
                          u64* shared_above) {
    u32 prefix = 0, mask = 0;
    u64 above = 0;  // what the kept tokens with keys above the current prefix's range hold
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // Whole warps step together (hist_add needs every lane).
        for (u32 base = 0; base < r.vocab; base += blockDim.x) {
            u32 c = base + threadIdx.x;
            float l = c < r.vocab ? r.logits[c] : NEG_INF;
            u32 key = order_key(l);
            u64 add = c < r.vocab && (key & mask) == prefix ? measure(r, by_weight, l, key, c) : 0;
            hist_add(hist, (key >> shift) & 0xffu, add, add != 0);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // Walk the bins from the top; stop in the one that reaches the target. Should
            // rounding leave it short, the lowest bin that holds anything is taken.
            u64 acc = above;
            int chosen = -1, lowest = 0;
            for (int b = SAMPLE_BINS - 1; b >= 0; b--) {
                if (hist[b] == 0) continue;
                lowest = b;
                if (acc + hist[b] >= target) {
                    chosen = b;
                    break;
                }
                acc += hist[b];
            }
            if (chosen < 0) {
                chosen = lowest;
                acc -= hist[lowest];
            }
            *shared_prefix = prefix | ((u32)chosen << shift);
            *shared_above = acc;
        }
        __syncthreads();
        prefix = *shared_prefix;
        above = *shared_above;
        mask |= 0xffu << shift;
        __syncthreads();
    }
    return prefix;
}

// The index of the n-th (from 0) kept token with key `key`, in index order; the last
// one should n run past them. Tokens are numbered chunk by chunk, each chunk by a
// block-wide count of the warps before.
__device__ u32 nth_with_key(const DrawRow& r, u32 key, u32 n, u32* warp_counts, u32* shared_found) {
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u32 before = 0;  // matching tokens in earlier chunks (the same in every thread)
    if (threadIdx.x == 0) *shared_found = 0xffffffffu;
    u32 last = 0xffffffffu;
    for (u32 base = 0; base < r.vocab; base += blockDim.x) {
        u32 c = base + threadIdx.x;
        bool match = c < r.vocab && order_key(r.logits[c]) == key && within_cut(r, key, c);
        u32 ballot = __ballot_sync(0xffffffffu, match);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        u32 at = before + __popc(ballot & ((1u << lane) - 1u)), chunk = 0;
        for (u32 w = 0; w < warps; w++) {
            if (w < warp) at += warp_counts[w];
            chunk += warp_counts[w];
        }
        if (match && at == n) *shared_found = c;
        if (match) last = c;
        before += chunk;
        __syncthreads();
    }
    __syncthreads();
    u32 found = *shared_found;
    __syncthreads();
    if (found != 0xffffffffu) return found;
    // n ran past them: the highest index that matched, over the block.
    if (threadIdx.x == 0) *shared_found = 0;
    __syncthreads();
    if (last != 0xffffffffu) atomicMax(shared_found, last);
    __syncthreads();
    found = *shared_found;
    __syncthreads();
    return found;
}

// Moves the cut to where walking the kept tokens in order reaches `target`: at the key
// select_key finds, after as many of its tied tokens as the rest of the target needs.
// Returns the token the cut now ends at.
__device__ u32 cut_at(DrawRow& r, bool by_weight, u64 target, u64* hist, u32* prefix, u64* above,
                      u32* warp_counts) {
    u32 key = select_key(r, by_weight, target, hist, prefix, above);
    u64 rest = target > *above ? target - *above : 1;
    u64 each = by_weight ? weight_of(r, key_logit(key)) : 1ull;
    u64 n = each > 0 ? (rest - 1) / each : 0;
    u32 token = nth_with_key(r, key, n > 0xffffffffull ? 0xffffffffu : (u32)n, warp_counts, prefix);
    r.cut_key = key;
    r.cut_index = token;
    return token;
}

// One block per row. Rows at temperature 0 keep the greedy pick already in `tokens`.
// top_k 0 is off, top_p 1 is off, min_p 0 is off; uniform is the row's draw in [0, 1).
extern "C" __global__ void __launch_bounds__(1024) row_sample(const float* logits, u32 vocab, const float* temperature, const u32* top_k,
                                      const float* top_p, const float* min_p, const float* uniform, u32* tokens) {
    __shared__ u64 hist[SAMPLE_BINS];
    __shared__ u64 scratch, above;
    __shared__ u32 prefix, warp_counts[32];
    u32 row_i = blockIdx.x;
    if (!(temperature[row_i] > 0.0f)) return;
    DrawRow r;
    r.logits = logits + (unsigned long long)row_i * vocab;
    r.vocab = vocab;
    float m = NEG_INF;
    for (u32 c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, r.logits[c]);
    r.max = block_max(m);
    r.temperature = temperature[row_i];
    r.min_p = 0.0f;
    r.cut_key = 0;
    r.cut_index = 0xffffffffu;
    u32 k = top_k[row_i];
    if (k > 0 && k < vocab) cut_at(r, false, k, hist, &prefix, &above, warp_counts);
    float p = top_p[row_i];
    if (p < 1.0f) {
        u64 target = (u64)((double)p * (double)kept_total(r, true, &scratch));
        cut_at(r, true, target > 0 ? target : 1, hist, &prefix, &above, warp_counts);
    }
    r.min_p = min_p[row_i];
    u64 total = kept_total(r, true, &scratch);
    if (total == 0) return;  // nothing drawable (every logit -inf or NaN): the greedy pick stands
    u64 target = (u64)((double)uniform[row_i] * (double)total);
    u32 token = cut_at(r, true, target > 0 ? target : 1, hist, &prefix, &above, warp_counts);
    if (threadIdx.x == 0) tokens[row_i] = token;
}
