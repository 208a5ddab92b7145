#include "harness.hpp"
#include "pyinfinity/detail/split_io.hpp"

using pyinfinity::detail::next_piece;

// Pieces tile [offset, offset+total) exactly; direct pieces are aligned and at most block_size.
TEST(pieces_tile_the_range) {
  const std::size_t align = 4096;
  for (bool direct : {true, false}) {
    for (std::size_t block : {std::size_t(4096), std::size_t(65536), std::size_t(1) << 20, std::size_t(5000)}) {
      for (std::int64_t off : {0L, 1L, 511L, 4095L, 4096L, 12345L}) {
        for (std::size_t total : {std::size_t(1), std::size_t(199), std::size_t(4095), std::size_t(4096),
                                  std::size_t(4097), (std::size_t(1) << 20) + 7, std::size_t(3) << 20}) {
          std::size_t pos = 0, pieces = 0;
          while (pos < total) {
            auto p = next_piece(off, total, pos, block, direct, align);
            CHECK(p.len > 0);
            CHECK(pos + p.len <= total);
            if (p.direct) {
              CHECK(direct);
              CHECK((static_cast<std::size_t>(off) + pos) % align == 0);
              CHECK(p.len % align == 0);
              CHECK(p.len <= std::max(align, block));
            } else if (!direct) {
              CHECK(p.len <= block);
            } else {
              CHECK(p.len < align);  // only a head or a tail goes buffered
            }
            pos += p.len;
            ++pieces;
          }
          CHECK(pos == total);
          CHECK(pieces <= total / align + 3 + total / block);
        }
      }
    }
  }
}

TEST(aligned_transfer_is_all_direct) {
  std::size_t pos = 0, total = 10u << 20;
  while (pos < total) {
    auto p = next_piece(1 << 20, total, pos, 1 << 20, true, 4096);
    CHECK(p.direct);
    CHECK(p.len == (1u << 20));
    pos += p.len;
  }
}
