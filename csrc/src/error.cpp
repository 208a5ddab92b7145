#include "pyinfinity/error.hpp"

#include <cstring>

namespace pyinfinity {

namespace {
std::string describe(int err, const std::string& op, const std::string& path, const char* file,
                     int line) {
  std::string s = op + ": " + std::strerror(err);
  if (!path.empty()) s += " [" + path + "]";
  s += " (" + std::string(file) + ":" + std::to_string(line) + ")";
  return s;
}
}  // namespace

SystemError::SystemError(int err, const std::string& op, const std::string& path,
                         const char* file, int line)
    : std::runtime_error(describe(err, op, path, file, line)), err_(err), op_(op), path_(path) {}

std::string SystemError::message() const { return op_ + ": " + std::strerror(err_); }

namespace detail {
void throw_argument(const std::string& msg, const char* /*file*/, int /*line*/) {
  throw ArgumentError(msg);
}
void throw_system(int err, const std::string& op, const std::string& path, const char* file,
                  int line) {
  throw SystemError(err, op, path, file, line);
}
}  // namespace detail
}  // namespace pyinfinity
