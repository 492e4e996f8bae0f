// Waiting on a peer's flag: spin briefly, then sleep on a futex (the poster wakes sleepers),
// checking every few milliseconds for the deadline, peers that aborted and peers that died.
// With more ranks than cores nobody burns a core another rank needs; inside a call the
// spin learns whether spinning pays (SpinLearner).
#pragma once
#include <algorithm>
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

// The adaptive spin of the ring's waits (shm::Link; not the header exchange or the one-shot
// path, which keep the fixed spin). Every rank has entered the call, so a peer that keeps a
// waiter past its spin is usually not running (more runnable threads than cores: another
// process beside the ranks), though a running successor busy with a long slice looks the
// same. A waiter that spins then only holds the core its peer needs, and spinning less hands
// it over sooner. The rule, per wait that did not find the flag already reached, with
// cap = WaitPolicy::spin_ns (policy.spin_ns: 50 us by default, 2 us where ranks and their
// compute threads outnumber the cores):
//   - the spin caught the flag: the next spins twice as long (at most cap); caught by a
//     probe, the cap at once;
//   - the waiter went to sleep: the next spins half as long (at least kFloorNs, or the cap
//     where that is smaller; the spin loop reads the clock every 64 pauses, so a 1 us spin
//     lasts 1.5-3 us);
//   - while the spin is below the cap, every kProbeEvery-th wait is a probe: it spins the
//     whole cap, so that a peer that runs again (late by less than the cap) is found again.
// Only whether the spin caught the flag counts, never how long a wait took: a wait that
// slept includes the futex wake-up (tens to hundreds of us on a VM), which would make a
// running peer that is a little late look like one that is not running (an earlier rule,
// "halve when the wait took longer than the cap", stuck at its floor against such a peer:
// a two-thread ping-pong 1.7-2x slower). What it learned carries over to the next call; a
// new cap (ShmComm::set_spin_ns: Python switches between the worker's and the inline spin)
// starts afresh. One learner per Link: at world >= 3 the waits on the predecessor and on
// the successor share it. Used by one thread at a time (the one running the call, under
// the communicator's lock).
class SpinLearner {
 public:
  static constexpr int64_t kFloorNs = 1000;
  static constexpr uint32_t kProbeEvery = 16;

  // The spin of the next wait, given the cap.
  int64_t begin(int64_t cap) {
    if (cap != cap_) {
      cap_ = cap;
      spin_ = cap;
      waits_ = 0;
    }
    probing_ = spin_ < cap_ && ++waits_ % kProbeEvery == 0;
    return probing_ ? cap_ : spin_;
  }
  // That wait's outcome: caught while spinning, or not (the waiter sleeps).
  void end(bool caught) {
    if (caught)
      spin_ = probing_ || spin_ > cap_ / 2 ? cap_ : 2 * spin_;
    else
      spin_ = std::max(std::min(kFloorNs, cap_), spin_ / 2);
  }
  int64_t spin_ns() const { return spin_; }

 private:
  int64_t cap_ = -1;
  int64_t spin_ = 0;
  uint32_t waits_ = 0;
  bool probing_ = false;
};

// Called by a waiter every check_every_ns; throws RingError when the wait must end.
using HealthCheck = std::function<void()>;

// Wait until `flag` (owned by a peer whose sleepers counter is `sleepers`) reaches target.
// Returns the value observed (acquire). `check` throws on deadline, abort or death. With a
// `learner`, the spin is the learner's (at most p.spin_ns) and the wait's outcome teaches it.
uint32_t wait_reached(const Flag& flag, Flag& sleepers, uint32_t target, const WaitPolicy& p,
                      const HealthCheck& check, SpinLearner* learner = nullptr);

// Store `value` into my own flag with release (seq_cst, paired with the sleeper's
// registration) and wake sleepers if any.
void publish(Flag& flag, const Flag& my_sleepers, uint32_t value);

// Wake everyone sleeping on `flag` (used when aborting).
void wake_all(Flag& flag);

}  // namespace shm
}  // namespace ringdp
