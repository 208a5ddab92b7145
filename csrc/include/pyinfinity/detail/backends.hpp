// Constructors of the concrete backends; use pyinfinity::make_backend instead.
#pragma once

#include <memory>

#include "pyinfinity/io_backend.hpp"

namespace pyinfinity::detail {
std::unique_ptr<IoBackend> make_aio_backend(std::size_t depth);
std::unique_ptr<IoBackend> make_uring_backend(std::size_t depth);
std::unique_ptr<IoBackend> make_posix_backend(std::size_t depth);
}  // namespace pyinfinity::detail
