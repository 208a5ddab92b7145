#include "pyinfinity/swap_engine.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <thread>
#include <vector>

#include "pyinfinity/checksum.hpp"
#include "pyinfinity/defaults.hpp"
#include "pyinfinity/detail/split_io.hpp"
#include "pyinfinity/error.hpp"
#include "pyinfinity/fault.hpp"
#include "pyinfinity/io_backend.hpp"

namespace pyinfinity {
namespace detail {

using Clock = std::chrono::steady_clock;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

struct OpState {
  std::shared_ptr<FileHandle> file;
  char* buf = nullptr;
  std::size_t nbytes = 0;
  std::int64_t offset = 0;
  bool write = false;
  std::size_t align = 4096;
  Lane* lane = nullptr;
  SwapEngine* engine = nullptr;
  // Integrity: a write computes one CRC-32C per kChecksumBlock; a read given `expected` checks.
  bool checksum = false;
  // The caller owns the bytes up to the next alignment boundary after the transfer (a swap
  // slot's reservation): an unaligned tail is written as one O_DIRECT block, zero-padded.
  bool pad_tail = false;
  std::vector<std::uint32_t> expected;
  std::vector<std::uint32_t> checksums;

  // Guarded by the lane's mutex.
  std::size_t cursor = 0;
  int inflight = 0;
  bool exhausted = false;
  int err = 0;
  std::string err_what;

  // Completion.
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool finished = false;
  std::atomic<std::size_t> bytes_done{0};
};

class Lane {
 public:
  Lane(SwapEngine* engine, std::string backend, const EngineOptions& o)
      : engine_(engine), backend_(std::move(backend)), opts_(o) {
    last_progress_ns_.store(now_ns());
    // Create every backend before starting threads so a failing io_setup raises here.
    std::vector<std::unique_ptr<IoBackend>> bes;
    for (std::size_t i = 0; i < o.threads; ++i) bes.push_back(make_backend(backend_, o.queue_depth));
    for (auto& be : bes) {
      threads_.emplace_back([this, b = std::move(be)]() mutable { run(std::move(b)); });
    }
  }
  ~Lane() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void enqueue(const std::shared_ptr<OpState>& op) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(op);
    }
    cv_.notify_one();
  }

  std::int64_t last_progress_ns() const { return last_progress_ns_.load(); }

 private:
  struct Piece {
    std::shared_ptr<OpState> op;
    char* user = nullptr;
    std::int64_t off = 0;
    std::size_t len = 0;
    std::size_t done = 0;
    bool direct = false;
    char* bounce = nullptr;
    // A read of an unaligned head/tail served by one O_DIRECT read of the aligned block that
    // holds it (into the bounce buffer): no cold page-cache reads for odd-sized tensors.
    bool widened = false;
  };

  struct Slot {
    Piece piece;
    char* bounce_mem = nullptr;  // lazily allocated, block_size bytes, page-aligned
  };

  // Takes the next piece of the first unfinished op. Caller holds mu_.
  bool take_piece_locked(Piece& p) {
    while (!queue_.empty()) {
      auto& op = queue_.front();
      if (op->exhausted) {
        queue_.pop_front();
        continue;
      }
      PieceSpec s = next_piece(op->offset, op->nbytes, op->cursor, opts_.block_size,
                               op->file->direct(), op->align);
      p.op = op;
      p.user = op->buf + op->cursor;
      p.off = op->offset + static_cast<std::int64_t>(op->cursor);
      p.len = s.len;
      p.done = 0;
      p.direct = s.direct;
      p.bounce = nullptr;
      const bool aligned_start =
          (static_cast<std::uint64_t>(p.off) & (op->align - 1)) == 0;
      p.widened = !s.direct && op->file->direct() && op->align <= bounce_bytes() &&
                  (!op->write || (op->pad_tail && aligned_start));
      op->cursor += s.len;
      op->inflight += 1;
      if (op->cursor == op->nbytes) {
        op->exhausted = true;
        queue_.pop_front();
      }
      return true;
    }
    return false;
  }

