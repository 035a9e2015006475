// Products with weights kept as their checkpoint stores them: ggml's block formats
// (GGUF), E4M3 bytes with block scales (FP8 checkpoints), 4-bit integers with group
// scales and zeros (AWQ/GPTQ, repacked row-major by the loader). Each kernel decodes the
// weights it reads into registers or shared memory, so a quantised model takes its
// file's bytes on the device, never a bf16 copy.
//
// Every format is read in units of 32 consecutive weights of a row (a whole block of
// the 32-weight ggml formats, one eighth of a K-quant super-block, 32 bytes of FP8, 16
// bytes of nibbles), each decoded exactly as the host decodes it (quant/dequant.rs,
// quant/scaled.rs), so the GPU's products differ from the CPU's only in bf16
// activations, the order of f32 sums and, in the tiled kernel, the decoded weights'
// rounding to bf16 for the tensor cores. The kernels take a decoder, a small struct
// whose `part(r, u, q, w)` decodes a quarter of unit u of row r (`decode_unit`: all
// four). ggml types are their ids: 2 Q4_0,
// 3 Q4_1, 6 Q5_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K. Rows are whole units (the host
// checks), and every ggml block starts 2-byte aligned (block sizes are even), so the
// f16 fields are read as halves.

typedef unsigned char u8;

// The instructions written in PTX; kernels/cuda/emulation gives the host its own
// (mma_bf16 is in common.cuh).
#ifndef TESSERA_HOST_EMULATION
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif

__device__ __forceinline__ float f16_at(const u8* p) { return h2f(*(const unsigned short*)p); }

// The weights' bytes are read in words, not a byte at a time: a warp's load
// instruction costs the L1 a pass per cache line it touches whatever its width, and byte
// loads made the decode kernels wait on the L1 rather than on memory. Each decoder gives
// a unit as four parts of 8 weights (`part(r, u, q, w)`: weights 8q..8q+7 of unit u of
// row r), so that four lanes share a unit and a warp's loads of the activations that
// go with it are 512 contiguous bytes.

// N bytes at p, 2-byte aligned (every ggml block is), as N / 4 little-endian words:
// aligned 4-byte loads, joined across a half-word where p is not 4-byte aligned. The
// extra word then read holds the bytes' last two and two after them: past the weight's
// last block only into the padding `upload_packed` leaves after ggml blocks.
template <int N> __device__ __forceinline__ void load_words(const u8* p, u32 (&out)[N / 4]) {
    // Offset from p, not an address made from an integer: the compiler then keeps
    // the global loads (LDG) rather than generic ones.
    const u32 misaligned = (u32)(unsigned long long)p & 2u;
    const u32* w = (const u32*)(p - misaligned);
    const u32 shift = misaligned * 8u;
    u32 v[N / 4 + 1];
#pragma unroll
    for (int i = 0; i < N / 4; i++) v[i] = w[i];
    v[N / 4] = shift ? w[N / 4] : 0u;
#pragma unroll
    for (int i = 0; i < N / 4; i++) out[i] = __funnelshift_r(v[i], v[i + 1], shift);
}

// 8 bytes at an 8-byte aligned p as two words.
__device__ __forceinline__ void load8_aligned(const u8* p, u32 (&out)[2]) {
    const uint2 v = *(const uint2*)p;
    out[0] = v.x;
    out[1] = v.y;
}

// Byte k of little-endian words (k a constant once unrolled).
template <int N> __device__ __forceinline__ u32 byte_of(const u32 (&w)[N], int k) {
    return (w[k >> 2] >> (8 * (k & 3))) & 0xffu;
}

// Sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block, from the words of its
// first 16 bytes (d, dmin, 12 bytes of packed scales and mins: words 1..3). j is not a
// constant, so it picks bytes by shifting, never by indexing the words.
__device__ __forceinline__ void scale_min_k4(u32 j, const uint4& head, float* sc, float* m) {
    const u32 s = 8 * (j & 3);
    const u32 a = (head.y >> s) & 0xffu, b = (head.z >> s) & 0xffu, c = (head.w >> s) & 0xffu;
    if (j < 4) {
        *sc = (float)(a & 63);
        *m = (float)(b & 63);
    } else {
        *sc = (float)((c & 0xF) | ((a >> 6) << 4));
        *m = (float)((c >> 4) | ((b >> 6) << 4));
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

// Weights 8q..8q+7 of unit u of a ggml row (row: the row's first byte) as floats.
template <int TY> __device__ __forceinline__ void block_part(const u8* row, u32 u, u32 q, float* w) {
    const u8* b = row + (unsigned long long)(u / Format<TY>::units) * Format<TY>::bytes;
    const u32 j = u % Format<TY>::units;
    if constexpr (TY == 2 || TY == 3 || TY == 6) {
        // Q4_0: d, 16 bytes of nibbles: x = (q − 8)·d. Q4_1: d, m, nibbles: x = q·d + m.
        // Q5_0: d, 32 fifth bits, nibbles: x = (q + 16·bit − 16)·d. Elements 0..16 are
        // the bytes' low nibbles, 16..32 their high ones; element e's fifth bit is bit e.
        const u32 at = TY == 2 ? 2 : 4, nib = TY == 6 ? 6 : at;
        float d = f16_at(b), m = TY == 3 ? f16_at(b + 2) : 0.0f;
        u32 qs[2];
        load_words<8>(b + nib + 8 * (q & 1), qs);
        const u32 shift = (q >> 1) * 4;
        u32 qh = 0;
        if constexpr (TY == 6) {
            u32 h[1];
            load_words<4>(b + 2, h);
            qh = h[0] >> (8 * q);
        }
#pragma unroll
        for (int l = 0; l < 8; l++) {
            const int v = (byte_of(qs, l) >> shift) & 0xF;
            if constexpr (TY == 2) w[l] = (float)(v - 8) * d;
            if constexpr (TY == 3) w[l] = __fadd_rn(__fmul_rn((float)v, d), m);
            if constexpr (TY == 6) w[l] = (float)((v | (int)(((qh >> l) & 1) << 4)) - 16) * d;
        }
    } else if constexpr (TY == 8) {  // Q8_0: d, 32 signed bytes
        float d = f16_at(b);
        u32 qs[2];
        load_words<8>(b + 2 + 8 * q, qs);
#pragma unroll
        for (int l = 0; l < 8; l++) w[l] = (float)(signed char)byte_of(qs, l) * d;
    } else if constexpr (TY == 12 || TY == 13) {
        // Q4_K: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles (each 32
        // bytes hold two sub-blocks: low nibbles, then high). Q5_K adds 32 bytes of
        // fifth bits (bit j of byte l for sub-block j) before the nibbles. Blocks of
        // 144 and 176 bytes keep every row's blocks 16-byte aligned.
        const uint4 head = *(const uint4*)b;
        float sc, mn;
        scale_min_k4(j, head, &sc, &mn);
        float scale = h2f((unsigned short)(head.x & 0xffffu)) * sc, min = h2f((unsigned short)(head.x >> 16)) * mn;
        const int first = TY == 12 ? 16 : 48;
        u32 qs[2], qh[2];
        load8_aligned(b + first + 32 * (j >> 1) + 8 * q, qs);
        if constexpr (TY == 13) load8_aligned(b + 16 + 8 * q, qh);
        const u32 shift = (j & 1) * 4;
#pragma unroll
        for (int l = 0; l < 8; l++) {
            int v = (byte_of(qs, l) >> shift) & 0xF;
            if constexpr (TY == 13) v += ((byte_of(qh, l) >> j) & 1) << 4;
            w[l] = __fsub_rn(__fmul_rn((float)v, scale), min);
        }
    } else if constexpr (TY == 14) {
        // Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed scales (one per
        // 16 weights), d. Sub-block j = 4·half + k takes byte l (+32 when k is odd) of
        // its half's low bits (high nibble when k ≥ 2) and bits 2k of qh[l].
        const u32 half = j >> 2, k = j & 3;
        u32 ql[2], qh[2];
        load_words<8>(b + 64 * half + 32 * (k & 1) + 8 * q, ql);
        load_words<8>(b + 128 + 32 * half + 8 * q, qh);
        const float d = f16_at(b + 208);
        const float s = d * (float)(signed char)b[192 + 2 * j + (q >> 1)];
        const u32 lo_shift = 4 * (k >> 1), hi_shift = 2 * k;
#pragma unroll
        for (int l = 0; l < 8; l++) {
            const int lo = (byte_of(ql, l) >> lo_shift) & 0xF;
            w[l] = s * (float)((lo | (int)(((byte_of(qh, l) >> hi_shift) & 3) << 4)) - 32);
        }
    }
}

// A decoder's whole unit u of row r: its four parts.
template <class D> __device__ __forceinline__ void decode_unit(const D& w, u32 r, u32 u, float* out) {
#pragma unroll
    for (u32 q = 0; q < 4; q++) w.part(r, u, q, out + 8 * q);
}

// ggml blocks, `row_bytes` a row.
template <int TY> struct BlockRows {
    const u8* w;
    unsigned long long row_bytes;
    __device__ __forceinline__ void part(u32 r, u32 u, u32 q, float* out) const {
        block_part<TY>(w + r * row_bytes, u, q, out);
    }
};

// One E4M3 ("fn") byte: its exponent and mantissa bits put where an f32's are, then the
// bias moved from 127 to 7 by an exact product with 2^120 (subnormals included). S.1111.111,
// E4M3's NaN, reads as ±480: checkpoints hold none.
__device__ __forceinline__ float e4m3(u32 b) {
    float mag = __uint_as_float((b & 0x7fu) << 20) * __uint_as_float(247u << 23);
    return (b & 0x80u) ? -mag : mag;
}

// n / d for the n the decoders divide (a row's units: under 2^16) as a multiply and a
// shift, exact for d < 2^16 (the error n/2^32 stays under 1/d): a u32 division is about
// 20 instructions, and a decoder's scale index needs one every 8 weights.
struct Divider {
    unsigned long long m;
    __device__ __forceinline__ u32 of(u32 n) const { return (u32)(((unsigned long long)n * m) >> 32); }
};
__device__ __forceinline__ Divider divider(u32 d) { return Divider{((1ull << 32) + d - 1) / d}; }

// E4M3 bytes, row-major, times a scale per block of block_rows × block_cols (a multiple
// of 32 columns, so a unit has one scale).
struct Fp8Rows {
    const u8* w;
    const float* scales;
    u32 cols, block_rows, block_cols;
    Divider units_per_block = divider(block_cols / 32);
    // Row r's scale for unit u.
    __device__ __forceinline__ float scale(u32 r, u32 u) const {
        const u32 scale_cols = (cols + block_cols - 1) / block_cols;
        return scales[(unsigned long long)(r / block_rows) * scale_cols + units_per_block.of(u)];
    }
    __device__ __forceinline__ void part(u32 r, u32 u, u32 q, float* out) const {
        u32 words[2];
        load8_aligned(w + (unsigned long long)r * cols + 32 * u + 8 * q, words);
        const float s = scale(r, u);
#pragma unroll
        for (int k = 0; k < 8; k++) out[k] = e4m3(byte_of(words, k)) * s;
    }
};

// 4-bit integers, two a byte (low nibble first), with a scale and a zero per row and
// group of `group` columns (a multiple of 32): (q − zero) · scale.
struct Int4Rows {
    const u8* q;
    const float* scales;
    const u8* zeros;
    u32 cols, group;
    Divider units_per_group = divider(group / 32);
    __device__ __forceinline__ void part(u32 r, u32 u, u32 p, float* out) const {
        const u32 v = *(const u32*)(q + (unsigned long long)r * (cols / 2) + 16 * u + 4 * p);
        const unsigned long long g = (unsigned long long)r * ((cols + group - 1) / group) + units_per_group.of(u);
        const float s = scales[g];
        const int z = zeros[g];
#pragma unroll
        for (int k = 0; k < 8; k++) out[k] = (float)((int)((v >> (4 * k)) & 0xFu) - z) * s;
    }
};

// Decode products, 1..GEMV_MAX_T tokens: out[t, r] = Σ_c x[t, c] · w[r, c], rows of out
// `out_stride` apart (a part of a stacked weight writes its rows among the others'). One warp per
// weight row, its lanes over the row's units in turn, so the warp reads the row's bytes
// once, front to back, for every token.
//
// With GLU the weight is an MLP's fused [gate; up] projection and `rows` the width of
// each half: the warp takes row r of both halves and writes silu(gate) · up, so the
// 2 · width products never reach memory and no silu_mul follows (one launch and a round
// trip a layer, which at batch 1 are a real part of a decode step).
#define GEMV_MAX_T 8
#define GEMV_WARPS 4

// silu(g) · u, as elementwise.cu's silu_mul takes it.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// Each token's warp-wide sums into out (silu(gate) · up with GLU), by lane 0.
template <bool GLU>
__device__ __forceinline__ void gemv_store(bf16* out, const float (&acc)[GLU ? 2 : 1][GEMV_MAX_T], u32 r,
                                           u32 tokens, u32 out_stride) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) {
        if ((u32)t < tokens) {
            float s = warp_sum(acc[0][t]);
            if constexpr (GLU) s = silu_times(s, warp_sum(acc[1][t]));
            if (lane == 0) out[(unsigned long long)t * out_stride + r] = f2bf(s);
        }
    }
}

