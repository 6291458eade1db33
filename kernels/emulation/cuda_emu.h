// Host emulation of the CUDA device language, enough to compile the
// unchanged kernels in kernels/*.cu with g++ (C++17) and run them on the CPU
// in `cargo test` (tests/cuda_emulation.rs). Included before the kernel
// source (`-include cuda_emu.h`); the kernel text is what NVRTC compiles.
//
// Execution model: a launch runs its blocks one at a time, in blockIdx
// order (x fastest), on blockDim real threads (std::thread), so that
// `__syncthreads()` is a real barrier over the block's threads and
// ThreadSanitizer sees every shared-memory access that no barrier orders.
// `__shared__` variables, static and dynamic, are process globals (see
// __shared__ below): with one block at a time and one launch at a time per
// library, that is exactly per-block memory. Before each block every shared
// variable is filled with 0xA5 bytes, so a kernel that reads shared memory
// it has not written in that block reads garbage here too.
//
// Warp intrinsics exchange through a per-warp buffer between two barriers
// over the warp's threads (lanes 32w .. 32w+31). Float intrinsics with an
// explicit rounding mode are plain IEEE single operations, which g++ keeps
// as written with -ffp-contract=off (no FMA contraction) on SSE; the tests
// compile with that flag.
//
// What it cannot show: timing, occupancy, memory coalescing, register
// spills, the weak memory model between blocks, and warp-synchronous code
// that relies on lockstep execution without __syncwarp (every lane here is
// an independent thread, which is the stricter, Volta-and-later model).
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ---- Qualifiers ----------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Every `__shared__` declaration becomes a block-scope `extern` declaration
// of a namespace-scope array that the kernel's emulation wrapper defines with
// QUIVER_EMU_STATIC_SHARED / QUIVER_EMU_DYNAMIC_SHARED (kernels/emulation/
// *.cpp). The leading function declaration absorbs the `extern` of
// `extern __shared__ T name[];`, so both spellings come out the same. (No
// single expansion can make a block-scope declaration `static` in one
// spelling and complete `extern T name[]` in the other.)
#define __shared__                      \
    void quiver_emu_shared_declaration(); \
    extern

// ---- Index variables -------------------------------------------------------

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
// CUDA's vector type, 16-byte aligned as on the device.
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

namespace quiver_emu {
inline thread_local uint3 thread_idx{};
// Written only between blocks, by the last thread to arrive at the
// between-blocks barrier, under its lock.
inline uint3 block_idx{};
inline dim3 block_dim{};
inline dim3 grid_dim{};
}  // namespace quiver_emu

#define threadIdx (::quiver_emu::thread_idx)
#define blockIdx (static_cast<const uint3&>(::quiver_emu::block_idx))
#define blockDim (static_cast<const dim3&>(::quiver_emu::block_dim))
#define gridDim (static_cast<const dim3&>(::quiver_emu::grid_dim))

// ---- Barriers ---------------------------------------------------------------

namespace quiver_emu {

// A reusable barrier whose participants may leave (a thread that returns
// from the kernel stops counting), with an optional step run by the last
// arrival before anyone is released.
class Barrier {
public:
    void reset(int expected) {
        expected_ = expected;
        arrived_ = 0;
    }
    template <typename F>
    void arrive_and_wait(F&& on_completion) {
        std::unique_lock<std::mutex> lock(mutex_);
        const std::uint64_t generation = generation_;
        if (++arrived_ == expected_) {
            on_completion();
            release();
        } else {
            cv_.wait(lock, [&] { return generation_ != generation; });
        }
    }
    void arrive_and_wait() {
        arrive_and_wait([] {});
    }
    void leave() {
        std::lock_guard<std::mutex> lock(mutex_);
        --expected_;
        if (expected_ > 0 && arrived_ == expected_) {
            release();
        }
    }

private:
    void release() {
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
    }
    std::mutex mutex_;
    std::condition_variable cv_;
    int expected_ = 0;
    int arrived_ = 0;
    std::uint64_t generation_ = 0;
};

constexpr int kWarp = 32;
constexpr unsigned kThreadsMax = 1024;
constexpr std::size_t kDynamicSharedMax = 48 * 1024;

struct BlockState {
    Barrier block;
    Barrier warps[kThreadsMax / kWarp];
    // The values lanes publish for a shuffle, per warp; 8 bytes per lane.
    std::uint64_t exchange[kThreadsMax / kWarp][kWarp];
};
inline BlockState block_state;

// Every __shared__ variable of the library, filled with 0xA5 before each block.
struct SharedRegion {
    void* at;
    std::size_t bytes;
};
inline std::vector<SharedRegion>& shared_regions() {
    static std::vector<SharedRegion> regions;
    return regions;
}
struct RegisterShared {
    RegisterShared(void* at, std::size_t bytes) {
        shared_regions().push_back({at, bytes});
    }
};

inline int warp_threads(int warp) {
    const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
    const int rest = threads - warp * kWarp;
    return rest < kWarp ? rest : kWarp;
}

inline unsigned linear_thread() {
    return threadIdx.x + block_dim.x * (threadIdx.y + block_dim.y * threadIdx.z);
}

template <typename T>
T shuffle(T v, unsigned source_lane_of(unsigned lane, int arg), int arg) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable<T>::value, "shuffled type");
    const unsigned t = linear_thread();
    const unsigned warp = t / kWarp, lane = t % kWarp;
    std::uint64_t slot = 0;
    std::memcpy(&slot, &v, sizeof(T));
    block_state.exchange[warp][lane] = slot;
    block_state.warps[warp].arrive_and_wait();
    unsigned src = source_lane_of(lane, arg);
    if (src >= static_cast<unsigned>(warp_threads(static_cast<int>(warp)))) {
        src = lane;  // outside the warp's live lanes: the caller's own value
    }
    slot = block_state.exchange[warp][src];
    // No lane may publish its next value before every lane has read this one.
    block_state.warps[warp].arrive_and_wait();
    T out;
    std::memcpy(&out, &slot, sizeof(T));
    return out;
}

}  // namespace quiver_emu

