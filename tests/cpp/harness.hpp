// A minimal test harness (no third-party framework to fetch): TEST registers a function,
// CHECK/CHECK_THROWS fail it with file:line, main() runs all and prints "N passed, N failed".
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

namespace harness {
struct Failure : std::exception {
  std::string msg;
  explicit Failure(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};
struct Case {
  const char* name;
  void (*fn)();
};
inline std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}
struct Registrar {
  Registrar(const char* n, void (*f)()) { cases().push_back({n, f}); }
};
inline std::string temp_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string t = std::string(base && *base ? base : "/tmp") + "/pyinf-cpp-XXXXXX";
  std::vector<char> buf(t.begin(), t.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw Failure("mkdtemp failed");
  return buf.data();
}
inline void fill_random(unsigned char* p, std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(rng() & 0xff);
}
}  // namespace harness

#define TEST(name)                                                  \
  static void name();                                               \
  static harness::Registrar name##_registrar(#name, &name);         \
  static void name()

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond))                                                                               \
      throw harness::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #cond); \
  } while (0)

#define CHECK_THROWS(Type, expr)                                                               \
  do {                                                                                         \
    bool pyinf_thrown_ = false;                                                                \
    try {                                                                                      \
      (void)(expr);                                                                            \
    } catch (const Type&) {                                                                    \
      pyinf_thrown_ = true;                                                                    \
    }                                                                                          \
    if (!pyinf_thrown_)                                                                        \
      throw harness::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) +          \
                             ": expected " #Type " from " #expr);                              \
  } while (0)

int main() {
  int passed = 0, failed = 0;
  for (const auto& c : harness::cases()) {
    try {
      c.fn();
      ++passed;
      std::printf("PASS %s\n", c.name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: %s\n", c.name, e.what());
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
