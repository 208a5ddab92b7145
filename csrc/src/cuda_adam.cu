// The 8bit and bf16 optimizer steps on a CUDA device (cuda_adam.hpp): the launches of the
// kernels of detail_cuda_adam_kernels.cuh, which compute the CPU kernels' bits (this file is also
// compiled with -fmad=false).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "detail_cuda_adam_kernels.cuh"
#include "pyinfinity/cuda_adam.hpp"
#include "pyinfinity/detail/adam_coeffs.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity::cuda {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    const std::string msg = std::string(what) + ": " + cudaGetErrorString(err) + " (cudaError " +
                            std::to_string(static_cast<int>(err)) + ")";
    (void)cudaGetLastError();
    throw CudaError(msg);
  }
}

// the device's current device is per runtime and thread: this static runtime's is set to the
// tensors' device before each launch (torch's setting is its own runtime's)
void use_device(int device, const char* what) { check(cudaSetDevice(device), what); }

template <GradType G>
void launch_8bit(const Adam8bitState& s, const void* grad, void* out, OutType ot, std::size_t n, const Coeffs& c,
                 cudaStream_t st) {
  const unsigned grid = grid_for(n, kQuantBlock);
  switch (ot) {
    case OutType::kNone:
      step_8bit<G, OutType::kNone><<<grid, kThreads, 0, st>>>(s.master, s.exp_avg, s.exp_avg_sq, s.exp_avg_scale,
                                                               s.exp_avg_sq_scale, grad, out, n, c);
      break;
    case OutType::kBFloat16:
      step_8bit<G, OutType::kBFloat16><<<grid, kThreads, 0, st>>>(s.master, s.exp_avg, s.exp_avg_sq,
                                                                   s.exp_avg_scale, s.exp_avg_sq_scale, grad, out,
                                                                   n, c);
      break;
    case OutType::kFloat16:
      step_8bit<G, OutType::kFloat16><<<grid, kThreads, 0, st>>>(s.master, s.exp_avg, s.exp_avg_sq, s.exp_avg_scale,
                                                                  s.exp_avg_sq_scale, grad, out, n, c);
      break;
    case OutType::kFloat32:
      step_8bit<G, OutType::kFloat32><<<grid, kThreads, 0, st>>>(s.master, s.exp_avg, s.exp_avg_sq, s.exp_avg_scale,
                                                                  s.exp_avg_sq_scale, grad, out, n, c);
      break;
  }
}

}  // namespace

bool adam_kernels_compiled() noexcept { return true; }

void adam_step_8bit(const Adam8bitState& s, const void* grad, GradType grad_type, void* out, OutType out_type,
                    std::size_t n, const AdamHyper& h, int device, std::uintptr_t stream) {
  const Coeffs c = detail::adam_coeffs(h, "cuda adam_step_8bit");
  if (n == 0) return;
  PYINF_EXPECT(s.master && s.exp_avg && s.exp_avg_sq && s.exp_avg_scale && s.exp_avg_sq_scale && grad,
               "cuda adam_step_8bit: null pointer");
  PYINF_EXPECT(out_type == OutType::kNone || out, "cuda adam_step_8bit: out is null but has a dtype");
  use_device(device, "cuda adam_step_8bit: cudaSetDevice");
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  if (grad_type == GradType::kBFloat16) {
    launch_8bit<GradType::kBFloat16>(s, grad, out, out_type, n, c, st);
  } else {
    launch_8bit<GradType::kFloat32>(s, grad, out, out_type, n, c, st);
  }
  check(cudaGetLastError(), "cuda adam_step_8bit: launch");
}

void adam_step_bf16(std::uint16_t* param, std::uint16_t* exp_avg, std::uint16_t* exp_avg_sq, const void* grad,
                    GradType grad_type, std::uint16_t* out_bf16, std::size_t n, const AdamHyper& h, int device,
                    std::uintptr_t stream) {
  const Coeffs c = detail::adam_coeffs(h, "cuda adam_step_bf16");
  if (n == 0) return;
  PYINF_EXPECT(param && exp_avg && exp_avg_sq && grad, "cuda adam_step_bf16: null pointer");
  use_device(device, "cuda adam_step_bf16: cudaSetDevice");
  const auto st = reinterpret_cast<cudaStream_t>(stream);
  const unsigned grid = grid_for(n, kBf16Threads);
  const bool bf16 = grad_type == GradType::kBFloat16;
  if (bf16 && out_bf16) {
    step_bf16<GradType::kBFloat16, true><<<grid, kBf16Threads, 0, st>>>(param, exp_avg, exp_avg_sq, grad,
                                                                        out_bf16, n, c);
  } else if (bf16) {
    step_bf16<GradType::kBFloat16, false><<<grid, kBf16Threads, 0, st>>>(param, exp_avg, exp_avg_sq, grad,
                                                                         nullptr, n, c);
  } else if (out_bf16) {
    step_bf16<GradType::kFloat32, true><<<grid, kBf16Threads, 0, st>>>(param, exp_avg, exp_avg_sq, grad,
                                                                       out_bf16, n, c);
  } else {
    step_bf16<GradType::kFloat32, false><<<grid, kBf16Threads, 0, st>>>(param, exp_avg, exp_avg_sq, grad,
                                                                        nullptr, n, c);
  }
  check(cudaGetLastError(), "cuda adam_step_bf16: launch");
}

}  // namespace pyinfinity::cuda