inline void __syncthreads() {
    quiver_emu::block_state.block.arrive_and_wait();
}

inline void __syncwarp(unsigned = 0xffffffffu) {
    const unsigned t = quiver_emu::linear_thread();
    quiver_emu::block_state.warps[t / quiver_emu::kWarp].arrive_and_wait();
}

// The mask is not checked: every kernel here passes the full warp.
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
    (void)width;
    return quiver_emu::shuffle<T>(
        v, [](unsigned lane, int m) { return lane ^ static_cast<unsigned>(m); }, lane_mask);
}

template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    (void)width;
    return quiver_emu::shuffle<T>(
        v, [](unsigned, int s) { return static_cast<unsigned>(s) % quiver_emu::kWarp; }, src_lane);
}

template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    (void)width;
    return quiver_emu::shuffle<T>(
        v, [](unsigned lane, int d) { return lane + static_cast<unsigned>(d); }, static_cast<int>(delta));
}

// ---- Arithmetic intrinsics (CUDA Math API semantics) -------------------------

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// IEEE single operations in round-to-nearest-even (the host's default mode;
// compiled with -ffp-contract=off, so never fused).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// IEEE square root is correctly rounded on the host as on the device.
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
// One rounding, as the device's FMA (glibc's fmaf is correctly rounded).
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }

// cvt.rni.s32.f32: ties to even; NaN gives 0; out of range saturates.
inline int __float2int_rn(float v) {
    if (std::isnan(v)) {
        return 0;
    }
    if (v >= 2147483648.0f) {
        return 2147483647;
    }
    if (v < -2147483648.0f) {
        return -2147483647 - 1;
    }
    return static_cast<int>(std::nearbyint(v));
}

// cvt.rn.f32.s32: the host's int-to-float conversion rounds to nearest even.
inline float __int2float_rn(int v) { return static_cast<float>(v); }

// Four signed byte products added to c, in 32-bit two's complement (dp4a.s32.s32).
inline int __dp4a(int a, int b, int c) {
    std::uint32_t sum = static_cast<std::uint32_t>(c);
    for (int i = 0; i < 4; ++i) {
        const int ai = static_cast<std::int8_t>(static_cast<std::uint32_t>(a) >> (8 * i));
        const int bi = static_cast<std::int8_t>(static_cast<std::uint32_t>(b) >> (8 * i));
        sum += static_cast<std::uint32_t>(ai * bi);
    }
    return static_cast<int>(sum);
}

inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, sizeof f);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, sizeof v);
    return v;
}

template <typename T>
inline T __ldg(const T* p) {
    return *p;
}

// ---- Launch ---------------------------------------------------------------

