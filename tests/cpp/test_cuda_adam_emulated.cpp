// The CUDA optimizer kernels (detail_cuda_adam_kernels.cuh) on host threads (cuda_emulation.hpp)
// against the CPU kernels: the 8-bit step's indexing, its block-wide maximum (warp shuffles, shared
// memory, barriers), the scales its thread 0 writes and its grid-stride loop, and the bf16 step's,
// leave the CPU kernels' state and outputs bit for bit (a NaN equals any NaN, as in the GPU tests,
// tests/python/test_cuda_steps.py) and nothing written past the arrays' ends. Sizes around a
// quantisation block, grids of one and two blocks (each strides over the rest) and the launchers'
// own, fp32 and bf16 gradients, every out dtype, a gradient held in out, three consecutive steps
// with zeros, a block of zeros, tiny, huge and non-finite gradients. No GPU or CUDA toolkit needed;
// ThreadSanitizer sees the kernels' threads and their barriers.
#include "cuda_emulation.hpp"  // first: the CUDA API the kernels use

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "detail_cuda_adam_kernels.cuh"
#include "harness.hpp"
#include "pyinfinity/cpu_adam.hpp"

using namespace pyinfinity;
using cuda::OutType;

namespace {

constexpr std::size_t kGuard = 9;  // elements past n in every array: no kernel may write them
constexpr float kSentinel = 1234.5f;
constexpr std::uint8_t kSentinel8 = 0xa5;
constexpr std::uint16_t kSentinel16 = 0x5a5a;

const std::size_t kSizes[] = {1, 255, 256, 257, 3 * 256 + 17, 5000};

// The Python GPU tests' hyperparameters: no decay, AdamW's decay with a gradient scale, Adam's L2.
AdamHyper hyper(int which, std::int64_t step) {
  AdamHyper h;
  h.lr = 2e-3f;
  h.step = step;
  h.weight_decay = which == 0 ? 0.0f : 0.1f;
  h.adamw = which != 2;
  h.grad_scale = which == 1 ? 2.5f : 1.0f;
  return h;
}

bool is_nan(std::uint16_t h, bool half) { return (h & 0x7fffu) > (half ? 0x7c00u : 0x7f80u); }

// Where a and b differ (the first index), or -1: the same bits, a NaN equal to any NaN.
long first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (__float_as_uint(a[i]) != __float_as_uint(b[i])) return static_cast<long>(i);
  }
  return -1;
}

long first_difference(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b, bool half) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (is_nan(a[i], half) && is_nan(b[i], half)) continue;
    if (a[i] != b[i]) return static_cast<long>(i);
  }
  return -1;
}

long first_difference(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<long>(i);
  }
  return -1;
}

void require_same(long diff, const std::string& what, const std::string& where) {
  if (diff >= 0) throw harness::Failure(where + ": " + what + " differs at " + std::to_string(diff));
}

// The 8-bit state of n parameters and the guards past its arrays.
struct State8 {
  std::vector<float> master, m_scale, v_scale;
  std::vector<std::uint8_t> m, v;
  explicit State8(std::size_t n)
      : master(n + kGuard, kSentinel), m_scale(quant_blocks(n) + kGuard, kSentinel),
        v_scale(quant_blocks(n) + kGuard, kSentinel), m(n + kGuard, kSentinel8), v(n + kGuard, kSentinel8) {}
  Adam8bitState view() { return Adam8bitState{master.data(), m.data(), v.data(), m_scale.data(), v_scale.data()}; }
};

void require_same(const State8& got, const State8& want, const std::string& where) {
  require_same(first_difference(got.master, want.master), "master", where);
  require_same(first_difference(got.m, want.m), "exp_avg codes", where);
  require_same(first_difference(got.v, want.v), "exp_avg_sq codes", where);
  require_same(first_difference(got.m_scale, want.m_scale), "exp_avg scales", where);
  require_same(first_difference(got.v_scale, want.v_scale), "exp_avg_sq scales", where);
}

// A state like a run's: weights ~N(0, 1); moments from gradient scales spread over orders of
// magnitude, those of the second block zero (and from six blocks on the third's, see gradient).
State8 start_8bit(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> m(n), v(n);
  State8 s(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float scale = 1e-3f * std::exp(1.5f * N(rng));
    s.master[i] = N(rng);
    m[i] = 0.3f * scale * N(rng);
    v[i] = scale * scale * (0.5f + std::fabs(N(rng)));
    const std::size_t blk = i / kQuantBlock;
    if (blk == 1 || (blk == 2 && n >= 6 * kQuantBlock)) m[i] = v[i] = 0.0f;
  }
  quantize_moments(m.data(), v.data(), n, s.view());
  return s;
}

