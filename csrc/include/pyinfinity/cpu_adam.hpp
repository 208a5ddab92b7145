// Adam/AdamW on the CPU in one pass over memory: fp32 master weights and moments, a gradient in
// bf16 or fp32, and (optionally) the new weights written out in bf16 in the same pass. This is the
// optimizer step of the offloaded training state: reading a bf16 gradient and writing the bf16
// weights directly saves the two extra passes a convert + step + cast sequence makes (40 -> 28
// bytes of memory traffic per parameter). Raw pointers and sizes only (no torch types).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyinfinity {

enum class GradType { kFloat32 = 0, kBFloat16 = 1 };

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;        // decoupled weight decay (AdamW) or L2 added to the gradient (Adam)
  std::int64_t step = 1;    // the step being taken (1 for the first), for the bias corrections
  float grad_scale = 1.0f;  // the gradient is divided by this (loss scale x clipping), as torch's fused Adam does
};

// Steps n parameters in place. master, exp_avg, exp_avg_sq: fp32 arrays of n; grad: n elements
// of grad_type; out_bf16: n bf16 values written with the new weights (round to nearest even), or
// nullptr. grad and out_bf16 may be the same memory (each element is read before it is written).
// threads <= 1 steps on the calling thread; more split the range in contiguous chunks.
void adam_step(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, GradType grad_type,
               std::uint16_t* out_bf16, std::size_t n, const AdamHyper& hyper, int threads);

// bf16 <-> fp32 as torch converts (round to nearest even; NaN stays NaN).
std::uint16_t float_to_bf16(float f);
float bf16_to_float(std::uint16_t h);

}  // namespace pyinfinity
