// The few CUDA runtime calls the core needs, behind functions that exist in every build: without
// the toolkit at build time, or without a device at run time, device_count() is 0 and the
// CUDA-only calls throw CudaError with the reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyinfinity::cuda {

bool compiled() noexcept;
/// Number of usable devices; 0 when none, or when the driver is missing (the reason in status()).
int device_count() noexcept;
/// Why device_count() is 0 ("built without CUDA", "CUDA driver version is insufficient ...").
std::string status();
/// Page-locks host memory for the GPU; false (reason in *why) when it cannot.
bool host_register(void* ptr, std::size_t nbytes, std::string* why);
void host_unregister(void* ptr) noexcept;

}  // namespace pyinfinity::cuda
