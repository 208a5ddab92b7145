// The CUDA steps of the compressed optimizer states in a build without the CUDA compiler: callers
// see adam_kernels_compiled() false and take the torch step.
#include "pyinfinity/cuda_adam.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity::cuda {

bool adam_kernels_compiled() noexcept { return false; }

void adam_step_8bit(const Adam8bitState&, const void*, GradType, void*, OutType, std::size_t, const AdamHyper&, int,
                    std::uintptr_t) {
  throw CudaError("adam_step_8bit on a CUDA device: pyinfinity was built without the CUDA kernels");
}

void adam_step_bf16(std::uint16_t*, std::uint16_t*, std::uint16_t*, const void*, GradType, std::uint16_t*, std::size_t,
                    const AdamHyper&, int, std::uintptr_t) {
  throw CudaError("adam_step_bf16 on a CUDA device: pyinfinity was built without the CUDA kernels");
}

}  // namespace pyinfinity::cuda
