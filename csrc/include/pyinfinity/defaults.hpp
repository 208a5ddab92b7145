// One table of defaults: each knob has an environment variable, a getter and validation.
// docs/README list the same table; a test checks they agree (tests/python/test_defaults.py).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace pyinfinity::defaults {

struct Entry {
  std::string name;   // knob name
  std::string env;    // environment variable
  std::string value;  // effective value, as text
  std::string doc;    // one line
};

std::size_t block_size();         // PYINFINITY_BLOCK_SIZE, bytes per I/O piece (1 MiB)
std::size_t queue_depth();        // PYINFINITY_QUEUE_DEPTH, pieces in flight per thread (32)
std::size_t io_threads();         // PYINFINITY_IO_THREADS, submitting threads per engine (1)
std::string backend();            // PYINFINITY_BACKEND, aio|uring|posix|auto (auto)
double wait_timeout_s();          // PYINFINITY_WAIT_TIMEOUT, seconds without progress (300)
std::size_t stager_chunk_bytes();  // PYINFINITY_STAGER_CHUNK, bytes per staged chunk (64 MiB)
std::size_t stager_buffers();     // PYINFINITY_STAGER_BUFFERS, pinned bounce buffers (4)
std::string cpu_isa();            // PYINFINITY_CPU_ISA, auto|avx512|avx2|generic: the optimizer loops (auto)

std::vector<Entry> table();

}  // namespace pyinfinity::defaults
