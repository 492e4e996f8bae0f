// The adaptive spin of the shared-memory ring's waits (csrc/transport/shm/wait.h,
// SpinLearner) on threads of one process: the rule in closed form, wait_reached teaching a
// learner against a publisher thread that is not running (it publishes only once the waiter
// sleeps), and the ping-pong that an earlier rule failed: a peer that runs but answers
// 20 us late must get the whole spin back (the earlier rule, which judged by how long a wait
// took, counted the futex wake-up and stayed at its floor). Built and run by
// tests/test_shm_wait.py; exit status 0 and "wait policy: N checks passed, 0 failed" when
// every check holds.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include "checks.h"
#include "transport/shm/wait.h"

using namespace ringdp::shm;
using std::chrono::microseconds;

namespace {
using checks::check_eq;

constexpr int64_t kCap = 50000;

// The spins of `n` waits that all went to sleep, from a fresh learner.
std::vector<int64_t> spins_of_misses(SpinLearner& l, int n, int64_t cap) {
  std::vector<int64_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(l.begin(cap));
    l.end(false);
  }
  return out;
}

void rule_in_closed_form() {
  // Misses from a fresh start: the cap, then halves down to the floor; every 16th wait
  // below the cap (waits 17 and 33 here) is a probe that spins the cap.
  SpinLearner l;
  std::vector<int64_t> got = spins_of_misses(l, 34, kCap);
  std::vector<int64_t> want = {kCap, 25000, 12500, 6250, 3125, 1562};
  while (want.size() < 34) want.push_back(SpinLearner::kFloorNs);
  want[16] = kCap;
  want[32] = kCap;
  for (size_t i = 0; i < want.size(); ++i) check_eq(got[i], want[i], "spin of a missed wait", __LINE__);

  // A probe that catches gives the whole cap back at once; at the cap there is no probe.
  SpinLearner p;
  spins_of_misses(p, 15, kCap);  // waits 1-15; the next (16th) wait is not a probe
  CHECK_EQ(p.begin(kCap), SpinLearner::kFloorNs);
  p.end(false);
  CHECK_EQ(p.begin(kCap), kCap);  // wait 17: a probe
  p.end(true);
  CHECK_EQ(p.spin_ns(), kCap);
  for (int i = 0; i < 40; ++i) {
    CHECK_EQ(p.begin(kCap), kCap);
    p.end(true);
  }

  // A wait its short spin caught doubles the spin (a peer that is back, soon enough).
  SpinLearner d;
  spins_of_misses(d, 7, kCap);  // at the floor
  const int64_t doubles[] = {1000, 2000, 4000, 8000, 16000, 32000, kCap, kCap};
  for (int64_t w : doubles) {
    CHECK_EQ(d.begin(kCap), w);
    d.end(true);
  }

  // A new cap starts afresh; a cap below the floor is its own floor; a zero cap never spins.
  SpinLearner c;
  spins_of_misses(c, 7, kCap);
  CHECK_EQ(c.begin(2000), 2000);
  c.end(false);
  CHECK_EQ(c.begin(2000), 1000);
  SpinLearner s;
  std::vector<int64_t> small = spins_of_misses(s, 20, 500);
  for (int64_t v : small) CHECK_EQ(v, 500);
  SpinLearner z;
  std::vector<int64_t> zero = spins_of_misses(z, 20, 0);
  for (int64_t v : zero) CHECK_EQ(v, 0);
}

// wait_reached against a publisher that is not running while the waiter spins: it
// publishes only once the waiter sleeps on the futex, 1 ms after that.
void waits_against_a_sleeping_peer() {
  Flag flag{}, sleepers{};
  WaitPolicy p;
  p.spin_ns.store(kCap);
  SpinLearner l;
  const int64_t want[] = {25000, 12500, 6250, 3125, 1562, 1000, 1000};
  uint32_t v = 0;
  for (int64_t w : want) {
    ++v;
    std::thread t([&, v] {
      while (sleepers.v.load() == 0) std::this_thread::yield();
      std::this_thread::sleep_for(microseconds(1000));
      publish(flag, sleepers, v);
    });
    wait_reached(flag, sleepers, v, p, [] {}, &l);
    t.join();
    CHECK_EQ(l.spin_ns(), w);
  }
  // A flag already reached: no wait, nothing learned.
  wait_reached(flag, sleepers, v, p, [] {}, &l);
  CHECK_EQ(l.spin_ns(), 1000);
}

