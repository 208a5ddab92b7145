// The 8bit and bf16 optimizer steps: the 8-bit codes (every code round-trips, rounding is to the
// nearest, saturation, NaN), the moments' quantisation error, the step against a double-precision
// reference on the decoded state, the same bits for every thread split and instruction set, the
// gradient and the bf16 output in one buffer, and the instruction-set choice.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "harness.hpp"
#include "pyinfinity/cpu_adam.hpp"
#include "pyinfinity/cpu_isa.hpp"

using namespace pyinfinity;

namespace {

// The 8-bit state of n parameters in vectors (the optimizer lays it out in one home).
struct State8 {
  std::vector<float> master, m_scale, v_scale;
  std::vector<std::uint8_t> m, v;
  explicit State8(std::size_t n)
      : master(n), m_scale(quant_blocks(n)), v_scale(quant_blocks(n)), m(n), v(n) {}
  Adam8bitState view() {
    return Adam8bitState{master.data(), m.data(), v.data(), m_scale.data(), v_scale.data()};
  }
  bool operator==(const State8& o) const {
    return std::memcmp(master.data(), o.master.data(), master.size() * 4) == 0 && m == o.m && v == o.v &&
           std::memcmp(m_scale.data(), o.m_scale.data(), m_scale.size() * 4) == 0 &&
           std::memcmp(v_scale.data(), o.v_scale.data(), v_scale.size() * 4) == 0;
  }
};

// Moments like a training run's: per-element gradient scales spread over orders of magnitude.
void fill_moments(std::vector<float>& m, std::vector<float>& v, unsigned seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.0f, 1.0f);
  for (std::size_t i = 0; i < m.size(); ++i) {
    const float s = 1e-3f * std::exp(spread * N(rng));
    m[i] = 0.3f * s * N(rng);
    v[i] = s * s * (0.5f + std::fabs(N(rng)));
  }
}

State8 quantized(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v) {
  State8 s(m.size());
  s.master = master;
  quantize_moments(m.data(), v.data(), m.size(), s.view());
  return s;
}

}  // namespace

TEST(e4m3_codes_round_trip_and_round_to_nearest_even) {
  for (unsigned c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // float8_e4m3fn's NaN: never written (a NaN poisons its block's scale)
    CHECK(encode_e4m3(decode_e4m3(static_cast<std::uint8_t>(c))) == c);
  }
  CHECK(decode_e4m3(0x38) == 1.0f && decode_e4m3(0xb8) == -1.0f && decode_e4m3(0x7e) == 448.0f);
  CHECK(decode_e4m3(0x01) == std::ldexp(1.0f, -9) && decode_e4m3(0x08) == std::ldexp(1.0f, -6));
  CHECK(encode_e4m3(1e6f) == 0x7e && encode_e4m3(-INFINITY) == 0xfe);  // saturates
  // NaN: +448 whatever its sign bit (x86 makes an invalid operation's NaN negative, a GPU positive)
  CHECK(encode_e4m3(std::nanf("")) == 0x7e && encode_e4m3(-std::nanf("")) == 0x7e);
  CHECK(encode_e4m3(INFINITY * 0.0f) == 0x7e);
  CHECK(encode_e4m3(std::ldexp(1.0f, -10)) == 0x00);  // half the smallest subnormal: a tie, to even
  CHECK(encode_e4m3(std::ldexp(3.0f, -10)) == 0x02);  // 1.5 steps: a tie, to even
  CHECK(encode_e4m3(1.0625f) == 0x38);                // halfway between 1 and 1.125: to even
  CHECK(encode_e4m3(1.1875f) == 0x3a);                // halfway between 1.125 and 1.25: to even
  CHECK(encode_e4m3(15.5f) == 0x58);                  // halfway between 15 and 16: to even, a carry into the exponent
}

