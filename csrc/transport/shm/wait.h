// Waiting on a peer's flag: spin briefly, then sleep on a futex (the poster wakes sleepers),
// checking every few milliseconds for the deadline, peers that aborted and peers that died.
// With more ranks than cores nobody burns a core another rank needs; inside a call the
// spin adapts to whether spinning paid off lately (WaitPolicy, next_spin_ns).
#pragma once
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <string>

#include "layout.h"

namespace ringdp {
namespace shm {

// Wrap-safe "a has reached b" for monotonic 32-bit counters.
inline bool reached(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

using Clock = std::chrono::steady_clock;

struct WaitPolicy {
  // Busy-wait this long before sleeping. Atomic: another thread may change it while a call
  // runs (a caller that starts waiting for the worker's call: ringdp/comm.py); each wait
  // reads it once.
  std::atomic<int64_t> spin_ns{50000};
  int64_t check_every_ns = 5000000;  // how often a sleeper checks deadline / peers
  // Adaptive spin (the ring's waits inside a call, shm::Link): spin at most `learned_ns`
  // (never more than spin_ns), which each wait that spun adjusts (next_spin_ns). Off for
  // the waits for a peer to enter a call, which may be as late as its compute makes it.
  bool adaptive = false;
  mutable std::atomic<int64_t> learned_ns{INT64_MAX};

  WaitPolicy() = default;
  WaitPolicy(const WaitPolicy& o)
      : spin_ns(o.spin_ns.load(std::memory_order_relaxed)),
        check_every_ns(o.check_every_ns),
        adaptive(o.adaptive),
        learned_ns(o.learned_ns.load(std::memory_order_relaxed)) {}
  WaitPolicy& operator=(const WaitPolicy& o) {
    spin_ns.store(o.spin_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
    check_every_ns = o.check_every_ns;
    adaptive = o.adaptive;
    learned_ns.store(o.learned_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
    return *this;
  }
};

// The least an adaptive wait spins (a spin of 0 would never learn that spinning pays).
constexpr int64_t kMinSpinNs = 1000;

// The adaptive rule: after a wait that spun up to `spun` ns (spin_ns `cap`) and was over
// after `took` ns, the next wait spins twice as long (at most `cap`) if spinning the whole
// `cap` would have caught the flag (took <= cap: the peer is running, sleeping would only
// add a wake-up), else half as long (at least kMinSpinNs): the peer was not running (more
// runnable threads than cores: another process, the caller's compute threads), and a
// spinning waiter only holds the core the peer needs. Measured on the 2-core box, world 2,
// beside one busy process (bench/allreduce.py --busy 1, 3 interleaved runs each): a 16 MiB
// all-reduce 5.9-6.9 ms with the fixed 50 us spin, 3.8-4.0 ms adaptive, 64 MiB 22.8-27.2 ->
// 14.5-15.1 ms; nothing else busy: no change beyond the noise
// (bench/results/compare_adaptive_spin_allreduce_cpu_w2_busy*.json).
inline int64_t next_spin_ns(int64_t spun, int64_t took, int64_t cap) {
  if (took <= cap) {
    const int64_t grown = spun > cap / 2 ? cap : 2 * spun;
    return grown < kMinSpinNs ? (cap < kMinSpinNs ? cap : kMinSpinNs) : grown;
  }
  const int64_t shrunk = spun / 2;
  return shrunk < kMinSpinNs ? kMinSpinNs : shrunk;
}

// Called by a waiter every check_every_ns; throws RingError when the wait must end.
using HealthCheck = std::function<void()>;

// Wait until `flag` (owned by a peer whose sleepers counter is `sleepers`) reaches target.
// Returns the value observed (acquire). `check` throws on deadline, abort or death.
uint32_t wait_reached(const Flag& flag, Flag& sleepers, uint32_t target, const WaitPolicy& p,
                      const HealthCheck& check);

// Store `value` into my own flag with release (seq_cst, paired with the sleeper's
// registration) and wake sleepers if any.
void publish(Flag& flag, const Flag& my_sleepers, uint32_t value);

// Wake everyone sleeping on `flag` (used when aborting).
void wake_all(Flag& flag);

}  // namespace shm
}  // namespace ringdp
