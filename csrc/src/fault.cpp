#include "pyinfinity/fault.hpp"

#include <cstdlib>

#include "pyinfinity/error.hpp"

namespace pyinfinity {

FaultInjector& FaultInjector::instance() {
  static FaultInjector inj;
  return inj;
}

FaultInjector::FaultInjector() {
  if (const char* env = std::getenv("PYINFINITY_FAULT"); env && *env) set(parse(env));
}

void FaultInjector::set(const FaultSpec& spec) {
  PYINF_EXPECT(spec.nth >= 1, "nth: must be >= 1");
  std::lock_guard<std::mutex> lk(mu_);
  spec_ = spec;
  seen_ = 0;
  enabled_.store(spec.action != FaultSpec::Action::none);
}

void FaultInjector::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  spec_ = FaultSpec{};
  enabled_.store(false);
}

FaultSpec FaultInjector::parse(const std::string& text) {
  FaultSpec s;
  s.action = FaultSpec::Action::error;
  s.value = 5;  // EIO
  std::size_t start = 0;
  auto to_u64 = [](const std::string& key, const std::string& v) {
    char* end = nullptr;
    unsigned long long x = std::strtoull(v.c_str(), &end, 10);
    PYINF_EXPECT(!v.empty() && *end == '\0', "PYINFINITY_FAULT: " + key + "=" + v + " is not a number");
    return static_cast<std::uint64_t>(x);
  };
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) continue;
    auto eq = item.find('=');
    PYINF_EXPECT(eq != std::string::npos, "PYINFINITY_FAULT: expected key=value, got '" + item + "'");
    std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "op") {
      PYINF_EXPECT(v == "read" || v == "write" || v == "any",
                   "PYINFINITY_FAULT: op must be read, write or any, got '" + v + "'");
      s.op = v == "read" ? FaultSpec::Op::read : v == "write" ? FaultSpec::Op::write : FaultSpec::Op::any;
    } else if (k == "action") {
      PYINF_EXPECT(v == "errno" || v == "short" || v == "stall",
                   "PYINFINITY_FAULT: action must be errno, short or stall, got '" + v + "'");
      s.action = v == "errno" ? FaultSpec::Action::error
                 : v == "short" ? FaultSpec::Action::short_io
                                : FaultSpec::Action::stall;
    } else if (k == "nth") {
      s.nth = to_u64(k, v);
    } else if (k == "count") {
      s.count = to_u64(k, v);
    } else if (k == "value") {
      s.value = static_cast<int>(to_u64(k, v));
    } else {
      PYINF_EXPECT(false, "PYINFINITY_FAULT: unknown key '" + k + "' (op, nth, action, value, count)");
    }
  }
  return s;
}

FaultDecision FaultInjector::on_submit(bool write) {
  if (!enabled_.load(std::memory_order_relaxed)) return {};
  std::lock_guard<std::mutex> lk(mu_);
  if (spec_.action == FaultSpec::Action::none) return {};
  if (spec_.op == FaultSpec::Op::read && write) return {};
  if (spec_.op == FaultSpec::Op::write && !write) return {};
  const std::uint64_t k = ++seen_;
  if (k < spec_.nth) return {};
  if (spec_.count != 0 && k >= spec_.nth + spec_.count) return {};
  injected_.fetch_add(1);
  return {spec_.action, spec_.value};
}

}  // namespace pyinfinity
