// FileHandle: an open file for the swap engine. It holds an O_DIRECT descriptor (when the
// filesystem supports it) for aligned bulk transfers, and a buffered descriptor for unaligned
// heads/tails and for filesystems without O_DIRECT. Owned through shared_ptr by the engine's
// requests; closes both descriptors on destruction. close() refuses while requests are in flight.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace pyinfinity {

enum class OpenMode { read, write, read_write };

class FileHandle {
 public:
  /// Opens path; write modes create it (0644) without truncating. direct=false skips O_DIRECT.
  FileHandle(std::string path, OpenMode mode, bool direct = true);
  ~FileHandle();
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;

  const std::string& path() const noexcept { return path_; }
  OpenMode mode() const noexcept { return mode_; }
  bool direct() const noexcept { return direct_fd_ >= 0; }
  int direct_fd() const noexcept { return direct_fd_; }
  int buffered_fd() const noexcept { return buffered_fd_; }
  /// O_DIRECT alignment of file offsets/lengths and of memory addresses (bytes, powers of two).
  std::size_t offset_align() const noexcept { return offset_align_; }
  std::size_t memory_align() const noexcept { return memory_align_; }
  bool closed() const noexcept { return buffered_fd_ < 0; }

  std::int64_t size() const;
  /// Sets the size (ftruncate).
  void resize(std::int64_t nbytes);
  /// Reserves blocks for [0, nbytes) without changing the data (fallocate; ftruncate fallback).
  void allocate(std::int64_t nbytes);
  void sync();
  /// Closes both descriptors; ArgumentError while requests on this file are in flight.
  void close();
  /// In-flight request count, kept by SwapEngine.
  void add_inflight(int delta) noexcept { inflight_.fetch_add(delta, std::memory_order_acq_rel); }
  int inflight() const noexcept { return inflight_.load(std::memory_order_acquire); }
  /// The backend an "auto" engine chose for this file (probed once, then kept with the file).
  std::string backend_hint() const {
    std::lock_guard<std::mutex> lk(hint_mu_);
    return backend_hint_;
  }
  void set_backend_hint(const std::string& b) const {
    std::lock_guard<std::mutex> lk(hint_mu_);
    backend_hint_ = b;
  }

 private:
  void close_fds() noexcept;

  std::string path_;
  OpenMode mode_ = OpenMode::read;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  std::size_t offset_align_ = 4096;
  std::size_t memory_align_ = 4096;
  std::atomic<int> inflight_{0};
  mutable std::mutex hint_mu_;
  mutable std::string backend_hint_;
};

}  // namespace pyinfinity
