// The 8bit and bf16 optimizer steps' CUDA kernels (device code only; cuda_adam.cu launches them).
// The element and the 8-bit codes are the CPU loops' own (detail_adam_element.inc), each
// operation here an explicitly rounded intrinsic (__fadd_rn, __fmul_rn, ...: never contracted
// into an FMA; cuda_adam.cu is also compiled with -fmad=false), the square root and the division
// correctly rounded, so a unit gives the same bits on the CPU, in torch and here.
//
// Not self-contained: the includer provides CUDA's device API first, cuda_fp16.h under nvcc
// (cuda_adam.cu), or the host-thread emulation of the C++ tests (tests/cpp/cuda_emulation.hpp),
// which runs these kernels on the CPU against the CPU kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pyinfinity/cuda_adam.hpp"
#include "pyinfinity/detail/adam_coeffs.hpp"

namespace pyinfinity::cuda {

namespace {

using detail::Coeffs;

constexpr int kThreads = static_cast<int>(kQuantBlock);  // the 8-bit step: a thread an element of a block
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "a quantisation block must be whole warps of one CUDA block");
constexpr int kWarps = kThreads / 32;
constexpr int kBf16Threads = 256;        // the bf16 step's threads a CUDA block
constexpr unsigned kMaxGrid = 1u << 20;  // CUDA blocks a launch; each strides over the rest

// The CUDA blocks a launch of `items` at `per_block` a block: one each, at most kMaxGrid (the
// kernels stride over the rest).
inline unsigned grid_for(std::size_t items, unsigned per_block) {
  const std::size_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
}

__device__ __forceinline__ float load_bf16(std::uint16_t h) {
  return __uint_as_float(static_cast<std::uint32_t>(h) << 16);
}

__device__ __forceinline__ std::uint16_t store_bf16(float f) {
  const std::uint32_t u = __float_as_uint(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// detail_adam_element.inc's operations on the device: the rounded intrinsics, never contracted
#define PYINF_EL __device__ __forceinline__
#define PYINF_BITS(f) __float_as_uint(f)
#define PYINF_FLOAT(u) __uint_as_float(u)
#define PYINF_ADD(a, b) __fadd_rn((a), (b))
#define PYINF_SUB(a, b) __fsub_rn((a), (b))
#define PYINF_MUL(a, b) __fmul_rn((a), (b))
#define PYINF_DIV(a, b) __fdiv_rn((a), (b))
#define PYINF_SQRT(a) __fsqrt_rn(a)
#include "detail_adam_element.inc"

template <GradType G>
__device__ __forceinline__ float load_grad(const void* grad, std::size_t i) {
  if constexpr (G == GradType::kBFloat16) {
    return load_bf16(static_cast<const std::uint16_t*>(grad)[i]);
  } else {
    return static_cast<const float*>(grad)[i];
  }
}

template <OutType O>
__device__ __forceinline__ void store_out(void* out, std::size_t i, float p) {
  if constexpr (O == OutType::kBFloat16) {
    static_cast<std::uint16_t*>(out)[i] = store_bf16(p);
  } else if constexpr (O == OutType::kFloat16) {
    static_cast<__half_raw*>(out)[i] = static_cast<__half_raw>(__float2half_rn(p));
  } else if constexpr (O == OutType::kFloat32) {
    static_cast<float*>(out)[i] = p;
  }
}

// The largest of a block's values (bits of magnitudes: an integer max, NaN above infinity) seen
// by every thread.
__device__ __forceinline__ void block_max(std::uint32_t& am, std::uint32_t& ar, std::uint32_t* sm,
                                          std::uint32_t* sr) {
  for (int off = 16; off > 0; off >>= 1) {
    am = max(am, __shfl_xor_sync(0xffffffffu, am, off));
    ar = max(ar, __shfl_xor_sync(0xffffffffu, ar, off));
  }
  const int warp = threadIdx.x / 32;
  if ((threadIdx.x & 31) == 0) {
    sm[warp] = am;
    sr[warp] = ar;
  }
  __syncthreads();
  am = sm[0];
  ar = sr[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    am = max(am, sm[w]);
    ar = max(ar, sr[w]);
  }
}

template <GradType G, OutType O>
__global__ void __launch_bounds__(kThreads) step_8bit(float* __restrict__ master, std::uint8_t* __restrict__ qm,
                                                      std::uint8_t* __restrict__ qr, float* __restrict__ m_scale,
                                                      float* __restrict__ r_scale, const void* grad, void* out,
                                                      std::size_t n, Coeffs c) {
  __shared__ std::uint32_t wm[kWarps], wr[kWarps];
  const std::size_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  for (std::size_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const std::size_t i = blk * kQuantBlock + threadIdx.x;
    const bool live = i < n;
    float p = 0.0f, m = 0.0f, v = 0.0f, root = 0.0f;
    if (live) {
      p = master[i];
      decode_element(qm[i], qr[i], m_scale[blk], r_scale[blk], m, v);
      adam_element(load_grad<G>(grad, i), p, m, v, root, c);
    }
    std::uint32_t am = live ? abs_bits(m) : 0u;
    std::uint32_t ar = live ? abs_bits(root) : 0u;
    block_max(am, ar, wm, wr);  // every thread read its block's old scales before this barrier
    const BlockScales bs = block_scales(am, ar);
    if (threadIdx.x == 0) {
      m_scale[blk] = bs.m_scale;
      r_scale[blk] = bs.r_scale;
    }
    if (live) {
      master[i] = p;
      qm[i] = static_cast<std::uint8_t>(exp_avg_code(m, bs));
      qr[i] = static_cast<std::uint8_t>(exp_avg_sq_code(root, bs));
      store_out<O>(out, i, p);
    }
    __syncthreads();  // the shared maxima are read before the next block writes them
  }
}

template <GradType G, bool Out>
__global__ void __launch_bounds__(kBf16Threads) step_bf16(std::uint16_t* __restrict__ param,
                                                          std::uint16_t* __restrict__ em,
                                                          std::uint16_t* __restrict__ ev, const void* grad,
                                                          std::uint16_t* out, std::size_t n, Coeffs c) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = load_grad<G>(grad, i);  // read before out (which may be the gradient) is written
    float p = load_bf16(param[i]), m = load_bf16(em[i]), v = load_bf16(ev[i]), root;
    adam_element(g, p, m, v, root, c);
    const std::uint16_t pb = store_bf16(p);
    param[i] = pb;
    em[i] = store_bf16(m);
    ev[i] = store_bf16(v);
    if constexpr (Out) out[i] = pb;
  }
}

}  // namespace

}  // namespace pyinfinity::cuda
