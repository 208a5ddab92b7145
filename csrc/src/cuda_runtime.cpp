#include "pyinfinity/cuda_runtime.hpp"

#include <mutex>

#ifdef PYINFINITY_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pyinfinity::cuda {

#ifdef PYINFINITY_WITH_CUDA
namespace {
struct Probe {
  int count = 0;
  std::string status = "ok";
};
const Probe& probe() {
  static Probe p;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaError_t err = cudaGetDeviceCount(&p.count);
    if (err != cudaSuccess) {
      p.count = 0;
      p.status = std::string("no usable CUDA device: ") + cudaGetErrorString(err) + " (cudaError " +
                 std::to_string(static_cast<int>(err)) + ")";
      (void)cudaGetLastError();
    } else if (p.count == 0) {
      p.status = "no CUDA device found";
    }
  });
  return p;
}
}  // namespace

bool compiled() noexcept { return true; }
int device_count() noexcept { return probe().count; }
std::string status() { return probe().status; }

bool host_register(void* ptr, std::size_t nbytes, std::string* why) {
  if (device_count() == 0) {
    if (why) *why = status();
    return false;
  }
  cudaError_t err = cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    if (why) *why = cudaGetErrorString(err);
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

void host_unregister(void* ptr) noexcept {
  (void)cudaHostUnregister(ptr);
  (void)cudaGetLastError();
}
#else
bool compiled() noexcept { return false; }
int device_count() noexcept { return 0; }
std::string status() { return "pyinfinity was built without the CUDA toolkit"; }
bool host_register(void*, std::size_t, std::string* why) {
  if (why) *why = status();
  return false;
}
void host_unregister(void*) noexcept {}
#endif

}  // namespace pyinfinity::cuda
