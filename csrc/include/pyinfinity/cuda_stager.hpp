// CudaStager: moves bytes between files and GPU memory through pinned bounce buffers, chunk by
// chunk, so the disk and the PCIe link work at the same time. Copies run on the CUDA stream the
// caller passes (an integer cudaStream_t, e.g. torch.cuda.Stream().cuda_stream; 0 = legacy
// default stream). Completion: when wait() returns, every copy has been enqueued on that stream
// (read_to_device) or has finished and the data is on disk (write_from_device), so work the
// caller enqueues on the stream afterwards sees the data.
// Built when the CUDA toolkit is found; without a device the constructor throws CudaError.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "pyinfinity/file_handle.hpp"
#include "pyinfinity/swap_engine.hpp"

namespace pyinfinity {

/// A future for one staged transfer.
class StageRequest {
 public:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
    std::exception_ptr error;
  };
  explicit StageRequest(std::shared_ptr<State> s) : s_(std::move(s)) {}
  bool done() const;
  /// Blocks until finished (timeout_s < 0: forever); rethrows the transfer's error.
  void wait(double timeout_s = -1) const;

 private:
  std::shared_ptr<State> s_;
};

struct StagerStats {
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0;
  double h2d_seconds = 0, d2h_seconds = 0;  // wall time of whole staged transfers
};

class CudaStager {
 public:
  CudaStager(std::shared_ptr<SwapEngine> engine, int device, std::size_t chunk_bytes,
             std::size_t num_buffers);
  ~CudaStager();
  CudaStager(const CudaStager&) = delete;
  CudaStager& operator=(const CudaStager&) = delete;

  StageRequest read_to_device(std::shared_ptr<FileHandle> file, std::int64_t offset,
                              void* device_ptr, std::size_t nbytes, std::uintptr_t stream);
  StageRequest write_from_device(std::shared_ptr<FileHandle> file, std::int64_t offset,
                                 const void* device_ptr, std::size_t nbytes, std::uintptr_t stream);
  /// cudaMemcpyAsync between (pinned) host and device memory on stream; synchronize waits for it.
  void copy(void* dst, const void* src, std::size_t nbytes, bool host_to_device,
            std::uintptr_t stream, bool synchronize);
  StagerStats stats() const;
  std::size_t chunk_bytes() const noexcept { return chunk_; }
  std::size_t num_buffers() const noexcept { return nbuf_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::size_t chunk_ = 0, nbuf_ = 0;
};

}  // namespace pyinfinity
