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

namespace generic {
#include "detail_cpu_adam_formats_loop.inc"
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYINF_HAVE_X86_LOOPS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "detail_cpu_adam_formats_loop.inc"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")
namespace avx512 {
#include "detail_cpu_adam_formats_loop.inc"
}  // namespace avx512
#pragma GCC pop_options
#endif

// PYINF_DISPATCH(isa, fn<...>(args)): the call in the namespace compiled for `isa`.
#ifdef PYINF_HAVE_X86_LOOPS
#define PYINF_DISPATCH(isa, ...)          \
  do {                                    \
    if ((isa) == CpuIsa::kAvx512) {       \
      avx512::__VA_ARGS__;                \
    } else if ((isa) == CpuIsa::kAvx2) {  \
      avx2::__VA_ARGS__;                  \
    } else {                              \
      generic::__VA_ARGS__;               \
    }                                     \
  } while (0)
#else
#define PYINF_DISPATCH(isa, ...) generic::__VA_ARGS__
#endif

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
                    GradType grad_type, std::size_t n, const AdamHyper& h, int threads, CpuIsa isa) {
  const Coeffs c = detail::adam_coeffs(h, "adam_step_bf16");
  PYINF_EXPECT(n == 0 || (param && exp_avg && exp_avg_sq && grad), "adam_step_bf16: null pointer");
  const CpuIsa use = resolve_isa(isa);
  const bool bf16 = grad_type == GradType::kBFloat16;
  auto run = [&](std::size_t b, std::size_t e) {
    if (bf16) {
      PYINF_DISPATCH(use, step_range_bf16<GradType::kBFloat16>(param, exp_avg, exp_avg_sq, grad, b, e, c));
    } else {
      PYINF_DISPATCH(use, step_range_bf16<GradType::kFloat32>(param, exp_avg, exp_avg_sq, grad, b, e, c));
    }
  };
  detail::parallel_chunks(n, threads, 64, run);
}

std::uint8_t encode_e4m3(float x) { return static_cast<std::uint8_t>(generic::encode_e4m3_bits(x)); }
float decode_e4m3(std::uint8_t code) { return generic::decode_e4m3_bits(code); }
std::uint8_t encode_ue4m4(float x) { return static_cast<std::uint8_t>(generic::encode_ue4m4_bits(x)); }
float decode_ue4m4(std::uint8_t code) { return generic::decode_ue4m4_bits(code); }

}  // namespace pyinfinity
