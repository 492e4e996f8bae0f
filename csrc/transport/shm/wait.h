// Waiting on a peer's flag: spin briefly, then sleep on a futex (the poster wakes sleepers),
// checking every few milliseconds for the deadline, peers that aborted and peers that died.
// With more ranks than cores nobody burns a core another rank needs.
#pragma once
#include <atomic>
#include <chrono>
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

  WaitPolicy() = default;
  WaitPolicy(const WaitPolicy& o)
      : spin_ns(o.spin_ns.load(std::memory_order_relaxed)), check_every_ns(o.check_every_ns) {}
  WaitPolicy& operator=(const WaitPolicy& o) {
    spin_ns.store(o.spin_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
    check_every_ns = o.check_every_ns;
    return *this;
  }
};

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
