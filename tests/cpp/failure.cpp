// Which collectives a failure struck (csrc/common/failure.h, what the NCCL transport's and,
// after destroy(), the IPC transport's failure_of() answer, and what a CUDA Work's
// is_success()/exception() ask): a failure strikes every collective not seen finished when
// it was declared, a device record the collective it names and every later one; the first
// reason stays; call 0 never failed; a failure that does not strike (a destroy after a
// drain) fails nothing; and, on threads, a collective reported failed stays failed and one
// seen finished before the failure never is. Built and run by tests/test_watchdog.py; exit
// status 0 and "failure: N checks passed, 0 failed" when every check holds.
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "checks.h"
#include "common/failure.h"

using ringdp::FailureLedger;

namespace {

void usable_until_a_failure() {
  FailureLedger f;
  CHECK(f.reason().empty());
  CHECK(f.failure_of(0).empty());
  CHECK(f.failure_of(1).empty());
  CHECK(f.failure_of(UINT64_MAX).empty());
  f.finished(3);
  CHECK(f.failure_of(4).empty());  // finishing says nothing about failing
}

void strikes_what_did_not_finish() {
  FailureLedger f;
  f.finished(3);
  f.fail("timeout");
  CHECK(f.reason() == "timeout");
  CHECK(f.failure_of(0).empty());
  CHECK(f.failure_of(1).empty());
  CHECK(f.failure_of(3).empty());
  CHECK(f.failure_of(4) == "timeout");
  CHECK(f.failure_of(5) == "timeout");
  CHECK(f.failure_of(1000000) == "timeout");
  f.finished(9);  // seen finished after the abort: its result was made on an aborted communicator
  CHECK(f.failure_of(5) == "timeout");
  CHECK(f.failure_of(9) == "timeout");
}

void nothing_in_flight() {
  FailureLedger f;  // the abort came after everything enqueued had finished (a drained reject)
  f.finished(7);
  f.fail("rejected");
  for (uint64_t c = 0; c <= 7; ++c) CHECK(f.failure_of(c).empty());
  CHECK(f.failure_of(8) == "rejected");  // (a call after it would raise at its start anyway)
}

void first_reason_stays() {
  FailureLedger f;
  f.fail("first");
  f.fail("second");
  f.fail_from("third", 1);
  CHECK(f.reason() == "first");
  CHECK(f.failure_of(1) == "first");
}

void finished_never_goes_back() {
  FailureLedger f;
  f.finished(5);
  f.finished(2);
  f.fail("x");
  CHECK(f.failure_of(5).empty());
  CHECK(f.failure_of(6) == "x");
}

void destroyed_strikes_nothing() {
  FailureLedger f;
  f.finished(2);
  f.fail("destroyed", /*strikes=*/false);
  CHECK(f.reason() == "destroyed");
  CHECK(f.failure_of(3).empty());
  CHECK(f.failure_of(100).empty());
  f.fail("late abort");  // (strikes now, under the first reason)
  CHECK(f.failure_of(3) == "destroyed");
  CHECK(f.failure_of(2).empty());
}

void device_names_the_call() {
  FailureLedger f;
  f.finished(10);  // the watchdog's view may run ahead of a record for an earlier call
  f.fail_from("mismatch at call 7", 7);
  CHECK(f.failure_of(6).empty());
  CHECK(f.failure_of(7) == "mismatch at call 7");
  CHECK(f.failure_of(11) == "mismatch at call 7");
  f.fail("abort");  // strikes 11 on: the earliest struck call stays 7
  CHECK(f.failure_of(7) == "mismatch at call 7");
  FailureLedger g;
  g.fail_from("bad", 0);  // (no call 0: the first call)
  CHECK(g.failure_of(0).empty());
  CHECK(g.failure_of(1) == "bad");
  FailureLedger h;
  h.finished(4);
  h.fail("abort");            // strikes 5 on
  h.fail_from("record", 9);   // a later record does not unstrike 5..8
  CHECK(h.failure_of(5) == "abort");
  CHECK(h.failure_of(4).empty());
}

// One thread finishes calls 1..N in order (the watchdog), another declares the failure
// midway (an abort), readers ask meanwhile: the calls seen finished before the failure
// never fail, those after the failure's point all do, and a call once failed stays failed.
void on_threads() {
  for (int round = 0; round < 20; ++round) {
    FailureLedger f;
    constexpr uint64_t kN = 4000;
    std::atomic<uint64_t> done{0}, done_before_fail{0};
    std::atomic<bool> go{false}, flip{false};
    std::thread finisher([&] {
      while (!go) std::this_thread::yield();
      for (uint64_t c = 1; c <= kN; ++c) {
        f.finished(c);
        done = c;
      }
    });
    std::thread aborter([&] {
      while (!go) std::this_thread::yield();
      while (done < static_cast<uint64_t>(round) * 150) std::this_thread::yield();
      done_before_fail = done.load();  // finished before the failure is declared
      f.fail("watchdog");
    });
    std::thread reader([&] {
      while (!go) std::this_thread::yield();
      std::vector<bool> seen(kN + 1, false);
      for (int it = 0; it < 20000; ++it) {
        const uint64_t c = 1 + static_cast<uint64_t>(it * 7919) % kN;
        const bool now = !f.failure_of(c).empty();
        if (seen[c] && !now) flip = true;
        seen[c] = seen[c] || now;
      }
    });
    go = true;
    finisher.join();
    aborter.join();
    reader.join();
    CHECK(!flip);
    uint64_t first = 0;
    for (uint64_t c = 1; c <= kN; ++c)
      if (!f.failure_of(c).empty()) {
        first = c;
        break;
      }
    CHECK_MSG(first == 0 || first > done_before_fail, "a call seen finished before the failure was struck");
    bool all_after = true;
    if (first != 0)
      for (uint64_t c = first; c <= kN; ++c) all_after = all_after && f.failure_of(c) == "watchdog";
    CHECK(all_after);
    CHECK(f.reason() == "watchdog");
  }
}

}  // namespace

int main() {
  usable_until_a_failure();
  strikes_what_did_not_finish();
  nothing_in_flight();
  first_reason_stays();
  finished_never_goes_back();
  destroyed_strikes_nothing();
  device_names_the_call();
  on_threads();
  return checks::report("failure");
}