// A step's gradient (n values and the guard): magnitudes over orders of magnitude, some zeros,
// every 37th element large and every 41st tiny; the second block all zeros. From six blocks on,
// blocks of their own: subnormal (the block is stored as zeros), huge (1e18: a square of 1e36),
// a NaN and an infinity (their blocks' scales become NaN).
std::vector<float> gradient(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> g(n + kGuard, kSentinel);
  for (std::size_t i = 0; i < n; ++i) {
    g[i] = 1e-3f * std::exp(2.0f * N(rng)) * N(rng);
    if (i % 13 == 5) g[i] = 0.0f;
    if (i % 37 == 11) g[i] *= 1e3f;
    if (i % 41 == 7) g[i] *= 1e-30f;
    const std::size_t blk = i / kQuantBlock;
    if (blk == 1) g[i] = 0.0f;
    if (n >= 6 * kQuantBlock) {
      if (blk == 2) g[i] = 1e-39f * N(rng);
      if (blk == 3) g[i] = 1e18f * N(rng);
    }
  }
  if (n >= 6 * kQuantBlock) {
    g[4 * kQuantBlock + 3 + seed % 50] = std::nanf("");
    g[5 * kQuantBlock + 100] = -INFINITY;
  }
  return g;
}

// That the CPU kernel's state after a step is what the gradients above make, so that a NaN equal
// to any NaN hides nothing: the second block's scales 0, and from six blocks on the third's 0 too
// (not under Adam's L2 decay, which adds the weights to the gradient) and the fifth's and sixth's
// NaN; every other block's finite, a third of its first moments or more not code 0.
void check_reference(const State8& s, std::size_t n, const AdamHyper& h, const std::string& where) {
  const bool l2 = !h.adamw && h.weight_decay != 0.0f;
  bool ok = true;
  for (std::size_t b = 0; b < quant_blocks(n); ++b) {
    const bool zero = !l2 && (b == 1 || (b == 2 && n >= 6 * kQuantBlock));
    const bool nan = (b == 4 || b == 5) && n >= 6 * kQuantBlock;
    for (float scale : {s.m_scale[b], s.v_scale[b]}) {
      ok = ok && (nan ? std::isnan(scale) : zero ? scale == 0.0f : std::isfinite(scale) && scale > 0.0f);
    }
    if (zero || nan) continue;
    std::size_t len = std::min(kQuantBlock, n - b * kQuantBlock), codes = 0;
    for (std::size_t i = b * kQuantBlock; i < b * kQuantBlock + len; ++i) codes += (s.m[i] & 0x7fu) != 0;
    ok = ok && codes * 3 >= len;
  }
  if (!ok) throw harness::Failure(where + ": the CPU kernel's state is not what the test means to step");
}

std::vector<std::uint16_t> to_bf16(const std::vector<float>& g) {
  std::vector<std::uint16_t> out(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) out[i] = float_to_bf16(g[i]);
  return out;
}

const char* name(GradType g) { return g == GradType::kBFloat16 ? "bf16" : "fp32"; }

const char* name(OutType o) {
  switch (o) {
    case OutType::kNone:
      return "none";
    case OutType::kBFloat16:
      return "bf16";
    case OutType::kFloat16:
      return "fp16";
    case OutType::kFloat32:
      return "fp32";
  }
  return "?";
}

// step_8bit<G, O> on `grid` blocks of the launcher's size.
template <GradType G, OutType O>
void emulate_8bit(unsigned grid, const Adam8bitState& s, const void* grad, void* out, std::size_t n,
                  const detail::Coeffs& c) {
  emulate_launch(grid, dim3(cuda::kThreads), cuda::step_8bit<G, O>, s.master, s.exp_avg, s.exp_avg_sq,
                 s.exp_avg_scale, s.exp_avg_sq_scale, grad, out, n, c);
}

template <GradType G>
void launch_8bit(OutType ot, unsigned grid, const Adam8bitState& s, const void* grad, void* out, std::size_t n,
                 const detail::Coeffs& c) {
  switch (ot) {
    case OutType::kNone:
      return emulate_8bit<G, OutType::kNone>(grid, s, grad, out, n, c);
    case OutType::kBFloat16:
      return emulate_8bit<G, OutType::kBFloat16>(grid, s, grad, out, n, c);
    case OutType::kFloat16:
      return emulate_8bit<G, OutType::kFloat16>(grid, s, grad, out, n, c);
    case OutType::kFloat32:
      return emulate_8bit<G, OutType::kFloat32>(grid, s, grad, out, n, c);
  }
}

