// The watchdog of work that finishes elsewhere (csrc/common/watchdog.h, what the NCCL
// transport uses to abort a communicator whose step waits on a dead peer) on threads of one
// process, with fake work (an atomic flag per token): work done in time is retired and
// never expires; work past its deadline expires once, near its deadline, with a reason that
// names it; an asynchronous error expires at once while work is in flight and not while
// idle; the later of two items may expire first (a shorter timeout); no limit never
// expires; stop() returns at once with work stuck, retires every token exactly once, and no
// hook runs after it; 20000 items completed by another thread are each retired once, in
// order. Built and run by tests/test_watchdog.py; exit status 0 and "watchdog: N checks
// passed, 0 failed" when every check holds.
#include <atomic>
#include <functional>
#include <memory>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checks.h"
#include "common/watchdog.h"

using ringdp::Watchdog;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Fake work: tokens are indices into `done`; the hooks count what the watchdog did.
struct Fake {
  explicit Fake(size_t n) : done(n) {
    for (auto& d : done) d = false;
    retired.assign(n, 0);
  }
  std::vector<std::atomic<bool>> done;
  std::mutex mu;
  std::vector<int> retired;          // times each token was retired
  std::vector<size_t> retire_order;  // tokens in the order they were retired
  std::vector<std::string> expiries;
  std::vector<double> expiry_at;     // seconds since t0
  std::string error;                 // what error() returns
  std::atomic<bool> stopped{false};  // set after stop() returned: no hook may run then
  std::atomic<int> hooks_after_stop{0};
  Clock::time_point t0 = Clock::now();

  static void* tok(size_t i) { return reinterpret_cast<void*>(i + 1); }
  static size_t idx(void* t) { return reinterpret_cast<size_t>(t) - 1; }

  Watchdog::Hooks hooks() {
    Watchdog::Hooks h;
    h.done = [this](void* t) {
      if (stopped) ++hooks_after_stop;
      return done[idx(t)].load();
    };
    h.error = [this] {
      if (stopped) ++hooks_after_stop;
      std::lock_guard<std::mutex> lk(mu);
      return error;
    };
    h.expire = [this](const std::string& why) {
      if (stopped) ++hooks_after_stop;
      std::lock_guard<std::mutex> lk(mu);
      expiries.push_back(why);
      expiry_at.push_back(since(t0));
    };
    h.retire = [this](void* t) {
      std::lock_guard<std::mutex> lk(mu);
      ++retired[idx(t)];
      retire_order.push_back(idx(t));
    };
    return h;
  }
  size_t n_expiries() {
    std::lock_guard<std::mutex> lk(mu);
    return expiries.size();
  }
  bool all_retired_once() {
    std::lock_guard<std::mutex> lk(mu);
    for (int r : retired)
      if (r != 1) return false;
    return true;
  }
};