template <bool GLU, class D>
__device__ __forceinline__ void gemv(bf16* out, const D& w, const bf16* x, u32 rows, u32 cols, u32 tokens,
                                     u32 out_stride) {
    const u32 r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31, q = lane & 3;
    if (r >= rows) return;  // the whole warp: the shuffles below need every lane
    constexpr int HALVES = GLU ? 2 : 1;
    float acc[HALVES][GEMV_MAX_T] = {};
    // Four lanes a unit, eight units a step: each activation load of the warp is 512
    // contiguous bytes.
    for (u32 u = lane >> 2; u < cols / 32; u += 8) {
#pragma unroll
        for (int h = 0; h < HALVES; h++) {
            float wv[8], xv[8];
            w.part(r + h * rows, u, q, wv);
#pragma unroll
            for (int t = 0; t < GEMV_MAX_T; t++) {
                if ((u32)t < tokens) {
                    unpack8(*(const uint4*)(x + (unsigned long long)t * cols + 32 * u + 8 * q), xv);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[h][t] = fmaf(wv[e], xv[e], acc[h][t]);
                }
            }
        }
    }
    gemv_store<GLU>(out, acc, r, tokens, out_stride);
}

// bf16 weights, 1..GEMV_MAX_T tokens (the backend's alternative to cuBLAS for decode):
// one warp per row, each lane 8 consecutive weights of every 256, so that each of the
// warp's loads is 512 contiguous bytes; rows 16-byte aligned (cols a multiple of 8).
template <bool GLU>
__device__ __forceinline__ void gemv_bf16_rows(bf16* out, const bf16* w, const bf16* x, u32 rows, u32 cols,
                                               u32 tokens, u32 out_stride) {
    const u32 r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;  // the whole warp
    constexpr int HALVES = GLU ? 2 : 1;
    float acc[HALVES][GEMV_MAX_T] = {};
#pragma unroll
    for (int h = 0; h < HALVES; h++) {
        const bf16* row = w + (unsigned long long)(r + h * rows) * cols;
#pragma unroll 4
        for (u32 c = 8 * lane; c < cols; c += 256) {
            float wv[8], xv[8];
            unpack8(*(const uint4*)(row + c), wv);
#pragma unroll
            for (int t = 0; t < GEMV_MAX_T; t++) {
                if ((u32)t < tokens) {
                    unpack8(*(const uint4*)(x + (unsigned long long)t * cols + c), xv);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[h][t] = fmaf(wv[e], xv[e], acc[h][t]);
                }
            }
        }
    }
    gemv_store<GLU>(out, acc, r, tokens, out_stride);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_bf16(bf16* out, const bf16* w, const bf16* x, u32 rows, u32 cols, u32 tokens, u32 out_stride) {
    gemv_bf16_rows<false>(out, w, x, rows, cols, tokens, out_stride);
}

// out[t, r] = silu(x[t] · w[r]) · (x[t] · w[r + width]), out `width` wide.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_bf16_glu(bf16* out, const bf16* w, const bf16* x, u32 width, u32 cols, u32 tokens) {
    gemv_bf16_rows<true>(out, w, x, width, cols, tokens, width);
}

