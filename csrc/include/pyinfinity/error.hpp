// Errors of the core: exceptions built only on failure, carrying errno, operation, path and
// the source location. The bindings map SystemError to Python's OSError(errno, msg, path),
// ArgumentError to ValueError and TimeoutError to TimeoutError.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

namespace pyinfinity {

/// A failed system call or I/O operation: errno, what was done, on which path.
class SystemError : public std::runtime_error {
 public:
  SystemError(int err, const std::string& op, const std::string& path, const char* file, int line);
  int code() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  /// "op: strerror" without location, for Python's OSError strerror field.
  std::string message() const;

 private:
  int err_;
  std::string op_;
  std::string path_;
};

/// A bad argument from the caller (maps to ValueError).
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A wait that saw no progress within its timeout (maps to TimeoutError).
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A CUDA runtime failure, or a CUDA-only call without a device (maps to RuntimeError).
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] void throw_argument(const std::string& msg, const char* file, int line);
[[noreturn]] void throw_system(int err, const std::string& op, const std::string& path,
                               const char* file, int line);
}  // namespace detail
}  // namespace pyinfinity

/// Argument check: throws ArgumentError(msg) when cond is false.
#define PYINF_EXPECT(cond, msg)                                                   \
  do {                                                                            \
    if (!(cond)) ::pyinfinity::detail::throw_argument((msg), __FILE__, __LINE__); \
  } while (0)

/// System call check: a result < 0 throws SystemError(errno, op, path). Yields the result.
#define PYINF_SYSCALL(call, op, path)                                                   \
  ([&]() {                                                                              \
    auto pyinf_rc_ = (call);                                                            \
    if (pyinf_rc_ < 0) ::pyinfinity::detail::throw_system(errno, (op), (path), __FILE__, \
                                                          __LINE__);                    \
    return pyinf_rc_;                                                                   \
  }())
