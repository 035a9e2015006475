// Runs prefill.cu's tiled attention on the host emulation (host.h, mma.h), for the Rust
// test that judges it against attention computed plainly
// (kernels/tests/cuda_host_emulation.rs).
//
//   prefill_check DIR HEAD_DIM HEADS KV_HEADS BLOCK_SIZE MAX_BLOCKS SCALE
//
// DIR holds q.bf16 ([rows, HEADS, HEAD_DIM]), k_cache.bf16 and v_cache.bf16 ([slots,
// KV_HEADS, HEAD_DIM]), query_start.u32 (sequences + 1), context_lens.u32,
// block_tables.u32 (MAX_BLOCKS a sequence) and tiles.u32 (sequence, first row: as the
// backend lists them). Written back: out.bf16.

#include "host.h"
#include "files.h"
#include "../common.cuh"
#include "mma.h"
#include "../prefill.cu"

int main(int argc, char** argv) {
    if (argc != 8) {
        std::fprintf(stderr, "usage: prefill_check DIR HEAD_DIM HEADS KV_HEADS BLOCK_SIZE MAX_BLOCKS SCALE\n");
        return 2;
    }
    files::dir = argv[1];
    const u32 head_dim = (u32)std::atoi(argv[2]), heads = (u32)std::atoi(argv[3]), kv_heads = (u32)std::atoi(argv[4]);
    const u32 block_size = (u32)std::atoi(argv[5]), max_blocks = (u32)std::atoi(argv[6]);
    const float scale = (float)std::atof(argv[7]);
    std::vector<bf16> q = read<bf16>("q.bf16"), k = read<bf16>("k_cache.bf16"), v = read<bf16>("v_cache.bf16");
    std::vector<u32> starts = read<u32>("query_start.u32"), contexts = read<u32>("context_lens.u32");
    std::vector<u32> tables = read<u32>("block_tables.u32"), tiles = read<u32>("tiles.u32");
    std::vector<bf16> out(q.size(), 0x7fc0);  // NaN: an unwritten output fails
    const dim3 grid{(u32)tiles.size() / 2, heads, 1};
    if (head_dim == 64) {
        emu::launch(grid, 128, [&] {
            prefill_attention_hd64(out.data(), q.data(), k.data(), v.data(), tiles.data(), starts.data(),
                                   contexts.data(), tables.data(), max_blocks, heads, kv_heads, block_size, scale);
        });
    } else if (head_dim == 128) {
        emu::launch(grid, 128, [&] {
            prefill_attention_hd128(out.data(), q.data(), k.data(), v.data(), tiles.data(), starts.data(),
                                    contexts.data(), tables.data(), max_blocks, heads, kv_heads, block_size, scale);
        });
    } else {
        std::fprintf(stderr, "no kernel for head_dim %u\n", head_dim);
        return 2;
    }
    write("out.bf16", out);
    return 0;
}
