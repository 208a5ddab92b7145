// The instruction set the CPU optimizer steps run with. Their loops are compiled once per set
// (the x86-64 baseline, AVX2+FMA, AVX-512) and one is picked at run time: the best this CPU
// supports, or the one PYINFINITY_CPU_ISA (or a caller) asks for, so a machine with AVX-512 can
// test the AVX2 path too.
#pragma once

#include <string>
#include <vector>

namespace pyinfinity {

enum class CpuIsa { kAuto = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3 };

/// "auto", "generic", "avx2", "avx512".
const char* isa_name(CpuIsa isa);

/// The ISA a name means ("auto", "generic", "avx2", "avx512"); ArgumentError naming `what` otherwise.
CpuIsa parse_isa(const std::string& name, const char* what = "isa");

/// Whether the loops were compiled for `isa` and this CPU runs them (kAuto and kGeneric: always).
bool isa_supported(CpuIsa isa);

/// Every ISA usable here, baseline first.
std::vector<CpuIsa> supported_isas();

/// The ISA a step runs with: `requested` when it is not kAuto, else PYINFINITY_CPU_ISA when set
/// to something other than "auto", else the best supported. Asking for one this CPU lacks is an
/// ArgumentError (a forced path never silently falls back).
CpuIsa resolve_isa(CpuIsa requested = CpuIsa::kAuto);

}  // namespace pyinfinity
