// CUDA's execution model emulated with host threads, as far as the optimizer kernels
// (csrc/src/detail_cuda_adam_kernels.cuh) use it, so that their device code compiles as plain
// C++20 and runs on the CPU in the C++ tests, where it can be compared with the CPU kernels and
// checked by the sanitizers, without a GPU or the CUDA toolkit. Include it before the kernels.
//
// What it emulates:
// - a launch (emulate_launch): one-dimensional grids and blocks. The blocks run one after another,
//   each on blockDim.x threads with their own threadIdx and blockIdx (thread_local); every thread
//   is done with a block before the next block starts (they meet at a barrier, which orders them as
//   a join would). The threads are std::threads started once and kept for the process (Pool): under
//   ThreadSanitizer a thread's start costs about a millisecond, and the tests launch hundreds of
//   blocks of 256. gridDim and blockDim are the launch's.
// - __shared__ is `static`: a kernel's shared arrays are one per template instance, and as one
//   block runs at a time they are that block's.
// - __syncthreads() is a std::barrier of the block's threads. __shfl_xor_sync() is an exchange
//   within the warp of 32 (threadIdx.x / 32): every lane writes its value into a slot of its own,
//   waits at the warp's std::barrier and reads its partner's slot, so it gets exactly the value its
//   partner passed in that call. A lane's shuffles alternate between two slots: a slot is written
//   again two shuffles later, after the barrier of the shuffle in between, which every lane reaches
//   only once it has read, so one barrier a shuffle keeps the exchange exact. The barriers give the
//   happens-before edges a real barrier gives, so ThreadSanitizer reports shared or global memory
//   used across a missing barrier.
// - the rounded intrinsics (__fadd_rn, ...) are the host's IEEE fp32 operations, rounded to nearest
//   even; with -ffp-contract=off (as the CPU kernels are compiled) none is fused into an FMA, so
//   they compute what the device's intrinsics compute. A NaN result is the device's canonical NaN,
//   0x7fffffff, not the host's (x86 propagates an input NaN's payload and sign and makes an invalid
//   operation's NaN 0xffc00000, negative), so a kernel whose bits follow a NaN's sign differs from
//   the CPU kernel here as it does on a GPU. __float2half_rn rounds to nearest even in software
//   (no dependence on the compiler's _Float16) and writes the device's NaN, 0x7fff.
//
// Where it is not faithful:
// - the blocks of a launch never run concurrently or out of order: blocks that write what other
//   blocks read are not tested for it (the optimizer kernels' blocks touch disjoint elements);
// - memory ordering is the barriers' and nothing else: accesses not ordered by a barrier are a
//   data race in C++ too (ThreadSanitizer's to find), but the emulation does not reproduce what a
//   GPU would read in such a race (a stale value, another warp's write);
// - a warp's lanes are independent threads, not a lockstep group: code relying on implicit warp
//   synchronicity is not emulated (it is a race here), and a shuffle or a __syncthreads that not
//   every thread reaches (divergence, undefined on a GPU) leaves the others waiting: the launch
//   reports it after kHangSeconds and aborts. A shuffle must name the whole warp (mask
//   0xffffffff, width 32) of a block whose warps are whole;
// - shared memory keeps the previous block's values where a GPU gives a new block undefined ones.
#pragma once

#include <barrier>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 blockDim;  // written by emulate_launch before it hands the threads their work, read-only after
inline dim3 gridDim;

namespace cuda_emulation {

constexpr unsigned kWarpSize = 32;
constexpr int kHangSeconds = 120;  // a block not done by then waits at a barrier that not every thread reaches

// A launch's synchronisation within a block: the block's barrier, a barrier a warp, and two slots a
// thread for the values it passes in shuffles.
struct Block {
  explicit Block(unsigned threads) : all(threads), lanes(2 * threads) {
    for (unsigned w = 0; w * kWarpSize < threads; ++w) {
      const unsigned lanes_in_warp = threads - w * kWarpSize < kWarpSize ? threads - w * kWarpSize : kWarpSize;
      warps.push_back(std::make_unique<std::barrier<>>(lanes_in_warp));
    }
  }
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<std::uint64_t> lanes;  // two slots a thread: a shuffle's, and the next one's
};

inline thread_local Block* current_block = nullptr;
inline thread_local unsigned shuffles = 0;  // this thread's shuffles in the launch: which slot the next uses

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

// float -> IEEE half bits, rounded to nearest even; overflow to infinity, NaN to 0x7fff.
inline std::uint16_t half_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // from 65520, halfway past 65504
  if (a >= 0x38800000u) {  // a normal half (from 2^-14): re-biased, rounded at the half's last mantissa bit
    const std::uint32_t r = a - (112u << 23);
    return static_cast<std::uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  // a subnormal half: the significand (with its leading 1) shifted to multiples of 2^-24, rounded;
  // a carry out of the largest subnormal gives the smallest normal's bits
  const std::uint32_t e = a >> 23;
  if (e < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25: rounds to zero
  const std::uint32_t sig = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126 - e;  // 14..24
  return static_cast<std::uint16_t>(sign | ((sig + (1u << (shift - 1)) - 1u + ((sig >> shift) & 1u)) >> shift));
}

// The threads that run the launches' CUDA threads, started when a launch first needs them and kept
// for the process. run(width, job) calls job(0) .. job(width - 1) on threads of their own and
// returns when every call has; a job calls progress() as it moves on (a block done), and run
// aborts (fail) when neither happens for kHangSeconds: threads left waiting at a barrier.
class Pool {
 public:
  template <class Job>
  void run(unsigned width, Job& job) {
    std::unique_lock<std::mutex> lock(mu_);
    while (threads_.size() < width) {
      const unsigned t = static_cast<unsigned>(threads_.size());
      threads_.emplace_back([this, t] { work(t); });
    }
    job_ = [&job](unsigned t) { job(t); };
    width_ = width;
    returned_ = 0;
    ++generation_;
    start_.notify_all();
    for (std::uint64_t seen = progress_; returned_ < width; seen = progress_) {
      if (!done_.wait_for(lock, std::chrono::seconds(kHangSeconds),
                          [&] { return returned_ == width || progress_ != seen; })) {
        fail("a block's threads did not finish: a __syncthreads or a shuffle not reached by every thread?");
      }
    }
    job_ = nullptr;
  }

  void progress() {
    const std::lock_guard<std::mutex> lock(mu_);
    ++progress_;
    done_.notify_one();
  }

  ~Pool() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      start_.notify_all();
    }
    for (std::thread& th : threads_) th.join();
  }