// The 8-bit kernel as the launcher picks it, on `grid` blocks.
void launch_8bit(GradType gt, OutType ot, unsigned grid, State8& s, const void* grad, void* out, std::size_t n,
                 const detail::Coeffs& c) {
  if (gt == GradType::kBFloat16) {
    launch_8bit<GradType::kBFloat16>(ot, grid, s.view(), grad, out, n, c);
  } else {
    launch_8bit<GradType::kFloat32>(ot, grid, s.view(), grad, out, n, c);
  }
}

// step_bf16<G, Out> on `grid` blocks of `block` threads.
template <GradType G, bool Out>
void emulate_bf16(unsigned grid, unsigned block, std::uint16_t* p, std::uint16_t* m, std::uint16_t* v,
                  const void* grad, std::uint16_t* out, std::size_t n, const detail::Coeffs& c) {
  emulate_launch(grid, block, cuda::step_bf16<G, Out>, p, m, v, grad, out, n, c);
}

// The grids a launch of `blocks` CUDA blocks is also tried with: one and two blocks, each striding
// over the others, and the launcher's own.
std::vector<unsigned> grids(unsigned launcher) {
  std::vector<unsigned> g = {1u, 2u};
  if (launcher > 2) g.push_back(launcher);
  return g;
}

// A test kernel of the emulation itself: each thread passes its own value through every xor
// shuffle and a shared array around the block.
__global__ void exchange(unsigned* shuffled, unsigned* rotated) {
  __shared__ unsigned slots[64];
  const unsigned mine = 1000u * threadIdx.x + 7u;
  for (int mask = 0; mask < 33; ++mask) {
    shuffled[threadIdx.x * 33 + static_cast<unsigned>(mask)] = __shfl_xor_sync(0xffffffffu, mine, mask);
  }
  slots[threadIdx.x] = mine;
  __syncthreads();
  rotated[threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
}

}  // namespace

TEST(the_emulation_exchanges_values_within_a_warp_and_orders_a_block_at_its_barrier) {
  std::vector<unsigned> shuffled(64 * 33), rotated(64);
  emulate_launch(1, 64, exchange, shuffled.data(), rotated.data());
  for (unsigned t = 0; t < 64; ++t) {
    for (unsigned mask = 0; mask < 33; ++mask) {
      const unsigned partner = (t & ~31u) | ((t ^ mask) & 31u);  // the low 5 bits of the mask, within the warp
      CHECK(shuffled[t * 33 + mask] == 1000u * partner + 7u);
    }
    CHECK(rotated[t] == 1000u * ((t + 1) % 64) + 7u);
  }
}

TEST(the_emulated_half_conversion_rounds_to_nearest_even) {
  // every finite half decodes exactly to a float; a float between two neighbours goes to the
  // nearer, a midpoint to the even one; past 65520 infinity
  auto decode = [](std::uint32_t h) {
    const std::uint32_t e = (h >> 10) & 0x1fu, f = h & 0x3ffu;
    const float mag = e == 0 ? std::ldexp(static_cast<float>(f), -24)
                             : std::ldexp(1.0f + static_cast<float>(f) / 1024.0f, static_cast<int>(e) - 15);
    return (h & 0x8000u) ? -mag : mag;
  };
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    if (((h >> 10) & 0x1fu) == 0x1fu) continue;
    CHECK(cuda_emulation::half_bits(decode(h)) == h);
    if ((h & 0x7fffu) == 0x7bffu) continue;  // the largest: no finite neighbour above
    const float lo = decode(h), hi = decode(h + 1), mid = (lo + hi) / 2;  // exact: 11 bits in 24
    const std::uint32_t even = (h & 1u) ? h + 1 : h;
    CHECK(cuda_emulation::half_bits(mid) == even);
    CHECK(cuda_emulation::half_bits(std::nextafter(mid, lo)) == h);
    CHECK(cuda_emulation::half_bits(std::nextafter(mid, hi)) == h + 1);
  }
  CHECK(cuda_emulation::half_bits(65519.996f) == 0x7bffu && cuda_emulation::half_bits(65520.0f) == 0x7c00u);
  CHECK(cuda_emulation::half_bits(-INFINITY) == 0xfc00u && cuda_emulation::half_bits(1e30f) == 0x7c00u);
  CHECK(cuda_emulation::half_bits(std::nanf("")) == 0x7fffu && cuda_emulation::half_bits(-0.0f) == 0x8000u);
  CHECK(cuda_emulation::half_bits(std::ldexp(1.0f, -25)) == 0u && cuda_emulation::half_bits(1e-40f) == 0u);
  CHECK(cuda_emulation::half_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 1u);
}