  std::size_t bounce_bytes() const { return std::max<std::size_t>(opts_.block_size, 65536); }

  IoRequest to_request(const Slot& s, std::uint64_t tag) const {
    const Piece& p = s.piece;
    IoRequest r;
    if (p.widened) {
      const std::size_t a = p.op->align;
      const auto base = static_cast<std::int64_t>(static_cast<std::uint64_t>(p.off) & ~(a - 1));
      r.fd = p.op->file->direct_fd();
      r.buf = p.bounce;
      r.nbytes = a;
      r.offset = base;
      r.write = p.op->write;
      r.tag = tag;
      return r;
    }
    r.fd = p.direct ? p.op->file->direct_fd() : p.op->file->buffered_fd();
    r.buf = (p.bounce ? p.bounce : p.user) + p.done;
    r.nbytes = p.len - p.done;
    r.offset = p.off + static_cast<std::int64_t>(p.done);
    r.write = p.op->write;
    r.tag = tag;
    return r;
  }

  static void fail_op_locked(OpState& op, int err, const std::string& what) {
    if (op.err == 0) {
      op.err = err;
      op.err_what = what;
    }
    op.exhausted = true;  // no further pieces; the queue skips it
  }

  // Piece finished (ok or failed). Completes the op when it was its last piece.
  void finish_piece(Slot& s, int err, const std::string& what) {
    std::shared_ptr<OpState> op = std::move(s.piece.op);
    bool complete = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (err != 0) fail_op_locked(*op, err, what);
      op->inflight -= 1;
      complete = op->inflight == 0 && op->exhausted;
    }
    s.piece = Piece{};
    if (complete) {
      if (op->err == 0 && (op->checksum || !op->expected.empty())) verify(*op);
      op->file->add_inflight(-1);
      engine_->op_finished(*op);
      {
        std::lock_guard<std::mutex> lk(op->mu);
        op->finished = true;
      }
      op->cv.notify_all();
    }
  }

  // Computed in the I/O thread once the data is in memory (reads) or on disk (writes), so the
  // caller's thread never pays for it.
  static void verify(OpState& op) {
    op.checksums = block_checksums(op.buf, op.nbytes);
    if (op.write || op.expected.empty()) return;
    for (std::size_t k = 0; k < op.checksums.size(); ++k) {
      if (op.checksums[k] != op.expected[k]) {
        const std::size_t lo = k * kChecksumBlock;
        const std::size_t hi = std::min(op.nbytes, lo + kChecksumBlock);
        op.err = EBADMSG;
        op.err_what = "checksum mismatch: bytes [" + std::to_string(lo) + ", " + std::to_string(hi) +
                      ") of the request, file offset " + std::to_string(op.offset + static_cast<std::int64_t>(lo)) +
                      " (the swap file changed since it was written)";
        return;
      }
    }
  }

  std::string describe(const Piece& p, std::int64_t res) const {
    std::string s = std::string(p.op->write ? "write" : "read") + " of " +
                    std::to_string(p.len - p.done) + " bytes at offset " +
                    std::to_string(p.off + static_cast<std::int64_t>(p.done)) + " (" + backend_ +
                    (p.direct || p.widened ? ", O_DIRECT" : ", buffered") + ")";
    if (res >= 0) s += ": transferred " + std::to_string(res) + " bytes";
    return s;
  }

  void run(std::unique_ptr<IoBackend> be) {
    const std::size_t qd = opts_.queue_depth;
    std::vector<Slot> slots(qd);
    std::vector<std::size_t> free_slots;
    for (std::size_t i = qd; i-- > 0;) free_slots.push_back(i);
    std::vector<std::size_t> staged;  // slots to submit
    std::vector<IoRequest> reqs;
    std::vector<IoCompletion> comps(qd);
    std::deque<IoCompletion> synthetic;
    std::size_t inflight = 0;  // submitted to the backend, not yet reaped
    FaultInjector& faults = FaultInjector::instance();
    struct FreeBounces {
      std::vector<Slot>& slots;
      ~FreeBounces() {
        for (auto& s : slots) std::free(s.bounce_mem);
      }
    } free_bounces{slots};

    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
          while (!free_slots.empty()) {
            Slot& s = slots[free_slots.back()];
            if (!take_piece_locked(s.piece)) break;
            staged.push_back(free_slots.back());
            free_slots.pop_back();
          }
          if (!staged.empty() || inflight > 0 || !synthetic.empty()) break;
          if (stop_ && queue_.empty()) {
            return;
          }
          cv_.wait(lk);
        }
      }
      // Prepare and submit outside the lock.
      reqs.clear();
      for (std::size_t idx : staged) {
        Slot& s = slots[idx];
        Piece& p = s.piece;
        const bool fresh = p.done == 0 && p.bounce == nullptr;
        const bool misaligned = p.direct && (reinterpret_cast<std::uintptr_t>(p.user) &
                                             (p.op->file->memory_align() - 1)) != 0;
        if (fresh && (misaligned || p.widened)) {
          if (!s.bounce_mem) {
            void* m = nullptr;
            if (posix_memalign(&m, 4096, bounce_bytes()) != 0) {
              synthetic.push_back({idx, -ENOMEM});
              continue;
            }
            s.bounce_mem = static_cast<char*>(m);
          }
          p.bounce = s.bounce_mem;
          if (p.op->write && p.widened) std::memset(p.bounce + p.len, 0, p.op->align - p.len);
          if (p.op->write) std::memcpy(p.bounce, p.user, p.len);
        }
        FaultDecision f = faults.on_submit(p.op->write);
        IoRequest r = to_request(s, idx);
        if (f.action == FaultSpec::Action::error) {
          synthetic.push_back({idx, -static_cast<std::int64_t>(f.value)});
          continue;
        }
        if (f.action == FaultSpec::Action::stall) {
          std::this_thread::sleep_for(std::chrono::milliseconds(f.value));
        } else if (f.action == FaultSpec::Action::short_io && r.nbytes > 1) {
          std::size_t half = r.nbytes / 2;
          if (p.direct || p.widened) half &= ~(p.op->align - 1);
          if (half == 0) {  // too small to halve aligned: go buffered for this piece
            if (p.widened) p.bounce = nullptr;  // its bounce held the whole block; read exactly now
            p.direct = false;
            p.widened = false;
            r = to_request(s, idx);
            half = r.nbytes / 2;
          }
          r.nbytes = half;
        }
        engine_->count_piece(p.bounce != nullptr && p.done == 0, !p.direct && !p.widened, false, false);
        reqs.push_back(r);
      }
      staged.clear();
      if (!reqs.empty()) {
        try {
          be->submit(reqs.data(), reqs.size());
          inflight += reqs.size();
        } catch (const SystemError& e) {
          for (const auto& r : reqs) synthetic.push_back({r.tag, -static_cast<std::int64_t>(e.code())});
        }
      }
      // Reap: block for one completion when nothing synthetic is pending.
      std::size_t n = 0;
      if (inflight > 0) {
        try {
          n = be->reap(comps.data(), comps.size(), synthetic.empty() ? 1 : 0, 1000);
        } catch (const SystemError&) {
          n = 0;  // io_getevents failing is not recoverable per piece; retry the wait
        }
        inflight -= n;
      }
      while (!synthetic.empty()) {
        if (n < comps.size()) {
          comps[n++] = synthetic.front();
          synthetic.pop_front();
        } else {
          break;
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t idx = static_cast<std::size_t>(comps[i].tag);
        const std::int64_t res = comps[i].res;
        Slot& s = slots[idx];
        Piece& p = s.piece;
        const std::size_t want = p.len - p.done;
        if (res == -EAGAIN || res == -EINTR) {
          engine_->count_piece(false, false, true, false);
          staged.push_back(idx);
          continue;
        }
        if (p.widened && res >= 0) {
          const auto base = static_cast<std::uint64_t>(p.off) & ~(p.op->align - 1);
          const std::size_t skip = static_cast<std::size_t>(static_cast<std::uint64_t>(p.off) - base);
          if (static_cast<std::size_t>(res) >= skip + p.len) {
            last_progress_ns_.store(now_ns());
            if (!p.op->write) std::memcpy(p.user, p.bounce + skip, p.len);
            p.op->bytes_done.fetch_add(p.len);
            finish_piece(s, 0, "");
            free_slots.push_back(idx);
          } else {  // came back short: move exactly the bytes asked for, buffered
            p.widened = false;
            p.bounce = nullptr;
            engine_->count_piece(false, false, false, true);
            staged.push_back(idx);
          }
          continue;
        }
        if (res < 0) {
          finish_piece(s, static_cast<int>(-res), describe(p, res));
          free_slots.push_back(idx);
          continue;
        }
        if (res == 0) {
          finish_piece(s, p.op->write ? EIO : ENODATA,
                       describe(p, 0) + (p.op->write ? "" : " (unexpected end of file)"));
          free_slots.push_back(idx);
          continue;
        }
        last_progress_ns_.store(now_ns());
        if (static_cast<std::size_t>(res) < want) {
          p.done += static_cast<std::size_t>(res);
          const auto pos = static_cast<std::uint64_t>(p.off) + p.done;
          if (p.direct && ((pos & (p.op->align - 1)) != 0 || ((p.len - p.done) & (p.op->align - 1)) != 0))
            p.direct = false;  // the remainder is no longer aligned: continue buffered
          engine_->count_piece(false, false, false, true);
          staged.push_back(idx);
          continue;
        }
        if (!p.op->write && p.bounce) std::memcpy(p.user, p.bounce, p.len);
        p.op->bytes_done.fetch_add(p.len);
        finish_piece(s, 0, "");
        free_slots.push_back(idx);
      }
    }
  }

  SwapEngine* engine_;
  std::string backend_;
  EngineOptions opts_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<OpState>> queue_;
  bool stop_ = false;
  std::atomic<std::int64_t> last_progress_ns_{0};
  std::vector<std::thread> threads_;
};

}  // namespace detail
}  // namespace pyinfinity

