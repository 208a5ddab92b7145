// PinnedArena: one large page-aligned host allocation carved into slabs. Page-locked through
// the CUDA runtime when a device is present (so copies to the GPU run at full PCIe speed), else
// with mlock where permitted, else plain. Sizes are rounded to the page size only (no powers
// of two); every slab is page-aligned, so it is O_DIRECT-safe by construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace pyinfinity {

struct ArenaStats {
  std::size_t capacity = 0;
  std::size_t in_use = 0;      // bytes in live slabs (page-rounded)
  std::size_t high_water = 0;  // most bytes in use at once
  std::size_t slabs = 0;       // live slabs
  std::size_t largest_free = 0;
};

namespace detail {
class ArenaImpl;
}

/// A slab of the arena. Move-only; returns its bytes on destruction or release().
class PinnedSlab {
 public:
  PinnedSlab() = default;
  PinnedSlab(std::shared_ptr<detail::ArenaImpl> arena, std::size_t offset, std::size_t nbytes,
             std::size_t reserved);
  ~PinnedSlab();
  PinnedSlab(PinnedSlab&& o) noexcept;
  PinnedSlab& operator=(PinnedSlab&& o) noexcept;
  PinnedSlab(const PinnedSlab&) = delete;
  PinnedSlab& operator=(const PinnedSlab&) = delete;

  void* data() const;
  std::size_t nbytes() const noexcept { return nbytes_; }
  bool valid() const noexcept { return arena_ != nullptr; }
  /// Returns the bytes to the arena; ArgumentError when already released.
  void release();

 private:
  std::shared_ptr<detail::ArenaImpl> arena_;
  std::size_t offset_ = 0;
  std::size_t nbytes_ = 0;
  std::size_t reserved_ = 0;
};

class PinnedArena {
 public:
  /// lock: "auto" (CUDA registration when a device exists, else mlock, else none),
  /// "cuda", "mlock" (errors when they fail) or "none".
  explicit PinnedArena(std::size_t capacity, const std::string& lock = "auto");
  PinnedSlab allocate(std::size_t nbytes);
  ArenaStats stats() const;
  /// How the memory is locked: "cuda", "mlock" or "none".
  std::string locked_by() const;
  /// Why the requested locking fell back (empty when it did not).
  std::string lock_note() const;
  void* base() const;

 private:
  std::shared_ptr<detail::ArenaImpl> impl_;
};

}  // namespace pyinfinity
