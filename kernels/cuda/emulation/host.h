// CUDA's execution model on the host, just enough to run kernels/cuda/quant.cu's kernels
// under g++ where there is no GPU (CI): each thread of a block is an OS thread, blocks
// run one after another, __syncthreads is a barrier over the block, and the warp-wide
// operations (shuffles, the tensor cores' mma) exchange values through per-warp slots
// between barriers over the warp. It is a test double for the GPU: a kernel that runs
// right here has its indexing, fragment layouts and decoding right; its speed, memory
// ordering and launch limits are the device's to show (the GPU tests).

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#define TESSERA_HOST_EMULATION 1
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)

struct uint4 {
    unsigned x, y, z, w;
};
struct dim3 {
    unsigned x, y, z;
};

namespace emu {
inline thread_local dim3 thread, block;
inline dim3 block_dim, grid_dim;
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
// Each warp's lanes' values in flight: 32 lanes × 6 words (an mma's a and b).
inline std::vector<unsigned> slots;

inline void warp_sync() { warp_barriers[thread.x / 32]->arrive_and_wait(); }
inline unsigned* slot(unsigned lane) { return &slots[((thread.x / 32) * 32 + lane) * 6]; }

// Runs `kernel` over `grid` blocks of `threads` (a multiple of 32).
template <class F>
void launch(dim3 grid, unsigned threads, F kernel) {
    grid_dim = grid;
    block_dim = {threads, 1, 1};
    slots.assign(threads * 6, 0);
    for (unsigned by = 0; by < grid.y; by++) {
        for (unsigned bx = 0; bx < grid.x; bx++) {
            block_barrier = std::make_unique<std::barrier<>>(threads);
            warp_barriers.clear();
            for (unsigned w = 0; w < threads / 32; w++) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
            std::vector<std::thread> pool;
            for (unsigned t = 0; t < threads; t++) {
                pool.emplace_back([&, t] {
                    thread = {t, 0, 0};
                    block = {bx, by, 0};
                    kernel();
                });
            }
            for (auto& p : pool) p.join();
        }
    }
}
}  // namespace emu

#define threadIdx (emu::thread)
#define blockIdx (emu::block)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
// Separate roundings, as the device's _rn intrinsics (g++ does not contract across them
// with -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned lane = threadIdx.x % 32;
    emu::slot(lane)[0] = __float_as_uint(v);
    emu::warp_sync();
    float r = __uint_as_float(emu::slot(lane ^ lane_mask)[0]);
    emu::warp_sync();
    return r;
}

// IEEE half to float (the device's cvt.f32.f16).
inline float h2f(unsigned short h) {
    unsigned sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float f = exponent == 0    ? std::ldexp((float)mantissa, -24)
              : exponent == 31 ? (mantissa ? NAN : INFINITY)
                               : std::ldexp((float)(mantissa | 1024), (int)exponent - 25);
    return sign ? -f : f;
}