// The first two CPUs this process may run on (-1 where there are fewer).
std::pair<int, int> two_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return {-1, -1};
  int found[2] = {-1, -1}, n = 0;
  for (int c = 0; c < CPU_SETSIZE && n < 2; ++c)
    if (CPU_ISSET(c, &set)) found[n++] = c;
  return {found[0], found[1]};
}

void pin(std::thread::native_handle_type t, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(t, sizeof(set), &set) != 0) std::printf("note: could not pin a thread to CPU %d\n", cpu);
}

// Two threads, each pinned to its own core (left to itself, the kernel sometimes puts both
// on one core, and then the peer truly is not running while A spins): A posts ping and
// waits for pong with a learner that starts at its floor; B waits for ping, busy-waits
// `late`, posts pong. A must get the cap back (a probe catches) and keep it: the spin must
// be at the cap after at least 44 of the last 48 rounds (a thread descheduled for a moment
// costs a few). Returns whether it was.
bool ping_pong_keeps_the_cap(microseconds late, std::pair<int, int> cpus) {
  Flag ping{}, pong{}, ping_sleepers{}, pong_sleepers{};
  WaitPolicy p;
  p.spin_ns.store(kCap);
  WaitPolicy patient;
  patient.spin_ns.store(1000000000);  // B never sleeps
  SpinLearner a;
  spins_of_misses(a, 7, kCap);
  CHECK_EQ(a.spin_ns(), SpinLearner::kFloorNs);
  const uint32_t rounds = 80;
  cpu_set_t before;
  const bool restore = sched_getaffinity(0, sizeof(before), &before) == 0;
  pin(pthread_self(), cpus.first);
  std::thread b([&] {
    for (uint32_t i = 1; i <= rounds; ++i) {
      wait_reached(ping, ping_sleepers, i, patient, [] {});
      const auto until = Clock::now() + late;
      while (Clock::now() < until) {
      }
      publish(pong, pong_sleepers, i);
    }
  });
  pin(b.native_handle(), cpus.second);
  int at_cap_last = 0;
  const auto start = Clock::now();
  for (uint32_t i = 1; i <= rounds; ++i) {
    publish(ping, ping_sleepers, i);
    wait_reached(pong, pong_sleepers, i, p, [] {}, &a);
    if (i > rounds - 48 && a.spin_ns() == kCap) ++at_cap_last;
  }
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / rounds;
  b.join();
  if (restore && pthread_setaffinity_np(pthread_self(), sizeof(before), &before) != 0)
    std::printf("note: could not restore the main thread's CPUs\n");
  std::printf("ping-pong, peer %lld us late: %.1f us per round, spin at the cap after %d of the last 48\n",
              static_cast<long long>(late.count()), us, at_cap_last);
  return at_cap_last >= 44;
}

// The ping-pong, up to 5 times (another process may hold a core for a while: then a wait
// legitimately sleeps); a rule that stays at its floor fails every time.
void ping_pong_with_a_running_late_peer(microseconds late) {
  const auto cpus = two_cpus();
  if (cpus.second < 0) {
    std::printf("ping-pong skipped: fewer than two CPUs to run on\n");  // test_shm_wait.py skips
    return;
  }
  bool kept = false;
  for (int attempt = 0; attempt < 5 && !kept; ++attempt) kept = ping_pong_keeps_the_cap(late, cpus);
  CHECK(kept);
}
}  // namespace

int main() {
  rule_in_closed_form();
  waits_against_a_sleeping_peer();
  ping_pong_with_a_running_late_peer(microseconds(5));
  ping_pong_with_a_running_late_peer(microseconds(20));
  return checks::report("wait policy");
}
