// The fp32 step (adam_step); the 8bit and bf16 steps are in cpu_adam_formats.cpp.
#include "pyinfinity/cpu_adam.hpp"

#include <cstring>

#include "pyinfinity/detail/adam_coeffs.hpp"
#include "pyinfinity/detail/parallel_chunks.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity {

namespace {

using detail::Coeffs;

#define PYINF_ISA_LOOPS "detail_cpu_adam_loop.inc"
#include "detail_isa_dispatch.inc"

template <GradType G, bool Out>
void step_range(CpuIsa isa, float* master, float* m, float* v, const void* grad, std::uint16_t* out,
                std::size_t begin, std::size_t end, const Coeffs& c) {
  PYINF_DISPATCH(isa, step_range<G, Out>(master, m, v, grad, out, begin, end, c));
}

}  // namespace

std::uint16_t float_to_bf16(float f) { return generic::store_bf16(f); }

float bf16_to_float(std::uint16_t h) { return generic::load_bf16(h); }

void adam_step(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, GradType grad_type,
               std::uint16_t* out_bf16, std::size_t n, const AdamHyper& h, int threads, CpuIsa isa) {
  const Coeffs c = detail::adam_coeffs(h, "adam_step");
  PYINF_EXPECT(n == 0 || (master && exp_avg && exp_avg_sq && grad), "adam_step: null pointer");
  const CpuIsa use = resolve_isa(isa);
  auto run = [&](std::size_t b, std::size_t e) {
    const bool bf16 = grad_type == GradType::kBFloat16;
    if (bf16 && out_bf16) {
      step_range<GradType::kBFloat16, true>(use, master, exp_avg, exp_avg_sq, grad, out_bf16, b, e, c);
    } else if (bf16) {
      step_range<GradType::kBFloat16, false>(use, master, exp_avg, exp_avg_sq, grad, nullptr, b, e, c);
    } else if (out_bf16) {
      step_range<GradType::kFloat32, true>(use, master, exp_avg, exp_avg_sq, grad, out_bf16, b, e, c);
    } else {
      step_range<GradType::kFloat32, false>(use, master, exp_avg, exp_avg_sq, grad, nullptr, b, e, c);
    }
  };
  detail::parallel_chunks(n, threads, 64, run);  // chunks of whole cache lines of every array
}

namespace {

inline float widen_bf16(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

void accumulate_grad(float* dst, const void* src, GradType src_type, std::size_t n, bool copy, int threads) {
  PYINF_EXPECT(n == 0 || (dst && src), "accumulate_grad: null pointer");
  auto run = [&](std::size_t b, std::size_t e) {
    if (src_type == GradType::kBFloat16) {
      const auto* s = static_cast<const std::uint16_t*>(src);
      if (copy) {
        for (std::size_t i = b; i < e; ++i) dst[i] = widen_bf16(s[i]);
      } else {
        for (std::size_t i = b; i < e; ++i) dst[i] += widen_bf16(s[i]);
      }
    } else {
      const auto* s = static_cast<const float*>(src);
      if (copy) {
        std::memcpy(dst + b, s + b, (e - b) * sizeof(float));
      } else {
        for (std::size_t i = b; i < e; ++i) dst[i] += s[i];
      }
    }
  };
  detail::parallel_chunks(n, threads, 16, run);  // whole cache lines of dst a chunk
}

}  // namespace pyinfinity
