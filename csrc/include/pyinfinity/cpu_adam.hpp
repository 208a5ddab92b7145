// Adam/AdamW on the CPU in one pass over memory, for each format the optimizer state can take:
//
// - fp32 (the default, exact): fp32 master weights and moments, 12 bytes a parameter
//   (adam_step);
// - 8bit: the fp32 master, and the two moments block-wise quantised to a byte each plus one fp32
//   scale per moment and kQuantBlock parameters, 6.03 bytes (adam_step_8bit);
// - bf16: the bf16 weights are the master, the moments bf16 too (DeepSpeed's
//   bf16_master_weights_and_grads + bf16_optimizer_states), 6 bytes (adam_step_bf16).
//
// Each reads the gradient (bf16 or fp32) as it is, steps in fp32, and writes the state back in
// the same pass; the fp32 and 8bit steps also write the new bf16 weights when asked (reading a
// bf16 gradient and writing bf16 weights directly saves the two passes a convert + step + cast
// sequence makes: 40 -> 28 bytes of memory traffic a parameter for fp32, 16 for 8bit). Raw
// pointers and sizes only (no torch types).
//
// The 8-bit code (docs/optimizer_state.md has the measurements behind it). Each block of
// kQuantBlock parameters (counted from the start of the arrays) has two fp32 scales:
// - exp_avg is stored as an 8-bit float E4M3 (sign, 4 exponent bits, 3 mantissa bits; bias 7,
//   subnormals, largest 448: torch.float8_e4m3fn's encoding of finite values) of exp_avg / scale,
//   scale = absmax / 448, rounded to nearest even;
// - exp_avg_sq is stored as its square root, an unsigned 8-bit float E4M4 (4 exponent bits, 4
//   mantissa bits, bias 15, subnormals, largest 1.9375) of sqrt(exp_avg_sq) / scale, scale =
//   absmax(sqrt) / 1.9375, rounded to nearest even, except that a non-zero value never becomes 0
//   (the smallest code instead: m / sqrt(v) stays bounded).
// Both are floats: every element keeps the same relative precision (2^-4 for the first moment, 2^-5
// for the root of the second) over a range of 2.3e5 (E4M3) and 5.1e5 (the root, 2.6e11 in v)
// below its block's largest, where the update m / sqrt(v) of each element counts the same.
// Encoding and decoding are bit arithmetic, no table lookups, so every instruction set vectorises
// them, and each ISA's loop computes the same bits as the pure-torch reference
// (pyinfinity.zero.state_formats). A non-finite value poisons its block (the scale becomes NaN), as
// it poisons its element in fp32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pyinfinity/cpu_isa.hpp"

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
// threads <= 1 steps on the calling thread; more split the range in contiguous chunks. isa: the
// instruction set (resolve_isa).
void adam_step(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, GradType grad_type,
               std::uint16_t* out_bf16, std::size_t n, const AdamHyper& hyper, int threads,
               CpuIsa isa = CpuIsa::kAuto);

// ----------------------------------------------------------------------------- 8bit

/// Parameters per quantisation block (one pair of scales each): a few KiB of L1 per block, scales
/// 8 bytes per 256 parameters (0.03 bytes a parameter).
constexpr std::size_t kQuantBlock = 256;
constexpr float kExpAvgCodeMax = 448.0f;     // the largest E4M3 value
constexpr float kExpAvgSqCodeMax = 1.9375f;  // the largest unsigned E4M4 value (of the root)

constexpr std::size_t quant_blocks(std::size_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

/// The 8-bit state of n parameters: five arrays, any memory (the optimizer lays them out).
struct Adam8bitState {
  float* master = nullptr;                 // n fp32
  std::uint8_t* exp_avg = nullptr;         // n E4M3 codes
  std::uint8_t* exp_avg_sq = nullptr;      // n unsigned E4M4 codes of the square root
  float* exp_avg_scale = nullptr;          // quant_blocks(n) fp32
  float* exp_avg_sq_scale = nullptr;       // quant_blocks(n) fp32
};

// Steps n parameters of the 8-bit state in place: each block's moments decoded, stepped in fp32
// (the update uses the new fp32 moments, as bitsandbytes' blockwise kernels do), re-encoded with
// the block's new scales; the master stays fp32. grad and out_bf16 as in adam_step. The result does
// not depend on threads or isa (each ISA's loop computes the same bits).
void adam_step_8bit(const Adam8bitState& state, const void* grad, GradType grad_type, std::uint16_t* out_bf16,
                    std::size_t n, const AdamHyper& hyper, int threads, CpuIsa isa = CpuIsa::kAuto);

/// fp32 moments -> the 8-bit state's codes and scales (state.master is not touched).
void quantize_moments(const float* exp_avg, const float* exp_avg_sq, std::size_t n, const Adam8bitState& state,
                      int threads = 1, CpuIsa isa = CpuIsa::kAuto);
/// The 8-bit state's codes and scales -> fp32 moments.
void dequantize_moments(const Adam8bitState& state, std::size_t n, float* exp_avg, float* exp_avg_sq,
                        int threads = 1, CpuIsa isa = CpuIsa::kAuto);

// ----------------------------------------------------------------------------- bf16

// Steps n parameters whose master is the bf16 weights themselves and whose moments are bf16
// (DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states): each value read as fp32,
// stepped in fp32, written back rounded to nearest even as DeepSpeed's CPU Adam does. param,
// exp_avg, exp_avg_sq: n bf16 each; grad must not overlap them. out_bf16 (may be null, may be
// grad itself): n bf16 that receive the new weights in the same pass (the weights' home). The
// result does not depend on threads or isa.
void adam_step_bf16(std::uint16_t* param, std::uint16_t* exp_avg, std::uint16_t* exp_avg_sq, const void* grad,
                    GradType grad_type, std::uint16_t* out_bf16, std::size_t n, const AdamHyper& hyper, int threads,
                    CpuIsa isa = CpuIsa::kAuto);

// ----------------------------------------------------------------------------- accumulation

// dst[i] += src[i] (dst[i] = src[i] with copy) over n elements: dst fp32, src of src_type (a bf16
// value widened exactly). One pass over both arrays, no temporary; each element is converted and
// added once, so the sums are those of torch's dst.add_(src) bit for bit, for any threads.
void accumulate_grad(float* dst, const void* src, GradType src_type, std::size_t n, bool copy, int threads);

// ----------------------------------------------------------------------------- conversions

// bf16 <-> fp32 as torch converts (round to nearest even; NaN stays NaN).
std::uint16_t float_to_bf16(float f);
float bf16_to_float(std::uint16_t h);

// One value of the 8-bit codes (for tests and conversions). encode_*: rounded to nearest even;
// magnitudes above the code's largest value, infinities and NaN saturate to it (a non-finite
// moment reaches the state through its block's NaN scale; E4M3's NaN codes are never written).
std::uint8_t encode_e4m3(float x);
float decode_e4m3(std::uint8_t code);
std::uint8_t encode_ue4m4(float x);  // x >= 0
float decode_ue4m4(std::uint8_t code);

}  // namespace pyinfinity
