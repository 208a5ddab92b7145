// io_uring through raw system calls and <linux/io_uring.h> (no liburing needed): one ring per
// backend, IORING_OP_READ/WRITE, completions reaped from the CQ ring.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>

#include "pyinfinity/detail/backends.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity::detail {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void* arg,
              std::size_t argsz) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz));
}

template <typename T>
T* at(void* base, unsigned off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(std::size_t depth) : depth_(depth) {
    io_uring_params p{};
    // CQ twice the SQ so completions never overflow while the caller bounds in-flight <= depth.
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = static_cast<unsigned>(2 * depth);
    fd_ = PYINF_SYSCALL(sys_setup(static_cast<unsigned>(depth), &p), "io_uring_setup", "");
    ext_arg_ = (p.features & IORING_FEAT_EXT_ARG) != 0;
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    single_mmap_ = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap_) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    try {
      sq_ptr_ = map(sq_len_, IORING_OFF_SQ_RING);
      cq_ptr_ = single_mmap_ ? sq_ptr_ : map(cq_len_, IORING_OFF_CQ_RING);
      sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
      sqes_ = static_cast<io_uring_sqe*>(map(sqes_len_, IORING_OFF_SQES));
    } catch (...) {
      unmap();
      ::close(fd_);
      throw;
    }
    sq_head_ = at<unsigned>(sq_ptr_, p.sq_off.head);
    sq_tail_ = at<unsigned>(sq_ptr_, p.sq_off.tail);
    sq_mask_ = *at<unsigned>(sq_ptr_, p.sq_off.ring_mask);
    sq_array_ = at<unsigned>(sq_ptr_, p.sq_off.array);
    sq_entries_ = p.sq_entries;
    cq_head_ = at<unsigned>(cq_ptr_, p.cq_off.head);
    cq_tail_ = at<unsigned>(cq_ptr_, p.cq_off.tail);
    cq_mask_ = *at<unsigned>(cq_ptr_, p.cq_off.ring_mask);
    cqes_ = at<io_uring_cqe>(cq_ptr_, p.cq_off.cqes);
  }
  ~UringBackend() override {
    unmap();
    if (fd_ >= 0) ::close(fd_);
  }
  const char* name() const noexcept override { return "uring"; }
  std::size_t capacity() const noexcept override { return depth_; }

  void submit(const IoRequest* reqs, std::size_t n) override {
    std::size_t i = 0;
    while (i < n) {
      unsigned tail = *sq_tail_;
      unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
      unsigned queued = 0;
      while (i < n && tail - head < sq_entries_) {
        unsigned idx = tail & sq_mask_;
        io_uring_sqe* sqe = &sqes_[idx];
        std::memset(sqe, 0, sizeof(*sqe));
        sqe->opcode = reqs[i].write ? IORING_OP_WRITE : IORING_OP_READ;
        sqe->fd = reqs[i].fd;
        sqe->addr = reinterpret_cast<std::uint64_t>(reqs[i].buf);
        sqe->len = static_cast<unsigned>(reqs[i].nbytes);
        sqe->off = static_cast<std::uint64_t>(reqs[i].offset);
        sqe->user_data = reqs[i].tag;
        sq_array_[idx] = idx;
        ++tail;
        ++queued;
        ++i;
      }
      __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
      unsigned left = queued;
      while (left > 0) {
        int rc = sys_enter(fd_, left, 0, 0, nullptr, 0);
        if (rc > 0) {
          left -= static_cast<unsigned>(rc);
        } else if (rc == 0 || errno == EINTR || errno == EAGAIN || errno == EBUSY) {
          sched_yield();
        } else {
          throw_system(errno, "io_uring_enter(submit)", "", __FILE__, __LINE__);
        }
      }
    }
  }

  std::size_t reap(IoCompletion* out, std::size_t max_n, std::size_t min_n,
                   int timeout_ms) override {
    std::size_t got = drain(out, max_n);
    while (got < min_n && got < max_n) {
      unsigned flags = IORING_ENTER_GETEVENTS;
      io_uring_getevents_arg arg{};
      __kernel_timespec ts{};
      void* argp = nullptr;
      std::size_t argsz = 0;
      if (timeout_ms >= 0) {
        if (!ext_arg_) {
          // Old kernel without timed waits: poll.
          if (timeout_ms == 0) break;
          usleep(1000);
          got += drain(out + got, max_n - got);
          timeout_ms -= 1;
          continue;
        }
        ts.tv_sec = timeout_ms / 1000;
        ts.tv_nsec = static_cast<long long>(timeout_ms % 1000) * 1000000LL;
        arg.ts = reinterpret_cast<std::uint64_t>(&ts);
        flags |= IORING_ENTER_EXT_ARG;
        argp = &arg;
        argsz = sizeof(arg);
      }
      int rc = sys_enter(fd_, 0, static_cast<unsigned>(min_n - got), flags, argp, argsz);
      if (rc < 0) {
        if (errno == ETIME) {
          got += drain(out + got, max_n - got);
          break;
        }
        if (errno != EINTR && errno != EAGAIN && errno != EBUSY)
          throw_system(errno, "io_uring_enter(wait)", "", __FILE__, __LINE__);
      }
      got += drain(out + got, max_n - got);
    }
    return got;
  }

 private:
  std::size_t drain(IoCompletion* out, std::size_t max_n) {
    unsigned head = *cq_head_;
    unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    std::size_t got = 0;
    while (head != tail && got < max_n) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      out[got++] = {cqe.user_data, cqe.res};
      ++head;
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return got;
  }
  void* map(std::size_t len, long long off) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, off);
    if (p == MAP_FAILED) throw_system(errno, "mmap(io_uring)", "", __FILE__, __LINE__);
    return p;
  }
  void unmap() {
    if (sqes_) munmap(sqes_, sqes_len_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) munmap(cq_ptr_, cq_len_);
    if (sq_ptr_) munmap(sq_ptr_, sq_len_);
    sqes_ = nullptr;
    cq_ptr_ = sq_ptr_ = nullptr;
  }

  std::size_t depth_;
  int fd_ = -1;
  bool ext_arg_ = false;
  bool single_mmap_ = false;
  std::size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0, sq_entries_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};
}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(std::size_t depth) {
  return std::make_unique<UringBackend>(depth);
}
}  // namespace pyinfinity::detail
