// Runs sampling.cu's pick kernels on the host emulation (host.h), for the Rust test that
// judges the tokens against a plain sort-and-walk of the same rows
// (kernels/tests/cuda_host_emulation.rs).
//
//   pick_check DIR TYPE ROWS VOCAB THREADS SPLITS...
//
// TYPE is f32 or bf16: DIR holds logits.TYPE ([ROWS, VOCAB]) and params.u32 (5 words a
// row, as cuda/sampling.rs uploads them). For each SPLITS, the launches the backend makes
// (every cut launched, whether or not a row needs it: the kernels skip the rows that do
// not) over blocks of THREADS; written back: tokens_SPLITS.u32, and for f32 logits each
// row's max, log-sum-exp and top 20 (max_SPLITS.f32, lse_SPLITS.f32, top_SPLITS.u32).

#include "host.h"
#include "files.h"
#include "../common.cuh"
#include "../sampling.cu"

struct Kernels {
    void (*best)(const void*, u32, u64*, u32);
    void (*radix)(const void*, u32, const u32*, u64*, u32, u32, u32);
    void (*count)(const void*, u32, const u32*, u64*, u32, u32);
    void (*find)(const void*, u32, const u32*, u64*, u32, u32);
    u32 passes;
};

#define KERNELS(NAME, T)                                                                                            \
    Kernels {                                                                                                       \
        [](const void* l, u32 v, u64* s, u32 n) { pick_best_##NAME((const T*)l, v, s, n); },                        \
            [](const void* l, u32 v, const u32* p, u64* s, u32 n, u32 c, u32 q) {                                   \
                pick_radix_##NAME((const T*)l, v, p, s, n, c, q);                                                   \
            },                                                                                                      \
            [](const void* l, u32 v, const u32* p, u64* s, u32 n, u32 c) { pick_count_##NAME((const T*)l, v, p, s, n, c); }, \
            [](const void* l, u32 v, const u32* p, u64* s, u32 n, u32 c) { pick_find_##NAME((const T*)l, v, p, s, n, c); }, \
            KeyBits<T>::passes                                                                                      \
    }

int main(int argc, char** argv) {
    if (argc < 7) {
        std::fprintf(stderr, "usage: pick_check DIR TYPE ROWS VOCAB THREADS SPLITS...\n");
        return 2;
    }
    files::dir = argv[1];
    const std::string type = argv[2];
    const u32 rows = (u32)std::atoi(argv[3]), vocab = (u32)std::atoi(argv[4]), threads = (u32)std::atoi(argv[5]);
    std::vector<float> f32 = read<float>("logits.f32");
    std::vector<bf16> b16 = read<bf16>("logits.bf16");
    const bool is_bf16 = type == "bf16";
    const void* logits = is_bf16 ? (const void*)b16.data() : (const void*)f32.data();
    const size_t have = is_bf16 ? b16.size() : f32.size();
    std::vector<u32> params = read<u32>("params.u32");
    if (have != (size_t)rows * vocab || params.size() != 5ull * rows) {
        std::fprintf(stderr, "logits.%s holds %zu values and params.u32 %zu words for %u rows of %u\n", type.c_str(),
                     have, params.size(), rows, vocab);
        return 2;
    }
    const Kernels k = is_bf16 ? KERNELS(bf16, bf16) : KERNELS(f32, float);
    for (int a = 6; a < argc; a++) {
        const u32 splits = (u32)std::atoi(argv[a]);
        std::vector<u64> state((size_t)rows * PICK_STATE_WORDS, 0);
        const dim3 grid{rows, splits, 1};
        emu::launch(grid, threads, [&] { k.best(logits, vocab, state.data(), splits); });
        for (u32 cut = 0; cut < PICK_CUTS; cut++) {
            for (u32 pass = 0; pass < k.passes; pass++)
                emu::launch(grid, threads, [&] { k.radix(logits, vocab, params.data(), state.data(), splits, cut, pass); });
            emu::launch(grid, threads, [&] { k.count(logits, vocab, params.data(), state.data(), splits, cut); });
            emu::launch(grid, threads, [&] { k.find(logits, vocab, params.data(), state.data(), splits, cut); });
        }
        std::vector<u32> tokens(rows, 0xffffffffu);
        emu::launch({1, 1, 1}, 32, [&] { pick_tokens(state.data(), rows, vocab, tokens.data()); });
        write("tokens_" + std::to_string(splits) + ".u32", tokens);
        if (is_bf16) continue;
        // Log-probabilities' parts (f32 logits, as the backend keeps them for those).
        std::vector<float> part_max((size_t)rows * splits), part_sum(part_max.size());
        emu::launch(grid, threads, [&] { lse_parts(f32.data(), vocab, splits, part_max.data(), part_sum.data()); });
        std::vector<float> maxes(rows, NAN), lses(rows, NAN);
        emu::launch({1, 1, 1}, 32,
                    [&] { lse_merge(part_max.data(), part_sum.data(), rows, splits, maxes.data(), lses.data()); });
        const u32 k = TOPK_MAX;
        std::vector<u32> cand((size_t)rows * splits * k), top((size_t)rows * k, 0xeeeeeeeeu);
        emu::launch(grid, threads, [&] { topk_parts(f32.data(), vocab, k, splits, cand.data()); });
        emu::launch({rows, 1, 1}, threads, [&] { topk_merge(f32.data(), vocab, k, splits, cand.data(), top.data()); });
        write("max_" + std::to_string(splits) + ".f32", maxes);
        write("lse_" + std::to_string(splits) + ".f32", lses);
        write("top_" + std::to_string(splits) + ".u32", top);
    }
    return 0;
}
