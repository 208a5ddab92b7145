// The 8bit and bf16 steps (adam_step_8bit, adam_step_bf16) and the 8-bit codes. Compiled with
// -ffp-contract=off (CMakeLists.txt): every instruction set's loop and the pure-torch reference
// round each operation, so they compute the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "pyinfinity/cpu_adam.hpp"
#include "pyinfinity/detail/adam_coeffs.hpp"
#include "pyinfinity/detail/parallel_chunks.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity {

namespace {

using detail::Coeffs;

// detail_adam_element.inc's operations on the CPU: plain fp32 operators (this file is compiled
// with -ffp-contract=off, so none becomes an FMA) and GCC's bit cast
#define PYINF_EL inline
#define PYINF_BITS(f) __builtin_bit_cast(std::uint32_t, (f))
#define PYINF_FLOAT(u) __builtin_bit_cast(float, (u))
#define PYINF_ADD(a, b) ((a) + (b))
#define PYINF_SUB(a, b) ((a) - (b))
#define PYINF_MUL(a, b) ((a) * (b))
#define PYINF_DIV(a, b) ((a) / (b))
#define PYINF_SQRT(a) std::sqrt(a)
#define PYINF_ISA_LOOPS "detail_cpu_adam_formats_loop.inc"
#include "detail_isa_dispatch.inc"

void check_state(const Adam8bitState& s, std::size_t n, const char* what) {
  PYINF_EXPECT(n == 0 || (s.master && s.exp_avg && s.exp_avg_sq && s.exp_avg_scale && s.exp_avg_sq_scale),
               std::string(what) + ": null pointer");
}

}  // namespace

void adam_step_8bit(const Adam8bitState& s, const void* grad, GradType grad_type, std::uint16_t* out_bf16,
                    std::size_t n, const AdamHyper& h, int threads, CpuIsa isa) {
  const Coeffs c = detail::adam_coeffs(h, "adam_step_8bit");
  check_state(s, n, "adam_step_8bit");
  PYINF_EXPECT(n == 0 || grad, "adam_step_8bit: null pointer");
  const CpuIsa use = resolve_isa(isa);
  const bool bf16 = grad_type == GradType::kBFloat16;
  auto run = [&](std::size_t b, std::size_t e) {
    if (bf16 && out_bf16) {
      PYINF_DISPATCH(use, step_range_8bit<GradType::kBFloat16, true>(s, grad, out_bf16, b, e, c));
    } else if (bf16) {
      PYINF_DISPATCH(use, step_range_8bit<GradType::kBFloat16, false>(s, grad, nullptr, b, e, c));
    } else if (out_bf16) {
      PYINF_DISPATCH(use, step_range_8bit<GradType::kFloat32, true>(s, grad, out_bf16, b, e, c));
    } else {
      PYINF_DISPATCH(use, step_range_8bit<GradType::kFloat32, false>(s, grad, nullptr, b, e, c));
    }
  };
  detail::parallel_chunks(n, threads, kQuantBlock, run);  // a block is never split between threads
}

void quantize_moments(const float* exp_avg, const float* exp_avg_sq, std::size_t n, const Adam8bitState& s,
                      int threads, CpuIsa isa) {
  PYINF_EXPECT(n == 0 || (exp_avg && exp_avg_sq && s.exp_avg && s.exp_avg_sq && s.exp_avg_scale &&
                          s.exp_avg_sq_scale),
               "quantize_moments: null pointer");
  const CpuIsa use = resolve_isa(isa);
  detail::parallel_chunks(n, threads, kQuantBlock, [&](std::size_t b, std::size_t e) {
    PYINF_DISPATCH(use, quantize_range(exp_avg, exp_avg_sq, s, b, e));
  });
}

void dequantize_moments(const Adam8bitState& s, std::size_t n, float* exp_avg, float* exp_avg_sq, int threads,
                        CpuIsa isa) {
  PYINF_EXPECT(n == 0 || (exp_avg && exp_avg_sq && s.exp_avg && s.exp_avg_sq && s.exp_avg_scale &&
                          s.exp_avg_sq_scale),
               "dequantize_moments: null pointer");
  const CpuIsa use = resolve_isa(isa);
  detail::parallel_chunks(n, threads, kQuantBlock, [&](std::size_t b, std::size_t e) {
    PYINF_DISPATCH(use, dequantize_range(s, exp_avg, exp_avg_sq, b, e));
  });
}

void adam_step_bf16(std::uint16_t* param, std::uint16_t* exp_avg, std::uint16_t* exp_avg_sq, const void* grad,
                    GradType grad_type, std::uint16_t* out_bf16, std::size_t n, const AdamHyper& h, int threads,
                    CpuIsa isa) {
  const Coeffs c = detail::adam_coeffs(h, "adam_step_bf16");
  PYINF_EXPECT(n == 0 || (param && exp_avg && exp_avg_sq && grad), "adam_step_bf16: null pointer");
  const CpuIsa use = resolve_isa(isa);
  const bool bf16 = grad_type == GradType::kBFloat16;
  auto run = [&](std::size_t b, std::size_t e) {
    if (bf16 && out_bf16) {
      PYINF_DISPATCH(use, step_range_bf16<GradType::kBFloat16, true>(param, exp_avg, exp_avg_sq, grad, out_bf16, b,
                                                                      e, c));
    } else if (bf16) {
      PYINF_DISPATCH(use, step_range_bf16<GradType::kBFloat16, false>(param, exp_avg, exp_avg_sq, grad, nullptr, b,
                                                                       e, c));
    } else if (out_bf16) {
      PYINF_DISPATCH(use, step_range_bf16<GradType::kFloat32, true>(param, exp_avg, exp_avg_sq, grad, out_bf16, b,
                                                                     e, c));
    } else {
      PYINF_DISPATCH(use, step_range_bf16<GradType::kFloat32, false>(param, exp_avg, exp_avg_sq, grad, nullptr, b,
                                                                      e, c));
    }
  };
  detail::parallel_chunks(n, threads, 64, run);
}

std::uint8_t encode_e4m3(float x) { return static_cast<std::uint8_t>(generic::encode_e4m3_bits(x)); }
float decode_e4m3(std::uint8_t code) { return generic::decode_e4m3_bits(code); }
std::uint8_t encode_ue4m4(float x) { return static_cast<std::uint8_t>(generic::encode_ue4m4_bits(x)); }
float decode_ue4m4(std::uint8_t code) { return generic::decode_ue4m4_bits(code); }

}  // namespace pyinfinity