// Products of more tokens (prefill, large decode batches) on the tensor cores: each
// block computes a 64-row × 64-token tile of out, 32 columns at a time. Its 128
// threads decode half a row's unit each into shared memory as bf16, then stage the
// tokens' 32 activations, then each of the 4 warps multiplies a 32 × 32 quarter: 2 × 4
// m16n8 tiles, two k16 steps. Rows of the staged tiles are 40 bf16 apart, so a warp's
// fragment loads fall in 32 different banks.
#define TILE 64
#define TILE_THREADS 128
#define TILE_STRIDE 40

// A warp's 32 × 32 quarter of a tile (2 × 4 m16n8 accumulators, rows from r0, tokens
// from t0) into out, times each token's scale where there are scales.
__device__ __forceinline__ void store_tile(bf16* out, const float (&acc)[2][4][4], u32 r0, u32 t0, u32 rows,
                                           u32 tokens, u32 out_stride, const float* token_scales) {
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++) {
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const u32 r = r0 + 16 * mi + g + 8 * (e >> 1), tok = t0 + 8 * ni + 2 * t + (e & 1);
                if (r < rows && tok < tokens) {
                    const float v = token_scales ? acc[mi][ni][e] * token_scales[tok] : acc[mi][ni][e];
                    out[(unsigned long long)tok * out_stride + r] = f2bf(v);
                }
            }
        }
    }
}