namespace pyinfinity {

using detail::Clock;
using detail::OpState;

bool Request::done() const {
  std::lock_guard<std::mutex> lk(op_->mu);
  return op_->finished;
}

void Request::wait(double timeout_s) const {
  const std::int64_t started = detail::now_ns();
  while (!wait_slice(-1, timeout_s, started)) {
  }
}

std::int64_t Request::clock_ns() { return detail::now_ns(); }

bool Request::wait_slice(double slice_s, double timeout_s, std::int64_t started_ns) const {
  const double limit = timeout_s < 0 ? defaults::wait_timeout_s() : timeout_s;
  const auto limit_ns = static_cast<std::int64_t>(limit * 1e9);
  const std::int64_t slice_end = slice_s < 0 ? std::numeric_limits<std::int64_t>::max()
                                              : detail::now_ns() + static_cast<std::int64_t>(slice_s * 1e9);
  std::unique_lock<std::mutex> lk(op_->mu);
  while (!op_->finished) {
    op_->cv.wait_for(lk, std::chrono::milliseconds(timeout_s == 0 || slice_s == 0 ? 0 : 50));
    if (op_->finished) break;
    const std::int64_t now = detail::now_ns();
    const std::int64_t last = std::max(started_ns, op_->lane->last_progress_ns());
    if (now - last >= limit_ns) {
      throw TimeoutError("wait(): no I/O progress for " + std::to_string(limit) + " s on " +
                         (op_->write ? "write" : "read") + " of " + std::to_string(op_->nbytes) +
                         " bytes at offset " + std::to_string(op_->offset) + " of " +
                         op_->file->path() + " (" + std::to_string(op_->bytes_done.load()) +
                         " bytes done)");
    }
    if (now >= slice_end) return false;
  }
  if (op_->err != 0) {
    throw SystemError(op_->err, op_->err_what, op_->file->path(), __FILE__, __LINE__);
  }
  return true;
}

std::size_t Request::nbytes() const { return op_->nbytes; }
std::int64_t Request::offset() const { return op_->offset; }
bool Request::is_write() const { return op_->write; }
const std::string& Request::path() const { return op_->file->path(); }
std::vector<std::uint32_t> Request::checksums() const {
  std::lock_guard<std::mutex> lk(op_->mu);
  PYINF_EXPECT(op_->finished, "checksums: the request is not done yet; wait() first");
  return op_->checksums;
}

SwapEngine::SwapEngine(EngineOptions o) : opts_(std::move(o)) {
  PYINF_EXPECT(opts_.block_size >= 4096 && opts_.block_size <= (std::size_t(1) << 30),
               "block_size: must be in [4096, 1 GiB], got " + std::to_string(opts_.block_size));
  PYINF_EXPECT(opts_.queue_depth >= 1 && opts_.queue_depth <= 65536,
               "queue_depth: must be in [1, 65536], got " + std::to_string(opts_.queue_depth));
  PYINF_EXPECT(opts_.threads >= 1 && opts_.threads <= 256,
               "threads: must be in [1, 256], got " + std::to_string(opts_.threads));
  PYINF_EXPECT(opts_.backend == "auto" || opts_.backend == "aio" || opts_.backend == "uring" ||
                   opts_.backend == "posix",
               "backend: unknown backend '" + opts_.backend + "' (expected aio, uring, posix or auto)");
  // An explicit backend is created now, so "uring unavailable" raises at construction.
  if (opts_.backend != "auto") lane(opts_.backend);
}

SwapEngine::~SwapEngine() { close(); }

void SwapEngine::close() {
  closed_.store(true);
  std::map<std::string, std::unique_ptr<detail::Lane>> lanes;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    lanes.swap(lanes_);
  }
  lanes.clear();  // each lane drains its queue and joins its threads
}

