#include "pyinfinity/cpu_adam.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "pyinfinity/error.hpp"

namespace pyinfinity {

namespace {

struct Coeffs {
  float lr, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt, scale;
  float decay;  // AdamW: lr * weight_decay (decoupled), else 0
  float l2;     // Adam: weight_decay added to the gradient, else 0
};

namespace generic {
#include "detail_cpu_adam_loop.inc"
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYINF_HAVE_AVX2_LOOP 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "detail_cpu_adam_loop.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

template <GradType G, bool Out>
void step_range(float* master, float* m, float* v, const void* grad, std::uint16_t* out, std::size_t begin,
                std::size_t end, const Coeffs& c) {
#ifdef PYINF_HAVE_AVX2_LOOP
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) {
    avx2::step_range<G, Out>(master, m, v, grad, out, begin, end, c);
    return;
  }
#endif
  generic::step_range<G, Out>(master, m, v, grad, out, begin, end, c);
}

}  // namespace

std::uint16_t float_to_bf16(float f) { return generic::store_bf16(f); }

float bf16_to_float(std::uint16_t h) { return generic::load_bf16(h); }

void adam_step(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, GradType grad_type,
               std::uint16_t* out_bf16, std::size_t n, const AdamHyper& h, int threads) {
  PYINF_EXPECT(h.step >= 1, "adam_step: step must be >= 1");
  PYINF_EXPECT(h.grad_scale > 0.0f && std::isfinite(h.grad_scale), "adam_step: grad_scale must be a positive number");
  PYINF_EXPECT(n == 0 || (master && exp_avg && exp_avg_sq && grad), "adam_step: null pointer");
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  Coeffs c{h.lr, 1.0f - h.beta1, h.beta2, 1.0f - h.beta2, h.eps, static_cast<float>(h.lr / bc1),
           static_cast<float>(std::sqrt(bc2)), h.grad_scale, h.adamw ? h.lr * h.weight_decay : 0.0f,
           h.adamw ? 0.0f : h.weight_decay};
  auto run = [&](std::size_t b, std::size_t e) {
    const bool bf16 = grad_type == GradType::kBFloat16;
    if (bf16 && out_bf16) {
      step_range<GradType::kBFloat16, true>(master, exp_avg, exp_avg_sq, grad, out_bf16, b, e, c);
    } else if (bf16) {
      step_range<GradType::kBFloat16, false>(master, exp_avg, exp_avg_sq, grad, nullptr, b, e, c);
    } else if (out_bf16) {
      step_range<GradType::kFloat32, true>(master, exp_avg, exp_avg_sq, grad, out_bf16, b, e, c);
    } else {
      step_range<GradType::kFloat32, false>(master, exp_avg, exp_avg_sq, grad, nullptr, b, e, c);
    }
  };
  constexpr std::size_t kMinChunk = 1 << 16;  // below this a thread costs more than it saves
  const std::size_t want = std::max<std::size_t>(1, std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)),
                                                                           n / kMinChunk));
  if (want <= 1) {
    run(0, n);
    return;
  }
  // Threads claim chunks from a shared counter (about 8 per thread, each a multiple of 64 elements:
  // whole cache lines of every array) instead of one fixed range each: a thread descheduled for a
  // while (the training loop's own thread shares these CPUs) delays one chunk, not 1/threads of
  // the step. The result is the same for any split (the step is elementwise).
  const std::size_t chunk = std::max<std::size_t>(kMinChunk / 4, (n / (want * 8) + 63) / 64 * 64);
  std::atomic<std::size_t> next{0};
  auto worker = [&]() {
    for (;;) {
      const std::size_t b = next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= n) return;
      run(b, std::min(n, b + chunk));
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(want - 1);
  for (std::size_t t = 1; t < want; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace pyinfinity