template <class D>
__device__ __forceinline__ void gemm(bf16* out, const D& w, const bf16* x, u32 rows, u32 cols, u32 tokens,
                                     u32 out_stride) {
    __shared__ __align__(16) bf16 ws[TILE * TILE_STRIDE];
    __shared__ __align__(16) bf16 xs[TILE * TILE_STRIDE];
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 r0 = blockIdx.x * TILE, t0 = blockIdx.y * TILE;
    const u32 wm = (warp >> 1) * 32, wn = (warp & 1) * 32, g = lane >> 2, t = lane & 3;
    float acc[2][4][4] = {};
    for (u32 u = 0; u < cols / 32; u++) {
        {
            // Two threads a row, two parts (16 weights) each.
            const u32 row = tid >> 1, half = tid & 1;
            float wv[16];
            if (r0 + row < rows) {
                w.part(r0 + row, u, 2 * half, wv);
                w.part(r0 + row, u, 2 * half + 1, wv + 8);
            } else {
#pragma unroll
                for (int l = 0; l < 16; l++) wv[l] = 0.0f;
            }
            u32* dst = (u32*)(ws + row * TILE_STRIDE + 16 * half);
#pragma unroll
            for (int l = 0; l < 8; l++) dst[l] = (u32)f2bf(wv[2 * l]) | ((u32)f2bf(wv[2 * l + 1]) << 16);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            // 64 tokens × 4 pieces of 8 activations: piece p of token p / 4.
            const u32 p = tid + 128 * i, tok = p / 4, part = p % 4;
            uint4 v = {0u, 0u, 0u, 0u};
            if (t0 + tok < tokens) v = *(const uint4*)(x + (unsigned long long)(t0 + tok) * cols + 32 * u + 8 * part);
            *(uint4*)(xs + tok * TILE_STRIDE + 8 * part) = v;
        }
        __syncthreads();
#pragma unroll
        for (int k0 = 0; k0 < 32; k0 += 16) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const bf16* top = ws + (wm + 16 * mi + g) * TILE_STRIDE + k0 + 2 * t;
                const bf16* bottom = top + 8 * TILE_STRIDE;
                a[mi][0] = *(const u32*)top;
                a[mi][1] = *(const u32*)bottom;
                a[mi][2] = *(const u32*)(top + 8);
                a[mi][3] = *(const u32*)(bottom + 8);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const bf16* col = xs + (wn + 8 * ni + g) * TILE_STRIDE + k0 + 2 * t;
                b[ni][0] = *(const u32*)col;
                b[ni][1] = *(const u32*)(col + 8);
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], a[mi], b[ni]);
        }
        __syncthreads();
    }
    store_tile(out, acc, r0 + wm, t0 + wn, rows, tokens, out_stride, nullptr);
}

// out[t] = table[ids[t]], decoded; one block per token. ids were checked on the host.
template <class D>
__device__ __forceinline__ void embedding_rows(bf16* out, const u32* ids, const D& table, u32 cols) {
    const u32 r = ids[blockIdx.x];
    bf16* o = out + (unsigned long long)blockIdx.x * cols;
    for (u32 u = threadIdx.x; u < cols / 32; u += blockDim.x) {
        float wv[32];
        decode_unit(table, r, u, wv);
#pragma unroll
        for (int l = 0; l < 32; l++) o[32 * u + l] = f2bf(wv[l]);
    }
}