detail::Lane& SwapEngine::lane(const std::string& backend) {
  std::lock_guard<std::mutex> lk(lanes_mu_);
  auto it = lanes_.find(backend);
  if (it == lanes_.end()) {
    it = lanes_.emplace(backend, std::make_unique<detail::Lane>(this, backend, opts_)).first;
  }
  return *it->second;
}

std::string SwapEngine::backend_for(const FileHandle& file) {
  if (opts_.backend != "auto") return opts_.backend;
  if (!file.direct()) return "posix";
  if (std::string hint = file.backend_hint(); !hint.empty()) return hint;
  // The directory of the open file itself (the given path may be a symlink or /proc/self/fd/N).
  std::string p = file.path();
  char link[4096];
  const std::string proc = "/proc/self/fd/" + std::to_string(file.buffered_fd());
  ssize_t len = ::readlink(proc.c_str(), link, sizeof(link) - 1);
  if (len > 0) {
    p.assign(link, static_cast<std::size_t>(len));
    const std::string deleted = " (deleted)";
    if (p.size() > deleted.size() && p.compare(p.size() - deleted.size(), deleted.size(), deleted) == 0)
      p.resize(p.size() - deleted.size());
  }
  auto slash = p.rfind('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : p.substr(0, slash));
  std::string best = probe_backend(dir).best;
  file.set_backend_hint(best);
  return best;
}

Request SwapEngine::submit(std::shared_ptr<FileHandle> file, void* buf, std::size_t nbytes,
                           std::int64_t offset, bool write, bool checksum,
                           std::vector<std::uint32_t> expected, bool pad_tail) {
  PYINF_EXPECT(!closed_.load(), "engine: used after close()");
  PYINF_EXPECT(file != nullptr, "file: must not be None");
  PYINF_EXPECT(!file->closed(), "file: used after close(): " + file->path());
  PYINF_EXPECT(buf != nullptr, "buffer: null pointer");
  PYINF_EXPECT(nbytes > 0, "nbytes: zero-size transfer to " + file->path());
  PYINF_EXPECT(offset >= 0, "offset: must be >= 0, got " + std::to_string(offset));
  if (write) {
    PYINF_EXPECT(file->mode() != OpenMode::read, "file: opened read-only, cannot write: " + file->path());
  } else {
    PYINF_EXPECT(file->mode() != OpenMode::write, "file: opened write-only, cannot read: " + file->path());
    const std::int64_t size = file->size();
    PYINF_EXPECT(offset + static_cast<std::int64_t>(nbytes) <= size,
                 "offset: read past end of file: " + file->path() + " has " + std::to_string(size) +
                     " bytes, asked for " + std::to_string(nbytes) + " at offset " + std::to_string(offset));
  }
  if (!expected.empty()) {
    PYINF_EXPECT(!write, "expected_checksums: only reads are verified");
    PYINF_EXPECT(expected.size() == (nbytes + kChecksumBlock - 1) / kChecksumBlock,
                 "expected_checksums: " + std::to_string(expected.size()) + " given, " +
                     std::to_string((nbytes + kChecksumBlock - 1) / kChecksumBlock) + " needed for " +
                     std::to_string(nbytes) + " bytes");
  }
  detail::Lane& ln = lane(backend_for(*file));
  auto op = std::make_shared<OpState>();
  op->file = std::move(file);
  op->buf = static_cast<char*>(buf);
  op->nbytes = nbytes;
  op->offset = offset;
  op->write = write;
  op->checksum = checksum;
  op->pad_tail = pad_tail;
  op->expected = std::move(expected);
  op->align = std::max<std::size_t>({op->file->offset_align(), static_cast<std::size_t>(::getpagesize())});
  op->lane = &ln;
  op->engine = this;
  op->file->add_inflight(1);
  op_started(write);
  ln.enqueue(op);
  return Request(op);
}

void SwapEngine::op_started(bool write) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  if (inflight_[write]++ == 0) busy_since_[write] = Clock::now();
}

