// What the NCCL transport enqueues for each primitive of the ring (the table at the top of
// nccl_transport.cpp), written once against two operations of its owner:
//
//   ops.group(send, send_bytes, recv, recv_bytes)    one ncclGroupStart .. ncclGroupEnd: send
//                                                    to the successor, receive from the
//                                                    predecessor (either may be 0 bytes)
//   ops.launch(kind, in, out, src, dst, count, avg)  ringdp's step kernel (reduce_kernels.cuh)
//
// NcclComm runs it on a CUDA stream; csrc/cuda/sim/nccl_sim.cpp runs it with threads as
// ranks, NCCL's point-to-point matching emulated, and checks that every group's send meets
// a receive of the same size, that nothing deadlocks, and the results. Torch- and CUDA-free.
//
// The pairing rule: the slice a step produces is sent in the *next* step's group, together
// with that step's receive, so every rank's k-th group sends what its successor's k-th group
// receives. A step with nothing to receive (send, copy_send) first sends a slice still
// pending alone (a broadcast's root, slice after slice), and finish() sends the last one.
#pragma once
#include <algorithm>
#include <cstddef>

#include "../common/types.h"
#include "../ring/ring.h"
#include "../transport/transport.h"
#include "protocol.h"

namespace ringdp {
namespace cuda {
namespace nccl {

// One collective's buffers and element sizes (the owner's collective in flight: what
// NcclComm::enter sets).
struct StepCall {
  char* data = nullptr;      // the buffer the schedule's slices index (reduce_scatter: the input)
  char* result = nullptr;    // reduce_scatter: the output, holding element result_base on
  size_t result_base = 0;
  size_t esize = 4;          // the tensor's element size
  size_t acc = 4;            // a partial sum's (half types: 4, float32)
  RedOp op = RedOp::kSum;
  int world = 1;
  char* sbuf = nullptr;      // staging: a slice of partial sums going out
  char* rbuf = nullptr;      // staging: a slice of partial sums coming in
};

// The ring plan of one NCCL collective: slices of at most `slot_bytes` in the type that
// travels (partial sums for the reducing collectives, values otherwise), whole packs.
inline RingPlan step_plan(ringdp::Kind kind, size_t count, int world, int rank, size_t slot_bytes, size_t esize,
                          size_t acc) {
  const bool reduces = kind == ringdp::Kind::kAllReduce || kind == ringdp::Kind::kReduceScatter;
  RingPlan plan;
  plan.count = count;
  plan.world = world;
  plan.rank = rank;
  plan.slice_elems = std::max<size_t>(slot_bytes / (reduces ? acc : esize) / kPackElems * kPackElems, kPackElems);
  plan.align = kPackElems;
  return plan;
}

// The steps of one collective after another; the only state carried between steps is the
// slice produced and not yet sent. `c` is the owner's collective in flight.
template <class Ops>
class Steps {
 public:
  // A new collective: nothing pending.
  void reset() {
    pending_ptr_ = nullptr;
    pending_bytes_ = 0;
  }

  void step(Ops& ops, const StepCall& c, StepKind k, const Slice& s) {
    char* d = c.data + s.offset * c.esize;
    if (k == StepKind::kSend || k == StepKind::kCopySend) {
      // Nothing to receive. A slice still pending (a broadcast's root, slice after slice) goes
      // out alone first; its receiver's group has a receive only, so nothing waits in a cycle.
      if (pending_bytes_) ops.group(pending_ptr_, pending_bytes_, nullptr, 0);
      if (k == StepKind::kCopySend || c.acc == c.esize) {
        pending_ptr_ = d;  // send my values (final ones for copy_send) straight from the tensor
      } else {
        ops.launch(StepKind::kSend, d, nullptr, nullptr, c.sbuf, s.count, 0);  // widen to Acc
        pending_ptr_ = c.sbuf;
      }
      pending_bytes_ = s.count * (k == StepKind::kCopySend ? c.esize : c.acc);
      return;
    }
    const bool partial_in = step_partial_in(k);
    void* rdst = partial_in ? static_cast<void*>(c.rbuf) : static_cast<void*>(d);
    ops.group(pending_ptr_, pending_bytes_, rdst, s.count * (partial_in ? c.acc : c.esize));
    pending_ptr_ = nullptr;
    pending_bytes_ = 0;
    const int avg_div = step_finalises(k) && c.op == RedOp::kAvg ? c.world : 0;
    switch (k) {
      case StepKind::kRecvReduceSend:
        ops.launch(k, d, nullptr, c.rbuf, c.sbuf, s.count, 0);
        pending_ptr_ = c.sbuf;
        pending_bytes_ = s.count * c.acc;
        break;
      case StepKind::kRecvReduceCopySend:
        ops.launch(k, d, d, c.rbuf, nullptr, s.count, avg_div);
        pending_ptr_ = d;
        pending_bytes_ = s.count * c.esize;
        break;
      case StepKind::kRecvReduceCopy:  // the final value goes to the output; nothing is sent
        ops.launch(k, d, c.result + (s.offset - c.result_base) * c.esize, c.rbuf, nullptr, s.count, avg_div);
        break;
      case StepKind::kRecvCopySend:
        pending_ptr_ = d;  // received in place: forward it from there
        pending_bytes_ = s.count * c.esize;
        break;
      default:  // kRecv: received in place, nothing more
        break;
    }
  }

  // The end of the schedule: the last slice produced (a broadcast's root and the middle of
  // its chain) goes out alone.
  void finish(Ops& ops) {
    if (pending_bytes_) ops.group(pending_ptr_, pending_bytes_, nullptr, 0);
    pending_ptr_ = nullptr;
    pending_bytes_ = 0;
  }

 private:
  const void* pending_ptr_ = nullptr;  // produced by the previous step, sent by the next group
  size_t pending_bytes_ = 0;
};

}  // namespace nccl
}  // namespace cuda
}  // namespace ringdp
