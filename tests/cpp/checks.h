// The check harness of the C++ test drivers in tests/cpp: every check counts; a failed one
// prints its line, what it checked and any detail; report(name) prints
// "NAME: N checks passed, M failed" (the line the Python test reads) and returns the exit
// status (0 when none failed).
#pragma once
#include <cstdio>
#include <string>

namespace checks {

inline int& total() {
  static int n = 0;
  return n;
}
inline int& failed() {
  static int n = 0;
  return n;
}

inline void check(bool ok, const char* what, int line, const std::string& detail = "") {
  ++total();
  if (!ok) {
    std::printf("FAIL line %d: %s%s%s\n", line, what, detail.empty() ? "" : " ", detail.c_str());
    ++failed();
  }
}

inline void check_eq(long long got, long long want, const char* what, int line) {
  ++total();
  if (got != want) {
    std::printf("FAIL line %d: %s = %lld, expected %lld\n", line, what, got, want);
    ++failed();
  }
}

inline int report(const char* name) {
  std::printf("%s: %d checks passed, %d failed\n", name, total() - failed(), failed());
  return failed() == 0 ? 0 : 1;
}

}  // namespace checks

#define CHECK(c) ::checks::check(static_cast<bool>(c), #c, __LINE__)
#define CHECK_MSG(c, m) ::checks::check(static_cast<bool>(c), #c, __LINE__, (m))
#define CHECK_EQ(a, b) ::checks::check_eq(static_cast<long long>(a), static_cast<long long>(b), #a, __LINE__)
