// The compressed optimizer states' steps on a CUDA device (units whose state lives there): one
// kernel a format, the same operations in the same order as the CPU kernels (cpu_adam.hpp), each
// rounded (no FMA contraction), so a unit computes the same bits wherever it steps. Every pointer
// is device memory of one device; the kernel is queued on `stream` (a cudaStream_t, e.g. torch's
// current stream) and these calls return without waiting for it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pyinfinity/cpu_adam.hpp"

namespace pyinfinity::cuda {

/// The dtype a step writes the new weights in (the unit's device buffer), or none.
enum class OutType { kNone = 0, kBFloat16 = 1, kFloat16 = 2, kFloat32 = 3 };

/// Whether this build has the kernels (built with the CUDA toolkit's compiler).
bool adam_kernels_compiled() noexcept;

/// adam_step_8bit (cpu_adam.hpp) on `device`: a thread block a quantisation block, the block's
/// new scales from a reduction of its elements. `out` (OutType `out_type`) may not overlap the
/// state; the gradient may be `out` itself. Throws CudaError when the launch fails.
void adam_step_8bit(const Adam8bitState& s, const void* grad, GradType grad_type, void* out, OutType out_type,
                    std::size_t n, const AdamHyper& h, int device, std::uintptr_t stream);

/// adam_step_bf16 (cpu_adam.hpp) on `device`; `out_bf16` (null: none) receives the new weights and
/// may be the gradient.
void adam_step_bf16(std::uint16_t* param, std::uint16_t* exp_avg, std::uint16_t* exp_avg_sq, const void* grad,
                    GradType grad_type, std::uint16_t* out_bf16, std::size_t n, const AdamHyper& h, int device,
                    std::uintptr_t stream);

}  // namespace pyinfinity::cuda