void SwapEngine::op_finished(const OpState& op) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  DirectionStats& d = op.write ? stats_.write : stats_.read;
  d.ops += 1;
  if (op.err != 0) {
    d.errors += 1;
  } else {
    d.bytes += op.nbytes;
  }
  if (--inflight_[op.write] == 0) {
    d.busy_seconds += std::chrono::duration<double>(Clock::now() - busy_since_[op.write]).count();
  }
}

void SwapEngine::count_piece(bool bounced, bool buffered, bool retry, bool short_resubmit) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  if (retry) {
    stats_.retries += 1;
  } else if (short_resubmit) {
    stats_.short_resubmits += 1;
  } else {
    stats_.pieces += 1;
    stats_.bounced += bounced;
    stats_.buffered += buffered;
  }
}

EngineStats SwapEngine::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  EngineStats s = stats_;
  const auto now = Clock::now();
  for (int w = 0; w < 2; ++w) {
    if (inflight_[w] > 0) {
      (w ? s.write : s.read).busy_seconds += std::chrono::duration<double>(now - busy_since_[w]).count();
    }
  }
  return s;
}

void SwapEngine::reset_stats() {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_ = EngineStats{};
  const auto now = Clock::now();
  busy_since_[0] = busy_since_[1] = now;
}

}  // namespace pyinfinity
