// Picking tokens from logits [rows, vocab]: penalties and logit bias applied in place
// (f32), per-row reductions for log-probabilities (one block per row: max and
// log-sum-exp, the top k for top_logprobs), and the pick itself, greedy or drawn, split
// over many blocks per row (f32 or the model's bf16 logits).

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

#define TOPK_MAX 20

// out[i] = src[at[i]]: a few logits fetched without downloading the matrix.
extern "C" __global__ void gather_f32(float* out, const float* src, const u32* at, unsigned long long n) {
    FOR_EACH(i, n) out[i] = src[at[i]];
}


// ---- The pick: the greedy argmax, or a draw after temperature, top-k, top-p, min-p ----
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
//
// One row is too little work for one block on a GPU of 100+ multiprocessors, so each row
// is split into `splits` contiguous chunks, one block each (grid: rows × splits), and a
// pick is a sequence of launches, the launches being its only barriers:
//   pick_best   the row's greedy token and maximum: one atomicMax of (key, ~index);
//   for each cut a row needs (0 top-k, 1 top-p, 2 the draw):
//     pick_radix  × PASSES: the chunk's histogram of the next key byte, among the kept
//                 tokens that match the bytes chosen so far, added to the row's;
//     pick_count  the chunk's tokens with the chosen key, within the cut so far;
//     pick_find   the chunk that holds the wanted one of them names it: the new cut;
//   pick_tokens the drawn token, or the greedy one.
// Each block re-derives the choices so far from the histograms already complete (a
// warp walks 256 bins in a few shuffles), so no block waits for another. A bf16 logit
// has 16 bits of key: two passes instead of four.

typedef unsigned long long u64;

#define SAMPLE_BINS 256
#define WEIGHT_ONE 1099511627776.0f  // 2^40

// A row's state in global memory, u64 words, zeroed before each pick (the host's
// PICK_STATE_WORDS and PICK_SPLITS_MAX in cuda/sampling.rs follow these).
#define PICK_SPLITS_MAX 128
#define PICK_CUTS 3
#define PICK_PASSES_MAX 4
#define PW_BEST 0     // (argmax key << 32) | ~index, by atomicMax; 0 while no logit is a number
#define PW_CUT 1      // the cut so far, (key << 32) | index, once PW_HAS_CUT is 1
#define PW_HAS_CUT 2
#define PW_DRAWN 3    // (1 << 32) | token once drawn
#define PW_COUNTS 4   // u32 [PICK_CUTS][PICK_SPLITS_MAX]: each chunk's tokens with the cut's key
#define PW_HIST (PW_COUNTS + PICK_CUTS * PICK_SPLITS_MAX / 2)  // u64 [PICK_CUTS][PICK_PASSES_MAX][SAMPLE_BINS]
#define PICK_STATE_WORDS (PW_HIST + PICK_CUTS * PICK_PASSES_MAX * SAMPLE_BINS)