namespace quiver_emu {

// The arguments of a launch as cuLaunchKernel takes them: one pointer per
// parameter, to a value of the parameter's type.
template <typename... P, std::size_t... I>
void call_kernel(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}

struct Entry {
    const char* name;
    void (*run)(void* kernel, void** args);
    void* kernel;
};

template <typename... P>
Entry entry(const char* name, void (*kernel)(P...)) {
    return Entry{name,
                 [](void* k, void** args) {
                     call_kernel(reinterpret_cast<void (*)(P...)>(k), args, std::index_sequence_for<P...>{});
                 },
                 reinterpret_cast<void*>(kernel)};
}

inline void poison_shared() {
    for (const SharedRegion& r : shared_regions()) {
        std::memset(r.at, 0xA5, r.bytes);
    }
}

// Runs `e` over the grid; one launch at a time per library (the shared
// variables and block state are the library's). Returns 0, or 1 with a
// message in `error`.
inline int launch(const Entry& e, const unsigned grid[3], const unsigned block[3], std::size_t shared_bytes,
                  void** args, char* error, std::size_t error_len) {
    static std::mutex one_launch;
    std::lock_guard<std::mutex> guard(one_launch);
    const unsigned long long threads = 1ull * block[0] * block[1] * block[2];
    const unsigned long long blocks = 1ull * grid[0] * grid[1] * grid[2];
    if (threads == 0 || threads > kThreadsMax || blocks == 0 || shared_bytes > kDynamicSharedMax) {
        std::snprintf(error, error_len,
                      "invalid launch of %s: block %ux%ux%u, grid %ux%ux%u, %zu bytes of dynamic shared memory",
                      e.name, block[0], block[1], block[2], grid[0], grid[1], grid[2], shared_bytes);
        return 1;
    }
    block_dim = dim3{block[0], block[1], block[2]};
    grid_dim = dim3{grid[0], grid[1], grid[2]};
    const int n = static_cast<int>(threads);
    // Sets up block `b` (its index, barriers and poisoned shared memory);
    // runs while no thread of the launch is inside the kernel.
    unsigned long long next = 0;
    Barrier between_blocks;
    between_blocks.reset(n);
    bool done = false;
    auto prepare = [&] {
        if (next == blocks) {
            done = true;
            return;
        }
        const unsigned long long b = next++;
        block_idx = uint3{static_cast<unsigned>(b % grid[0]), static_cast<unsigned>(b / grid[0] % grid[1]),
                          static_cast<unsigned>(b / grid[0] / grid[1])};
        block_state.block.reset(n);
        for (int w = 0; w * kWarp < n; ++w) {
            block_state.warps[w].reset(warp_threads(w));
        }
        poison_shared();
    };
    prepare();
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < n; ++t) {
        pool.emplace_back([&, t] {
            const unsigned u = static_cast<unsigned>(t);
            thread_idx = uint3{u % block[0], u / block[0] % block[1], u / block[0] / block[1]};
            for (;;) {
                e.run(e.kernel, args);
                // A thread that has returned no longer holds back a barrier.
                block_state.warps[t / kWarp].leave();
                block_state.block.leave();
                between_blocks.arrive_and_wait(prepare);
                if (done) {
                    return;
                }
            }
        });
    }
    for (std::thread& t : pool) {
        t.join();
    }
    return 0;
}

}  // namespace quiver_emu

// Defines the storage of a kernel's `__shared__ T name[bound];` (static
// shared memory) and of its `extern __shared__ T name[];` (dynamic, sized for
// the 48 KiB a launch may ask for without opting in to more).
#define QUIVER_EMU_STATIC_SHARED(T, name, bound) \
    T name bound;                                \
    static ::quiver_emu::RegisterShared quiver_emu_register_##name(&name, sizeof(name))
#define QUIVER_EMU_DYNAMIC_SHARED(T, name)                                             \
    alignas(16) T name[::quiver_emu::kDynamicSharedMax / sizeof(T)];                  \
    static ::quiver_emu::RegisterShared quiver_emu_register_##name(&name, sizeof(name))

// The library's launch entry point over its kernels' entries:
//   int quiver_emu_launch(const char* entry, const unsigned grid[3],
//                         const unsigned block[3], size_t shared_bytes,
//                         void** args, char* error, size_t error_len)
// 0 on success; 1 with a message for an unknown entry or an invalid launch.
#define QUIVER_EMU_ENTRIES(...)                                                                                  \
    extern "C" int quiver_emu_launch(const char* name, const unsigned grid[3], const unsigned block[3],          \
                                     std::size_t shared_bytes, void** args, char* error, std::size_t error_len) { \
        static const ::quiver_emu::Entry entries[] = {__VA_ARGS__};                                               \
        for (const ::quiver_emu::Entry& e : entries) {                                                            \
            if (std::strcmp(e.name, name) == 0) {                                                                 \
                return ::quiver_emu::launch(e, grid, block, shared_bytes, args, error, error_len);               \
            }                                                                                                     \
        }                                                                                                         \
        std::snprintf(error, error_len, "no kernel entry named %s in this library", name);                        \
        return 1;                                                                                                 \
    }
#define QUIVER_EMU_ENTRY(kernel) ::quiver_emu::entry(#kernel, &kernel)