 private:
  void work(unsigned t) {
    std::uint64_t seen = 0;
    for (;;) {
      std::function<void(unsigned)> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (t >= width_) continue;
        job = job_;
      }
      job(t);
      const std::lock_guard<std::mutex> lock(mu_);
      if (++returned_ == width_) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable start_, done_;
  std::vector<std::thread> threads_;
  std::function<void(unsigned)> job_;
  unsigned width_ = 0, returned_ = 0;
  std::uint64_t generation_ = 0, progress_ = 0;
  bool stop_ = false;
};

inline Pool& pool() {
  static Pool p;
  return p;
}

// Runs a launch of `grid` blocks of `block` threads, as described above. The kernel's parameters
// are copied once per launch from args and passed to every thread by value, as CUDA passes them.
template <class... Params, class... Args>
void emulate_launch(dim3 grid, dim3 block, void (*kernel)(Params...), Args&&... args) {
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) fail("only one-dimensional launches");
  if (grid.x == 0 || block.x == 0 || block.x > 1024) fail("a launch needs 1..1024 threads a block and a block");
  const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  gridDim = grid;
  blockDim = block;
  // a block's end: every thread done with it (as a join would be) before the next block starts
  auto block_done = []() noexcept { pool().progress(); };
  std::barrier<decltype(block_done)> end_of_block(block.x, block_done);
  Block sync(block.x);
  auto cuda_thread = [&](unsigned t) {
    threadIdx = uint3{t, 0, 0};
    current_block = &sync;
    shuffles = 0;
    for (unsigned b = 0; b < grid.x; ++b) {
      blockIdx = uint3{b, 0, 0};
      std::apply(kernel, params);
      end_of_block.arrive_and_wait();
    }
    current_block = nullptr;
  };
  pool().run(block.x, cuda_thread);
}

}  // namespace cuda_emulation

using cuda_emulation::emulate_launch;

// ----------------------------------------------------------------------------- synchronisation

inline void __syncthreads() { cuda_emulation::current_block->all.arrive_and_wait(); }

// var of lane (this lane ^ lane_mask) of the warp, exchanged through the lanes' slots (the header's
// comment says why one barrier a call suffices); as on the device only lane_mask's low 5 bits count
// (width 32: the partner is always in the warp).
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(std::uint64_t),
                "a shuffle moves 8 bytes at most");
  using cuda_emulation::kWarpSize;
  cuda_emulation::Block& b = *cuda_emulation::current_block;
  const unsigned lane = threadIdx.x % kWarpSize, first = threadIdx.x - lane;
  if (mask != 0xffffffffu || width != static_cast<int>(kWarpSize) || first + kWarpSize > blockDim.x) {
    cuda_emulation::fail("__shfl_xor_sync: only whole warps (mask 0xffffffff, width 32) are emulated");
  }
  std::uint64_t mine = 0;
  std::memcpy(&mine, &var, sizeof var);
  const unsigned half = (cuda_emulation::shuffles++ & 1u) * blockDim.x;
  b.lanes[half + threadIdx.x] = mine;
  b.warps[threadIdx.x / kWarpSize]->arrive_and_wait();  // every lane's value published
  T got;
  std::memcpy(&got, &b.lanes[half + first + (lane ^ (static_cast<unsigned>(lane_mask) & (kWarpSize - 1)))],
              sizeof got);
  return got;
}

// ----------------------------------------------------------------------------- arithmetic

inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// A NaN result as the device writes it: 0x7fffffff whatever the operands' NaNs.
inline float device_nan(float r) { return std::isnan(r) ? std::bit_cast<float>(0x7fffffffu) : r; }
inline float __fadd_rn(float a, float b) { return device_nan(a + b); }
inline float __fsub_rn(float a, float b) { return device_nan(a - b); }
inline float __fmul_rn(float a, float b) { return device_nan(a * b); }
inline float __fdiv_rn(float a, float b) { return device_nan(a / b); }
inline float __fsqrt_rn(float a) { return device_nan(std::sqrt(a)); }

inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }

// cuda_fp16.h's types as far as the kernels use them: a half's bits, and __half converting to them.
struct __half_raw {
  unsigned short x;
};
struct __half {
  unsigned short __x;
  operator __half_raw() const { return __half_raw{__x}; }
};

inline __half __float2half_rn(float f) { return __half{cuda_emulation::half_bits(f)}; }
