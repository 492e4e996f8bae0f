// A blocking call that may never return, bounded: `call_bounded` runs it on a thread of its
// own and waits up to a timeout. On time: its result, or its exception rethrown. Past the
// timeout: a RingError naming it, at once; the call is abandoned on its thread, and when it
// returns after all, `abandon(result)` runs there to release what it made (the caller has
// long moved on). A timeout that limits() nothing (0, infinity): no limit. What the NCCL transport uses for ncclCommInitRank, which waits in NCCL's
// bootstrap for a peer that died after the ranks exchanged their records.
//
// The work and abandon functions run on the other thread and may outlive the caller's
// frame and object: capture by value what they need (never `this`). Torch-free and
// CUDA-free: tests/cpp/bounded.cpp drives it.
#pragma once
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "error.h"

namespace ringdp {

// Whether a timeout in seconds limits a wait: 0 or less, NaN, infinity (`timeout=inf`) or
// more than a steady_clock deadline holds (~292 years of nanoseconds; here 10^9 s) is no
// limit. Converting such a value to a clock duration is undefined (an overflow: the wait
// ends at once).
inline bool limits(double timeout_s) { return timeout_s > 0 && timeout_s < 1e9; }

template <class T>
T call_bounded(std::function<T()> work, std::function<void(T&)> abandon, double timeout_s, const std::string& what,
               const std::string& likely_cause) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, abandoned = false;
    std::optional<T> value;
    std::exception_ptr error;
  };
  auto st = std::make_shared<State>();
  std::thread t([st, work = std::move(work), abandon = std::move(abandon)]() mutable {
    std::optional<T> v;
    std::exception_ptr e;
    try {
      v.emplace(work());
    } catch (...) {
      e = std::current_exception();
    }
    std::unique_lock<std::mutex> lk(st->mu);
    if (st->abandoned) {  // the caller gave up: release what the call made, here
      lk.unlock();
      if (v && abandon) {
        try {
          abandon(*v);
        } catch (...) {
        }
      }
      return;
    }
    st->value = std::move(v);
    st->error = e;
    st->done = true;
    lk.unlock();
    st->cv.notify_all();
  });
  std::unique_lock<std::mutex> lk(st->mu);
  const auto ready = [&] { return st->done; };
  const bool on_time = limits(timeout_s)
                           ? st->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)
                           : (st->cv.wait(lk, ready), true);
  if (!on_time) {
    st->abandoned = true;
    lk.unlock();
    t.detach();
    throw RingError(cat(what, " did not return within ", timeout_s, " s: ", likely_cause));
  }
  lk.unlock();
  t.join();
  if (st->error) std::rethrow_exception(st->error);
  return std::move(*st->value);
}

}  // namespace ringdp