// Logit bits whose unsigned order is the floats' order.
__device__ __forceinline__ u32 order_key(float l) {
    u32 b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_logit(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ float logit_at(const float* row, u32 c) { return row[c]; }
__device__ __forceinline__ float logit_at(const bf16* row, u32 c) { return bf2f(row[c]); }

// Radix passes a logit type needs, and the key a finished select names: a bf16 logit's
// low 16 bits are zero, so its key's are all zeros (positive) or all ones (negative).
template <class T> struct KeyBits { static constexpr u32 passes = 4; };
template <> struct KeyBits<bf16> { static constexpr u32 passes = 2; };
template <class T> __device__ __forceinline__ u32 whole_key(u32 prefix) {
    if (KeyBits<T>::passes == 4) return prefix;
    return prefix | ((prefix & 0x80000000u) ? 0u : 0xffffu);
}

__device__ __forceinline__ u64 shfl64(u64 v, int src) {
    u32 lo = __shfl_sync(0xffffffffu, (u32)v, src), hi = __shfl_sync(0xffffffffu, (u32)(v >> 32), src);
    return ((u64)hi << 32) | lo;
}

// A row's parameters: 5 words each (temperature, top_k, top_p, min_p, uniform; floats as
// bits). Temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off.
struct PickParams {
    float temperature, top_p, min_p, uniform;
    u32 top_k;
};

__device__ __forceinline__ PickParams params_of(const u32* params, u32 row) {
    const u32* q = params + 5ull * row;
    return {__uint_as_float(q[0]), __uint_as_float(q[2]), __uint_as_float(q[3]), __uint_as_float(q[4]), q[1]};
}

__device__ __forceinline__ bool cut_active(const PickParams& p, u32 cut, u32 vocab) {
    if (!(p.temperature > 0.0f)) return false;
    if (cut == 0) return p.top_k > 0 && p.top_k < vocab;
    if (cut == 1) return p.top_p < 1.0f;
    return true;
}

// One row and the cut so far: a token is kept when it comes at or before the cut in the
// order (key descending, then index ascending) and its probability is at least min_p of
// the top token's (the draw only).
template <class T> struct DrawRow {
    const T* logits;
    float max;
    float temperature;
    float min_p;
    u32 cut_key;    // tokens with a lower key are dropped
    u32 cut_index;  // of the tokens with key cut_key, those after this index are dropped
};

template <class T>
__device__ __forceinline__ DrawRow<T> draw_row(const T* logits, u32 vocab, const PickParams& p, const u64* st,
                                               u32 cut) {
    DrawRow<T> r;
    r.logits = logits + (u64)blockIdx.x * vocab;
    const u32 top = (u32)(st[PW_BEST] >> 32);
    r.max = top == 0 ? NEG_INF : key_logit(top);
    r.temperature = p.temperature;
    r.min_p = cut == 2 ? p.min_p : 0.0f;
    const bool has_cut = st[PW_HAS_CUT] != 0;
    r.cut_key = has_cut ? (u32)(st[PW_CUT] >> 32) : 0u;
    r.cut_index = has_cut ? (u32)st[PW_CUT] : 0xffffffffu;
    return r;
}

template <class T> __device__ __forceinline__ u64 weight_of(const DrawRow<T>& r, float l) {
    float w = expf((l - r.max) / r.temperature);
    if (!(w >= r.min_p)) return 0;  // NaN too
    return (u64)__float2ull_rz(w * WEIGHT_ONE);
}

template <class T> __device__ __forceinline__ bool within_cut(const DrawRow<T>& r, u32 key, u32 c) {
    return key > r.cut_key || (key == r.cut_key && c <= r.cut_index);
}

// What a kept token adds when counting (top-k: 1 within the cut) or weighing.
template <class T>
__device__ __forceinline__ u64 measure(const DrawRow<T>& r, bool by_weight, float l, u32 key, u32 c) {
    if (!within_cut(r, key, c)) return 0;
    return by_weight ? weight_of(r, l) : 1ull;
}

// This block's chunk of the row: whole multiples of the block, so whole warps step
// together.
struct Chunk {
    u32 begin, end;
};

__device__ __forceinline__ Chunk chunk_of(u32 vocab, u32 splits) {
    const u32 size = ((vocab + splits - 1) / splits + blockDim.x - 1) / blockDim.x * blockDim.x;
    const u32 begin = min(vocab, blockIdx.y * size);
    return {begin, min(vocab, begin + size)};
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
        u64 theirs = shfl64(sum, next < 0 ? (int)lane : next);
        if (next >= 0) sum += theirs;
        later &= __ballot_sync(all, (rank & 1u) == 0);
        rank >>= 1;
    }
    if (valid && sum != 0 && (peers & ((1u << lane) - 1u)) == 0) atomicAdd(hist + bin, sum);
}

// One warp, every lane: where walking the 256 bins from the top, starting with `above`
// already passed, first reaches `target`. Returns the bin; `above` becomes what the bins
// over it hold (with the start). Should no bin reach it (rounding), the lowest bin that
// holds anything is taken. Lane L sums bins 255 - 8L down to 248 - 8L; a scan over the
// lanes finds the lane the walk stops in, and that lane walks its eight.
__device__ u32 walk_bins(const u64* h, u64 target, u64& above) {
    const u32 lane = threadIdx.x & 31;
    u64 s = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) s += h[255 - 8 * lane - i];
    u64 incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 y = shfl64(incl, lane >= (u32)o ? (int)(lane - o) : (int)lane);
        if (lane >= (u32)o) incl += y;
    }
    const u64 total = shfl64(incl, 31);
    const u32 reach = __ballot_sync(0xffffffffu, s != 0 && above + incl >= target);
    u32 bin = 0;
    u64 acc = above;
    if (reach != 0) {
        const int at = __ffs(reach) - 1;
        if ((int)lane == at) {
            acc = above + (incl - s);
            for (int i = 0; i < 8; i++) {
                const u32 b = 255 - 8 * lane - i;
                if (h[b] == 0) continue;
                if (acc + h[b] >= target) {
                    bin = b;
                    break;
                }
                acc += h[b];
            }
        }
        bin = __shfl_sync(0xffffffffu, bin, at);
        acc = shfl64(acc, at);
    } else {
        const u32 nonempty = __ballot_sync(0xffffffffu, s != 0);
        if (nonempty != 0) {
            const int at = 31 - __clz(nonempty);  // the highest lane holds the lowest bins
            if ((int)lane == at) {
                for (int i = 7; i >= 0; i--) {
                    if (h[255 - 8 * lane - i] != 0) {
                        bin = 255 - 8 * lane - i;
                        break;
                    }
                }
            }
            bin = __shfl_sync(0xffffffffu, bin, at);
            acc = above + total - h[bin];
        }
    }
    above = acc;
    return bin;
}