TEST(ue4m4_codes_round_trip_are_monotonic_and_nearest) {
  for (unsigned c = 0; c < 256; ++c) {
    CHECK(encode_ue4m4(decode_ue4m4(static_cast<std::uint8_t>(c))) == c);
    if (c) CHECK(decode_ue4m4(static_cast<std::uint8_t>(c)) > decode_ue4m4(static_cast<std::uint8_t>(c - 1)));
  }
  CHECK(decode_ue4m4(0xff) == kExpAvgSqCodeMax && decode_ue4m4(0x01) == std::ldexp(1.0f, -18));
  CHECK(encode_ue4m4(5.0f) == 0xff);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> U(-20.0f, 0.9f);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(U(rng));
    const unsigned c = encode_ue4m4(x);
    const float err = std::fabs(decode_ue4m4(static_cast<std::uint8_t>(c)) - x);
    if (c > 0) CHECK(err <= std::fabs(decode_ue4m4(static_cast<std::uint8_t>(c - 1)) - x));
    if (c < 255) CHECK(err <= std::fabs(decode_ue4m4(static_cast<std::uint8_t>(c + 1)) - x));
  }
}

TEST(quantisation_error_is_bounded_relative_to_each_element) {
  const std::size_t n = 256 * 40 + 77;  // a partial last block
  std::vector<float> m(n), v(n), master(n, 0.0f);
  fill_moments(m, v, 11, 2.0f);  // scales over ~e^+-6 within a block
  State8 s = quantized(master, m, v);
  std::vector<float> m2(n), v2(n);
  dequantize_moments(s.view(), n, m2.data(), v2.data());
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / kQuantBlock;
    // E4M3: half a step of 2^-3 relative, or half the smallest subnormal step absolute
    const double m_tol = std::fabs(m[i]) * 0x1p-4 + s.m_scale[b] * 0x1p-10;
    CHECK(std::fabs(m2[i] - m[i]) <= m_tol * 1.0001);
    // the root: half a step of 2^-4 relative or half a subnormal step; a non-zero v never becomes 0
    const double r = std::sqrt(static_cast<double>(v[i])), r2 = std::sqrt(static_cast<double>(v2[i]));
    const double smallest = s.v_scale[b] * 0x1p-18;  // where a root far below its block's largest lands
    CHECK(std::fabs(r2 - r) <= (r * 0x1p-5 + s.v_scale[b] * 0x1p-19) * 1.0001 ||
          (r < smallest && std::fabs(r2 - smallest) <= 1e-6 * smallest));
    CHECK(v2[i] > 0.0f);
  }
}

TEST(zero_blocks_tiny_values_and_non_finite_values) {
  const std::size_t n = 3 * kQuantBlock;
  std::vector<float> m(n, 0.0f), v(n, 0.0f), master(n, 1.0f);
  m[kQuantBlock + 5] = 1.0f;
  v[kQuantBlock + 5] = 1.0f;
  v[kQuantBlock + 6] = 1e-30f;  // far below the block's largest: the smallest code, not 0
  m[2 * kQuantBlock + 1] = std::nanf("");
  State8 s = quantized(master, m, v);
  std::vector<float> m2(n), v2(n);
  dequantize_moments(s.view(), n, m2.data(), v2.data());
  CHECK(s.m_scale[0] == 0.0f && s.v_scale[0] == 0.0f && m2[3] == 0.0f && v2[3] == 0.0f);
  CHECK(std::fabs(m2[kQuantBlock + 5] - 1.0f) < 1e-6f && std::fabs(v2[kQuantBlock + 5] - 1.0f) < 1e-6f);
  CHECK(v2[kQuantBlock + 7] == 0.0f);
  CHECK(v2[kQuantBlock + 6] > 0.0f && v2[kQuantBlock + 6] < 1e-9f);
  CHECK(std::isnan(s.m_scale[2]) && std::isnan(m2[2 * kQuantBlock + 100]));  // the NaN poisons its block only
  CHECK(!std::isnan(m2[kQuantBlock + 100]));
}

