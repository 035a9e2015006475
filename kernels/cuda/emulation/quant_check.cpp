// Runs quant.cu's kernels for one packed weight on the host emulation (host.h), for the
// Rust test that judges their results against the CPU backend's
// (kernels/tests/cuda_host_emulation.rs).
//
//   quant_check DIR FORMAT ROWS COLS TOKENS...
//
// FORMAT is a kernel suffix (q4_0 … q6_k), fp8:BLOCK_ROWS:BLOCK_COLS, int4:GROUP, or bf16
// (w.bin bf16 weights through gemv_bf16 alone: out_T.bf16 for each T up to 8). DIR
// holds w.bin (the blocks, the E4M3 bytes or the nibbles), scales.f32 and zeros.u8 where
// the format has them, x.bf16 (the most tokens' activations) and ids.u32. Written back:
// decoded.f32 (every row's units through the format's decoder), out_T.bf16 for each
// token count T (through the entry points the backend launches), wide_T.bf16 (the same
// written 2 rows into an output 5 rows wider, as a part of a stacked weight writes),
// emb.bf16 (the ids' rows through the embedding kernel), and for decode counts with an
// even ROWS glu_T.bf16 (the weight as an MLP's [gate; up] through gemv_glu: silu(gate) · up,
// ROWS / 2 wide; bf16 weights through gemv_bf16_glu). FP8 weights also take the W8A8
// path for each count above the decode kernel's: xq_T.u8 and xs_T.f32 (quantise_e4m3's
// bytes and scales) and tc_T.bf16 (gemm_fp8_tc's product).

#include "host.h"
#include "files.h"
#include "../common.cuh"
#include "mma.h"
#include "../quant.cu"

// glu_T.bf16 through `glu` (out, x, width, cols, tokens) for each decode count T.
template <class Glu>
static void glu_products(Glu glu, const std::vector<bf16>& x, u32 rows, u32 cols, const std::vector<u32>& token_counts) {
    if (rows % 2 != 0) return;
    const u32 width = rows / 2;
    for (u32 tokens : token_counts) {
        if (tokens > GEMV_MAX_T) continue;
        std::vector<bf16> out((size_t)tokens * width, 0x7fc0);
        emu::launch({(width + GEMV_WARPS - 1) / GEMV_WARPS, 1, 1}, GEMV_WARPS * 32,
                    [&] { glu(out.data(), x.data(), width, cols, tokens); });
        write("glu_" + std::to_string(tokens) + ".bf16", out);
    }
}

// The format's decoder, its four entry points with the weight's own arguments bound.
template <class D, class Gemv, class Glu, class Gemm, class Embed>
static void run(const D& decoder, Gemv gemv, Glu glu, Gemm gemm, Embed embed, u32 rows, u32 cols,
                const std::vector<u32>& token_counts) {
    std::vector<float> decoded((size_t)rows * cols);
    for (u32 r = 0; r < rows; r++)
        for (u32 u = 0; u < cols / 32; u++) decode_unit(decoder, r, u, &decoded[(size_t)r * cols + 32 * u]);
    write("decoded.f32", decoded);
    std::vector<bf16> x = read<bf16>("x.bf16");
    for (u32 tokens : token_counts) {
        if (x.size() < (size_t)tokens * cols) {
            std::fprintf(stderr, "x.bf16 holds %zu values, not %u tokens of %u\n", x.size(), tokens, cols);
            std::exit(2);
        }
        std::vector<bf16> out((size_t)tokens * rows, 0x7fc0);  // NaN: an unwritten output fails
        if (tokens <= GEMV_MAX_T) {
            emu::launch({(rows + GEMV_WARPS - 1) / GEMV_WARPS, 1, 1}, GEMV_WARPS * 32,
                        [&] { gemv(out.data(), x.data(), rows, cols, tokens, rows); });
        } else {
            emu::launch({(rows + TILE - 1) / TILE, (tokens + TILE - 1) / TILE, 1}, TILE_THREADS,
                        [&] { gemm(out.data(), x.data(), rows, cols, tokens, rows); });
        }
        write("out_" + std::to_string(tokens) + ".bf16", out);
        // The same into rows 2.. of a wider output (a part of a stacked weight).
        const u32 stride = rows + 5;
        std::vector<bf16> wide((size_t)tokens * stride, 0x7fc0);
        if (tokens <= GEMV_MAX_T) {
            emu::launch({(rows + GEMV_WARPS - 1) / GEMV_WARPS, 1, 1}, GEMV_WARPS * 32,
                        [&] { gemv(wide.data() + 2, x.data(), rows, cols, tokens, stride); });
        } else {
            emu::launch({(rows + TILE - 1) / TILE, (tokens + TILE - 1) / TILE, 1}, TILE_THREADS,
                        [&] { gemm(wide.data() + 2, x.data(), rows, cols, tokens, stride); });
        }
        write("wide_" + std::to_string(tokens) + ".bf16", wide);
    }
    glu_products(glu, x, rows, cols, token_counts);
    std::vector<u32> ids = read<u32>("ids.u32");
    std::vector<bf16> emb(ids.size() * cols, 0x7fc0);
    emu::launch({(unsigned)ids.size(), 1, 1}, 32, [&] { embed(emb.data(), ids.data(), cols); });
    write("emb.bf16", emb);
}

