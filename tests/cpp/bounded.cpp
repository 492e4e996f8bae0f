// A blocking call bounded by a timeout (csrc/common/bounded.h, what the NCCL transport runs
// ncclCommInitRank through) on threads of one process: a call on time returns its value;
// its exception reaches the caller as it was thrown; a call past the timeout raises a
// RingError that names it and its likely cause, near the timeout, and when it returns
// later its result is handed to `abandon` on its own thread, once, after the caller's frame
// is gone; without a limit the caller waits. Built and run by tests/test_watchdog.py; exit
// status 0 and "bounded: N checks passed, 0 failed" when every check holds.
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "checks.h"
#include "common/bounded.h"

using ringdp::call_bounded;
using ringdp::RingError;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void on_time() {
  std::atomic<int> abandoned{0};
  const int v = call_bounded<int>([] { std::this_thread::sleep_for(milliseconds(20)); return 42; },
                                  [&](int&) { ++abandoned; }, 5.0, "init", "cause");
  CHECK(v == 42);
  CHECK(abandoned == 0);
}

void its_exception() {
  std::string msg;
  try {
    call_bounded<int>([]() -> int { throw RingError("ringdp nccl rank 1: ncclCommInitRank failed: boom"); },
                      [](int&) {}, 5.0, "init", "cause");
  } catch (const RingError& e) {
    msg = e.what();
  }
  CHECK_MSG(msg == "ringdp nccl rank 1: ncclCommInitRank failed: boom", msg);
}

void past_the_timeout() {
  auto abandoned = std::make_shared<std::atomic<int>>(0);
  auto released = std::make_shared<std::atomic<int>>(0);
  auto go = std::make_shared<std::atomic<bool>>(false);
  std::string msg;
  const auto t0 = Clock::now();
  double took = -1;
  {
    // the work waits until released (a peer that never comes), then "makes" 7
    try {
      call_bounded<int>(
          [go] {
            while (!*go) std::this_thread::sleep_for(milliseconds(1));
            return 7;
          },
          [abandoned, released](int& v) {
            ++*abandoned;
            if (v == 7) ++*released;
          },
          0.2, "ringdp nccl rank 0: ncclCommInitRank", "a peer died after the exchange");
    } catch (const RingError& e) {
      msg = e.what();
      took = since(t0);
    }
  }
  CHECK_MSG(msg == "ringdp nccl rank 0: ncclCommInitRank did not return within 0.2 s: a peer died after the exchange",
            msg);
  CHECK_MSG(took >= 0.2 && took < 0.2 + 0.5, std::to_string(took));
  CHECK(*abandoned == 0);  // still stuck: nothing to release yet
  *go = true;              // the call returns after all: its result is released on its thread
  const auto t1 = Clock::now();
  while (*abandoned == 0 && since(t1) < 5) std::this_thread::sleep_for(milliseconds(1));
  std::this_thread::sleep_for(milliseconds(20));
  CHECK(*abandoned == 1);
  CHECK(*released == 1);
}

void abandoned_failure_releases_nothing() {
  auto abandoned = std::make_shared<std::atomic<int>>(0);
  auto go = std::make_shared<std::atomic<bool>>(false);
  auto finished = std::make_shared<std::atomic<bool>>(false);
  bool raised = false;
  try {
    call_bounded<int>(
        [go, finished]() -> int {
          while (!*go) std::this_thread::sleep_for(milliseconds(1));
          *finished = true;
          throw RingError("late failure");
        },
        [abandoned](int&) { ++*abandoned; }, 0.05, "init", "cause");
  } catch (const RingError&) {
    raised = true;
  }
  CHECK(raised);
  *go = true;
  const auto t1 = Clock::now();
  while (!*finished && since(t1) < 5) std::this_thread::sleep_for(milliseconds(1));
  std::this_thread::sleep_for(milliseconds(20));
  CHECK(*finished);
  CHECK(*abandoned == 0);  // it made nothing: nothing to release, and its exception goes nowhere
}

void no_limit_waits() {
  // 0, infinity (timeout=float("inf")), NaN, 10^12 s: the caller waits for the call
  for (double limit : {0.0, std::numeric_limits<double>::infinity(), std::nan(""), 1e12}) {
    const auto t0 = Clock::now();
    int v = -1;
    try {
      v = call_bounded<int>([] { std::this_thread::sleep_for(milliseconds(150)); return 3; },
                            [](int&) {}, limit, "init", "cause");
    } catch (const RingError& e) {
      checks::check(false, "no limit raised", __LINE__, e.what());
    }
    CHECK_MSG(v == 3, std::to_string(limit));
    CHECK_MSG(since(t0) >= 0.15, std::to_string(limit));
  }
  CHECK(!ringdp::limits(0.0) && !ringdp::limits(-1.0) && !ringdp::limits(1e9) && ringdp::limits(300.0));
}
}  // namespace

int main() {
  on_time();
  its_exception();
  past_the_timeout();
  abandoned_failure_releases_nothing();
  no_limit_waits();
  return checks::report("bounded");
}
