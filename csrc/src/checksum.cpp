#include "pyinfinity/checksum.hpp"

#include <array>
#include <cstring>

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