// A cut's progress from its finished passes' histograms, in every thread of the block:
// the target, the key's bytes chosen so far and what the kept tokens above them hold.
struct Progress {
    u64 target, above;
    u32 prefix;
};

// False where the cut has nothing to weigh (every weight 0: the greedy pick stands).
__device__ bool resume(const PickParams& p, const u64* st, u32 cut, u32 passes, Progress* out) {
    __shared__ u64 seen[PICK_PASSES_MAX][SAMPLE_BINS];
    __shared__ Progress s_progress;
    __shared__ int s_ok;
    const u64* hist = st + PW_HIST + (u64)cut * PICK_PASSES_MAX * SAMPLE_BINS;
    for (u32 i = threadIdx.x; i < passes * SAMPLE_BINS; i += blockDim.x) seen[i / SAMPLE_BINS][i % SAMPLE_BINS] = hist[i];
    __syncthreads();
    if (threadIdx.x < 32) {
        u64 target = p.top_k;
        bool ok = true;
        if (cut != 0 && passes > 0) {
            // The first pass matched every kept token: its bins sum to the cut's total.
            u64 s = 0;
            for (u32 b = threadIdx.x; b < SAMPLE_BINS; b += 32) s += seen[0][b];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += shfl64(s, (int)(threadIdx.x ^ o));
            const float share = cut == 1 ? p.top_p : p.uniform;
            target = (u64)((double)share * (double)s);
            if (target == 0) target = 1;
            ok = s != 0;
        }
        u32 prefix = 0;
        u64 above = 0;
        for (u32 q = 0; q < passes; q++) prefix |= walk_bins(seen[q], target, above) << (24 - 8 * q);
        if (threadIdx.x == 0) {
            s_progress = {target, above, prefix};
            s_ok = ok;
        }
    }
    __syncthreads();
    *out = s_progress;
    const bool ok = s_ok != 0;
    __syncthreads();  // before another call overwrites the slots
    return ok;
}

// The row's greedy token and maximum: NaN never wins, equal logits go to the lower index.
template <class T> __device__ void pick_best(const T* logits, u32 vocab, u64* state, u32 splits) {
    const T* row = logits + (u64)blockIdx.x * vocab;
    const Chunk ch = chunk_of(vocab, splits);
    u64 best = 0;
    for (u32 c = ch.begin + threadIdx.x; c < ch.end; c += blockDim.x) {
        // -0 as +0: equal logits, the lower index (the CPU's argmax compares floats).
        const float l = logit_at(row, c) + 0.0f;
        const u64 b = l != l ? 0ull : ((u64)order_key(l) << 32) | (u64)(~c);
        if (b > best) best = b;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = shfl64(best, (int)((threadIdx.x & 31) ^ o));
        if (other > best) best = other;
    }
    if ((threadIdx.x & 31) == 0 && best != 0) atomicMax(state + (u64)blockIdx.x * PICK_STATE_WORDS + PW_BEST, best);
}

