#include <cstring>
#include <vector>

#include "harness.hpp"
#include "pyinfinity/error.hpp"
#include "pyinfinity/pinned_arena.hpp"

using namespace pyinfinity;

TEST(slabs_are_aligned_disjoint_and_coalesce) {
  PinnedArena a(1 << 20, "none");
  std::vector<PinnedSlab> s;
  for (std::size_t n : {std::size_t(1), std::size_t(4097), std::size_t(100000), std::size_t(4096)}) {
    s.push_back(a.allocate(n));
    CHECK(reinterpret_cast<std::uintptr_t>(s.back().data()) % 4096 == 0);
    std::memset(s.back().data(), 0xab, n);
  }
  CHECK(a.stats().slabs == 4);
  CHECK(a.stats().in_use == 4096 + 8192 + 102400 + 4096);
  s.clear();
  ArenaStats st = a.stats();
  CHECK(st.in_use == 0);
  CHECK(st.largest_free == (1u << 20));  // every hole merged back
  CHECK(st.high_water == 4096 + 8192 + 102400 + 4096);
}

TEST(exhaustion_and_double_free_are_errors) {
  PinnedArena a(64 * 1024, "none");
  PinnedSlab x = a.allocate(60 * 1024);
  CHECK_THROWS(ArgumentError, a.allocate(8 * 1024));
  x.release();
  CHECK_THROWS(ArgumentError, x.release());
  PinnedSlab y = a.allocate(64 * 1024);
  CHECK(y.nbytes() == 64 * 1024);
  CHECK_THROWS(ArgumentError, PinnedArena(0, "none"));
  CHECK_THROWS(ArgumentError, PinnedArena(4096, "bogus"));
}
