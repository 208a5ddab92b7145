// SwapEngine: asynchronous reads and writes of byte ranges between memory and files.
// Requests are split into block_size pieces (detail/split_io.hpp, the one place) with up to
// queue_depth pieces in flight per thread; each piece's completion is checked (-errno raises at
// wait(), short transfers are resubmitted, EAGAIN/EINTR retried). Any size and offset works:
// the O_DIRECT-aligned middle goes direct (through an aligned bounce buffer when the memory is
// misaligned), an unaligned head/tail goes through the buffered descriptor.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pyinfinity/file_handle.hpp"

namespace pyinfinity {

namespace detail {
class Lane;
struct OpState;
}  // namespace detail

/// A future for one submitted transfer.
class Request {
 public:
  explicit Request(std::shared_ptr<detail::OpState> op) : op_(std::move(op)) {}
  bool done() const;
  /// Blocks until the transfer finished; throws its SystemError. TimeoutError when the engine
  /// made no progress for timeout_s seconds (< 0: PYINFINITY_WAIT_TIMEOUT).
  void wait(double timeout_s = -1) const;
  /// One bounded slice of wait(), for callers that act between slices (the Python binding checks
  /// for signals): true once the transfer finished (throwing its error as wait() does), false
  /// after slice_s seconds (< 0: no bound); TimeoutError as wait() when the engine made no
  /// progress for timeout_s seconds since started_ns (a clock_ns() value taken when the wait began).
  bool wait_slice(double slice_s, double timeout_s, std::int64_t started_ns) const;
  /// The monotonic clock wait_slice() measures with, in nanoseconds.
  static std::int64_t clock_ns();
  std::size_t nbytes() const;
  std::int64_t offset() const;
  bool is_write() const;
  const std::string& path() const;
  /// CRC-32C per kChecksumBlock of the transferred bytes (requests made with checksum=true or
  /// expected checksums); ArgumentError before the request is done.
  std::vector<std::uint32_t> checksums() const;

 private:
  std::shared_ptr<detail::OpState> op_;
};

struct EngineOptions {
  std::string backend = "auto";  // aio | uring | posix | auto
  std::size_t block_size = 1 << 20;
  std::size_t queue_depth = 32;
  std::size_t threads = 1;
};

struct DirectionStats {
  std::uint64_t bytes = 0;
  std::uint64_t ops = 0;
  std::uint64_t errors = 0;
  double busy_seconds = 0;  // wall time with at least one request of this direction in flight
};

struct EngineStats {
  DirectionStats read, write;
  std::uint64_t pieces = 0;           // pieces submitted to a backend
  std::uint64_t bounced = 0;          // pieces staged through an aligned bounce buffer
  std::uint64_t buffered = 0;         // pieces sent through the buffered descriptor
  std::uint64_t retries = 0;          // EAGAIN/EINTR resubmissions
  std::uint64_t short_resubmits = 0;  // short transfers continued
};

class SwapEngine {
 public:
  explicit SwapEngine(EngineOptions options);
  ~SwapEngine();  // waits for every submitted request
  SwapEngine(const SwapEngine&) = delete;
  SwapEngine& operator=(const SwapEngine&) = delete;

  /// Starts a transfer of nbytes between buf and file at offset. buf must stay valid until the
  /// request is done. Bad arguments throw ArgumentError here; I/O failures surface at wait().
  /// pad_tail (writes): the caller owns the file bytes up to the next alignment boundary, so an
  /// unaligned tail may be written as one zero-padded O_DIRECT block instead of a buffered
  /// read-modify-write. checksum: compute CRC-32Cs of the data (Request::checksums()). expected (reads): the
  /// checksums a write returned; a mismatch fails the request with EBADMSG naming the bytes.
  Request submit(std::shared_ptr<FileHandle> file, void* buf, std::size_t nbytes,
                 std::int64_t offset, bool write, bool checksum = false,
                 std::vector<std::uint32_t> expected = {}, bool pad_tail = false);
  /// The backend this engine uses for file (resolving "auto" by probing its directory).
  std::string backend_for(const FileHandle& file);
  const EngineOptions& options() const noexcept { return opts_; }
  EngineStats stats() const;
  void reset_stats();
  /// Waits for all requests and stops the threads; later submit() raises.
  void close();
  bool closed() const noexcept { return closed_.load(); }

  // Used by the lanes.
  void op_started(bool write);
  void op_finished(const detail::OpState& op);
  void count_piece(bool bounced, bool buffered, bool retry, bool short_resubmit);

 private:
  detail::Lane& lane(const std::string& backend);

  EngineOptions opts_;
  std::atomic<bool> closed_{false};
  std::mutex lanes_mu_;
  std::map<std::string, std::unique_ptr<detail::Lane>> lanes_;

  mutable std::mutex stats_mu_;
  EngineStats stats_;
  int inflight_[2] = {0, 0};
  std::chrono::steady_clock::time_point busy_since_[2];
};

}  // namespace pyinfinity
