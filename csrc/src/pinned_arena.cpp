#include "pyinfinity/pinned_arena.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "pyinfinity/cuda_runtime.hpp"
#include "pyinfinity/error.hpp"

namespace pyinfinity {
namespace detail {

std::size_t page_size() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

std::string human(std::size_t n) {
  char buf[64];
  if (n >= (std::size_t(1) << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(n) / (1 << 30));
  } else if (n >= (1u << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(n) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%zu bytes", n);
  }
  return buf;
}

class ArenaImpl {
 public:
  ArenaImpl(std::size_t capacity, const std::string& lock) {
    PYINF_EXPECT(capacity > 0, "capacity: must be > 0");
    PYINF_EXPECT(lock == "auto" || lock == "cuda" || lock == "mlock" || lock == "none",
                 "lock: expected auto, cuda, mlock or none, got '" + lock + "'");
    const std::size_t pg = page_size();
    capacity_ = (capacity + pg - 1) / pg * pg;
    void* p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw SystemError(errno, "mmap " + human(capacity_) + " for the pinned arena", "", __FILE__, __LINE__);
    }
    base_ = static_cast<char*>(p);
    free_[0] = capacity_;
    try {
      lock_memory(lock);
    } catch (...) {
      ::munmap(base_, capacity_);
      throw;
    }
  }
  ~ArenaImpl() {
    if (locked_by_ == "cuda") cuda::host_unregister(base_);
    if (locked_by_ == "mlock") ::munlock(base_, capacity_);
    ::munmap(base_, capacity_);
  }

  void lock_memory(const std::string& lock) {
    if (lock == "none") return;
    if (lock == "cuda" || (lock == "auto" && cuda::device_count() > 0)) {
      std::string why;
      if (cuda::host_register(base_, capacity_, &why)) {
        locked_by_ = "cuda";
        return;
      }
      if (lock == "cuda") throw CudaError("PinnedArena(lock='cuda'): " + why);
      note_ = "cudaHostRegister failed (" + why + "); ";
    } else if (lock == "auto") {
      note_ = "no CUDA device (" + cuda::status() + "); ";
    }
    if (::mlock(base_, capacity_) == 0) {
      locked_by_ = "mlock";
      return;
    }
    const int err = errno;
    rlimit rl{};
    std::string limit = ::getrlimit(RLIMIT_MEMLOCK, &rl) != 0 ? "unknown"
                        : rl.rlim_cur == RLIM_INFINITY        ? "unlimited"
                                                              : human(rl.rlim_cur);
    std::string msg = "mlock of " + human(capacity_) + " failed: " + std::strerror(err) +
                      " (ulimit -l is " + limit + "; raise it, e.g. `ulimit -l unlimited`, or run as root)";
    if (lock == "mlock") throw SystemError(err, msg, "", __FILE__, __LINE__);
    note_ += msg + "; using unlocked memory";
  }

  std::size_t allocate(std::size_t nbytes, std::size_t* reserved) {
    PYINF_EXPECT(nbytes > 0, "nbytes: must be > 0");
    const std::size_t pg = page_size();
    const std::size_t need = (nbytes + pg - 1) / pg * pg;
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {  // first fit
      if (it->second >= need) {
        const std::size_t off = it->first;
        const std::size_t left = it->second - need;
        free_.erase(it);
        if (left > 0) free_[off + need] = left;
        in_use_ += need;
        slabs_ += 1;
        high_water_ = std::max(high_water_, in_use_);
        *reserved = need;
        return off;
      }
    }
    std::size_t largest = 0;
    for (auto& f : free_) largest = std::max(largest, f.second);
    throw ArgumentError("PinnedArena exhausted: asked for " + std::to_string(nbytes) + " bytes (" +
                        human(nbytes) + "), " +
                        human(capacity_ - in_use_) + " of " + human(capacity_) +
                        " free (largest free block " + human(largest) +
                        "); free slabs or make the arena larger");
  }

  void release(std::size_t off, std::size_t reserved) {
    std::lock_guard<std::mutex> lk(mu_);
    auto next = free_.lower_bound(off);
    if (next != free_.end() && next->first == off) {
      throw ArgumentError("PinnedSlab: double free at offset " + std::to_string(off));
    }
    std::size_t start = off, len = reserved;
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second > off) {
        throw ArgumentError("PinnedSlab: double free at offset " + std::to_string(off));
      }
      if (prev->first + prev->second == off) {
        start = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && off + reserved == next->first) {
      len += next->second;
      free_.erase(next);
    }
    free_[start] = len;
    in_use_ -= reserved;
    slabs_ -= 1;
  }

  ArenaStats stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    ArenaStats s;
    s.capacity = capacity_;
    s.in_use = in_use_;
    s.high_water = high_water_;
    s.slabs = slabs_;
    for (auto& f : free_) s.largest_free = std::max(s.largest_free, f.second);
    return s;
  }

  char* base() const { return base_; }
  const std::string& locked_by() const { return locked_by_; }
  const std::string& note() const { return note_; }

 private:
  char* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::string locked_by_ = "none";
  std::string note_;
  mutable std::mutex mu_;
  std::map<std::size_t, std::size_t> free_;  // offset -> length, coalesced
  std::size_t in_use_ = 0, high_water_ = 0, slabs_ = 0;
};

}  // namespace detail

PinnedSlab::PinnedSlab(std::shared_ptr<detail::ArenaImpl> arena, std::size_t offset,
                       std::size_t nbytes, std::size_t reserved)
    : arena_(std::move(arena)), offset_(offset), nbytes_(nbytes), reserved_(reserved) {}

PinnedSlab::~PinnedSlab() {
  if (arena_) arena_->release(offset_, reserved_);
}

PinnedSlab::PinnedSlab(PinnedSlab&& o) noexcept
    : arena_(std::move(o.arena_)), offset_(o.offset_), nbytes_(o.nbytes_), reserved_(o.reserved_) {}

PinnedSlab& PinnedSlab::operator=(PinnedSlab&& o) noexcept {
  if (this != &o) {
    if (arena_) arena_->release(offset_, reserved_);
    arena_ = std::move(o.arena_);
    offset_ = o.offset_;
    nbytes_ = o.nbytes_;
    reserved_ = o.reserved_;
  }
  return *this;
}

void* PinnedSlab::data() const {
  PYINF_EXPECT(arena_ != nullptr, "PinnedSlab: used after free()");
  return arena_->base() + offset_;
}

void PinnedSlab::release() {
  PYINF_EXPECT(arena_ != nullptr, "PinnedSlab: double free (free() called twice)");
  arena_->release(offset_, reserved_);
  arena_.reset();
}

PinnedArena::PinnedArena(std::size_t capacity, const std::string& lock)
    : impl_(std::make_shared<detail::ArenaImpl>(capacity, lock)) {}

PinnedSlab PinnedArena::allocate(std::size_t nbytes) {
  std::size_t reserved = 0;
  std::size_t off = impl_->allocate(nbytes, &reserved);
  return PinnedSlab(impl_, off, nbytes, reserved);
}

ArenaStats PinnedArena::stats() const { return impl_->stats(); }
std::string PinnedArena::locked_by() const { return impl_->locked_by(); }
std::string PinnedArena::lock_note() const { return impl_->note(); }
void* PinnedArena::base() const { return impl_->base(); }

}  // namespace pyinfinity