// Each format's four kernels: decode products (plain, and an MLP's gate and up halves
// to silu(gate) · up), tiled products, embedding lookups. PARAMS are the weight's own
// arguments, DECODER builds the decoder from them.
#define WEIGHT_KERNELS(NAME, PARAMS, DECODER)                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                   \
        gemv_##NAME(bf16* out, PARAMS, const bf16* x, u32 rows, u32 cols, u32 tokens, u32 out_stride) {             \
        gemv<false>(out, DECODER, x, rows, cols, tokens, out_stride);                                               \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                   \
        gemv_glu_##NAME(bf16* out, PARAMS, const bf16* x, u32 width, u32 cols, u32 tokens) {                        \
        gemv<true>(out, DECODER, x, width, cols, tokens, width);                                                    \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS)                                                      \
        gemm_##NAME(bf16* out, PARAMS, const bf16* x, u32 rows, u32 cols, u32 tokens, u32 out_stride) {             \
        gemm(out, DECODER, x, rows, cols, tokens, out_stride);                                                      \
    }                                                                                                               \
    extern "C" __global__ void embedding_##NAME(bf16* out, const u32* ids, PARAMS, u32 cols) {                      \
        embedding_rows(out, ids, DECODER, cols);                                                                    \
    }

#define COMMA ,
#define BLOCK_KERNELS(NAME, TY) \
    WEIGHT_KERNELS(NAME, const u8* w COMMA unsigned long long row_bytes, (BlockRows<TY>{w COMMA row_bytes}))

BLOCK_KERNELS(q4_0, 2)
BLOCK_KERNELS(q4_1, 3)
BLOCK_KERNELS(q5_0, 6)
BLOCK_KERNELS(q8_0, 8)
BLOCK_KERNELS(q4_k, 12)
BLOCK_KERNELS(q5_k, 13)
BLOCK_KERNELS(q6_k, 14)
WEIGHT_KERNELS(fp8, const u8* w COMMA const float* scales COMMA u32 block_rows COMMA u32 block_cols,
               (Fp8Rows{w COMMA scales COMMA cols COMMA block_rows COMMA block_cols}))
WEIGHT_KERNELS(int4, const u8* q COMMA const float* scales COMMA const u8* zeros COMMA u32 group,
               (Int4Rows{q COMMA scales COMMA zeros COMMA cols COMMA group}))

// ---- FP8 weights on FP8 tensor cores (compute capability 8.9 and up): W8A8 products ----
//
// For more tokens than the decode kernel takes, FP8 weights multiply as they are stored,
// on the FP8 tensor cores (twice the bf16 rate): each token's activations are scaled to
// E4M3 by their largest magnitude (quantise_e4m3, as FP8 serving does), and the tile
// kernel feeds both byte tiles to mma m16n8k32. A k32 step is exactly one 32-column
// unit, which has one weight scale per row, so each step's product is taken apart and
// added to an f32 sum times its rows' scales: no long sum stays in the tensor cores'
// narrower FP8 accumulator. Decode (up to 8 tokens) keeps bf16 activations (gemv_fp8).

#define E4M3_MAX 448.0f

// f32 to E4M3 ("fn"), to nearest (ties to even), saturating at ±448; finite inputs.
__device__ __forceinline__ u32 to_e4m3(float f) {
    const u32 bits = __float_as_uint(f), sign = (bits >> 24) & 0x80u;
    const float a = fabsf(f);
    if (a >= E4M3_MAX) return sign | 0x7eu;
    if (a < 0.015625f) return sign | (u32)rintf(a * 512.0f);  // subnormals, m·2⁻⁹ (8: the least normal)
    // The exponent rebiased from 127 to 7 above three mantissa bits; a carry out of
    // the mantissa's rounding moves up the exponent.
    const u32 keep = (bits >> 20) & 7u, rest = bits & 0xfffffu;
    u32 v = ((((bits >> 23) & 0xffu) - 120u) << 3) | keep;
    v += rest > 0x80000u || (rest == 0x80000u && (keep & 1u));
    return sign | min(v, 0x7eu);
}

// Each token's activations as E4M3 bytes times a scale per token: x ≈ e4m3(q) · scales[t],
// the largest magnitude at ±448. One block per token. Activations are finite (an
// infinite one would make its token's products NaN, as in bf16 they would be too).
extern "C" __global__ void quantise_e4m3(u8* q, float* scales, const bf16* x, u32 cols) {
    const bf16* row = x + (unsigned long long)blockIdx.x * cols;
    float m = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(bf2f(row[c])));
    m = block_max(m);
    const float inv = m > 0.0f ? E4M3_MAX / m : 0.0f;
    u8* out = q + (unsigned long long)blockIdx.x * cols;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) out[c] = (u8)to_e4m3(bf2f(row[c]) * inv);
    if (threadIdx.x == 0) scales[blockIdx.x] = m / E4M3_MAX;
}