// One radix pass of a cut: this chunk's histogram of key byte `pass` (from the top)
// over the kept tokens whose higher bytes are those chosen so far.
template <class T>
__device__ void pick_radix(const T* logits, u32 vocab, const u32* params, u64* state, u32 splits, u32 cut, u32 pass) {
    const PickParams p = params_of(params, blockIdx.x);
    if (!cut_active(p, cut, vocab)) return;
    u64* st = state + (u64)blockIdx.x * PICK_STATE_WORDS;
    const DrawRow<T> r = draw_row(logits, vocab, p, st, cut);
    Progress g;
    if (!resume(p, st, cut, pass, &g)) return;
    __shared__ u64 hist[SAMPLE_BINS];
    for (u32 b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const u32 shift = 24 - 8 * pass, mask = pass == 0 ? 0u : 0xffffffffu << (32 - 8 * pass);
    const Chunk ch = chunk_of(vocab, splits);
    for (u32 base = ch.begin; base < ch.end; base += blockDim.x) {
        const u32 c = base + threadIdx.x;
        const float l = c < ch.end ? logit_at(r.logits, c) : NEG_INF;
        const u32 key = order_key(l);
        const u64 add = c < ch.end && (key & mask) == g.prefix ? measure(r, cut != 0, l, key, c) : 0;
        hist_add(hist, (key >> shift) & 0xffu, add, add != 0);
    }
    __syncthreads();
    u64* out = st + PW_HIST + ((u64)cut * PICK_PASSES_MAX + pass) * SAMPLE_BINS;
    for (u32 b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        if (hist[b] != 0) atomicAdd(out + b, hist[b]);
    }
}

// A cut whose radix passes are done, in every thread of the block: the row, its state,
// the key the select names, and which of that key's tied tokens (from 0, in index order)
// the cut ends at, as many as the rest of the target needs. False where the row skips
// the cut.
template <class T> struct CutPoint {
    DrawRow<T> row;
    u64* st;
    u32 key, nth;
};

template <class T>
__device__ bool cut_point(const T* logits, u32 vocab, const u32* params, u64* state, u32 cut, CutPoint<T>* out) {
    const PickParams p = params_of(params, blockIdx.x);
    if (!cut_active(p, cut, vocab)) return false;
    out->st = state + (u64)blockIdx.x * PICK_STATE_WORDS;
    out->row = draw_row(logits, vocab, p, out->st, cut);
    Progress g;
    if (!resume(p, out->st, cut, KeyBits<T>::passes, &g)) return false;
    out->key = whole_key<T>(g.prefix);
    const u64 rest = g.target > g.above ? g.target - g.above : 1;
    const u64 each = cut != 0 ? weight_of(out->row, key_logit(out->key)) : 1ull;
    const u64 n = each > 0 ? (rest - 1) / each : 0;
    out->nth = n > 0xffffffffull ? 0xffffffffu : (u32)n;
    return true;
}

template <class T> __device__ __forceinline__ bool tied(const DrawRow<T>& r, u32 key, u32 c, const Chunk& ch) {
    return c < ch.end && order_key(logit_at(r.logits, c)) == key && within_cut(r, key, c);
}

// How many of this chunk's tokens have the chosen key (within the cut so far).
template <class T>
__device__ void pick_count(const T* logits, u32 vocab, const u32* params, u64* state, u32 splits, u32 cut) {
    CutPoint<T> at;
    if (!cut_point(logits, vocab, params, state, cut, &at)) return;
    const DrawRow<T>& r = at.row;
    u64* st = at.st;
    const u32 key = at.key;
    __shared__ u32 count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const Chunk ch = chunk_of(vocab, splits);
    u32 mine = 0;
    for (u32 c = ch.begin + threadIdx.x; c < ch.end; c += blockDim.x) mine += tied(r, key, c, ch);
    if (mine) atomicAdd(&count, mine);
    __syncthreads();
    if (threadIdx.x == 0) ((u32*)(st + PW_COUNTS))[cut * PICK_SPLITS_MAX + blockIdx.y] = count;
}

// The chunk holding the wanted tied token finds it and moves the cut there (the draw's
// cut is the drawn token). Should the wanted one run past them all, the last is taken.
template <class T>
__device__ void pick_find(const T* logits, u32 vocab, const u32* params, u64* state, u32 splits, u32 cut) {
    CutPoint<T> at;
    if (!cut_point(logits, vocab, params, state, cut, &at)) return;
    const DrawRow<T>& r = at.row;
    u64* st = at.st;
    const u32 key = at.key, nth = at.nth;
    const u32* counts = (const u32*)(st + PW_COUNTS) + cut * PICK_SPLITS_MAX;
    u32 before = 0, total = 0, last = 0;
    for (u32 s = 0; s < splits; s++) {
        if (s < blockIdx.y) before += counts[s];
        total += counts[s];
        if (counts[s] != 0) last = s;
    }
    const u32 mine = counts[blockIdx.y];
    u32 want;
    if (nth < total) {
        if (nth < before || nth >= before + mine) return;
        want = nth - before;
    } else {
        if (blockIdx.y != last) return;
        want = mine == 0 ? 0 : mine - 1;  // none at all: token 0 (the greedy pick stands for the draw's)
    }
    __shared__ u32 warp_counts[32];
    __shared__ u32 found;
    if (threadIdx.x == 0) found = mine == 0 ? 0 : 0xffffffffu;
    __syncthreads();
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const Chunk ch = chunk_of(vocab, splits);
    u32 seen = 0;  // tied tokens in the earlier steps (the same in every thread)
    for (u32 base = ch.begin; base < ch.end && mine != 0; base += blockDim.x) {
        const u32 c = base + threadIdx.x;
        const bool match = tied(r, key, c, ch);
        const u32 ballot = __ballot_sync(0xffffffffu, match);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        u32 at = seen + __popc(ballot & ((1u << lane) - 1u)), step = 0;
        for (u32 w = 0; w < warps; w++) {
            if (w < warp) at += warp_counts[w];
            step += warp_counts[w];
        }
        if (match && at == want) found = c;
        seen += step;
        __syncthreads();
        if (found != 0xffffffffu) break;
        __syncthreads();  // every thread has read `found` before warp_counts is reused
    }
    if (threadIdx.x == 0 && found != 0xffffffffu) {
        if (cut == 2) {
            if (mine != 0) st[PW_DRAWN] = (1ull << 32) | found;
        } else {
            st[PW_CUT] = ((u64)key << 32) | found;
            st[PW_HAS_CUT] = 1;
        }
    }
}

#define PICK_KERNELS(NAME, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(1024) pick_best_##NAME(const T* logits, u32 vocab, u64* state,       \
                                                                         u32 splits) {                                 \
        pick_best(logits, vocab, state, splits);                                                                     \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) pick_radix_##NAME(const T* logits, u32 vocab,                 \
                                                                          const u32* params, u64* state, u32 splits,   \
                                                                          u32 cut, u32 pass) {                         \
        pick_radix(logits, vocab, params, state, splits, cut, pass);                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) pick_count_##NAME(const T* logits, u32 vocab,                 \
                                                                          const u32* params, u64* state, u32 splits,   \
                                                                          u32 cut) {                                   \
        pick_count(logits, vocab, params, state, splits, cut);                                                       \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) pick_find_##NAME(const T* logits, u32 vocab,                  \
                                                                         const u32* params, u64* state, u32 splits,    \
                                                                         u32 cut) {                                    \
        pick_find(logits, vocab, params, state, splits, cut);                                                        \
    }

