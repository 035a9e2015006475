// Runs elementwise.cu's qkv_to_cache on the host emulation (host.h), for the Rust test
// that judges it against RoPE computed plainly (kernels/tests/cuda_host_emulation.rs).
//
//   qkv_check DIR TOKENS HEADS KV_HEADS HEAD_DIM HALF NEOX CAPACITY
//
// DIR holds qkv.bf16 ([TOKENS, (HEADS + 2 KV_HEADS) · HEAD_DIM]), positions.u32 and
// slots.u32 (one a token) and inv_freq.f32 (HALF). Written back: q.bf16 and the two
// caches, k_cache.bf16 and v_cache.bf16 ([CAPACITY, KV_HEADS, HEAD_DIM], NaN where no
// token was written).

#include "host.h"
#include "files.h"
#include "../common.cuh"
#include "../elementwise.cu"

int main(int argc, char** argv) {
    if (argc != 9) {
        std::fprintf(stderr, "usage: qkv_check DIR TOKENS HEADS KV_HEADS HEAD_DIM HALF NEOX CAPACITY\n");
        return 2;
    }
    files::dir = argv[1];
    u32 a[7];
    for (int i = 0; i < 7; i++) a[i] = (u32)std::atoi(argv[2 + i]);
    const u32 tokens = a[0], heads = a[1], kv_heads = a[2], head_dim = a[3], half = a[4], neox = a[5], capacity = a[6];
    std::vector<bf16> qkv = read<bf16>("qkv.bf16");
    std::vector<u32> positions = read<u32>("positions.u32"), slots = read<u32>("slots.u32");
    std::vector<float> inv_freq = read<float>("inv_freq.f32");
    if (qkv.size() != (size_t)tokens * (heads + 2 * kv_heads) * head_dim || positions.size() != tokens ||
        slots.size() != tokens || inv_freq.size() != half) {
        std::fprintf(stderr, "inputs do not match the sizes\n");
        return 2;
    }
    std::vector<bf16> q((size_t)tokens * heads * head_dim, 0x7fc0);
    std::vector<bf16> k_cache((size_t)capacity * kv_heads * head_dim, 0x7fc0), v_cache = k_cache;
    // A few blocks of a grid-stride loop, as the backend's flat launch.
    emu::launch({3, 1, 1}, 64, [&] {
        qkv_to_cache(q.data(), k_cache.data(), v_cache.data(), qkv.data(), positions.data(), slots.data(),
                     inv_freq.data(), tokens, heads, kv_heads, head_dim, half, neox);
    });
    write("q.bf16", q);
    write("k_cache.bf16", k_cache);
    write("v_cache.bf16", v_cache);
    return 0;
}
