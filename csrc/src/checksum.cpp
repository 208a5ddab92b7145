#include "pyinfinity/checksum.hpp"

#include <array>
#include <cstring>
#include <vector>

#include "pyinfinity/detail/parallel_chunks.hpp"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace pyinfinity {
namespace {

std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

std::uint32_t crc_table(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  static const std::array<std::uint32_t, 256> table = make_table();
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc_hw(const unsigned char* p, std::size_t n,
                                                        std::uint32_t crc) {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  std::uint32_t c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

}  // namespace

bool crc32c_hardware() {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
#else
  return false;
#endif
}

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (crc32c_hardware()) return ~crc_hw(p, n, crc);
#endif
  return ~crc_table(p, n, crc);
}

namespace {

// CRC-32C of zero bytes appended, as a linear map over GF(2): a 32x32 bit matrix, one column a word.
using Gf2Matrix = std::array<std::uint32_t, 32>;

std::uint32_t gf2_times(const Gf2Matrix& m, std::uint32_t v) {
  std::uint32_t sum = 0;
  for (int i = 0; v != 0; ++i, v >>= 1) {
    if (v & 1) sum ^= m[i];
  }
  return sum;
}

Gf2Matrix gf2_square(const Gf2Matrix& m) {
  Gf2Matrix sq{};
  for (int i = 0; i < 32; ++i) sq[i] = gf2_times(m, m[i]);
  return sq;
}

// The map "append len zero bytes" of a (pre- and post-conditioned) CRC-32C register.
Gf2Matrix zeros_operator(std::size_t len) {
  Gf2Matrix op{};  // identity
  for (int i = 0; i < 32; ++i) op[i] = 1u << i;
  Gf2Matrix bit{};  // one zero bit
  bit[0] = 0x82F63B78u;
  for (int i = 1; i < 32; ++i) bit[i] = 1u << (i - 1);
  Gf2Matrix step = gf2_square(gf2_square(gf2_square(bit)));  // one zero byte
  while (len != 0) {
    if (len & 1) {
      Gf2Matrix next{};
      for (int i = 0; i < 32; ++i) next[i] = gf2_times(step, op[i]);
      op = next;
    }
    len >>= 1;
    if (len != 0) step = gf2_square(step);
  }
  return op;
}

// Pieces of a copy: each copied then checksummed while in a core's cache.
constexpr std::size_t kCopyPiece = std::size_t{1} << 20;

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t len_b) {
  if (len_b == 0) return crc_a;
  return gf2_times(zeros_operator(len_b), crc_a) ^ crc_b;
}

std::uint32_t copy_crc32c(void* dst, const void* src, std::size_t n, int threads) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const std::size_t pieces = (n + kCopyPiece - 1) / kCopyPiece;
  std::vector<std::uint32_t> crcs(pieces);
  detail::parallel_chunks(n, threads, kCopyPiece, [&](std::size_t begin, std::size_t end) {
    for (std::size_t a = begin; a < end; a += kCopyPiece) {
      const std::size_t k = std::min(kCopyPiece, end - a);
      std::memcpy(d + a, s + a, k);
      crcs[a / kCopyPiece] = crc32c(d + a, k);
    }
  });
  if (pieces == 0) return 0;
  const Gf2Matrix whole = zeros_operator(kCopyPiece);  // every piece but the last is whole
  std::uint32_t crc = crcs[0];
  for (std::size_t i = 1; i < pieces; ++i) {
    const std::size_t k = std::min(kCopyPiece, n - i * kCopyPiece);
    crc = (k == kCopyPiece ? gf2_times(whole, crc) : gf2_times(zeros_operator(k), crc)) ^ crcs[i];
  }
  return crc;
}

std::vector<std::uint32_t> block_checksums(const void* data, std::size_t n) {
  std::vector<std::uint32_t> out;
  out.reserve((n + kChecksumBlock - 1) / kChecksumBlock);
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t pos = 0; pos < n; pos += kChecksumBlock) {
    out.push_back(crc32c(p + pos, std::min(kChecksumBlock, n - pos)));
  }
  return out;
}

}  // namespace pyinfinity
