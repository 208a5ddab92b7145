// A pool of threads doing pread/pwrite: the path for filesystems without O_DIRECT (tmpfs, some
// network filesystems) and the portable fallback.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "pyinfinity/detail/backends.hpp"

namespace pyinfinity::detail {
namespace {

class PosixBackend final : public IoBackend {
 public:
  explicit PosixBackend(std::size_t depth) : depth_(depth) {
    std::size_t n = std::min<std::size_t>(depth, 16);
    threads_.reserve(n);
    for (std::size_t i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~PosixBackend() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  const char* name() const noexcept override { return "posix"; }
  std::size_t capacity() const noexcept override { return depth_; }

  void submit(const IoRequest* reqs, std::size_t n) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (std::size_t i = 0; i < n; ++i) pending_.push_back(reqs[i]);
    }
    if (n == 1) {
      work_cv_.notify_one();
    } else {
      work_cv_.notify_all();
    }
  }

  std::size_t reap(IoCompletion* out, std::size_t max_n, std::size_t min_n,
                   int timeout_ms) override {
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [&] { return done_.size() >= std::min(min_n, max_n); };
    if (timeout_ms < 0) {
      done_cv_.wait(lk, ready);
    } else {
      done_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
    }
    std::size_t got = 0;
    while (!done_.empty() && got < max_n) {
      out[got++] = done_.front();
      done_.pop_front();
    }
    return got;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stop_ and nothing left
      IoRequest r = pending_.front();
      pending_.pop_front();
      lk.unlock();
      ssize_t rc = r.write ? ::pwrite(r.fd, r.buf, r.nbytes, r.offset)
                           : ::pread(r.fd, r.buf, r.nbytes, r.offset);
      std::int64_t res = rc < 0 ? -static_cast<std::int64_t>(errno) : rc;
      lk.lock();
      done_.push_back({r.tag, res});
      done_cv_.notify_one();
    }
  }

  std::size_t depth_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<IoRequest> pending_;
  std::deque<IoCompletion> done_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};
}  // namespace

std::unique_ptr<IoBackend> make_posix_backend(std::size_t depth) {
  return std::make_unique<PosixBackend>(depth);
}
}  // namespace pyinfinity::detail
