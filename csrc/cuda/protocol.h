// The IPC ring protocol's host-side arithmetic, free of CUDA headers so that a CPU
// simulation (csrc/cuda/sim/protocol_sim.cpp, run by tests/test_cuda.py without a GPU) can
// drive exactly the code the transport uses.
//
// Every rank keeps two counters per connection, monotonic over the communicator's life:
//   produced  slices made available to the successor (the k-th goes to slot k % slots, or
//             is a slice of the rank's own registered tensor, which the successor reads in
//             place)
//   consumed  slices taken from the predecessor
// A step that consumes waits pred.posted >= c+1 and publishes my.consumed = c+1 afterwards;
// a step that produces publishes my.posted = p+1 after its writes; and before any write a
// step waits succ.consumed >= guard, where guard covers
//   * slot reuse: slice p reuses the slot of slice p-slots, so guard >= p+1-slots;
//   * in-place reads: rewriting a range of my registered tensor that I produced in place as
//     slice j (the successor reads it there) needs guard >= j+1.
// With slots >= 2 every wait is on a step that is at least two positions earlier in the
// peer's (identical) sequence: the wait graph has no cycle (see docs/cuda.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "../common/types.h"
#include "../transport/transport.h"

#ifdef __CUDACC__
#define RINGDP_HD __host__ __device__
#else
#define RINGDP_HD
#endif

