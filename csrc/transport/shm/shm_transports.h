// The shared-memory implementation of RingTransport (see transport.h): it moves bytes over
// a Link (link.h), which owns the neighbours' flags, FIFOs and the counters. Tensors that
// every rank holds in registered memory do not take the ring (shm_comm.cpp run_direct).
#pragma once
#include "../../common/types.h"
#include "../../kernels/cpu/reduce.h"
#include "../transport.h"
#include "link.h"

namespace ringdp {
namespace shm {

// Ordinary tensors. Each connection prev -> me is a FIFO of `fifo_slots` slots living in
// prev's segment: prev writes slot (posted % slots), I read it and bump my `consumed`.
// Reduce-scatter slices travel in the accumulation type (float32 for half types), final
// values (all-gather, broadcast) in the tensor's dtype. `data` is the buffer the schedule's
// offsets index (read and written); final values of recv_reduce_copy go to `result`, whose
// first element is element `result_base` of the buffer (reduce_scatter: data = the input,
// untouched, result = the output; otherwise result = data, result_base = 0).
class StagedTransport final : public RingTransport {
 public:
  StagedTransport(Link& link, char* data, DType dtype, RedOp op) : StagedTransport(link, data, data, 0, dtype, op) {}
  StagedTransport(Link& link, char* data, char* result, size_t result_base, DType dtype, RedOp op);
  void send(const Slice& s) override;
  void recv_reduce_send(const Slice& s) override;
  void recv_reduce_copy_send(const Slice& s) override;
  void recv_copy_send(const Slice& s) override;
  void recv(const Slice& s) override;
  void copy_send(const Slice& s) override;
  void recv_reduce_copy(const Slice& s) override;
  void finish() override {}

 private:
  char* at(const Slice& s) const { return data_ + s.offset * esz_; }

  Link& link_;
  char* data_;
  char* result_;
  size_t result_base_;
  const cpu::Kernels& k_;
  size_t esz_, asz_;
  int avg_div_;
};

}  // namespace shm
}  // namespace ringdp
