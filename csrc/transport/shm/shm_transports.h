// The two shared-memory implementations of RingTransport (see transport.h).
#pragma once
#include "../../kernels/cpu/reduce.h"
#include "../transport.h"
#include "shm_comm.h"

namespace ringdp {
namespace shm {

// Ordinary tensors. Each connection prev -> me is a FIFO of `fifo_slots` slots living in
// prev's segment: prev writes slot (posted % slots), I read it and bump my `consumed`.
// Reduce-scatter slices travel in the accumulation type (float32 for half types).
class StagedTransport final : public RingTransport {
 public:
  StagedTransport(ShmComm& c, char* data, DType dtype, RedOp op);
  void send(const Slice& s) override;
  void recv_reduce_send(const Slice& s) override;
  void recv_reduce_copy_send(const Slice& s) override;
  void recv_copy_send(const Slice& s) override;
  void recv(const Slice& s) override;
  void finish() override {}

 private:
  char* out_slot();      // wait until my next slot is free (successor consumed it)
  void post_out();
  const char* in_slot();  // wait until predecessor posted my next slot
  void done_in();
  char* at(const Slice& s) const { return data_ + s.offset * esz_; }

  ShmComm& c_;
  char* data_;
  const cpu::Kernels& k_;
  size_t esz_, asz_;
  int avg_div_;
  int next_, prev_;
  char* my_fifo_;
  const char* prev_fifo_;
  size_t slots_, slot_bytes_;
};

// Registered tensors (ringdp.empty): the tensor itself lives in the arena every peer has
// mapped, so I read my predecessor's slice in place and reduce into my own tensor in place.
// No slots, no staging copies. finish() waits until my successor has read my last slice.
class RegisteredTransport final : public RingTransport {
 public:
  RegisteredTransport(ShmComm& c, char* data, const char* prev_data, DType dtype, RedOp op);
  void send(const Slice& s) override;
  void recv_reduce_send(const Slice& s) override;
  void recv_reduce_copy_send(const Slice& s) override;
  void recv_copy_send(const Slice& s) override;
  void recv(const Slice& s) override;
  void finish() override;

 private:
  const char* in(const Slice& s);  // wait for predecessor's slice
  void done_in();
  void post_out();

  ShmComm& c_;
  char* data_;
  const char* prev_data_;
  const cpu::Kernels& k_;
  size_t esz_;
  int avg_div_;
  int next_, prev_;
};

}  // namespace shm
}  // namespace ringdp
