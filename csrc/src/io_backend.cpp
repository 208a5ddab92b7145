// The backend factory and the per-directory probe behind "auto".
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "pyinfinity/detail/backends.hpp"
#include "pyinfinity/error.hpp"
#include "pyinfinity/file_handle.hpp"
#include "pyinfinity/io_backend.hpp"

namespace pyinfinity {

std::vector<std::string> compiled_backends() { return {"aio", "uring", "posix"}; }

std::unique_ptr<IoBackend> make_backend(const std::string& name, std::size_t queue_depth) {
  PYINF_EXPECT(queue_depth >= 1 && queue_depth <= 65536,
               "queue_depth: must be in [1, 65536], got " + std::to_string(queue_depth));
  if (name == "aio") return detail::make_aio_backend(queue_depth);
  if (name == "uring") return detail::make_uring_backend(queue_depth);
  if (name == "posix") return detail::make_posix_backend(queue_depth);
  PYINF_EXPECT(false, "backend: unknown backend '" + name + "' (expected aio, uring, posix or auto)");
  return nullptr;
}

namespace {

// One write + read back of a small aligned block through backend `name`; "" on success, else why.
std::string round_trip(const std::string& name, FileHandle& fh, bool direct) {
  const std::size_t n = 8192;
  void* wbuf = nullptr;
  void* rbuf = nullptr;
  if (posix_memalign(&wbuf, 4096, n) != 0 || posix_memalign(&rbuf, 4096, n) != 0) {
    std::free(wbuf);
    return "out of memory";
  }
  std::string why;
  try {
    for (std::size_t i = 0; i < n; ++i) static_cast<unsigned char*>(wbuf)[i] = static_cast<unsigned char>(i * 7 + 3);
    std::memset(rbuf, 0, n);
    auto be = make_backend(name, 2);
    const int fd = direct ? fh.direct_fd() : fh.buffered_fd();
    IoRequest w{fd, wbuf, n, 0, true, 1};
    be->submit(&w, 1);
    IoCompletion c{};
    if (be->reap(&c, 1, 1, 5000) != 1) {
      why = "write timed out";
    } else if (c.res != static_cast<std::int64_t>(n)) {
      why = c.res < 0 ? std::string("write: ") + std::strerror(static_cast<int>(-c.res))
                      : "short write";
    } else {
      IoRequest r{fd, rbuf, n, 0, false, 2};
      be->submit(&r, 1);
      if (be->reap(&c, 1, 1, 5000) != 1) {
        why = "read timed out";
      } else if (c.res != static_cast<std::int64_t>(n)) {
        why = c.res < 0 ? std::string("read: ") + std::strerror(static_cast<int>(-c.res))
                        : "short read";
      } else if (std::memcmp(wbuf, rbuf, n) != 0) {
        why = "data mismatch";
      }
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  std::free(wbuf);
  std::free(rbuf);
  return why;
}

[[noreturn]] void throw_system_probe(int err, const std::string& dir) {
  throw SystemError(err, "create probe file", dir, __FILE__, __LINE__);
}

}  // namespace

ProbeResult probe_backend(const std::string& dir) {
  struct stat st {};
  PYINF_SYSCALL(::stat(dir.c_str(), &st), "stat", dir);
  if (!S_ISDIR(st.st_mode)) throw SystemError(ENOTDIR, "probe", dir, __FILE__, __LINE__);
  static std::mutex mu;
  static std::map<dev_t, ProbeResult> cache;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(st.st_dev);
    if (it != cache.end()) return it->second;
  }
  std::string tmpl = dir + "/.pyinfinity-probe-XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0 && (errno == EROFS || errno == EACCES || errno == EPERM)) {
    // Nothing can be written here (read-only mount): reads need no round trip; the thread
    // pool is the backend that works on every filesystem. Not cached: the mount may change.
    ProbeResult ro;
    ro.best = "posix";
    ro.failures.push_back(std::string("probe: ") + std::strerror(errno) + " (read-only directory)");
    return ro;
  }
  if (fd < 0) throw_system_probe(errno, dir);
  ::close(fd);
  const std::string path(name.data());
  ProbeResult res;
  try {
    FileHandle fh(path, OpenMode::read_write, true);
    res.direct_io = fh.direct();
    for (const auto& b : compiled_backends()) {
      std::string why = round_trip(b, fh, res.direct_io);
      if (why.empty()) {
        res.working.push_back(b);
      } else {
        res.failures.push_back(b + ": " + why);
      }
    }
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
  ::unlink(path.c_str());
  // Without O_DIRECT, kernel AIO submits synchronously: the thread pool is the fast path there.
  if (!res.direct_io) {
    res.best = "posix";
  } else {
    for (const auto& b : res.working) {
      res.best = b;
      break;
    }
  }
  if (res.best.empty()) {
    std::string all;
    for (const auto& f : res.failures) all += (all.empty() ? "" : "; ") + f;
    throw SystemError(EIO, "no I/O backend works here (" + all + ")", dir, __FILE__, __LINE__);
  }
  std::lock_guard<std::mutex> lk(mu);
  cache[st.st_dev] = res;
  return res;
}

}  // namespace pyinfinity
