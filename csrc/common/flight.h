// The flight record: the last N collectives of one communicator, for the stall report and
// for post-mortems (ringdp dumps it beside RINGDP_TRACE on a stall or a failure). One
// fixed-size record per call, written by the thread that runs the call; a snapshot may be
// taken from any thread.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "types.h"

namespace ringdp {

struct CallRecord {
  enum Status : int32_t { kRunning = 0, kOk = 1, kFailed = 2 };
  // What moved the data, once the headers agreed: nothing (world 1, no elements, a call that
  // failed its checks), the one-shot buffers, the ring through the FIFOs (staged), or the
  // direct path over registered tensors (shm_comm.cpp run_direct).
  enum Path : int32_t { kNone = 0, kOneShot = 1, kRingStaged = 2, kDirect = 3 };
  uint32_t seq = 0;       // the communicator's call number
  int32_t kind = 0;       // Kind
  int32_t dtype = 0;      // DType
  int32_t op = 0;         // RedOp
  int32_t algo = 0;       // the transport's algorithm code
  int32_t status = kRunning;
  int32_t path = kNone;
  uint64_t count = 0;     // elements
  int64_t t_start_us = 0;  // system clock, microseconds since the epoch
  int64_t t_end_us = 0;    // 0 while running
  char tag[kTagBytes] = {};
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity = 256) : ring_(capacity ? capacity : 1) {}

  static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  // Start a record; returns its slot for end().
  size_t begin(uint32_t seq, Kind kind, DType dtype, RedOp op, int32_t algo, uint64_t count, const std::string& tag) {
    std::lock_guard<std::mutex> g(mu_);
    const size_t slot = next_++ % ring_.size();
    CallRecord& r = ring_[slot];
    r = CallRecord();
    r.seq = seq;
    r.kind = static_cast<int32_t>(kind);
    r.dtype = static_cast<int32_t>(dtype);
    r.op = static_cast<int32_t>(op);
    r.algo = algo;
    r.count = count;
    r.t_start_us = now_us();
    std::memcpy(r.tag, tag.data(), tag.size() < kTagBytes ? tag.size() : kTagBytes - 1);
    return slot;
  }

  void set_path(size_t slot, uint32_t seq, CallRecord::Path path) {
    std::lock_guard<std::mutex> g(mu_);
    CallRecord& r = ring_[slot];
    if (r.seq == seq) r.path = path;
  }

  void end(size_t slot, uint32_t seq, CallRecord::Status status) {
    std::lock_guard<std::mutex> g(mu_);
    CallRecord& r = ring_[slot];
    if (r.seq != seq) return;  // overwritten meanwhile (capacity smaller than calls in flight)
    r.status = status;
    r.t_end_us = now_us();
  }

  // Oldest first.
  std::vector<CallRecord> snapshot() const {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<CallRecord> out;
    const size_t n = next_ < ring_.size() ? next_ : ring_.size();
    for (size_t i = next_ - n; i < next_; ++i) out.push_back(ring_[i % ring_.size()]);
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::vector<CallRecord> ring_;
  size_t next_ = 0;
};

}  // namespace ringdp
