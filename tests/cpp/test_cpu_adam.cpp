// The one-pass optimizer step: bf16 rounding like torch's, the update against a double-precision
// reference, thread splits that change nothing, the gradient and the bf16 output in one buffer,
// every instruction set; the gradient add of accumulation.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "harness.hpp"
#include "pyinfinity/cpu_adam.hpp"
#include "pyinfinity/cpu_isa.hpp"

using namespace pyinfinity;

namespace {
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace

TEST(bf16_rounds_to_nearest_even_and_keeps_nan) {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(float_to_bf16(from_bits(0x3f808000u)) == 0x3f80);  // a tie: to the even one
  CHECK(float_to_bf16(from_bits(0x3f818000u)) == 0x3f82);
  CHECK(float_to_bf16(from_bits(0x3f808001u)) == 0x3f81);  // above the tie: up
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  CHECK(float_to_bf16(INFINITY) == 0x7f80);
}

TEST(update_matches_a_double_precision_reference) {
  const std::size_t n = 300001;
  std::mt19937 rng(7);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> p(n), m(n), v(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = N(rng);
    m[i] = 0.1f * N(rng);
    v[i] = 0.01f * std::fabs(N(rng));
    g[i] = N(rng);
  }
  for (bool adamw : {true, false}) {
    AdamHyper h;
    h.lr = 1e-2f;
    h.beta1 = 0.9f;
    h.beta2 = 0.99f;
    h.weight_decay = 0.1f;
    h.adamw = adamw;
    h.step = 3;
    h.grad_scale = 2.0f;
    std::vector<float> P = p, M = m, V = v;
    std::vector<std::uint16_t> out(n, 0xffff);
    adam_step(P.data(), M.data(), V.data(), g.data(), GradType::kFloat32, out.data(), n, h, 4);
    const double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.99, 3);
    for (std::size_t i = 0; i < n; i += 997) {
      double gi = g[i] / 2.0, pi = p[i];
      if (adamw) {
        pi -= 1e-2 * 0.1 * pi;
      } else {
        gi += 0.1 * p[i];
      }
      const double mi = m[i] + 0.1 * (gi - m[i]);
      const double vi = 0.99 * v[i] + 0.01 * gi * gi;
      pi -= 1e-2 / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + 1e-8);
      CHECK(std::fabs(P[i] - pi) <= 1e-5 * (std::fabs(pi) + 1e-3));
      CHECK(std::fabs(M[i] - mi) <= 1e-5 * (std::fabs(mi) + 1e-3));
      CHECK(out[i] == float_to_bf16(P[i]));
    }
  }
}

TEST(threads_change_nothing_and_the_gradient_may_be_the_output) {
  const std::size_t n = (1 << 20) + 13;
  std::vector<float> p0(n), g32(n);
  harness::fill_random(reinterpret_cast<unsigned char*>(p0.data()), n * 4, 1);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = std::isfinite(p0[i]) ? std::fmod(p0[i], 4.0f) : 0.5f;
    g32[i] = std::sin(static_cast<float>(i));
  }
  std::vector<std::uint16_t> g16(n);
  for (std::size_t i = 0; i < n; ++i) g16[i] = float_to_bf16(g32[i]);
  AdamHyper h;
  std::vector<std::vector<float>> results;
  std::vector<std::vector<std::uint16_t>> outs;
  for (int threads : {1, 3, 16}) {
    std::vector<float> P = p0, M(n, 0.0f), V(n, 0.0f);
    std::vector<std::uint16_t> out(n);
    adam_step(P.data(), M.data(), V.data(), g16.data(), GradType::kBFloat16, out.data(), n, h, threads);
    results.push_back(P);
    outs.push_back(out);
  }
  CHECK(results[0] == results[1] && results[0] == results[2] && outs[0] == outs[2]);
  std::vector<float> P = p0, M(n, 0.0f), V(n, 0.0f);
  std::vector<std::uint16_t> home = g16;  // the gradient lands in the parameter home
  adam_step(P.data(), M.data(), V.data(), home.data(), GradType::kBFloat16, home.data(), n, h, 3);
  CHECK(P == results[0] && home == outs[0]);
}

