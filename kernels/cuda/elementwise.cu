// Row-wise and elementwise ops of the forward pass. Activations are bf16, parameters
// that need range or precision (norm weights, biases, RoPE frequencies) stay f32, and
// every reduction accumulates in f32.

extern "C" __global__ void f32_to_bf16(bf16* out, const float* x, unsigned long long n) {
    FOR_EACH(i, n) out[i] = f2bf(x[i]);
}

extern "C" __global__ void bf16_to_f32(float* out, const bf16* x, unsigned long long n) {
    FOR_EACH(i, n) out[i] = bf2f(x[i]);
}

// out[t] = table[ids[t]]; ids were checked against the table on the host.
extern "C" __global__ void embedding(bf16* out, const u32* ids, const bf16* table, u32 tokens, u32 dim) {
    FOR_EACH(i, (unsigned long long)tokens * dim) {
        unsigned long long t = i / dim, c = i % dim;
        out[i] = table[(unsigned long long)ids[t] * dim + c];
    }
}

// One block per row.
extern "C" __global__ void rms_norm(bf16* out, const bf16* x, const float* w, u32 dim, float eps) {
    const bf16* row = x + (unsigned long long)blockIdx.x * dim;
    bf16* o = out + (unsigned long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = bf2f(row[c]);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = f2bf(bf2f(row[c]) * inv * w[c]);
}

// The residual add fused with the next norm: h += y, then out = rms_norm(h). The norm
// reads h as stored (rounded to bf16), the same value the next layer adds to.
extern "C" __global__ void add_rms_norm(bf16* out, bf16* h, const bf16* y, const float* w, u32 dim, float eps) {
    unsigned long long base = (unsigned long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
        bf16 s = f2bf(bf2f(h[base + c]) + bf2f(y[base + c]));
        h[base + c] = s;
        float v = bf2f(s);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) out[base + c] = f2bf(bf2f(h[base + c]) * inv * w[c]);
}

extern "C" __global__ void add_assign(bf16* x, const bf16* y, unsigned long long n) {
    FOR_EACH(i, n) x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

extern "C" __global__ void add_bias(bf16* x, const float* bias, u32 rows, u32 cols) {
    FOR_EACH(i, (unsigned long long)rows * cols) x[i] = f2bf(bf2f(x[i]) + bias[i % cols]);
}

// x is [tokens, heads, head_dim]; one thread per rotated pair. neox pairs (i, i + half),
// otherwise (2i, 2i + 1).
extern "C" __global__ void rope(bf16* x, const u32* positions, const float* inv_freq, u32 tokens, u32 heads,
                                u32 head_dim, u32 half, u32 neox) {
    FOR_EACH(n, (unsigned long long)tokens * heads * half) {
        u32 i = n % half;
        unsigned long long th = n / half;
        unsigned long long t = th / heads;
        bf16* head = x + th * head_dim;
        u32 a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float s, c;
        sincosf((float)positions[t] * inv_freq[i], &s, &c);
        float x0 = bf2f(head[a]), x1 = bf2f(head[b]);
        head[a] = f2bf(x0 * c - x1 * s);
        head[b] = f2bf(x0 * s + x1 * c);
    }
}

// Attention's inputs from a fused Q/K/V row per token ([heads + 2 kv_heads] × head_dim):
// query heads rotated into q_out, key heads rotated and value heads copied into the
// caches at slot slots[t] ([slots, kv_heads, head_dim]). One thread per pair of a head:
// pair p < half is rope's rotated pair (the same arithmetic, so the same bits as rope
// then write_kv), the rest (partial rotary) and every value pair are copied.
extern "C" __global__ void qkv_to_cache(bf16* q_out, bf16* k_cache, bf16* v_cache, const bf16* qkv,
                                        const u32* positions, const u32* slots, const float* inv_freq, u32 tokens,
                                        u32 heads, u32 kv_heads, u32 head_dim, u32 half, u32 neox) {
    const u32 all = heads + 2 * kv_heads, pairs = head_dim / 2;
    FOR_EACH(n, (unsigned long long)tokens * all * pairs) {
        const u32 p = n % pairs;
        const unsigned long long th = n / pairs, t = th / all;
        const u32 h = th % all;
        const bf16* src = qkv + th * head_dim;
        bf16* dst = h < heads ? q_out + (t * heads + h) * head_dim
                    : h < heads + kv_heads
                        ? k_cache + ((unsigned long long)slots[t] * kv_heads + (h - heads)) * head_dim
                        : v_cache + ((unsigned long long)slots[t] * kv_heads + (h - heads - kv_heads)) * head_dim;
        const bool rotate = p < half && h < heads + kv_heads;
        const u32 a = rotate && neox ? p : 2 * p, b = rotate && neox ? p + half : 2 * p + 1;
        if (rotate) {
            float s, c;
            sincosf((float)positions[t] * inv_freq[p], &s, &c);
            const float x0 = bf2f(src[a]), x1 = bf2f(src[b]);
            dst[a] = f2bf(x0 * c - x1 * s);
            dst[b] = f2bf(x0 * s + x1 * c);
        } else {
            dst[a] = src[a];
            dst[b] = src[b];
        }
    }
}

// gate_up rows are [gate (width), up (width)].
extern "C" __global__ void silu_mul(bf16* out, const bf16* gate_up, u32 rows, u32 width) {
    FOR_EACH(i, (unsigned long long)rows * width) {
        unsigned long long r = i / width, c = i % width;
        float g = bf2f(gate_up[r * 2 * width + c]), u = bf2f(gate_up[r * 2 * width + width + c]);
        out[i] = f2bf(g / (1.0f + __expf(-g)) * u);
    }
}

// One block per row, in place.
extern "C" __global__ void softmax(bf16* x, u32 cols) {
    bf16* row = x + (unsigned long long)blockIdx.x * cols;
    float m = NEG_INF;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, bf2f(row[c]));
    m = block_max(m);
    float s = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) s += __expf(bf2f(row[c]) - m);
    float inv = 1.0f / block_sum(s);
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) row[c] = f2bf(__expf(bf2f(row[c]) - m) * inv);
}