TEST(the_grid_is_a_block_per_quantisation_block_up_to_the_cap) {
  CHECK(cuda::grid_for(1, kQuantBlock) == 1 && cuda::grid_for(256, kQuantBlock) == 1);
  CHECK(cuda::grid_for(257, kQuantBlock) == 2 && cuda::grid_for(5000, kQuantBlock) == 20);
  CHECK(cuda::grid_for(std::size_t{1} << 40, kQuantBlock) == cuda::kMaxGrid);
}

TEST(step_8bit_emulated_leaves_the_cpu_kernels_bits) {
  // a run of three steps for each size and grid, each step with the next (gradient, out dtype)
  // pair: every pair is taken at each size from four blocks on, and at every grid
  int run = 0;
  for (std::size_t n : kSizes) {
    for (unsigned grid : grids(cuda::grid_for(n, kQuantBlock))) {
      const int hp = run % 3;
      State8 want = start_8bit(n, static_cast<unsigned>(n)), got = want;
      for (std::int64_t step = 1; step <= 3; ++step) {
        const int pair = (run * 3 + static_cast<int>(step) - 1) % 8;
        const GradType gt = pair % 2 ? GradType::kBFloat16 : GradType::kFloat32;
        const OutType ot = static_cast<OutType>(pair / 2);
        const std::string where = "n=" + std::to_string(n) + " grid=" + std::to_string(grid) + " grad=" + name(gt) +
                                  " out=" + name(ot) + " hyper=" + std::to_string(hp) + " step=" + std::to_string(step);
        const AdamHyper h = hyper(hp, step);
        const std::vector<float> g32 = gradient(n, static_cast<unsigned>(n * 7 + step));
        const std::vector<std::uint16_t> g16 = to_bf16(g32);
        const void* grad = gt == GradType::kBFloat16 ? static_cast<const void*>(g16.data()) : g32.data();
        std::vector<std::uint16_t> want_bf16(n + kGuard, kSentinel16);
        adam_step_8bit(want.view(), grad, gt, ot == OutType::kBFloat16 ? want_bf16.data() : nullptr, n, h, 2);
        check_reference(want, n, h, where);
        std::vector<std::uint16_t> out16(n + kGuard, kSentinel16);
        std::vector<float> out32(n + kGuard, kSentinel);
        void* out = ot == OutType::kFloat32 ? static_cast<void*>(out32.data())
                    : ot == OutType::kNone  ? nullptr
                                            : out16.data();
        launch_8bit(gt, ot, grid, got, grad, out, n, detail::adam_coeffs(h, "test"));
        require_same(got, want, where);
        if (ot == OutType::kBFloat16) require_same(first_difference(out16, want_bf16, false), "out", where);
        if (ot == OutType::kFloat16) {  // the CPU's master converted as the kernel converts
          std::vector<std::uint16_t> want16(n + kGuard, kSentinel16);
          for (std::size_t i = 0; i < n; ++i) want16[i] = cuda_emulation::half_bits(want.master[i]);
          require_same(first_difference(out16, want16, true), "out", where);
        }
        if (ot == OutType::kFloat32) {
          std::vector<float> want32(n + kGuard, kSentinel);
          std::memcpy(want32.data(), want.master.data(), n * sizeof(float));
          require_same(first_difference(out32, want32), "out", where);
        }
      }
      ++run;
    }
  }
}

TEST(step_8bit_emulated_reads_a_gradient_held_in_out_before_writing_it) {
  for (std::size_t n : {std::size_t{257}, std::size_t{3 * 256 + 17}}) {
    for (unsigned grid : {1u, cuda::grid_for(n, kQuantBlock)}) {
      State8 want = start_8bit(n, 3), got = want;
      for (std::int64_t step = 1; step <= 2; ++step) {
        const std::string where = "n=" + std::to_string(n) + " grid=" + std::to_string(grid) + " step=" +
                                  std::to_string(step);
        const AdamHyper h = hyper(1, step);
        const std::vector<std::uint16_t> g16 = to_bf16(gradient(n, static_cast<unsigned>(step)));
        std::vector<std::uint16_t> want_out(n + kGuard, kSentinel16), home = g16;
        adam_step_8bit(want.view(), g16.data(), GradType::kBFloat16, want_out.data(), n, h, 2);
        launch_8bit(GradType::kBFloat16, OutType::kBFloat16, grid, got, home.data(), home.data(), n,
                    detail::adam_coeffs(h, "test"));
        require_same(got, want, where);
        for (std::size_t i = n; i < n + kGuard; ++i) want_out[i] = g16[i];  // the gradient's own guard
        require_same(first_difference(home, want_out, false), "out", where);
      }
    }
  }
}

