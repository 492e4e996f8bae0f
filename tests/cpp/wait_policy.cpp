// The adaptive spin of the shared-memory waits (csrc/transport/shm/wait.h) on two threads
// of one process: the rule in closed form, then wait_reached against a publisher thread
// that is late (the spin halves down to the floor) or prompt (it doubles back), an
// already-reached flag (nothing learned) and a policy that is not adaptive (the waits for a
// peer to enter a call). Built and run by tests/test_shm_wait.py; exit status 0 and
// "wait policy: N checks passed" when every check holds.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>

#include "transport/shm/wait.h"

using namespace ringdp::shm;

namespace {
int checks = 0, failures = 0;

void check_eq(long long got, long long want, const char* what, int line) {
  ++checks;
  if (got != want) {
    std::printf("FAIL line %d: %s = %lld, expected %lld\n", line, what, got, want);
    ++failures;
  }
}
#define CHECK_EQ(a, b) check_eq(static_cast<long long>(a), static_cast<long long>(b), #a, __LINE__)

Flag flag{}, sleepers{};

// Publish `value` once the waiter sleeps on the futex (so that its spin is over and the
// wait's length is the publisher's doing), `late` after that.
void publish_when_asleep(uint32_t value, std::chrono::microseconds late) {
  while (sleepers.v.load() == 0) std::this_thread::yield();
  std::this_thread::sleep_for(late);
  publish(flag, sleepers, value);
}

// One wait for `value` against a publisher thread; returns what the policy learned.
int64_t one_wait(WaitPolicy& p, uint32_t value, std::chrono::microseconds late) {
  std::thread t(publish_when_asleep, value, late);
  wait_reached(flag, sleepers, value, p, [] {});
  t.join();
  return p.learned_ns.load();
}
}  // namespace

int main() {
  using std::chrono::microseconds;
  // 1. The rule (cap 50 us).
  const int64_t cap = 50000;
  CHECK_EQ(next_spin_ns(cap, 10000, cap), cap);              // caught within the cap: stays
  CHECK_EQ(next_spin_ns(cap, cap, cap), cap);                // the boundary counts as caught
  CHECK_EQ(next_spin_ns(cap, 80000, cap), 25000);            // not caught: half
  CHECK_EQ(next_spin_ns(1500, 3000000, cap), kMinSpinNs);    // never below the floor
  CHECK_EQ(next_spin_ns(1000, 30000, cap), 2000);            // slept, but within the cap: twice
  CHECK_EQ(next_spin_ns(30000, 40000, cap), cap);            // never above the cap
  CHECK_EQ(next_spin_ns(400, 100, 500), 500);                // a cap below the floor: the cap

  // 2. A peer 2 ms late, six times: 50 us halves down to the 1 us floor, then stays.
  flag.v.store(0);
  sleepers.v.store(0);
  WaitPolicy p;
  p.spin_ns.store(cap);
  p.adaptive = true;
  CHECK_EQ(p.learned_ns.load(), INT64_MAX);  // nothing learned yet: the first wait spins the cap
  const int64_t halves[] = {25000, 12500, 6250, 3125, 1562, 1000, 1000};
  uint32_t v = 0;
  for (int64_t want : halves) CHECK_EQ(one_wait(p, ++v, microseconds(2000)), want);

  // 3. A flag already reached: no wait, nothing learned.
  wait_reached(flag, sleepers, v, p, [] {});
  CHECK_EQ(p.learned_ns.load(), 1000);

  // 4. Waits that end within the cap double the spin back (a cap of 1 s, so that the
  //    wake-up always fits in it; the publisher is prompt).
  p.spin_ns.store(1000000000);
  const int64_t doubles[] = {2000, 4000, 8000};
  for (int64_t want : doubles) CHECK_EQ(one_wait(p, ++v, microseconds(0)), want);

  // 5. A policy that is not adaptive learns nothing and spins its cap.
  WaitPolicy q;
  q.spin_ns.store(cap);
  CHECK_EQ(one_wait(q, ++v, microseconds(2000)), INT64_MAX);

  std::printf("wait policy: %d checks passed, %d failed\n", checks - failures, failures);
  return failures == 0 ? 0 : 1;
}
