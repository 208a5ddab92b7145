#include "pyinfinity/cuda_stager.hpp"

#include <chrono>
#include <optional>
#include <vector>

#include "pyinfinity/cuda_runtime.hpp"
#include "pyinfinity/error.hpp"
#include "pyinfinity/pinned_arena.hpp"

#ifdef PYINFINITY_WITH_CUDA
#include <cuda_runtime_api.h>
#define PYINF_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t pyinf_err_ = (call);                                                          \
    if (pyinf_err_ != cudaSuccess) {                                                          \
      (void)cudaGetLastError();                                                               \
      throw ::pyinfinity::CudaError(std::string(#call) + ": " + cudaGetErrorString(pyinf_err_) + \
                                    " (" __FILE__ ":" + std::to_string(__LINE__) + ")");      \
    }                                                                                         \
  } while (0)
#endif

namespace pyinfinity {

bool StageRequest::done() const {
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->finished;
}

void StageRequest::wait(double timeout_s) const {
  std::unique_lock<std::mutex> lk(s_->mu);
  if (timeout_s < 0) {
    s_->cv.wait(lk, [&] { return s_->finished; });
  } else if (!s_->cv.wait_for(lk, std::chrono::duration<double>(timeout_s),
                              [&] { return s_->finished; })) {
    throw TimeoutError("wait(): staged transfer not finished after " + std::to_string(timeout_s) + " s");
  }
  if (s_->error) std::rethrow_exception(s_->error);
}

#ifdef PYINFINITY_WITH_CUDA

struct CudaStager::Impl {
  std::shared_ptr<SwapEngine> engine;
  int device = 0;
  std::size_t chunk = 0, nbuf = 0;
  PinnedArena arena;
  std::vector<PinnedSlab> bufs;
  std::vector<cudaEvent_t> events;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> jobs;
  bool stop = false;
  std::thread thread;
  mutable std::mutex stats_mu;
  StagerStats stats;

  Impl(std::shared_ptr<SwapEngine> e, int dev, std::size_t c, std::size_t n)
      : engine(std::move(e)), device(dev), chunk(c), nbuf(n), arena(c * n, "cuda") {
    PYINF_CUDA(cudaSetDevice(device));
    for (std::size_t i = 0; i < nbuf; ++i) bufs.push_back(arena.allocate(chunk));
    events.resize(nbuf);
    for (auto& ev : events) PYINF_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    thread = std::thread([this] { run(); });
  }
  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
    for (auto ev : events) (void)cudaEventDestroy(ev);
  }

  void run() {
    (void)cudaSetDevice(device);
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stop || !jobs.empty(); });
      if (jobs.empty()) return;
      auto job = std::move(jobs.front());
      jobs.pop_front();
      lk.unlock();
      job();
      lk.lock();
    }
  }

  StageRequest enqueue(std::function<void()> body) {
    auto state = std::make_shared<StageRequest::State>();
    auto job = [state, body = std::move(body)] {
      try {
        body();
      } catch (...) {
        state->error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lk(state->mu);
        state->finished = true;
      }
      state->cv.notify_all();
    };
    {
      std::lock_guard<std::mutex> lk(mu);
      jobs.push_back(std::move(job));
    }
    cv.notify_one();
    return StageRequest(state);
  }

  char* buf(std::size_t slot) { return static_cast<char*>(bufs[slot].data()); }

  // NVMe -> pinned bounce -> device; nbuf-1 reads ahead of the copy.
  void read_job(const std::shared_ptr<FileHandle>& file, std::int64_t offset, char* dev,
                std::size_t n, cudaStream_t stream) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t nchunks = (n + chunk - 1) / chunk;
    std::vector<std::optional<Request>> reads(nbuf);
    auto len_of = [&](std::size_t i) { return std::min(chunk, n - i * chunk); };
    auto issue = [&](std::size_t i) {
      reads[i % nbuf] = engine->submit(file, buf(i % nbuf), len_of(i),
                                       offset + static_cast<std::int64_t>(i * chunk), false);
    };
    std::exception_ptr err;
    auto drain = [&] {
      for (auto& r : reads) {
        if (!r) continue;
        try {
          r->wait();
        } catch (...) {
        }
        r.reset();
      }
    };
    try {
      for (std::size_t i = 0; i < std::min(nbuf - 1, nchunks); ++i) issue(i);
      for (std::size_t i = 0; i < nchunks; ++i) {
        const std::size_t slot = i % nbuf;
        reads[slot]->wait();
        reads[slot].reset();
        PYINF_CUDA(cudaMemcpyAsync(dev + i * chunk, buf(slot), len_of(i), cudaMemcpyHostToDevice, stream));
        PYINF_CUDA(cudaEventRecord(events[slot], stream));
        const std::size_t j = i + nbuf - 1;
        if (j < nchunks) {
          if (j >= nbuf) PYINF_CUDA(cudaEventSynchronize(events[j % nbuf]));  // slot's last copy
          issue(j);
        }
      }
    } catch (...) {
      err = std::current_exception();
      drain();
    }
    if (err) std::rethrow_exception(err);
    std::lock_guard<std::mutex> lk(stats_mu);
    stats.h2d_bytes += n;
    stats.h2d_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Device -> pinned bounce -> NVMe; the copy of chunk i+1 overlaps the write of chunk i.
  void write_job(const std::shared_ptr<FileHandle>& file, std::int64_t offset, const char* dev,
                 std::size_t n, cudaStream_t stream) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t nchunks = (n + chunk - 1) / chunk;
    std::vector<std::optional<Request>> writes(nbuf);
    std::exception_ptr err;
    try {
      for (std::size_t i = 0; i < nchunks; ++i) {
        const std::size_t slot = i % nbuf;
        if (writes[slot]) {
          writes[slot]->wait();
          writes[slot].reset();
        }
        const std::size_t len = std::min(chunk, n - i * chunk);
        PYINF_CUDA(cudaMemcpyAsync(buf(slot), dev + i * chunk, len, cudaMemcpyDeviceToHost, stream));
        PYINF_CUDA(cudaEventRecord(events[slot], stream));
        PYINF_CUDA(cudaEventSynchronize(events[slot]));
        writes[slot] = engine->submit(file, buf(slot), len, offset + static_cast<std::int64_t>(i * chunk), true);
      }
      for (auto& w : writes) {
        if (w) {
          w->wait();
          w.reset();
        }
      }
    } catch (...) {
      err = std::current_exception();
      for (auto& w : writes) {
        if (!w) continue;
        try {
          w->wait();
        } catch (...) {
        }
      }
    }
    if (err) std::rethrow_exception(err);
    std::lock_guard<std::mutex> lk(stats_mu);
    stats.d2h_bytes += n;
    stats.d2h_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

