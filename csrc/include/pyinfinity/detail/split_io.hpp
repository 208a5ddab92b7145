// The one place where a transfer is cut into pieces.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pyinfinity::detail {

struct PieceSpec {
  std::size_t len = 0;  // bytes of this piece
  bool direct = false;  // through the O_DIRECT descriptor (offset and length aligned)
};

/// The piece that starts `pos` bytes into a transfer of `total` bytes at file offset `offset`.
/// With O_DIRECT, pieces are block_size (rounded down to the alignment) and aligned; an
/// unaligned head (up to the next alignment boundary) and a tail shorter than the alignment go
/// buffered. `align` is a power of two >= the page size so buffered and direct pieces never
/// share a page of the page cache.
inline PieceSpec next_piece(std::int64_t offset, std::size_t total, std::size_t pos,
                            std::size_t block_size, bool direct_file, std::size_t align) {
  const std::size_t remaining = total - pos;
  if (!direct_file) return {std::min(block_size, remaining), false};
  const auto off = static_cast<std::uint64_t>(offset) + pos;
  const std::size_t mis = static_cast<std::size_t>(off & (align - 1));
  if (mis != 0) return {std::min(remaining, align - mis), false};
  if (remaining < align) return {remaining, false};
  const std::size_t block = std::max(align, block_size & ~(align - 1));
  return {std::min(block, remaining & ~(align - 1)), true};
}

}  // namespace pyinfinity::detail