// out[r] = x[r, offset .. offset + width] of rows `total` wide.
extern "C" __global__ void copy_columns(bf16* out, const bf16* x, u32 rows, u32 total, u32 offset, u32 width) {
    FOR_EACH(i, (unsigned long long)rows * width) {
        unsigned long long r = i / width, c = i % width;
        out[i] = x[r * total + offset + c];
    }
}

// out[i] = x[rows[i]]; rows were checked on the host.
extern "C" __global__ void gather_rows(bf16* out, const bf16* x, const u32* rows, u32 n, u32 cols) {
    FOR_EACH(i, (unsigned long long)n * cols) {
        unsigned long long r = i / cols, c = i % cols;
        out[i] = x[(unsigned long long)rows[r] * cols + c];
    }
}

// Uniform values in [-scale, scale) from a counter-based hash of (seed, index), for
// benchmark weights made on the device: an 8B-parameter model never crosses PCIe.
extern "C" __global__ void fill_random_bf16(bf16* x, unsigned long long n, unsigned long long seed, float scale) {
    FOR_EACH(i, n) {
        unsigned long long z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        x[i] = f2bf((2.0f * u - 1.0f) * scale);
    }
}

// One block per row: two passes over the row (mean, then the variance around it), so an
// offset residual stream loses no precision.
extern "C" __global__ void layer_norm(bf16* out, const bf16* x, const float* w, const float* b, u32 dim, float eps) {
    const bf16* row = x + (unsigned long long)blockIdx.x * dim;
    bf16* o = out + (unsigned long long)blockIdx.x * dim;
    float s = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) s += bf2f(row[c]);
    float mean = block_sum(s) / dim;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
        float d = bf2f(row[c]) - mean;
        ss += d * d;
    }
    float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = f2bf((bf2f(row[c]) - mean) * inv * w[c] + b[c]);
}

// kind: 0 erf, 1 tanh approximation, 2 quick (x·σ(1.702x)); in place.
extern "C" __global__ void gelu(bf16* x, unsigned long long n, u32 kind) {
    FOR_EACH(i, n) {
        float v = bf2f(x[i]), r;
        if (kind == 0) r = 0.5f * v * (1.0f + erff(v * 0.70710678f));
        else if (kind == 1) r = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
        else r = v / (1.0f + __expf(-1.702f * v));
        x[i] = f2bf(r);
    }
}

// x[rows[i]] = src[i]; rows were checked on the host.
extern "C" __global__ void scatter_rows(bf16* x, const bf16* src, const u32* rows, u32 n, u32 cols) {
    FOR_EACH(i, (unsigned long long)n * cols) {
        unsigned long long r = i / cols, c = i % cols;
        x[(unsigned long long)rows[r] * cols + c] = src[i];
    }
}