// quantise_e4m3 then gemm_fp8_tc, as the backend runs FP8 weights' products of many tokens.
static void fp8_tensor_cores(const std::vector<u8>& w, const std::vector<float>& scales, u32 block_rows,
                             u32 block_cols, u32 rows, u32 cols, const std::vector<u32>& token_counts) {
    std::vector<bf16> x = read<bf16>("x.bf16");
    for (u32 tokens : token_counts) {
        if (tokens <= GEMV_MAX_T) continue;
        std::vector<u8> xq((size_t)tokens * cols, 0xff);
        std::vector<float> xs(tokens, NAN);
        emu::launch({tokens, 1, 1}, 64, [&] { quantise_e4m3(xq.data(), xs.data(), x.data(), cols); });
        std::vector<bf16> out((size_t)tokens * rows, 0x7fc0);
        emu::launch({(rows + TILE - 1) / TILE, (tokens + TILE - 1) / TILE, 1}, TILE_THREADS, [&] {
            gemm_fp8_tc(out.data(), w.data(), scales.data(), block_rows, block_cols, xq.data(), xs.data(), rows, cols,
                        tokens, rows);
        });
        const std::string t = std::to_string(tokens);
        write("xq_" + t + ".u8", xq);
        write("xs_" + t + ".f32", xs);
        write("tc_" + t + ".bf16", out);
    }
}

#define BLOCK_FORMAT(NAME, TY)                                                                            \
    if (format == #NAME) {                                                                                \
        unsigned long long rb = (unsigned long long)cols / 32 / Format<TY>::units * Format<TY>::bytes;    \
        run(                                                                                              \
            BlockRows<TY>{w.data(), rb},                                                                  \
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t, u32 s) { gemv_##NAME(o, w.data(), rb, xs, r, c, t, s); }, \
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t) { gemv_glu_##NAME(o, w.data(), rb, xs, r, c, t); }, \
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t, u32 s) { gemm_##NAME(o, w.data(), rb, xs, r, c, t, s); }, \
            [&](bf16* o, const u32* i, u32 c) { embedding_##NAME(o, i, w.data(), rb, c); }, rows, cols, tokens); \
        return 0;                                                                                         \
    }

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: quant_check DIR FORMAT ROWS COLS TOKENS...\n");
        return 2;
    }
    files::dir = argv[1];
    std::string format = argv[2];
    u32 rows = (u32)std::atoi(argv[3]), cols = (u32)std::atoi(argv[4]);
    std::vector<u32> tokens;
    for (int i = 5; i < argc; i++) tokens.push_back((u32)std::atoi(argv[i]));
    std::vector<u8> w = read<u8>("w.bin");
    // load_words may read 2 bytes past the last block: padded as upload_packed pads
    // ggml blocks on the device (BLOCK_PADDING).
    w.resize(w.size() + 4, 0);
    if (format == "bf16") {  // gemv_bf16 only: bf16 weights' decode products
        std::vector<bf16> x = read<bf16>("x.bf16");
        for (u32 t : tokens) {
            if (t > GEMV_MAX_T) continue;
            std::vector<bf16> out((size_t)t * rows, 0x7fc0);
            emu::launch({(rows + GEMV_WARPS - 1) / GEMV_WARPS, 1, 1}, GEMV_WARPS * 32,
                        [&] { gemv_bf16(out.data(), (const bf16*)w.data(), x.data(), rows, cols, t, rows); });
            write("out_" + std::to_string(t) + ".bf16", out);
        }
        glu_products([&](bf16* o, const bf16* xs, u32 width, u32 c, u32 t) { gemv_bf16_glu(o, (const bf16*)w.data(), xs, width, c, t); },
                     x, rows, cols, tokens);
        return 0;
    }
    std::vector<float> scales = read<float>("scales.f32");
    std::vector<u8> zeros = read<u8>("zeros.u8");
    BLOCK_FORMAT(q4_0, 2)
    BLOCK_FORMAT(q4_1, 3)
    BLOCK_FORMAT(q5_0, 6)
    BLOCK_FORMAT(q8_0, 8)
    BLOCK_FORMAT(q4_k, 12)
    BLOCK_FORMAT(q5_k, 13)
    BLOCK_FORMAT(q6_k, 14)
    u32 a = 0, b = 0;
    if (std::sscanf(format.c_str(), "fp8:%u:%u", &a, &b) == 2) {
        run(
            Fp8Rows{w.data(), scales.data(), cols, a, b},
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t, u32 s) { gemv_fp8(o, w.data(), scales.data(), a, b, xs, r, c, t, s); },
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t) { gemv_glu_fp8(o, w.data(), scales.data(), a, b, xs, r, c, t); },
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t, u32 s) { gemm_fp8(o, w.data(), scales.data(), a, b, xs, r, c, t, s); },
            [&](bf16* o, const u32* i, u32 c) { embedding_fp8(o, i, w.data(), scales.data(), a, b, c); }, rows, cols,
            tokens);
        fp8_tensor_cores(w, scales, a, b, rows, cols, tokens);
        return 0;
    }
    if (std::sscanf(format.c_str(), "int4:%u", &a) == 1) {
        const u8* q = w.data();
        run(
            Int4Rows{q, scales.data(), zeros.data(), cols, a},
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t, u32 s) { gemv_int4(o, q, scales.data(), zeros.data(), a, xs, r, c, t, s); },
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t) { gemv_glu_int4(o, q, scales.data(), zeros.data(), a, xs, r, c, t); },
            [&](bf16* o, const bf16* xs, u32 r, u32 c, u32 t, u32 s) { gemm_int4(o, q, scales.data(), zeros.data(), a, xs, r, c, t, s); },
            [&](bf16* o, const u32* i, u32 c) { embedding_int4(o, i, q, scales.data(), zeros.data(), a, c); }, rows, cols,
            tokens);
        return 0;
    }
    std::fprintf(stderr, "unknown format %s\n", format.c_str());
    return 2;
}