TEST(step_8bit_matches_a_double_precision_reference_on_the_decoded_state) {
  const std::size_t n = 256 * 300 + 19;
  std::mt19937 rng(5);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> p(n), m(n), v(n), g(n);
  fill_moments(m, v, 7, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = N(rng);
    g[i] = 1e-3f * N(rng);
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
    State8 s = quantized(p, m, v);
    std::vector<float> m0(n), v0(n);  // the state the step starts from, decoded
    dequantize_moments(s.view(), n, m0.data(), v0.data());
    std::vector<std::uint16_t> out(n, 0xffff);
    adam_step_8bit(s.view(), g.data(), GradType::kFloat32, out.data(), n, h, 3);
    std::vector<float> m1(n), v1(n);
    dequantize_moments(s.view(), n, m1.data(), v1.data());
    const double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.99, 3);
    for (std::size_t i = 0; i < n; ++i) {
      double gi = g[i] / 2.0, pi = p[i];
      if (adamw) {
        pi -= 1e-2 * 0.1 * pi;
      } else {
        gi += 0.1 * p[i];
      }
      const double mi = m0[i] + 0.1 * (gi - m0[i]);
      const double vi = 0.99 * v0[i] + 0.01 * gi * gi;
      // fp32 against double: a few ulps of the larger of the weight and the update (they may cancel)
      const double update = 1e-2 / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + 1e-8);
      pi -= update;
      CHECK(std::fabs(s.master[i] - pi) <= 1e-6 * (std::fabs(pi) + std::fabs(update)));
      CHECK(out[i] == float_to_bf16(s.master[i]));
      const std::size_t b = i / kQuantBlock;
      CHECK(std::fabs(m1[i] - mi) <= (std::fabs(mi) * 0x1p-4 + s.m_scale[b] * 0x1p-10) * 1.001);
      const double r = std::sqrt(vi), r1 = std::sqrt(static_cast<double>(v1[i]));
      CHECK(std::fabs(r1 - r) <= (r * 0x1p-5 + s.v_scale[b] * 0x1p-19) * 1.001);
    }
  }
}

TEST(step_8bit_same_bits_for_threads_isas_and_in_place_gradient) {
  const std::size_t n = (1 << 20) + 4 * kQuantBlock + 13;
  std::vector<float> p0(n), m(n), v(n);
  fill_moments(m, v, 2, 1.5f);
  std::vector<std::uint16_t> g16(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = std::sin(0.001f * static_cast<float>(i));
    g16[i] = float_to_bf16(1e-3f * std::cos(static_cast<float>(i)));
  }
  AdamHyper h;
  h.step = 7;
  const State8 start = quantized(p0, m, v);
  std::vector<State8> results;
  std::vector<std::vector<std::uint16_t>> outs;
  for (CpuIsa isa : supported_isas()) {
    for (int threads : {1, 3, 16}) {
      State8 s = start;
      std::vector<std::uint16_t> out(n);
      adam_step_8bit(s.view(), g16.data(), GradType::kBFloat16, out.data(), n, h, threads, isa);
      results.push_back(s);
      outs.push_back(out);
    }
  }
  for (std::size_t k = 1; k < results.size(); ++k) CHECK(results[k] == results[0] && outs[k] == outs[0]);
  State8 s = start;
  std::vector<std::uint16_t> home = g16;  // the gradient lands in the parameter home
  adam_step_8bit(s.view(), home.data(), GradType::kBFloat16, home.data(), n, h, 3);
  CHECK(s == results[0] && home == outs[0]);
}

