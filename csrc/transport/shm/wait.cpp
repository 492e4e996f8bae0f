#include "wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RINGDP_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define RINGDP_PAUSE() asm volatile("yield")
#else
#define RINGDP_PAUSE() ((void)0)
#endif

namespace ringdp {
namespace shm {
namespace {

uint32_t* word(const Flag& f) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint32_t>*>(&f.v));
}

// Shared (not PRIVATE) futex: the kernel keys it on the shm page, so processes that map
// the segment at different addresses meet on the same futex.
void futex_wait(const Flag& f, uint32_t expected, int64_t ns) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  syscall(SYS_futex, word(f), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

}  // namespace

void wake_all(Flag& flag) { syscall(SYS_futex, word(flag), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

void publish(Flag& flag, const Flag& my_sleepers, uint32_t value) {
  flag.v.store(value, std::memory_order_seq_cst);
  if (my_sleepers.v.load(std::memory_order_seq_cst) != 0) wake_all(flag);
}

uint32_t wait_reached(const Flag& flag, Flag& sleepers, uint32_t target, const WaitPolicy& p,
                      const HealthCheck& check, SpinLearner* learner) {
  uint32_t v = flag.v.load(std::memory_order_acquire);
  if (reached(v, target)) return v;
  // Phase 1: spin.
  const int64_t cap = p.spin_ns.load(std::memory_order_relaxed);
  const int64_t spin_ns = learner ? learner->begin(cap) : cap;
  if (spin_ns > 0) {
    const auto spin_end = Clock::now() + std::chrono::nanoseconds(spin_ns);
    for (unsigned i = 1;; ++i) {
      RINGDP_PAUSE();
      v = flag.v.load(std::memory_order_acquire);
      if (reached(v, target)) {
        if (learner) learner->end(true);
        return v;
      }
      if ((i & 63u) == 0 && Clock::now() >= spin_end) break;
    }
  }
  if (learner) learner->end(false);
  // Phase 2: sleep on the futex; the publisher wakes us. Registering as a sleeper and
  // re-reading the flag are seq_cst, as are the publisher's store and its read of the
  // sleeper count, so one of the two always sees the other: no lost wake-up.
  auto next_check = Clock::now() + std::chrono::nanoseconds(p.check_every_ns);
  for (;;) {
    sleepers.v.fetch_add(1, std::memory_order_seq_cst);
    v = flag.v.load(std::memory_order_seq_cst);
    if (!reached(v, target)) futex_wait(flag, v, p.check_every_ns);
    sleepers.v.fetch_sub(1, std::memory_order_seq_cst);
    v = flag.v.load(std::memory_order_acquire);
    if (reached(v, target)) return v;
    auto now = Clock::now();
    if (now >= next_check) {
      check();
      next_check = now + std::chrono::nanoseconds(p.check_every_ns);
    }
  }
}

}  // namespace shm
}  // namespace ringdp
