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
