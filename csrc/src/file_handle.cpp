#include "pyinfinity/file_handle.hpp"

#include <fcntl.h>
#include <linux/stat.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "pyinfinity/error.hpp"

namespace pyinfinity {

namespace {
int flags_for(OpenMode mode) {
  switch (mode) {
    case OpenMode::read:
      return O_RDONLY;
    case OpenMode::write:
      return O_WRONLY | O_CREAT;
    case OpenMode::read_write:
      return O_RDWR | O_CREAT;
  }
  return O_RDONLY;
}
}  // namespace

FileHandle::FileHandle(std::string path, OpenMode mode, bool direct)
    : path_(std::move(path)), mode_(mode) {
  PYINF_EXPECT(!path_.empty(), "path: must not be empty");
  const int flags = flags_for(mode) | O_CLOEXEC;
  buffered_fd_ = PYINF_SYSCALL(::open(path_.c_str(), flags, 0644), "open", path_);
  struct stat st {};
  if (::fstat(buffered_fd_, &st) == 0 && S_ISDIR(st.st_mode)) {
    close_fds();
    throw SystemError(EISDIR, "open", path_, __FILE__, __LINE__);
  }
  if (direct && S_ISREG(st.st_mode)) {
    direct_fd_ = ::open(path_.c_str(), (flags & ~O_CREAT) | O_DIRECT | O_CLOEXEC);
    if (direct_fd_ < 0 && errno != EINVAL) {
      int err = errno;
      close_fds();
      throw SystemError(err, "open(O_DIRECT)", path_, __FILE__, __LINE__);
    }
    // EINVAL: the filesystem has no O_DIRECT (tmpfs); the buffered descriptor serves alone.
  }
#ifdef STATX_DIOALIGN
  if (direct_fd_ >= 0) {
    struct statx sx {};
    if (::statx(direct_fd_, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align > 0 &&
        sx.stx_dio_mem_align > 0) {
      offset_align_ = sx.stx_dio_offset_align;
      memory_align_ = sx.stx_dio_mem_align;
    }
  }
#endif
}

FileHandle::~FileHandle() { close_fds(); }

std::int64_t FileHandle::size() const {
  PYINF_EXPECT(!closed(), "file: used after close(): " + path_);
  struct stat st {};
  PYINF_SYSCALL(::fstat(buffered_fd_, &st), "fstat", path_);
  return st.st_size;
}

void FileHandle::resize(std::int64_t nbytes) {
  PYINF_EXPECT(!closed(), "file: used after close(): " + path_);
  PYINF_EXPECT(nbytes >= 0, "nbytes: must be >= 0");
  PYINF_SYSCALL(::ftruncate(buffered_fd_, nbytes), "ftruncate", path_);
}

void FileHandle::allocate(std::int64_t nbytes) {
  PYINF_EXPECT(!closed(), "file: used after close(): " + path_);
  PYINF_EXPECT(nbytes >= 0, "nbytes: must be >= 0");
  if (nbytes == 0) return;
  int rc = ::posix_fallocate(buffered_fd_, 0, nbytes);
  if (rc == EOPNOTSUPP || rc == EINVAL) {
    if (size() < nbytes) resize(nbytes);
    return;
  }
  if (rc != 0) throw SystemError(rc, "fallocate " + std::to_string(nbytes) + " bytes", path_,
                                 __FILE__, __LINE__);
}

void FileHandle::sync() {
  PYINF_EXPECT(!closed(), "file: used after close(): " + path_);
  PYINF_SYSCALL(::fdatasync(buffered_fd_), "fdatasync", path_);
}

void FileHandle::close() {
  PYINF_EXPECT(inflight() == 0, "file: " + std::to_string(inflight()) +
                                    " requests still in flight on " + path_ +
                                    "; wait() for them before close()");
  close_fds();
}

void FileHandle::close_fds() noexcept {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  direct_fd_ = buffered_fd_ = -1;
}

}  // namespace pyinfinity