PICK_KERNELS(f32, float)
PICK_KERNELS(bf16, bf16)

// Each row's token: the drawn one, else the greedy one (token 0 for a row of NaNs).
extern "C" __global__ void pick_tokens(const u64* state, u32 rows, u32 vocab, u32* tokens) {
    FOR_EACH(i, rows) {
        const u64* st = state + i * PICK_STATE_WORDS;
        const u64 drawn = st[PW_DRAWN], best = st[PW_BEST];
        const u32 greedy = ~(u32)best;
        tokens[i] = (drawn >> 32) ? (u32)drawn : best != 0 && greedy < vocab ? greedy : 0;
    }
}

// ---- Log-probabilities, split over blocks as the pick is ----

// Each chunk's maximum and sum of exp(l - max); an empty chunk holds max -inf, sum 0.
extern "C" __global__ void lse_parts(const float* logits, u32 vocab, u32 splits, float* part_max, float* part_sum) {
    const float* row = logits + (u64)blockIdx.x * vocab;
    const Chunk ch = chunk_of(vocab, splits);
    float m = NEG_INF;
    for (u32 c = ch.begin + threadIdx.x; c < ch.end; c += blockDim.x) m = fmaxf(m, row[c]);
    m = block_max(m);
    float s = 0.0f;
    if (m != NEG_INF) {
        for (u32 c = ch.begin + threadIdx.x; c < ch.end; c += blockDim.x) s += expf(row[c] - m);
    }
    s = block_sum(s);
    if (threadIdx.x == 0) {
        part_max[(u64)blockIdx.x * splits + blockIdx.y] = m;
        part_sum[(u64)blockIdx.x * splits + blockIdx.y] = s;
    }
}

