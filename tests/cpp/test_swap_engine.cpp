#include <unistd.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "pyinfinity/error.hpp"
#include "pyinfinity/fault.hpp"
#include "pyinfinity/file_handle.hpp"
#include "pyinfinity/swap_engine.hpp"

using namespace pyinfinity;

namespace {
void round_trip(SwapEngine& e, const std::shared_ptr<FileHandle>& f, std::size_t n, std::int64_t off,
                std::size_t mis, unsigned seed) {
  std::vector<unsigned char> src(n + mis), dst(n + mis, 0);
  harness::fill_random(src.data() + mis, n, seed);
  e.submit(f, src.data() + mis, n, off, true).wait(30);
  e.submit(f, dst.data() + mis, n, off, false).wait(30);
  CHECK(std::memcmp(src.data() + mis, dst.data() + mis, n) == 0);
}
}  // namespace

TEST(every_backend_any_size_and_offset) {
  const std::string dir = harness::temp_dir();
  for (const char* be : {"aio", "uring", "posix"}) {
    for (std::size_t qd : {std::size_t(1), std::size_t(8)}) {
      for (std::size_t threads : {std::size_t(1), std::size_t(2)}) {
        SwapEngine e({be, 65536, qd, threads});
        auto f = std::make_shared<FileHandle>(dir + "/f_" + be, OpenMode::read_write);
        unsigned seed = 1;
        for (std::size_t n : {std::size_t(1), std::size_t(199), std::size_t(4095), std::size_t(4096),
                              std::size_t(4097), (std::size_t(1) << 20) + 7}) {
          for (std::int64_t off : {0L, 1L, 4096L, 12345L}) {
            for (std::size_t mis : {std::size_t(0), std::size_t(3)}) round_trip(e, f, n, off, mis, seed++);
          }
        }
        f->close();
      }
    }
    ::unlink((dir + "/f_" + be).c_str());
  }
  ::rmdir(dir.c_str());
}

TEST(many_concurrent_requests_from_threads) {
  const std::string dir = harness::temp_dir();
  SwapEngine e({"auto", 1 << 16, 16, 2});
  auto f = std::make_shared<FileHandle>(dir + "/many", OpenMode::read_write);
  const std::size_t per = 50000;
  std::vector<std::thread> ts;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&, t] {
      std::vector<std::vector<unsigned char>> bufs;
      std::vector<Request> reqs;
      for (int i = 0; i < 8; ++i) {
        bufs.emplace_back(per);
        harness::fill_random(bufs.back().data(), per, 100 * t + i);
        reqs.push_back(e.submit(f, bufs.back().data(), per, static_cast<std::int64_t>((t * 8 + i) * per), true));
      }
      for (auto& r : reqs) r.wait(30);
      reqs.clear();
      std::vector<std::vector<unsigned char>> back(8, std::vector<unsigned char>(per));
      for (int i = 0; i < 8; ++i)
        reqs.push_back(e.submit(f, back[i].data(), per, static_cast<std::int64_t>((t * 8 + i) * per), false));
      for (auto& r : reqs) r.wait(30);
      int good = 1;
      for (int i = 0; i < 8; ++i) good &= back[i] == bufs[i];
      ok[t] = good;
    });
  }
  for (auto& t : ts) t.join();
  for (int v : ok) CHECK(v == 1);
  f->close();
  ::unlink((dir + "/many").c_str());
  ::rmdir(dir.c_str());
}

TEST(faults_surface_or_recover) {
  const std::string dir = harness::temp_dir();
  SwapEngine e({"aio", 4096, 4, 1});
  auto f = std::make_shared<FileHandle>(dir + "/fault", OpenMode::read_write);
  std::vector<unsigned char> buf(64 * 1024), back(buf.size());
  harness::fill_random(buf.data(), buf.size(), 7);
  auto& inj = FaultInjector::instance();
  FaultSpec s;
  // An I/O error on the 3rd piece: the request fails with EIO at wait().
  s.action = FaultSpec::Action::error;
  s.op = FaultSpec::Op::write;
  s.nth = 3;
  s.value = EIO;
  inj.set(s);
  bool failed = false;
  try {
    e.submit(f, buf.data(), buf.size(), 0, true).wait(30);
  } catch (const SystemError& err) {
    failed = err.code() == EIO && err.path() == dir + "/fault";
  }
  CHECK(failed);
  // EINTR and short transfers are retried: the data arrives intact.
  s.value = EINTR;
  s.count = 3;
  inj.set(s);
  e.submit(f, buf.data(), buf.size(), 0, true).wait(30);
  s.action = FaultSpec::Action::short_io;
  s.op = FaultSpec::Op::read;
  s.nth = 1;
  s.count = 0;
  inj.set(s);
  e.submit(f, back.data(), back.size(), 0, false).wait(30);
  CHECK(back == buf);
  // A stall longer than the timeout: wait() reports what it waited for.
  s.action = FaultSpec::Action::stall;
  s.value = 400;
  s.count = 1;
  inj.set(s);
  Request r = e.submit(f, back.data(), 4096, 0, false);
  CHECK_THROWS(TimeoutError, r.wait(0.1));
  r.wait(30);
  inj.clear();
  f->close();
  ::unlink((dir + "/fault").c_str());
  ::rmdir(dir.c_str());
}

TEST(bad_arguments_raise) {
  const std::string dir = harness::temp_dir();
  SwapEngine e({"posix", 4096, 4, 1});
  auto f = std::make_shared<FileHandle>(dir + "/bad", OpenMode::read_write);
  char b[16] = {0};
  CHECK_THROWS(ArgumentError, e.submit(f, b, 16, 0, false));  // past end of an empty file
  CHECK_THROWS(ArgumentError, e.submit(f, b, 0, 0, true));
  CHECK_THROWS(ArgumentError, e.submit(f, b, 16, -1, true));
  CHECK_THROWS(ArgumentError, e.submit(f, nullptr, 16, 0, true));
  CHECK_THROWS(ArgumentError, SwapEngine({"nope", 4096, 4, 1}));
  CHECK_THROWS(ArgumentError, SwapEngine({"aio", 4096, 0, 1}));
  CHECK_THROWS(SystemError, FileHandle(dir + "/missing/x", OpenMode::read));
  f->close();
  CHECK_THROWS(ArgumentError, e.submit(f, b, 16, 0, true));
  e.close();
  ::unlink((dir + "/bad").c_str());
  ::rmdir(dir.c_str());
}
