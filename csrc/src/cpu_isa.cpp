#include "pyinfinity/cpu_isa.hpp"

#include "pyinfinity/defaults.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity {

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto: return "auto";
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

CpuIsa parse_isa(const std::string& name, const char* what) {
  for (CpuIsa isa : {CpuIsa::kAuto, CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  PYINF_EXPECT(false, std::string(what) + ": expected auto, avx512, avx2 or generic, got '" + name + "'");
  return CpuIsa::kAuto;
}

bool isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kGeneric:
      return true;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    case CpuIsa::kAvx2: {
      static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
      return ok;
    }
    case CpuIsa::kAvx512: {
      static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
      return ok;
    }
#else
    default:
      return false;
#endif
  }
  return false;
}

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

CpuIsa resolve_isa(CpuIsa requested) {
  CpuIsa isa = requested;
  const char* source = "isa";
  if (isa == CpuIsa::kAuto) {
    isa = parse_isa(defaults::cpu_isa(), "PYINFINITY_CPU_ISA");
    source = "PYINFINITY_CPU_ISA";
  }
  if (isa == CpuIsa::kAuto) return supported_isas().back();
  if (!isa_supported(isa)) {
    std::string have;
    for (CpuIsa i : supported_isas()) have += std::string(have.empty() ? "" : ", ") + isa_name(i);
    PYINF_EXPECT(false, std::string(source) + ": this CPU (or this build) has no " + isa_name(isa) +
                            " path; supported here: " + have);
  }
  return isa;
}

}  // namespace pyinfinity