TEST(accumulate_grad_adds_and_copies_alike_on_any_thread_split) {
  // the gradient add of accumulation: fp32 and bf16 sources into an fp32 accumulator, copy (the
  // first micro-batch) or add, the same sums whatever the threads (each element summed once)
  const std::size_t n = (1 << 18) + 7;
  std::vector<float> g32(n), acc0(n);
  std::vector<std::uint16_t> g16(n);
  for (std::size_t i = 0; i < n; ++i) {
    g32[i] = std::sin(static_cast<float>(i) * 0.37f);
    g16[i] = float_to_bf16(std::cos(static_cast<float>(i) * 0.11f));
    acc0[i] = static_cast<float>(i % 97) * 0.25f;
  }
  for (int threads : {1, 3, 16}) {
    std::vector<float> a = acc0, b = acc0, c(n, -1.0f), d(n, -1.0f);
    accumulate_grad(a.data(), g32.data(), GradType::kFloat32, n, false, threads);
    accumulate_grad(b.data(), g16.data(), GradType::kBFloat16, n, false, threads);
    accumulate_grad(c.data(), g32.data(), GradType::kFloat32, n, true, threads);
    accumulate_grad(d.data(), g16.data(), GradType::kBFloat16, n, true, threads);
    bool ok = true;
    for (std::size_t i = 0; i < n && ok; ++i) {
      ok = a[i] == acc0[i] + g32[i] && b[i] == acc0[i] + bf16_to_float(g16[i]) && c[i] == g32[i] &&
           d[i] == bf16_to_float(g16[i]);
    }
    CHECK(ok);
  }
  float x = 0;
  CHECK_THROWS(std::exception, accumulate_grad(nullptr, &x, GradType::kFloat32, 1, false, 1));
  accumulate_grad(nullptr, nullptr, GradType::kFloat32, 0, false, 4);  // nothing to add: no pointer read
}

TEST(bad_arguments_throw) {
  float x = 0;
  AdamHyper h;
  h.step = 0;
  CHECK_THROWS(std::exception, adam_step(&x, &x, &x, &x, GradType::kFloat32, nullptr, 1, h, 1));
  h.step = 1;
  h.grad_scale = 0;
  CHECK_THROWS(std::exception, adam_step(&x, &x, &x, &x, GradType::kFloat32, nullptr, 1, h, 1));
}

TEST(every_instruction_set_steps_alike) {
  // AVX2 and AVX-512 contract the same multiply-adds into FMAs: the same bits. The x86-64 baseline
  // has no FMA: an ulp here and there.
  const std::size_t n = 100003;
  std::vector<float> p0(n), g(n), m0(n), v0(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = std::sin(static_cast<float>(i));
    g[i] = std::cos(0.37f * static_cast<float>(i));
    m0[i] = 0.1f * std::sin(1.3f * static_cast<float>(i));
    v0[i] = 0.01f * std::fabs(std::cos(0.7f * static_cast<float>(i)));
  }
  AdamHyper h;
  h.weight_decay = 0.1f;
  h.step = 4;
  std::vector<std::vector<float>> results;
  std::vector<CpuIsa> isas = supported_isas();
  for (CpuIsa isa : isas) {
    std::vector<float> P = p0, M = m0, V = v0;
    std::vector<std::uint16_t> out(n);
    adam_step(P.data(), M.data(), V.data(), g.data(), GradType::kFloat32, out.data(), n, h, 2, isa);
    results.push_back(P);
    CHECK(out[n - 1] == float_to_bf16(P[n - 1]));
  }
  for (std::size_t k = 1; k < results.size(); ++k) {
    if (isas[k] != CpuIsa::kGeneric && isas[k - 1] != CpuIsa::kGeneric) {
      CHECK(std::memcmp(results[k].data(), results[k - 1].data(), n * sizeof(float)) == 0);
    }
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(std::fabs(results[k][i] - results[0][i]) <= 1e-6f * (std::fabs(results[0][i]) + 1e-3f));
    }
  }
}
