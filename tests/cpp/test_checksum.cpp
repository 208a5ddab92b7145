#include <cstring>
#include <vector>

#include "harness.hpp"
#include "pyinfinity/checksum.hpp"

using namespace pyinfinity;

TEST(crc32c_known_value_and_chaining) {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);  // the CRC-32C check value
  CHECK(crc32c(s + 4, 5, crc32c(s, 4)) == 0xE3069283u);
  CHECK(crc32c(s, 0) == 0u);
}

TEST(block_checksums_cover_every_byte) {
  std::vector<unsigned char> buf(kChecksumBlock * 2 + 17);
  harness::fill_random(buf.data(), buf.size(), 3);
  auto c = block_checksums(buf.data(), buf.size());
  CHECK(c.size() == 3);
  CHECK(c[2] == crc32c(buf.data() + 2 * kChecksumBlock, 17));
  buf[2 * kChecksumBlock + 16] ^= 1;
  auto d = block_checksums(buf.data(), buf.size());
  CHECK(d[0] == c[0] && d[1] == c[1] && d[2] != c[2]);
}

TEST(crc32c_combine_equals_the_crc_of_the_concatenation) {
  std::vector<unsigned char> buf(3 * 4096 + 333);
  harness::fill_random(buf.data(), buf.size(), 7);
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{5000}, buf.size() - 1,
                          buf.size()}) {
    const std::uint32_t a = crc32c(buf.data(), cut);
    const std::uint32_t b = crc32c(buf.data() + cut, buf.size() - cut);
    CHECK(crc32c_combine(a, b, buf.size() - cut) == crc32c(buf.data(), buf.size()));
  }
}

TEST(copy_crc32c_copies_every_byte_and_returns_the_sources_crc) {
  // pieces of 1 MiB: a whole number of them, a partial last one, a copy smaller than one
  for (std::size_t n : {std::size_t{0}, std::size_t{100}, std::size_t{3} << 20, (std::size_t{5} << 20) + 4099}) {
    for (int threads : {1, 4}) {
      std::vector<unsigned char> src(n), dst(n + 1, 0xAB);
      harness::fill_random(src.data(), n, 11 + static_cast<int>(n % 97));
      const std::uint32_t crc = copy_crc32c(dst.data(), src.data(), n, threads);
      CHECK(crc == crc32c(src.data(), n));
      CHECK(n == 0 || std::memcmp(dst.data(), src.data(), n) == 0);
      CHECK(dst[n] == 0xAB);  // nothing past the end
    }
  }
}