// D = A·B + D, m16n8k32, E4M3 inputs, f32 accumulators. Fragments (g = lane / 4, t = lane
// % 4, four bytes a register, the lowest k in the low byte; the PTX ISA's 8-bit layout):
// a = A[g][4t..], A[g+8][4t..], A[g][4t+16..], A[g+8][4t+16..]; b = B[4t..][g],
// B[4t+16..][g]; d as mma_bf16's.
#ifndef TESSERA_HOST_EMULATION
__device__ __forceinline__ void mma_e4m3(float* d, const u32* a, const u32* b) {
#if __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // the backend launches these only on compute capability 8.9 and up
#endif
}
#endif

// Rows of the staged byte tiles are 48 bytes apart: a fragment load's 8 rows × 4 lanes
// fall in 32 different banks, and 16-byte stores stay aligned.
#define FP8_TILE_STRIDE 48

// out[t, r] = x_scales[t] · Σ_u scale(r, u) · Σ_{c in u} e4m3(w[r, c]) · e4m3(xq[t, c]): a
// 64-row × 64-token tile per block of 128 threads, as gemm's: each thread stages 16
// bytes of the weight tile and 16 of the tokens' for each unit.
extern "C" __global__ void __launch_bounds__(TILE_THREADS)
    gemm_fp8_tc(bf16* out, const u8* w, const float* scales, u32 block_rows, u32 block_cols, const u8* xq,
                const float* x_scales, u32 rows, u32 cols, u32 tokens, u32 out_stride) {
    __shared__ __align__(16) u8 ws[TILE * FP8_TILE_STRIDE];
    __shared__ __align__(16) u8 xs[TILE * FP8_TILE_STRIDE];
    __shared__ float row_scale[TILE];
    const Fp8Rows weight{w, scales, cols, block_rows, block_cols};
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 r0 = blockIdx.x * TILE, t0 = blockIdx.y * TILE;
    const u32 wm = (warp >> 1) * 32, wn = (warp & 1) * 32, g = lane >> 2, t = lane & 3;
    const u32 staged = tid >> 1, half = 16 * (tid & 1);  // this thread's row (or token) and half
    float acc[2][4][4] = {};
    for (u32 u = 0; u < cols / 32; u++) {
        uint4 v = {0u, 0u, 0u, 0u}, xv = {0u, 0u, 0u, 0u};
        if (r0 + staged < rows) v = *(const uint4*)(w + (unsigned long long)(r0 + staged) * cols + 32 * u + half);
        if (t0 + staged < tokens) xv = *(const uint4*)(xq + (unsigned long long)(t0 + staged) * cols + 32 * u + half);
        *(uint4*)(ws + staged * FP8_TILE_STRIDE + half) = v;
        *(uint4*)(xs + staged * FP8_TILE_STRIDE + half) = xv;
        if (tid < TILE) row_scale[tid] = r0 + tid < rows ? weight.scale(r0 + tid, u) : 0.0f;
        __syncthreads();
        u32 a[2][4], b[4][2];
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            const u8* top = ws + (wm + 16 * mi + g) * FP8_TILE_STRIDE + 4 * t;
            const u8* bottom = top + 8 * FP8_TILE_STRIDE;
            a[mi][0] = *(const u32*)top;
            a[mi][1] = *(const u32*)bottom;
            a[mi][2] = *(const u32*)(top + 16);
            a[mi][3] = *(const u32*)(bottom + 16);
        }
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            const u8* col = xs + (wn + 8 * ni + g) * FP8_TILE_STRIDE + 4 * t;
            b[ni][0] = *(const u32*)col;
            b[ni][1] = *(const u32*)(col + 16);
        }
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            const float s_top = row_scale[wm + 16 * mi + g], s_bottom = row_scale[wm + 16 * mi + g + 8];
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                float step[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_e4m3(step, a[mi], b[ni]);
                acc[mi][ni][0] += step[0] * s_top;
                acc[mi][ni][1] += step[1] * s_top;
                acc[mi][ni][2] += step[2] * s_bottom;
                acc[mi][ni][3] += step[3] * s_bottom;
            }
        }
        __syncthreads();
    }
    store_tile(out, acc, r0 + wm, t0 + wn, rows, tokens, out_stride, x_scales);
}