namespace {
void check_args(const std::shared_ptr<FileHandle>& file, std::int64_t offset, const void* dev,
                std::size_t n, bool write) {
  PYINF_EXPECT(file != nullptr && !file->closed(), "file: closed or None");
  PYINF_EXPECT(dev != nullptr, "device_ptr: null pointer");
  PYINF_EXPECT(n > 0, "nbytes: zero-size transfer");
  PYINF_EXPECT(offset >= 0, "offset: must be >= 0");
  if (!write) {
    PYINF_EXPECT(offset + static_cast<std::int64_t>(n) <= file->size(),
                 "offset: read past end of file: " + file->path() + " has " +
                     std::to_string(file->size()) + " bytes, asked for " + std::to_string(n) +
                     " at offset " + std::to_string(offset));
  }
}
}  // namespace

CudaStager::CudaStager(std::shared_ptr<SwapEngine> engine, int device, std::size_t chunk_bytes,
                       std::size_t num_buffers)
    : chunk_(chunk_bytes), nbuf_(num_buffers) {
  PYINF_EXPECT(engine != nullptr, "engine: must not be None");
  PYINF_EXPECT(chunk_bytes >= 4096, "chunk_bytes: must be >= 4096");
  PYINF_EXPECT(num_buffers >= 2, "num_buffers: must be >= 2");
  if (cuda::device_count() == 0) throw CudaError("CudaStager needs a CUDA device: " + cuda::status());
  PYINF_EXPECT(device >= 0 && device < cuda::device_count(),
               "device: " + std::to_string(device) + " out of range (" +
                   std::to_string(cuda::device_count()) + " devices)");
  impl_ = std::make_unique<Impl>(std::move(engine), device, chunk_bytes, num_buffers);
}

CudaStager::~CudaStager() = default;

StageRequest CudaStager::read_to_device(std::shared_ptr<FileHandle> file, std::int64_t offset,
                                        void* device_ptr, std::size_t nbytes, std::uintptr_t stream) {
  check_args(file, offset, device_ptr, nbytes, false);
  Impl* im = impl_.get();
  return im->enqueue([im, file, offset, device_ptr, nbytes, stream] {
    im->read_job(file, offset, static_cast<char*>(device_ptr), nbytes, reinterpret_cast<cudaStream_t>(stream));
  });
}

StageRequest CudaStager::write_from_device(std::shared_ptr<FileHandle> file, std::int64_t offset,
                                           const void* device_ptr, std::size_t nbytes,
                                           std::uintptr_t stream) {
  check_args(file, offset, device_ptr, nbytes, true);
  PYINF_EXPECT(file->mode() != OpenMode::read, "file: opened read-only, cannot write: " + file->path());
  Impl* im = impl_.get();
  return im->enqueue([im, file, offset, device_ptr, nbytes, stream] {
    im->write_job(file, offset, static_cast<const char*>(device_ptr), nbytes,
                  reinterpret_cast<cudaStream_t>(stream));
  });
}

void CudaStager::copy(void* dst, const void* src, std::size_t nbytes, bool host_to_device,
                      std::uintptr_t stream, bool synchronize) {
  PYINF_EXPECT(dst != nullptr && src != nullptr, "copy: null pointer");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  PYINF_CUDA(cudaSetDevice(impl_->device));
  PYINF_CUDA(cudaMemcpyAsync(dst, src, nbytes,
                             host_to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s));
  if (synchronize) PYINF_CUDA(cudaStreamSynchronize(s));
}

StagerStats CudaStager::stats() const {
  std::lock_guard<std::mutex> lk(impl_->stats_mu);
  return impl_->stats;
}

#else  // built without the CUDA toolkit

struct CudaStager::Impl {};

CudaStager::CudaStager(std::shared_ptr<SwapEngine>, int, std::size_t, std::size_t) {
  throw CudaError("CudaStager: " + cuda::status());
}
CudaStager::~CudaStager() = default;
StageRequest CudaStager::read_to_device(std::shared_ptr<FileHandle>, std::int64_t, void*,
                                        std::size_t, std::uintptr_t) {
  throw CudaError("CudaStager: " + cuda::status());
}
StageRequest CudaStager::write_from_device(std::shared_ptr<FileHandle>, std::int64_t, const void*,
                                           std::size_t, std::uintptr_t) {
  throw CudaError("CudaStager: " + cuda::status());
}
void CudaStager::copy(void*, const void*, std::size_t, bool, std::uintptr_t, bool) {
  throw CudaError("CudaStager: " + cuda::status());
}
StagerStats CudaStager::stats() const { return {}; }

#endif

}  // namespace pyinfinity
