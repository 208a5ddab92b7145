// CRC-32C (Castagnoli) of byte ranges: the SSE4.2 instruction where the CPU has it (about
// 10 GB/s a core), a table otherwise. Used to detect swap files changed under the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyinfinity {

/// Bytes covered by one checksum of a request (the last one may cover fewer).
constexpr std::size_t kChecksumBlock = 64 * 1024;

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0);

/// One CRC-32C per kChecksumBlock bytes of [data, data + n).
std::vector<std::uint32_t> block_checksums(const void* data, std::size_t n);

/// The CRC-32C of A followed by B, from crc_a = crc32c(A), crc_b = crc32c(B) and B's length.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::size_t len_b);

/// Copies n bytes from src to dst (not overlapping) on up to `threads` threads, each piece
/// checksummed right after its copy while it is in cache; returns crc32c(src, n). One read of
/// src and one write of dst.
std::uint32_t copy_crc32c(void* dst, const void* src, std::size_t n, int threads);

/// True when the CPU instruction is used.
bool crc32c_hardware();

}  // namespace pyinfinity
