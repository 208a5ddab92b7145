// The fault-injection seam of the I/O layer: make the n-th I/O piece fail with an errno, come
// back short, or stall. Off unless a test sets it or PYINFINITY_FAULT is set, e.g.
//   PYINFINITY_FAULT="op=write,nth=3,action=errno,value=28,count=1"   (28 = ENOSPC)
// Keys: op=read|write|any, nth>=1 (1-based count of matching pieces submitted since set),
// action=errno|short|stall, value (errno number or stall milliseconds), count (pieces affected,
// 0 = every one from nth on).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace pyinfinity {

struct FaultSpec {
  enum class Action { none, error, short_io, stall };
  enum class Op { any, read, write };
  Action action = Action::none;
  Op op = Op::any;
  std::uint64_t nth = 1;
  std::uint64_t count = 1;
  int value = 0;
};

/// What the engine must do to the piece it is about to submit.
struct FaultDecision {
  FaultSpec::Action action = FaultSpec::Action::none;
  int value = 0;
};

class FaultInjector {
 public:
  static FaultInjector& instance();
  void set(const FaultSpec& spec);
  void clear();
  /// Parses the PYINFINITY_FAULT syntax; ArgumentError on a bad spec.
  static FaultSpec parse(const std::string& text);
  /// Called once per piece submission. Cheap when disabled (one relaxed load).
  FaultDecision on_submit(bool write);
  std::uint64_t injected() const noexcept { return injected_.load(); }

 private:
  FaultInjector();
  std::atomic<bool> enabled_{false};
  std::mutex mu_;
  FaultSpec spec_;
  std::uint64_t seen_ = 0;
  std::atomic<std::uint64_t> injected_{0};
};

}  // namespace pyinfinity