namespace ringdp {
namespace cuda {

constexpr int kMaxChannels = 64;    // flags are laid out for this many channels
constexpr int kBlockThreads = 512;  // threads per channel block
constexpr size_t kPackElems = 8;    // range starts are multiples of this (16 bytes of fp16)
constexpr int kMaxOneShotWorld = 16;
constexpr size_t kLineBytes = 128;  // one flag per 128-byte line
constexpr size_t kLineWords = kLineBytes / sizeof(uint64_t);

enum class StepKind : int32_t {
  kSend = 0,
  kRecvReduceSend = 1,
  kRecvReduceCopySend = 2,
  kRecvCopySend = 3,
  kRecv = 4,
  // The standalone halves (transport.h): copy_send starts an all-gather or a broadcast (my
  // final values, in T, go to the successor; nothing is received), recv_reduce_copy ends a
  // reduce-scatter (the final value, AVG applied, goes to the *result*, not to the buffer the
  // schedule indexes; nothing is sent).
  kCopySend = 5,
  kRecvReduceCopy = 6,
};

// True when a pointer allows the 16-byte vector path.
RINGDP_HD inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Elements per channel for a slice of `count` split over `channels` blocks: both ends of a
// connection must use this same function.
RINGDP_HD inline size_t channel_span(size_t count, int channels) {
  size_t per = (count + static_cast<size_t>(channels) - 1) / static_cast<size_t>(channels);
  return (per + kPackElems - 1) / kPackElems * kPackElems;
}

// Staged slices: channel c of every slice lives in its own fixed sub-buffer of the slot
// (slot + c * sub_bytes), whatever the slice's length and element size. Flags are per
// channel, so a channel may only ever reuse bytes that the *same* channel of the consumer
// has released: a layout in which channel ranges move with the slice length (or with Acc
// vs T) would let channel c of slice p+slots overwrite bytes that channel c' of slice p is
// still reading (found by the CPU simulation).
struct SlotGeometry {
  size_t slot_bytes = 0;
  int channels = 1;
  size_t sub_bytes() const { return slot_bytes / static_cast<size_t>(channels) / 16 * 16; }
  // Largest slice (elements) whose channel spans all fit their sub-buffers for element
  // size `acc`: channels x (sub-buffer elements rounded down to kPackElems).
  size_t slice_elems(size_t acc) const {
    return static_cast<size_t>(channels) * (sub_bytes() / acc / kPackElems * kPackElems);
  }
};

// Channels per rank of the IPC transport. Each channel is one thread block per step kernel
// that spins on its peers' blocks of the same channel, so every rank's blocks should be able
// to be resident at once: ranks that share a GPU split its SMs. The share is the smallest,
// over all ranks, of floor(SMs of the rank's GPU / ranks on that GPU), at least 1. A request
// of 0 takes the share; an explicit request above it (or above kMaxChannels) is clamped.
// Every rank computes this from the same records, so both ends of a connection agree.
struct ChannelChoice {
  int channels = 1;    // what the transport uses
  int requested = 0;   // Options::channels (0: automatic)
  int share = 1;       // SMs per rank on the most shared GPU
  bool clamped = false;  // an explicit request was lowered
};

// sm_count[p]: SMs of rank p's GPU; sharing[p]: ranks on that GPU (rank p included).
inline int smallest_sm_share(int world, const int* sm_count, const int* sharing) {
  int share = 0;
  for (int p = 0; p < world; ++p) {
    const int s = sm_count[p] / (sharing[p] > 0 ? sharing[p] : 1);
    if (p == 0 || s < share) share = s;
  }
  return share > 0 ? share : 1;
}

inline ChannelChoice choose_channels(int requested, int share) {
  ChannelChoice c;
  c.requested = requested > 0 ? requested : 0;
  c.share = share > 0 ? share : 1;
  int ch = c.requested > 0 ? c.requested : c.share;
  if (ch > c.share) ch = c.share;
  if (ch > kMaxChannels) ch = kMaxChannels;
  c.channels = ch;
  c.clamped = c.requested > 0 && ch < c.requested;
  return c;
}

// A device wait's limit in nanoseconds (the kernels' FlagWait::timeout_ns) from a timeout in
// seconds: infinity, or past what 64 bits of nanoseconds hold (585 years), is no limit. The
// plain conversion of such a value is undefined (0 on x86: every wait timed out at once),
// as the shared-memory transport's deadline once was.
inline uint64_t timeout_ns(double seconds) {
  return seconds >= 1.8e10 ? UINT64_MAX : static_cast<uint64_t>(seconds * 1e9);
}

// What one ring primitive does on this rank, in protocol terms.
struct StepPlan {
  StepKind kind = StepKind::kSend;
  bool consumes = false;
  bool produces = false;
  uint64_t consume_target = 0;  // wait pred.posted >= this; then publish my.consumed = this
  uint64_t produce_value = 0;   // publish my.posted = this (slice index + 1)
  uint64_t produce_index = 0;   // slot = produce_index % slots
  uint64_t guard = 0;           // wait succ.consumed >= this before writing (0: no wait)
  bool reads_in = false;        // reads my tensor's slice
  bool writes_out = false;      // writes my tensor's slice
  bool writes_result = false;   // writes the final value to the call's result (kRecvReduceCopy:
                                // the reduce-scatter's output, not the tensor the slices index)
  bool in_place = false;        // the produced slice is my registered tensor's slice, read
                                // in place by the successor (no slot write)
  bool writes_slot = false;     // the produced slice goes to slot produce_index % slots
  uint32_t consume_elem_bytes = 0;  // Acc during the reduce-scatter, T after
  uint32_t produce_elem_bytes = 0;
  int avg_div = 0;              // world size on the finalising step of an AVG
};

// Which primitives consume (receive) and produce (send) a slice, and in which element type.
inline bool step_consumes(StepKind k) { return k != StepKind::kSend && k != StepKind::kCopySend; }
inline bool step_produces(StepKind k) { return k != StepKind::kRecv && k != StepKind::kRecvReduceCopy; }
// Partial sums (Acc) go out of send/recv_reduce_send and come into the three recv_reduce_*.
inline bool step_partial_out(StepKind k) { return k == StepKind::kSend || k == StepKind::kRecvReduceSend; }
inline bool step_partial_in(StepKind k) {
  return k == StepKind::kRecvReduceSend || k == StepKind::kRecvReduceCopySend || k == StepKind::kRecvReduceCopy;
}
// The steps that compute a final value (AVG divides there).
inline bool step_finalises(StepKind k) { return k == StepKind::kRecvReduceCopySend || k == StepKind::kRecvReduceCopy; }

class Planner {
 public:
  explicit Planner(size_t slots = 2) : slots_(slots) {}

