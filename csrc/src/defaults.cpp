#include "pyinfinity/defaults.hpp"

#include <cstdlib>
#include <type_traits>
#include <cstdio>

#include "pyinfinity/error.hpp"

namespace pyinfinity::defaults {
namespace {

// Parses "1048576", "1M", "64MiB", "1G" (binary units).
std::size_t parse_size(const char* env, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit(end);
  double mul = 1;
  if (unit == "" || unit == "B") mul = 1;
  else if (unit == "K" || unit == "KiB" || unit == "k") mul = 1024.0;
  else if (unit == "M" || unit == "MiB") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") mul = 1024.0 * 1024 * 1024;
  else PYINF_EXPECT(false, std::string(env) + ": cannot parse size '" + text + "' (e.g. 1048576, 1MiB)");
  PYINF_EXPECT(end != text.c_str() && v > 0, std::string(env) + ": must be a positive size, got '" + text + "'");
  return static_cast<std::size_t>(v * mul);
}

std::size_t size_env(const char* env, std::size_t dflt, std::size_t lo, std::size_t hi) {
  const char* s = std::getenv(env);
  if (!s || !*s) return dflt;
  std::size_t v = parse_size(env, s);
  PYINF_EXPECT(v >= lo && v <= hi, std::string(env) + ": " + s + " out of range [" +
                                       std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

}  // namespace

std::size_t block_size() { return size_env("PYINFINITY_BLOCK_SIZE", 1u << 20, 4096, 1u << 30); }
std::size_t queue_depth() { return size_env("PYINFINITY_QUEUE_DEPTH", 32, 1, 65536); }
std::size_t io_threads() { return size_env("PYINFINITY_IO_THREADS", 1, 1, 256); }
std::size_t stager_chunk_bytes() {
  return size_env("PYINFINITY_STAGER_CHUNK", 64u << 20, 1u << 16, std::size_t(1) << 32);
}
std::size_t stager_buffers() { return size_env("PYINFINITY_STAGER_BUFFERS", 4, 2, 64); }

std::string backend() {
  const char* s = std::getenv("PYINFINITY_BACKEND");
  if (!s || !*s) return "auto";
  std::string b(s);
  PYINF_EXPECT(b == "auto" || b == "aio" || b == "uring" || b == "posix",
               "PYINFINITY_BACKEND: expected auto, aio, uring or posix, got '" + b + "'");
  return b;
}

std::string cpu_isa() {
  const char* s = std::getenv("PYINFINITY_CPU_ISA");
  if (!s || !*s) return "auto";
  std::string v(s);
  PYINF_EXPECT(v == "auto" || v == "avx512" || v == "avx2" || v == "generic",
               "PYINFINITY_CPU_ISA: expected auto, avx512, avx2 or generic, got '" + v + "'");
  return v;
}

double wait_timeout_s() {
  const char* s = std::getenv("PYINFINITY_WAIT_TIMEOUT");
  if (!s || !*s) return 300.0;
  char* end = nullptr;
  double v = std::strtod(s, &end);
  PYINF_EXPECT(end != s && *end == '\0' && v > 0,
               std::string("PYINFINITY_WAIT_TIMEOUT: must be a positive number of seconds, got '") + s + "'");
  return v;
}

std::vector<Entry> table() {
  // No iostreams in the core: a module with its own copy of libstdc++ (some toolchains link
  // it statically) crashes formatting numbers through the locale that torch's copy set up.
  auto str = [](auto v) {
    char buf[64];
    if constexpr (std::is_floating_point_v<decltype(v)>) {
      std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    } else {
      std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(v));
    }
    return std::string(buf);
  };
  return {
      {"block_size", "PYINFINITY_BLOCK_SIZE", str(block_size()),
       "bytes per I/O piece; larger requests are split into pieces of this size"},
      {"queue_depth", "PYINFINITY_QUEUE_DEPTH", str(queue_depth()),
       "I/O pieces in flight per submitting thread"},
      {"io_threads", "PYINFINITY_IO_THREADS", str(io_threads()),
       "submitting threads per engine, each with its own queue"},
      {"backend", "PYINFINITY_BACKEND", backend(),
       "aio, uring, posix, or auto (probe each directory once, pick the best that works)"},
      {"wait_timeout", "PYINFINITY_WAIT_TIMEOUT", str(wait_timeout_s()),
       "seconds a wait() may see no progress before it raises TimeoutError"},
      {"stager_chunk", "PYINFINITY_STAGER_CHUNK", str(stager_chunk_bytes()),
       "bytes per chunk of the CUDA stager's disk<->GPU pipeline"},
      {"stager_buffers", "PYINFINITY_STAGER_BUFFERS", str(stager_buffers()),
       "pinned bounce buffers of the CUDA stager"},
      {"cpu_isa", "PYINFINITY_CPU_ISA", cpu_isa(),
       "instruction set of the CPU optimizer steps: auto (the best this CPU has), avx512, avx2 or generic"},
      {"fault", "PYINFINITY_FAULT", std::getenv("PYINFINITY_FAULT") ? std::getenv("PYINFINITY_FAULT") : "",
       "fault injection for tests: op=read|write|any,nth=N,action=errno|short|stall,value=V,count=C"},
  };
}

}  // namespace pyinfinity::defaults
