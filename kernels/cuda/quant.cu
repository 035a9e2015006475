// Products with weights kept in ggml's block formats, as the GGUF file stores them:
// each kernel decodes the blocks it reads into registers or shared memory, so a
// quantised model takes its file's bytes on the device, never a bf16 copy.
//
// Every format is read in units of 32 consecutive weights of a row: a whole block of
// the 32-weight formats, one eighth of a K-quant super-block. `unit<TY>` decodes unit
// `u` of a row into 32 floats exactly as the host's decoder does (quant/dequant.rs),
// so the GPU's products differ from the CPU's only in bf16 activations and the order
// of f32 sums. Types are ggml's ids: 2 Q4_0, 3 Q4_1, 6 Q5_0, 8 Q8_0, 12 Q4_K, 13 Q5_K,
// 14 Q6_K. Rows are whole units (the host checks), and every block starts 2-byte
// aligned (block sizes are even), so the f16 fields are read as halves.

typedef unsigned char u8;

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float f16_at(const u8* p) { return h2f(*(const unsigned short*)p); }

// Sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block (12 packed bytes).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

template <int TY> struct Format;
template <> struct Format<2> { static constexpr int bytes = 18, units = 1; };
template <> struct Format<3> { static constexpr int bytes = 20, units = 1; };
template <> struct Format<6> { static constexpr int bytes = 22, units = 1; };
template <> struct Format<8> { static constexpr int bytes = 34, units = 1; };
template <> struct Format<12> { static constexpr int bytes = 144, units = 8; };
template <> struct Format<13> { static constexpr int bytes = 176, units = 8; };
template <> struct Format<14> { static constexpr int bytes = 210, units = 8; };

// Unit u of a row (row: the row's first byte) as 32 floats.
template <int TY> __device__ __forceinline__ void unit(const u8* row, unsigned u, float* w) {
    const u8* b = row + (unsigned long long)(u / Format<TY>::units) * Format<TY>::bytes;
    const int j = u % Format<TY>::units;
    if constexpr (TY == 2) {  // Q4_0: d, 16 bytes of nibbles; low nibbles are elements 0..16
        float d = f16_at(b);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            w[l] = (float)((int)(b[2 + l] & 0xF) - 8) * d;
            w[l + 16] = (float)((int)(b[2 + l] >> 4) - 8) * d;
        }
    } else if constexpr (TY == 3) {  // Q4_1: d, m, 16 bytes of nibbles: x = q·d + m
        float d = f16_at(b), m = f16_at(b + 2);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            w[l] = __fadd_rn(__fmul_rn((float)(b[4 + l] & 0xF), d), m);
            w[l + 16] = __fadd_rn(__fmul_rn((float)(b[4 + l] >> 4), d), m);
        }
    } else if constexpr (TY == 6) {  // Q5_0: d, 32 fifth bits, nibbles as Q4_0: x = (q − 16)·d
        float d = f16_at(b);
        unsigned qh = (unsigned)b[2] | ((unsigned)b[3] << 8) | ((unsigned)b[4] << 16) | ((unsigned)b[5] << 24);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            int lo = b[6 + l] & 0xF, hi = b[6 + l] >> 4;
            w[l] = (float)((lo | (int)(((qh >> l) & 1) << 4)) - 16) * d;
            w[l + 16] = (float)((hi | (int)(((qh >> (l + 16)) & 1) << 4)) - 16) * d;
        }
    } else if constexpr (TY == 8) {  // Q8_0: d, 32 signed bytes
        float d = f16_at(b);
#pragma unroll
        for (int l = 0; l < 32; l++) w[l] = (float)(signed char)b[2 + l] * d;
    } else if constexpr (TY == 12 || TY == 13) {
        // Q4_K: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles (each 32
        // bytes hold two sub-blocks: low nibbles, then high). Q5_K adds 32 bytes of
        // fifth bits (bit j of byte l for sub-block j) before the nibbles.
        float sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        float scale = f16_at(b) * sc, min = f16_at(b + 2) * mn;
        const int first = TY == 12 ? 16 : 48;
        const u8* qs = b + first + 32 * (j >> 1);
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int q = (qs[l] >> shift) & 0xF;
            if constexpr (TY == 13) q += ((b[16 + l] >> j) & 1) << 4;
            w[l] = __fsub_rn(__fmul_rn((float)q, scale), min);
        }
    } else if constexpr (TY == 14) {
        // Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed scales (one per
        // 16 weights), d. Sub-block j = 4·half + k takes byte l (+32 when k is odd) of
        // its half's low bits (high nibble when k ≥ 2) and bits 2k of qh[l].
        const int half = j >> 2, k = j & 3;
        const u8* ql = b + 64 * half + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * half;
        float d = f16_at(b + 208);
        float s0 = d * (float)(signed char)b[192 + 2 * j], s1 = d * (float)(signed char)b[193 + 2 * j];
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int lo = k >= 2 ? ql[l] >> 4 : ql[l] & 0xF;
            int q = (lo | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
            w[l] = (l < 16 ? s0 : s1) * (float)q;
        }
    }
}

// 32 activations from p (16-byte aligned: units start at multiples of 32 elements of
// rows whose width is a multiple of 32) as floats.
__device__ __forceinline__ void load_x32(const bf16* p, float* x) {
#pragma unroll
    for (int i = 0; i < 4; i++) unpack8(((const uint4*)p)[i], x + 8 * i);
}