  // `registered`: my tensor is registered memory that my successor may read in place. A
  // reduce-scatter must pass false: in place, recv_reduce_send would write its partial sums
  // over the caller's input (the shared-memory transport stages it for the same reason).
  void begin_call(bool registered, size_t esize, size_t acc, RedOp op, int world) {
    registered_ = registered;
    esize_ = esize;
    acc_ = acc;
    op_ = op;
    world_ = world;
    in_place_.clear();
    drain_ = 0;
  }

  StepPlan step(StepKind k, const Slice& s) {
    StepPlan p;
    p.kind = k;
    p.consumes = step_consumes(k);
    p.produces = step_produces(k);
    const bool partial_out = step_partial_out(k);
    const bool partial_in = step_partial_in(k);
    p.reads_in = k == StepKind::kSend || k == StepKind::kCopySend || partial_in;
    // Produce in place: final values, or partial sums when they have the tensor's type.
    p.in_place = p.produces && registered_ && s.count > 0 && (!partial_out || acc_ == esize_);
    if (k == StepKind::kSend || k == StepKind::kCopySend) {
      p.writes_out = false;  // my values go out as they are
    } else if (k == StepKind::kRecvReduceSend) {
      p.writes_out = p.in_place;  // the partial sum replaces my (no longer needed) values
    } else if (k == StepKind::kRecvReduceCopy) {
      p.writes_result = true;  // the tensor (the reduce-scatter's input) stays as it was
    } else {
      p.writes_out = true;
    }
    p.writes_slot = p.produces && !p.in_place;
    p.consume_elem_bytes = static_cast<uint32_t>(partial_in ? acc_ : esize_);
    p.produce_elem_bytes = static_cast<uint32_t>(partial_out ? acc_ : esize_);
    p.avg_div = (step_finalises(k) && op_ == RedOp::kAvg) ? world_ : 0;
    if (p.consumes) p.consume_target = ++consumed_;
    // Guards are computed before this step's own in-place slice is recorded: it protects
    // readers of the *previous* in-place slice of the range.
    if (p.writes_out && s.count > 0) {
      auto it = in_place_.find(s.offset);
      if (it != in_place_.end()) p.guard = it->second + 1;
    }
    if (p.produces) {
      p.produce_index = produced_++;
      p.produce_value = produced_;
      if (p.produce_index + 1 > slots_) {
        const uint64_t g = p.produce_index + 1 - slots_;
        if (g > p.guard) p.guard = g;
      }
      if (p.in_place) {
        in_place_[s.offset] = p.produce_index;
        if (p.produce_index + 1 > drain_) drain_ = p.produce_index + 1;
      }
    }
    return p;
  }

  // After the last step of a collective: the successor's `consumed` value to wait for before
  // the caller may touch the tensor again (0: nothing of it was read in place).
  uint64_t end_call() {
    const uint64_t d = drain_;
    in_place_.clear();
    drain_ = 0;
    return d;
  }

  uint64_t produced() const { return produced_; }
  uint64_t consumed() const { return consumed_; }
  size_t slots() const { return slots_; }

 private:
  size_t slots_;
  bool registered_ = false;
  size_t esize_ = 4;
  size_t acc_ = 4;
  RedOp op_ = RedOp::kSum;
  int world_ = 1;
  uint64_t produced_ = 0;
  uint64_t consumed_ = 0;
  uint64_t drain_ = 0;
  // Non-empty slices produced in place during this call: slice offset -> production index.
  // Within a call, equal offsets mean the same chunk of the same round.
  std::unordered_map<size_t, uint64_t> in_place_;
};

}  // namespace cuda
}  // namespace ringdp
