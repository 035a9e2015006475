// CUDA's execution model on the host, just enough to run kernels/cuda/quant.cu's and
// sampling.cu's kernels under g++ where there is no GPU (CI): each thread of a block is a
// fiber, blocks run one after another, __syncthreads is a barrier over the block, and the warp-wide
// operations (shuffles, the tensor cores' mma) exchange values through per-warp slots
// between barriers over the warp. It is a test double for the GPU: a kernel that runs
// right here has its indexing, fragment layouts and decoding right; its speed, memory
// ordering and launch limits are the device's to show (the GPU tests).

#include <functional>
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#define TESSERA_HOST_EMULATION 1
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)

// Aligned as the device's vector types, so that the drivers' alignment sanitizer
// (-fsanitize=alignment) fails a load the device would fault on.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct dim3 {
    unsigned x, y, z;
};

namespace emu {
// Each CUDA thread of a launch is a fiber (ucontext) on the calling thread. A barrier
// parks its fiber until every member has arrived, and the launch switches round-robin
// among the fibers: kernels meet at a barrier every few instructions (each warp-wide
// step is two), and a fiber switch costs far less than an OS thread's wake-up.
inline dim3 thread, block, block_dim, grid_dim;

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    dim3 block{0, 0, 0};
    bool done = false;
};
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline unsigned current;
inline std::function<void()> body;  // what each fiber of the launch runs
constexpr size_t FIBER_STACK = 256 * 1024;

inline void yield() { swapcontext(&fibers[current].context, &scheduler); }

// Arrivals at barriers and finished fibers: a sweep over the fibers that adds none
// is a deadlock (a barrier some threads never reach), reported rather than spun on.
inline unsigned long long progress = 0;

struct Barrier {
    unsigned n, arrived = 0, generation = 0;
    void arrive_and_wait() {
        const unsigned gen = generation;
        progress++;
        if (++arrived == n) {
            arrived = 0;
            generation++;
            return;
        }
        while (generation == gen) yield();
    }
};

inline Barrier block_barrier{0};
// The end of a block: its own barrier, so that threads returning early cannot stand in
// for the others at a __syncthreads they skipped.
inline Barrier block_end{0};
inline std::vector<Barrier> warp_barriers;
// Each warp's lanes' values in flight: 32 lanes × 6 words (an mma's a and b).
inline std::vector<unsigned> slots;

inline void warp_sync() { warp_barriers[thread.x / 32].arrive_and_wait(); }
inline unsigned* slot(unsigned lane) { return &slots[((thread.x / 32) * 32 + lane) * 6]; }

inline void fiber_entry() {
    body();
    progress++;
    fibers[current].done = true;  // returning resumes the scheduler (uc_link)
}

// Runs `kernel` over `grid` blocks of `threads` (a multiple of 32): every fiber runs
// every block in turn, with a barrier between blocks (their __shared__ variables are
// the same statics).
template <class F>
void launch(dim3 grid, unsigned threads, F kernel) {
    grid_dim = grid;
    block_dim = {threads, 1, 1};
    slots.assign(threads * 6, 0);
    block_barrier = Barrier{threads};
    block_end = Barrier{threads};
    warp_barriers.assign(threads / 32, Barrier{32});
    body = [&] {
        for (unsigned by = 0; by < grid.y; by++) {
            for (unsigned bx = 0; bx < grid.x; bx++) {
                block = fibers[current].block = {bx, by, 0};
                kernel();
                block_end.arrive_and_wait();
            }
        }
    };
    fibers = std::vector<Fiber>(threads);
    for (Fiber& f : fibers) {
        getcontext(&f.context);
        f.stack.reset(new char[FIBER_STACK]);
        f.context.uc_stack.ss_sp = f.stack.get();
        f.context.uc_stack.ss_size = FIBER_STACK;
        f.context.uc_link = &scheduler;
        makecontext(&f.context, fiber_entry, 0);
    }
    for (unsigned left = threads; left > 0;) {
        const unsigned long long before = progress;
        for (unsigned t = 0; t < threads; t++) {
            if (fibers[t].done) continue;
            current = t;
            thread = {t, 0, 0};
            block = fibers[t].block;
            swapcontext(&scheduler, &fibers[t].context);
            if (fibers[t].done) left--;
        }
        if (left > 0 && progress == before) {
            std::fprintf(stderr, "emulation: every thread waits at a barrier the others never reach "
                                 "(a divergent __syncthreads or warp-wide call)\n");
            std::exit(3);
        }
    }
    fibers.clear();
}
}  // namespace emu

#define threadIdx (emu::thread)
#define blockIdx (emu::block)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_barrier.arrive_and_wait(); }

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
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}

namespace emu {
// Every lane of the warp posts a word; each gets back what `read` makes of the 32.
template <class F>
inline unsigned across_warp(unsigned v, F read) {
    unsigned lane = threadIdx.x % 32;
    slot(lane)[0] = v;
    warp_sync();
    unsigned words[32];
    for (unsigned l = 0; l < 32; l++) words[l] = slot(l)[0];
    unsigned r = read(words, lane);
    warp_sync();
    return r;
}
template <class T>
inline unsigned bits_of(T v) {
    static_assert(sizeof(T) == 4);
    unsigned u;
    std::memcpy(&u, &v, 4);
    return u;
}
template <class T>
inline T of_bits(unsigned u) {
    T v;
    std::memcpy(&v, &u, 4);
    return v;
}
}  // namespace emu

template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
    return emu::of_bits<T>(emu::across_warp(emu::bits_of(v), [&](unsigned* w, unsigned) { return w[src % 32]; }));
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    return emu::of_bits<T>(
        emu::across_warp(emu::bits_of(v), [&](unsigned* w, unsigned lane) { return w[(lane ^ lane_mask) % 32]; }));
}
inline unsigned __ballot_sync(unsigned, bool pred) {
    return emu::across_warp(pred, [](unsigned* w, unsigned) {
        unsigned m = 0;
        for (unsigned l = 0; l < 32; l++) m |= (w[l] ? 1u : 0u) << l;
        return m;
    });
}
inline bool __any_sync(unsigned mask, bool pred) { return __ballot_sync(mask, pred) != 0; }
inline unsigned __match_any_sync(unsigned, unsigned v) {
    return emu::across_warp(v, [](unsigned* w, unsigned lane) {
        unsigned m = 0;
        for (unsigned l = 0; l < 32; l++) m |= (w[l] == w[lane] ? 1u : 0u) << l;
        return m;
    });
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline int __clz(unsigned v) { return v == 0 ? 32 : __builtin_clz(v); }

// Atomics as the host's (one fiber runs at a time, but they cost nothing here).
template <class T>
inline T atomicAdd(T* p, T v) {
    if constexpr (std::is_floating_point_v<T>) {
        T old, sum;
        __atomic_load(p, &old, __ATOMIC_RELAXED);
        do {
            sum = old + v;
        } while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
        return old;
    } else {
        return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
    }
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline unsigned long long __float2ull_rz(float f) { return f > 0.0f ? (unsigned long long)f : 0ull; }
template <class T>
inline T min(T a, T b) {
    return b < a ? b : a;
}
template <class T>
inline T max(T a, T b) {
    return a < b ? b : a;
}

// IEEE half to float (the device's cvt.f32.f16).
inline float h2f(unsigned short h) {
    unsigned sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float f = exponent == 0    ? std::ldexp((float)mantissa, -24)
              : exponent == 31 ? (mantissa ? NAN : INFINITY)
                               : std::ldexp((float)(mantissa | 1024), (int)exponent - 25);
    return sign ? -f : f;
}
