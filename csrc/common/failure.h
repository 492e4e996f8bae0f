// Why an endpoint became unusable, and which of its collectives that failure struck, so that
// a collective's Work can say whether its own result is valid (Work.is_success(),
// .exception(): ringdp/comm.py) after the NCCL watchdog or a host-side abort killed the
// communicator under it. Its kernels then return and its end event completes, so the event
// alone cannot tell a result from garbage.
//
// The rule: collectives are numbered 1, 2, ... as they are enqueued and finish in that order
// (one stream); a failure strikes every collective not known to have finished when it was
// declared (an abort returns every step in flight, whose results are then not valid), and
// the first failure's reason stays. Declared without striking (a communicator destroyed
// after it drained), it only makes the endpoint unusable. Conservative by at most what the
// owner has not yet seen finish (the watchdog polls every 10 ms): a collective reported as
// failed may have finished just before the abort; one reported as not failed never ran on
// an aborted communicator.
//
// Thread-safe; torch- and CUDA-free: tests/cpp/failure.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

namespace ringdp {

class FailureLedger {
 public:
  static constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();

  // Collectives 1..`call` finished (a smaller number than already known changes nothing).
  void finished(uint64_t call) {
    std::lock_guard<std::mutex> lk(mu_);
    finished_ = std::max(finished_, call);
  }

  // Declare the endpoint unusable for `why` (the first reason stays). `strikes`: the
  // collectives not known to have finished fail with it (an abort, a timeout, an error the
  // transport reported); false: none does (destroyed after a drain).
  void fail(const std::string& why, bool strikes = true) {
    std::lock_guard<std::mutex> lk(mu_);
    if (reason_.empty()) reason_ = why;
    if (strikes) first_struck_ = std::min(first_struck_, finished_ + 1);
  }

  // The same, striking collective `first` and every one after it (a failure the device
  // reported for that collective).
  void fail_from(const std::string& why, uint64_t first) {
    std::lock_guard<std::mutex> lk(mu_);
    if (reason_.empty()) reason_ = why;
    first_struck_ = std::min(first_struck_, first);  // (call 0 never fails: failure_of)
  }

  // Why the endpoint is unusable, "" while it is usable.
  std::string reason() const {
    std::lock_guard<std::mutex> lk(mu_);
    return reason_;
  }

  // Why collective `call` failed: the first reason, or "" when no failure struck it (as far
  // as is known now). Call 0 (none enqueued yet) never failed.
  std::string failure_of(uint64_t call) const {
    std::lock_guard<std::mutex> lk(mu_);
    return call != 0 && call >= first_struck_ ? reason_ : std::string();
  }

 private:
  mutable std::mutex mu_;
  std::string reason_;
  uint64_t finished_ = 0;
  uint64_t first_struck_ = kNone;
};

}  // namespace ringdp
