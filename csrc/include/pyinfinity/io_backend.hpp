// IoBackend: one interface over the kernel's asynchronous I/O paths. A backend moves bytes
// between a file descriptor and memory; it knows nothing of tensors, splitting or retries
// (SwapEngine does those, in one place). Every completion carries bytes (>= 0) or -errno.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pyinfinity {

struct IoRequest {
  int fd = -1;
  void* buf = nullptr;
  std::size_t nbytes = 0;
  std::int64_t offset = 0;
  bool write = false;
  std::uint64_t tag = 0;  // returned in the completion
};

struct IoCompletion {
  std::uint64_t tag = 0;
  std::int64_t res = 0;  // bytes transferred, or -errno
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const noexcept = 0;
  /// Most requests that may be in flight at once.
  virtual std::size_t capacity() const noexcept = 0;
  /// Queues n requests; the caller keeps in-flight requests <= capacity(). A request the kernel
  /// rejects at submission comes back as a completion with -errno, never as an exception.
  virtual void submit(const IoRequest* reqs, std::size_t n) = 0;
  /// Waits for at least min_n completions (or timeout_ms, -1 = forever), writes up to max_n into
  /// out and returns how many it wrote.
  virtual std::size_t reap(IoCompletion* out, std::size_t max_n, std::size_t min_n,
                           int timeout_ms) = 0;
};

/// "aio", "uring" or "posix" (not "auto": resolve it with probe_backend first).
std::unique_ptr<IoBackend> make_backend(const std::string& name, std::size_t queue_depth);

/// Backends compiled into this build, in order of preference.
std::vector<std::string> compiled_backends();

/// Result of probing one directory: which backends completed a small O_DIRECT round trip.
struct ProbeResult {
  std::string best;                  // the backend "auto" picks for this directory
  bool direct_io = false;            // O_DIRECT supported by the filesystem
  std::vector<std::string> working;  // backends that passed the round trip
  std::vector<std::string> failures; // "backend: reason" for those that did not
};

/// Probes dir once (cached per device id); throws SystemError if dir is unusable.
ProbeResult probe_backend(const std::string& dir);

}  // namespace pyinfinity
