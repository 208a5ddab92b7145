// Linux kernel AIO (io_setup/io_submit/io_getevents) through raw system calls and
// <linux/aio_abi.h>: the interface libaio wraps, without needing libaio to build or run.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "pyinfinity/detail/backends.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity::detail {
namespace {

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb** cbs) {
  return syscall(SYS_io_submit, ctx, n, cbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, io_event* ev, timespec* ts) {
  return syscall(SYS_io_getevents, ctx, min_nr, nr, ev, ts);
}

class AioBackend final : public IoBackend {
 public:
  explicit AioBackend(std::size_t depth) : depth_(depth) {
    PYINF_SYSCALL(sys_io_setup(static_cast<unsigned>(depth), &ctx_), "io_setup", "");
  }
  ~AioBackend() override {
    // Library contract: the engine drains every request before destroying a backend.
    if (ctx_ != 0) (void)sys_io_destroy(ctx_);
  }
  const char* name() const noexcept override { return "aio"; }
  std::size_t capacity() const noexcept override { return depth_; }

  void submit(const IoRequest* reqs, std::size_t n) override {
    cbs_.assign(n, iocb{});
    ptrs_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      iocb& cb = cbs_[i];
      cb.aio_data = reqs[i].tag;
      cb.aio_lio_opcode = reqs[i].write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<std::uint32_t>(reqs[i].fd);
      cb.aio_buf = reinterpret_cast<std::uint64_t>(reqs[i].buf);
      cb.aio_nbytes = reqs[i].nbytes;
      cb.aio_offset = reqs[i].offset;
      ptrs_[i] = &cb;
    }
    std::size_t done = 0;
    while (done < n) {
      long rc = sys_io_submit(ctx_, static_cast<long>(n - done), ptrs_.data() + done);
      if (rc > 0) {
        done += static_cast<std::size_t>(rc);
      } else if (rc == 0 || errno == EAGAIN || errno == EINTR) {
        // Kernel queue momentarily full: yield and retry (the caller bounds in-flight requests).
        sched_yield();
      } else {
        // The first remaining request was rejected: report it as its completion, go on.
        synthetic_.push_back({reqs[done].tag, -static_cast<std::int64_t>(errno)});
        ++done;
      }
    }
  }

  std::size_t reap(IoCompletion* out, std::size_t max_n, std::size_t min_n,
                   int timeout_ms) override {
    std::size_t got = 0;
    while (!synthetic_.empty() && got < max_n) {
      out[got++] = synthetic_.front();
      synthetic_.pop_front();
    }
    if (got >= max_n) return got;
    std::size_t want_min = min_n > got ? min_n - got : 0;
    events_.resize(max_n - got);
    timespec ts{};
    timespec* tsp = nullptr;
    if (timeout_ms >= 0) {
      ts.tv_sec = timeout_ms / 1000;
      ts.tv_nsec = static_cast<long>(timeout_ms % 1000) * 1000000L;
      tsp = &ts;
    }
    long rc;
    do {
      rc = sys_io_getevents(ctx_, static_cast<long>(want_min), static_cast<long>(max_n - got),
                            events_.data(), tsp);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0) throw_system(errno, "io_getevents", "", __FILE__, __LINE__);
    for (long i = 0; i < rc; ++i) out[got++] = {events_[i].data, events_[i].res};
    return got;
  }

 private:
  std::size_t depth_;
  aio_context_t ctx_ = 0;
  std::vector<iocb> cbs_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
  std::deque<IoCompletion> synthetic_;
};
}  // namespace

std::unique_ptr<IoBackend> make_aio_backend(std::size_t depth) {
  return std::make_unique<AioBackend>(depth);
}
}  // namespace pyinfinity::detail