TEST(step_bf16_emulated_leaves_the_cpu_kernels_bits) {
  struct Launch {
    unsigned grid, block;
  };
  // (gradient, out) pairs: out none, its own buffer, or (a bf16 gradient) the gradient's buffer
  const struct {
    GradType grad;
    int out;
  } pairs[] = {{GradType::kFloat32, 0}, {GradType::kBFloat16, 1}, {GradType::kFloat32, 1}, {GradType::kBFloat16, 2},
               {GradType::kBFloat16, 0}};
  // a run of three steps for each size and launch, each step with the next pair
  int run = 0;
  for (std::size_t n : kSizes) {
    // the launcher's block size on one, two and the launcher's blocks, and blocks of three warps
    // whose stride is no power of two
    std::vector<Launch> launches;
    for (unsigned grid : grids(cuda::grid_for(n, cuda::kBf16Threads))) {
      launches.push_back({grid, static_cast<unsigned>(cuda::kBf16Threads)});
    }
    launches.push_back({5, 96});
    for (const Launch& l : launches) {
      const int hp = run % 3;
      std::mt19937 rng(static_cast<unsigned>(n));
      std::normal_distribution<float> N(0.0f, 1.0f);
      std::vector<std::uint16_t> p(n + kGuard, kSentinel16), m = p, v = p;  // the CPU kernel's
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = float_to_bf16(N(rng));
        m[i] = i % 11 == 4 ? 0 : float_to_bf16(1e-2f * N(rng));
        v[i] = i % 11 == 4 ? 0 : float_to_bf16(1e-4f * std::fabs(N(rng)));
      }
      std::vector<std::uint16_t> P = p, M = m, V = v;  // the CUDA kernel's
      for (std::int64_t step = 1; step <= 3; ++step) {
        const auto [gt, out_mode] = pairs[(run * 3 + static_cast<int>(step) - 1) % 5];
        const std::string where = "n=" + std::to_string(n) + " grid=" + std::to_string(l.grid) + "x" +
                                  std::to_string(l.block) + " grad=" + name(gt) + " out=" + std::to_string(out_mode) +
                                  " hyper=" + std::to_string(hp) + " step=" + std::to_string(step);
        const AdamHyper h = hyper(hp, step);
        const std::vector<float> g32 = gradient(n, static_cast<unsigned>(n * 5 + step));
        std::vector<std::uint16_t> g16 = to_bf16(g32);
        const void* grad = gt == GradType::kBFloat16 ? static_cast<const void*>(g16.data()) : g32.data();
        std::vector<std::uint16_t> want_out(n + kGuard, kSentinel16);
        adam_step_bf16(p.data(), m.data(), v.data(), grad, gt, want_out.data(), n, h, 2);
        std::vector<std::uint16_t> out(n + kGuard, kSentinel16);
        std::uint16_t* o = out_mode == 0 ? nullptr : out_mode == 1 ? out.data() : g16.data();
        auto kernel = emulate_bf16<GradType::kFloat32, false>;  // the one the launcher picks
        if (gt == GradType::kBFloat16) {
          kernel = o ? emulate_bf16<GradType::kBFloat16, true> : emulate_bf16<GradType::kBFloat16, false>;
        } else if (o) {
          kernel = emulate_bf16<GradType::kFloat32, true>;
        }
        kernel(l.grid, l.block, P.data(), M.data(), V.data(), grad, o, n, detail::adam_coeffs(h, "test"));
        require_same(first_difference(P, p, false), "param", where);
        require_same(first_difference(M, m, false), "exp_avg", where);
        require_same(first_difference(V, v, false), "exp_avg_sq", where);
        if (out_mode == 0) CHECK(out == std::vector<std::uint16_t>(n + kGuard, kSentinel16));
        if (out_mode == 1) require_same(first_difference(out, want_out, false), "out", where);
        if (out_mode == 2) {
          for (std::size_t i = n; i < n + kGuard; ++i) want_out[i] = float_to_bf16(kSentinel);  // its own guard
          require_same(first_difference(g16, want_out, false), "out (the gradient's buffer)", where);
        }
      }
      ++run;
    }
  }
}