// Decode products, 1..GEMV_MAX_T tokens: out[t, r] = Σ_c x[t, c] · w[r, c]. One warp per
// weight row, its lanes over the row's units in turn, so the warp reads the row's bytes
// once, front to back, for every token.
#define GEMV_MAX_T 8
#define GEMV_WARPS 4

template <int TY>
__device__ __forceinline__ void gemv(bf16* out, const u8* w, const bf16* x, u32 rows, u32 cols, u32 tokens,
                                     unsigned long long row_bytes) {
    const u32 r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;  // the whole warp: the shuffles below need every lane
    const u8* row = w + r * row_bytes;
    float acc[GEMV_MAX_T];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.0f;
    for (u32 u = lane; u < cols / 32; u += 32) {
        float wv[32], xv[32];
        unit<TY>(row, u, wv);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++) {
            if (t < tokens) {
                load_x32(x + (unsigned long long)t * cols + 32 * u, xv);
                float s = 0.0f;
#pragma unroll
                for (int l = 0; l < 32; l++) s = fmaf(wv[l], xv[l], s);
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < tokens) {
            float s = warp_sum(acc[t]);
            if (lane == 0) out[(unsigned long long)t * rows + r] = f2bf(s);
        }
    }
}

// Prefill products, any number of tokens: each block computes a 64-row × 64-token tile
// of out, 32 columns at a time. The block's first 64 threads decode one row's unit each
// into shared memory; all 256 stage the tokens' 32 activations; then each thread sums a
// 4 × 4 patch in f32.
#define TILE 64
#define TILE_THREADS 256

template <int TY>
__device__ __forceinline__ void gemm(bf16* out, const u8* w, const bf16* x, u32 rows, u32 cols, u32 tokens,
                                     unsigned long long row_bytes) {
    __shared__ float ws[32][TILE + 1];
    __shared__ float xs[32][TILE + 1];
    const u32 tid = threadIdx.x, r0 = blockIdx.x * TILE, t0 = blockIdx.y * TILE;
    const u32 tr = tid / 16, tt = tid % 16;
    float acc[4][4] = {};
    for (u32 u = 0; u < cols / 32; u++) {
        if (tid < TILE) {
            float wv[32];
            if (r0 + tid < rows) {
                unit<TY>(w + (r0 + tid) * row_bytes, u, wv);
            } else {
#pragma unroll
                for (int l = 0; l < 32; l++) wv[l] = 0.0f;
            }
#pragma unroll
            for (int l = 0; l < 32; l++) ws[l][tid] = wv[l];
        }
        {
            // Thread tid stages 8 activations: token tid / 4, columns 8·(tid % 4)..
            const u32 t = tid / 4, part = tid % 4;
            float xv[8] = {};
            const bf16* from = x + (unsigned long long)(t0 + t) * cols + 32 * u + 8 * part;
            if (t0 + t < tokens) unpack8(*(const uint4*)from, xv);
#pragma unroll
            for (int k = 0; k < 8; k++) xs[8 * part + k][t] = xv[k];
        }
        __syncthreads();
#pragma unroll 8
        for (int l = 0; l < 32; l++) {
            float a[4], bt[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                a[i] = ws[l][4 * tr + i];
                bt[i] = xs[l][4 * tt + i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc[i][k] = fmaf(a[i], bt[k], acc[i][k]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 t = t0 + 4 * tt + k;
        if (t >= tokens) continue;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 r = r0 + 4 * tr + i;
            if (r < rows) out[(unsigned long long)t * rows + r] = f2bf(acc[i][k]);
        }
    }
}

// out[t] = table[ids[t]], decoded; one block per token. ids were checked on the host.
template <int TY>
__device__ __forceinline__ void embedding_rows(bf16* out, const u32* ids, const u8* table, u32 cols,
                                               unsigned long long row_bytes) {
    const u8* row = table + ids[blockIdx.x] * row_bytes;
    bf16* o = out + (unsigned long long)blockIdx.x * cols;
    for (u32 u = threadIdx.x; u < cols / 32; u += blockDim.x) {
        float wv[32];
        unit<TY>(row, u, wv);
#pragma unroll
        for (int l = 0; l < 32; l++) o[32 * u + l] = f2bf(wv[l]);
    }
}

#define QUANT_KERNELS(NAME, TY)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                   \
        gemv_##NAME(bf16* out, const u8* w, const bf16* x, u32 rows, u32 cols, u32 tokens,                          \
                    unsigned long long row_bytes) {                                                                 \
        gemv<TY>(out, w, x, rows, cols, tokens, row_bytes);                                                         \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS)                                                      \
        gemm_##NAME(bf16* out, const u8* w, const bf16* x, u32 rows, u32 cols, u32 tokens,                          \
                    unsigned long long row_bytes) {                                                                 \
        gemm<TY>(out, w, x, rows, cols, tokens, row_bytes);                                                         \
    }                                                                                                               \
    extern "C" __global__ void embedding_##NAME(bf16* out, const u32* ids, const u8* table, u32 cols,               \
                                                unsigned long long row_bytes) {                                     \
        embedding_rows<TY>(out, ids, table, cols, row_bytes);                                                       \
    }

QUANT_KERNELS(q4_0, 2)
QUANT_KERNELS(q4_1, 3)
QUANT_KERNELS(q5_0, 6)
QUANT_KERNELS(q8_0, 8)
QUANT_KERNELS(q4_k, 12)
QUANT_KERNELS(q5_k, 13)
QUANT_KERNELS(q6_k, 14)