TEST(step_bf16_matches_a_double_precision_reference_and_rounds_like_deepspeed) {
  const std::size_t n = 100003;
  std::mt19937 rng(9);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<std::uint16_t> p(n), m(n), v(n);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = float_to_bf16(N(rng));
    m[i] = float_to_bf16(0.01f * N(rng));
    v[i] = float_to_bf16(1e-4f * std::fabs(N(rng)));
    g[i] = 0.01f * N(rng);
  }
  AdamHyper h;
  h.lr = 1e-2f;
  h.weight_decay = 0.01f;
  h.step = 5;
  std::vector<std::uint16_t> P = p, M = m, V = v;
  adam_step_bf16(P.data(), M.data(), V.data(), g.data(), GradType::kFloat32, nullptr, n, h, 3);
  const double bc1 = 1 - std::pow(0.9, 5), bc2 = 1 - std::pow(static_cast<double>(0.999f), 5);
  for (std::size_t i = 0; i < n; ++i) {
    double pi = bf16_to_float(p[i]);
    const double gi = g[i];
    pi -= 1e-2 * 0.01 * pi;
    const double mi = bf16_to_float(m[i]) + (1 - 0.9) * (gi - bf16_to_float(m[i]));
    const double vi = 0.999 * bf16_to_float(v[i]) + (1 - 0.999) * gi * gi;
    pi -= 1e-2 / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + 1e-8);
    // the fp32 result rounded once to bf16: within half a bf16 step (2^-8 relative) plus fp32 noise
    CHECK(std::fabs(bf16_to_float(P[i]) - pi) <= 0x1p-8 * std::fabs(pi) * 1.01 + 1e-7);
    CHECK(std::fabs(bf16_to_float(M[i]) - mi) <= 0x1p-8 * std::fabs(mi) * 1.01 + 1e-12);
    CHECK(std::fabs(bf16_to_float(V[i]) - vi) <= 0x1p-8 * vi * 1.01 + 1e-15);
  }
  for (CpuIsa isa : supported_isas()) {
    for (int threads : {1, 4}) {
      std::vector<std::uint16_t> P2 = p, M2 = m, V2 = v;
      adam_step_bf16(P2.data(), M2.data(), V2.data(), g.data(), GradType::kFloat32, nullptr, n, h, threads, isa);
      CHECK(P2 == P && M2 == M && V2 == V);
      std::vector<std::uint16_t> P3 = p, M3 = m, V3 = v, O(n, 0);  // the new weights written out in the same pass
      adam_step_bf16(P3.data(), M3.data(), V3.data(), g.data(), GradType::kFloat32, O.data(), n, h, threads, isa);
      CHECK(P3 == P && M3 == M && V3 == V && O == P);
    }
  }
  // a bf16 gradient in the weights' home, which receives the new weights: the same result as a
  // gradient elsewhere, on any split between threads
  std::vector<std::uint16_t> g16(n);
  for (std::size_t i = 0; i < n; ++i) g16[i] = float_to_bf16(g[i]);
  std::vector<std::uint16_t> Pr = p, Mr = m, Vr = v;
  adam_step_bf16(Pr.data(), Mr.data(), Vr.data(), g16.data(), GradType::kBFloat16, nullptr, n, h, 1);
  for (CpuIsa isa : supported_isas()) {
    for (int threads : {1, 3, 16}) {
      std::vector<std::uint16_t> P4 = p, M4 = m, V4 = v, home = g16;
      adam_step_bf16(P4.data(), M4.data(), V4.data(), home.data(), GradType::kBFloat16, home.data(), n, h, threads,
                     isa);
      CHECK(P4 == Pr && M4 == Mr && V4 == Vr && home == Pr);
    }
  }
}

TEST(isa_choice_is_explicit_and_checked) {
  const std::vector<CpuIsa> have = supported_isas();
  CHECK(!have.empty() && have.front() == CpuIsa::kGeneric);
  CHECK(resolve_isa(CpuIsa::kGeneric) == CpuIsa::kGeneric);
  CHECK(parse_isa("avx2") == CpuIsa::kAvx2 && parse_isa("auto") == CpuIsa::kAuto);
  CHECK_THROWS(std::invalid_argument, parse_isa("sse9"));
  const char* old = std::getenv("PYINFINITY_CPU_ISA");
  const std::string saved = old ? old : "";
  setenv("PYINFINITY_CPU_ISA", "generic", 1);
  CHECK(resolve_isa() == CpuIsa::kGeneric);
  CHECK(resolve_isa(have.back()) == have.back());  // an explicit request wins over the environment
  setenv("PYINFINITY_CPU_ISA", "fast", 1);
  CHECK_THROWS(std::invalid_argument, resolve_isa());
  if (old) {
    setenv("PYINFINITY_CPU_ISA", saved.c_str(), 1);
  } else {
    unsetenv("PYINFINITY_CPU_ISA");
  }
  CHECK(resolve_isa() == (old ? resolve_isa(parse_isa(saved)) : have.back()));
}

TEST(bad_arguments_throw) {
  State8 s(4);
  float g = 0;
  std::uint16_t b = 0;
  AdamHyper h;
  h.step = 0;
  CHECK_THROWS(std::invalid_argument, adam_step_8bit(s.view(), &g, GradType::kFloat32, nullptr, 4, h, 1));
  CHECK_THROWS(std::invalid_argument, adam_step_bf16(&b, &b, &b, &g, GradType::kFloat32, nullptr, 1, h, 1));
  h.step = 1;
  Adam8bitState missing = s.view();
  missing.exp_avg_sq_scale = nullptr;
  CHECK_THROWS(std::invalid_argument, adam_step_8bit(missing, &g, GradType::kFloat32, nullptr, 4, h, 1));
  adam_step_8bit(missing, nullptr, GradType::kFloat32, nullptr, 0, h, 1);  // nothing to step: fine
}
