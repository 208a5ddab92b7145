// How the CPU optimizer steps split a range over threads: chunks claimed from a shared counter.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace pyinfinity::detail {

/// Runs fn(begin, end) over [0, n) on up to `threads` threads (the caller's included). Each
/// chunk's begin is a multiple of `align` elements (a power of two: whole cache lines, whole
/// quantisation blocks). Threads claim chunks (about 8 each) from a shared counter instead of one
/// fixed range each: a thread descheduled for a while (the training loop's own thread shares these
/// CPUs) delays one chunk, not 1/threads of the step. Callers are elementwise (or blockwise on
/// `align`), so the result is the same for any split.
template <typename Fn>
void parallel_chunks(std::size_t n, int threads, std::size_t align, Fn&& fn) {
  constexpr std::size_t kMinChunk = 1 << 16;  // below this a thread costs more than it saves
  const std::size_t want = std::max<std::size_t>(
      1, std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), n / kMinChunk));
  if (want <= 1) {
    fn(std::size_t{0}, n);
    return;
  }
  const std::size_t chunk = std::max<std::size_t>(kMinChunk / 4, (n / (want * 8) + align - 1) / align * align);
  std::atomic<std::size_t> next{0};
  auto worker = [&]() {
    for (;;) {
      const std::size_t b = next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= n) return;
      fn(b, std::min(n, b + chunk));
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(want - 1);
  for (std::size_t t = 1; t < want; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace pyinfinity::detail