// Each row's maximum and log-sum-exp from its chunks', so that log P(t) = logit(t) - max - lse.
extern "C" __global__ void lse_merge(const float* part_max, const float* part_sum, u32 rows, u32 splits,
                                     float* max_out, float* lse_out) {
    FOR_EACH(r, rows) {
        const float* pm = part_max + r * splits;
        const float* ps = part_sum + r * splits;
        float m = NEG_INF;
        for (u32 s = 0; s < splits; s++) m = fmaxf(m, pm[s]);
        float total = 0.0f;
        for (u32 s = 0; s < splits; s++) {
            if (pm[s] != NEG_INF) total += ps[s] * expf(pm[s] - m);
        }
        max_out[r] = m;
        lse_out[r] = logf(total);
    }
}

// k rounds of a block-wide argmax over `count` candidates (`at(j)`: a token, or one past
// the vocabulary for none), each skipping the tokens already taken: the k largest,
// largest first, equal logits by lower index. Returns nothing; `put(round, token)`
// gets each (0xffffffff where none is left but NaNs).
template <class At, class Put>
__device__ void top_rounds(const float* row, u32 vocab, u32 k, u32 count, At at, Put put) {
    __shared__ u32 taken[TOPK_MAX];
    for (u32 round = 0; round < k; round++) {
        float v = NEG_INF;
        u32 i = 0xffffffffu;
        for (u32 j = threadIdx.x; j < count; j += blockDim.x) {
            const u32 c = at(j);
            if (c >= vocab) continue;
            bool skip = false;
            for (u32 t = 0; t < round; t++) skip |= taken[t] == c;
            if (!skip) better(v, i, row[c], c);
        }
        block_argmax(v, i);
        if (threadIdx.x == 0) {
            taken[round] = i;
            put(round, i);
        }
        __syncthreads();
    }
}

// Each chunk's k largest logits (k at most TOPK_MAX): cand[(row, split)] holds k tokens.
extern "C" __global__ void topk_parts(const float* logits, u32 vocab, u32 k, u32 splits, u32* cand) {
    const float* row = logits + (u64)blockIdx.x * vocab;
    const Chunk ch = chunk_of(vocab, splits);
    u32* out = cand + ((u64)blockIdx.x * splits + blockIdx.y) * k;
    top_rounds(row, vocab, k, ch.end - ch.begin, [&](u32 j) { return ch.begin + j; },
               [&](u32 round, u32 token) { out[round] = token; });
}

// Each row's k largest from its chunks' (the row's top k are among them); one block per
// row. A row with fewer than k numbers names token 0 for the rest.
extern "C" __global__ void topk_merge(const float* logits, u32 vocab, u32 k, u32 splits, const u32* cand,
                                      u32* idx_out) {
    const float* row = logits + (u64)blockIdx.x * vocab;
    const u32* mine = cand + (u64)blockIdx.x * splits * k;
    u32* out = idx_out + (u64)blockIdx.x * k;
    top_rounds(row, vocab, k, splits * k, [&](u32 j) { return mine[j]; },
               [&](u32 round, u32 token) { out[round] = token < vocab ? token : 0; });
}