bool wait_until(const std::function<bool()>& pred, double seconds) {
  const auto t0 = Clock::now();
  while (!pred()) {
    if (since(t0) > seconds) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

void done_in_time() {
  Fake f(3);
  {
    Watchdog w(f.hooks());
    for (size_t i = 0; i < 3; ++i) w.watch(Fake::tok(i), 0.5, "call " + std::to_string(i));
    std::this_thread::sleep_for(milliseconds(50));
    for (size_t i = 0; i < 3; ++i) f.done[i] = true;
    CHECK(wait_until([&] { return w.watching() == 0; }, 2.0));
    std::this_thread::sleep_for(milliseconds(700));  // past every deadline: nothing is watched
    CHECK(!w.expired());
  }
  CHECK(f.n_expiries() == 0);
  CHECK(f.all_retired_once());
  CHECK((f.retire_order == std::vector<size_t>{0, 1, 2}));
}

void late_work_expires_once() {
  Fake f(3);
  Watchdog w(f.hooks());
  f.t0 = Clock::now();
  w.watch(Fake::tok(0), 0.3, "all_reduce of 4096 B (call 7)");
  w.watch(Fake::tok(1), 0.3, "all_reduce of 8 B (call 8)");
  w.watch(Fake::tok(2), 0.3, "all_reduce of 8 B (call 9)");
  CHECK(wait_until([&] { return f.n_expiries() > 0; }, 3.0));
  std::this_thread::sleep_for(milliseconds(300));  // every deadline passed: still one expiry
  CHECK(f.n_expiries() == 1);
  CHECK(w.expired());
  {
    std::lock_guard<std::mutex> lk(f.mu);
    CHECK_MSG(f.expiry_at[0] >= 0.3 && f.expiry_at[0] < 0.3 + 0.5, std::to_string(f.expiry_at[0]));
    const std::string& why = f.expiries[0];
    CHECK_MSG(why.find("all_reduce of 4096 B (call 7) not finished") == 0, why);
    CHECK_MSG(why.find("(timeout 0.3 s)") != std::string::npos, why);
    CHECK_MSG(why.find("a peer is stuck or dead") != std::string::npos, why);
  }
  // the owner's abort makes the work finish: every token is retired, in order
  for (size_t i = 0; i < 3; ++i) f.done[i] = true;
  CHECK(wait_until([&] { return w.watching() == 0; }, 2.0));
  CHECK(f.all_retired_once());
  CHECK((f.retire_order == std::vector<size_t>{0, 1, 2}));
}

void error_expires_in_flight_only() {
  Fake f(1);
  Watchdog w(f.hooks());
  {
    std::lock_guard<std::mutex> lk(f.mu);
    f.error = "NCCL reported an error: remote process exited";
  }
  std::this_thread::sleep_for(milliseconds(50));  // idle: no thread yet, nothing to expire
  CHECK(f.n_expiries() == 0);
  f.t0 = Clock::now();
  w.watch(Fake::tok(0), 60.0, "broadcast of 12 B");
  CHECK(wait_until([&] { return f.n_expiries() > 0; }, 2.0));
  {
    std::lock_guard<std::mutex> lk(f.mu);
    CHECK_MSG(f.expiry_at[0] < 1.0, std::to_string(f.expiry_at[0]));
    CHECK_MSG(f.expiries[0] == "NCCL reported an error: remote process exited", f.expiries[0]);
  }
  f.done[0] = true;
  CHECK(wait_until([&] { return w.watching() == 0; }, 2.0));
  CHECK(f.n_expiries() == 1);
}

void shorter_timeout_behind() {
  Fake f(2);
  Watchdog w(f.hooks());
  f.t0 = Clock::now();
  w.watch(Fake::tok(0), 30.0, "first");
  w.watch(Fake::tok(1), 0.2, "second");
  CHECK(wait_until([&] { return f.n_expiries() > 0; }, 3.0));
  {
    std::lock_guard<std::mutex> lk(f.mu);
    CHECK_MSG(f.expiries[0].find("second not finished") == 0, f.expiries[0]);
    CHECK_MSG(f.expiry_at[0] < 0.2 + 0.5, std::to_string(f.expiry_at[0]));
  }
  f.done[0] = f.done[1] = true;
  CHECK(wait_until([&] { return w.watching() == 0; }, 2.0));
}

void no_limit_never_expires() {
  // 0, infinity (timeout=float("inf")), NaN and 10^12 s: no deadline (a plain conversion of
  // the last three to a clock duration overflows, and the work would expire at once)
  Fake f(4);
  Watchdog w(f.hooks());
  const double limits[] = {0.0, std::numeric_limits<double>::infinity(), std::nan(""), 1e12};
  for (size_t i = 0; i < 4; ++i) w.watch(Fake::tok(i), limits[i], "no limit " + std::to_string(i));
  std::this_thread::sleep_for(milliseconds(200));
  CHECK(f.n_expiries() == 0);
  CHECK(w.watching() == 4);
  for (auto& d : f.done) d = true;
  CHECK(wait_until([&] { return w.watching() == 0; }, 2.0));
}

void stop_with_work_stuck() {
  Fake f(4);
  auto w = std::make_unique<Watchdog>(f.hooks());
  for (size_t i = 0; i < 3; ++i) w->watch(Fake::tok(i), 60.0, "stuck");
  f.done[0] = true;  // one of them finished; the others never do
  std::this_thread::sleep_for(milliseconds(30));
  const auto t0 = Clock::now();
  w->stop();
  f.stopped = true;
  const double took = since(t0);
  CHECK_MSG(took < 0.5, std::to_string(took));
  w->watch(Fake::tok(3), 60.0, "after stop");  // retired at once, never watched
  CHECK(w->watching() == 0);
  w->stop();  // idempotent
  w.reset();
  std::this_thread::sleep_for(milliseconds(20));
  CHECK(f.hooks_after_stop == 0);
  CHECK(f.n_expiries() == 0);
  CHECK(f.all_retired_once());
}

void many_completed_by_another_thread() {
  constexpr size_t kN = 20000;
  Fake f(kN);
  Watchdog w(f.hooks(), std::chrono::microseconds(50));
  std::atomic<size_t> enqueued{0};
  std::thread gpu([&] {  // "the stream": finishes work in order, shortly after it was enqueued
    for (size_t i = 0; i < kN; ++i) {
      while (enqueued.load() <= i) std::this_thread::yield();
      f.done[i] = true;
    }
  });
  for (size_t i = 0; i < kN; ++i) {
    w.watch(Fake::tok(i), 30.0, "many");
    enqueued = i + 1;
  }
  gpu.join();
  CHECK(wait_until([&] { return w.watching() == 0; }, 10.0));
  w.stop();
  CHECK(f.n_expiries() == 0);
  CHECK(f.all_retired_once());
  std::lock_guard<std::mutex> lk(f.mu);
  bool ordered = f.retire_order.size() == kN;
  for (size_t i = 0; ordered && i < kN; ++i) ordered = f.retire_order[i] == i;
  CHECK(ordered);
}
}  // namespace

int main() {
  done_in_time();
  late_work_expires_once();
  error_expires_in_flight_only();
  shorter_timeout_behind();
  no_limit_never_expires();
  stop_with_work_stuck();
  many_completed_by_another_thread();
  return checks::report("watchdog");
}
