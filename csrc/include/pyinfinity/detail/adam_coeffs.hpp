// The per-step constants every CPU Adam loop uses, computed once per call in one place, so the
// state formats step with the same numbers.
#pragma once

#include <cmath>

#include "pyinfinity/cpu_adam.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity::detail {

struct Coeffs {
  float lr, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt, scale;
  float decay;  // AdamW: lr * weight_decay (decoupled), else 0
  float l2;     // Adam: weight_decay added to the gradient, else 0
  // the 8bit and bf16 steps multiply where the fp32 step divides (one division a parameter, not three)
  float inv_scale;       // 1 / scale
  float inv_bias2_sqrt;  // 1 / bias2_sqrt
};

/// The constants of step h.step (bias corrections in double, then fp32); `what` names the caller
/// in the errors of a bad step or gradient scale.
inline Coeffs adam_coeffs(const AdamHyper& h, const char* what) {
  PYINF_EXPECT(h.step >= 1, std::string(what) + ": step must be >= 1");
  PYINF_EXPECT(h.grad_scale > 0.0f && std::isfinite(h.grad_scale),
               std::string(what) + ": grad_scale must be a positive number");
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  return Coeffs{h.lr, 1.0f - h.beta1, h.beta2, 1.0f - h.beta2, h.eps, static_cast<float>(h.lr / bc1),
                static_cast<float>(std::sqrt(bc2)), h.grad_scale, h.adamw ? h.lr * h.weight_decay : 0.0f,
                h.adamw ? 0.0f : h.weight_decay, static_cast<float>(1.0 / static_cast<double>(h.grad_scale)),
                static_cast<float>(1.0 / std::sqrt(bc2))};
}

}  // namespace pyinfinity::detail
