#include "shm_transports.h"

#include <cstring>

namespace ringdp {
namespace shm {

// ---- staged ----------------------------------------------------------------------------

StagedTransport::StagedTransport(ShmComm& c, char* data, DType dtype, RedOp op)
    : c_(c),
      data_(data),
      k_(cpu::kernels_for(dtype, op)),
      esz_(dtype_size(dtype)),
      asz_(acc_size(dtype)),
      avg_div_(op == RedOp::kAvg ? c.world() : 0),
      next_((c.rank() + 1) % c.world()),
      prev_((c.rank() + c.world() - 1) % c.world()),
      my_fifo_(c.fifo(c.rank())),
      prev_fifo_(c.fifo(prev_)),
      slots_(c.geometry().fifo_slots),
      slot_bytes_(c.geometry().slot_bytes) {}

char* StagedTransport::out_slot() {
  // Slot posted % slots is free once the successor has consumed slice posted - slots.
  c_.wait(c_.ctrl(next_).consumed, next_, c_.posted + 1 - static_cast<uint32_t>(slots_),
          "a free slot (successor is behind)");
  return my_fifo_ + (c_.posted % slots_) * slot_bytes_;
}

void StagedTransport::post_out() { c_.publish(c_.ctrl(c_.rank()).posted, ++c_.posted); }

const char* StagedTransport::in_slot() {
  c_.wait(c_.ctrl(prev_).posted, prev_, c_.consumed + 1, "data from predecessor");
  return prev_fifo_ + (c_.consumed % slots_) * slot_bytes_;
}

void StagedTransport::done_in() { c_.publish(c_.ctrl(c_.rank()).consumed, ++c_.consumed); }

void StagedTransport::send(const Slice& s) {
  char* o = out_slot();
  if (asz_ == esz_) std::memcpy(o, at(s), s.count * esz_);
  else k_.to_acc(o, at(s), s.count);
  post_out();
}

void StagedTransport::recv_reduce_send(const Slice& s) {
  char* o = out_slot();
  const char* i = in_slot();
  k_.reduce_acc(o, i, at(s), s.count);
  done_in();
  post_out();
}

void StagedTransport::recv_reduce_copy_send(const Slice& s) {
  // The final value goes to my tensor and, in the tensor's own dtype, to my successor.
  char* o = out_slot();
  const char* i = in_slot();
  k_.reduce_final(at(s), o, i, at(s), s.count, avg_div_);
  done_in();
  post_out();
}

void StagedTransport::recv_copy_send(const Slice& s) {
  char* o = out_slot();
  const char* i = in_slot();
  std::memcpy(at(s), i, s.count * esz_);
  std::memcpy(o, at(s), s.count * esz_);
  done_in();
  post_out();
}

void StagedTransport::recv(const Slice& s) {
  const char* i = in_slot();
  std::memcpy(at(s), i, s.count * esz_);
  done_in();
}

// ---- registered ------------------------------------------------------------------------

RegisteredTransport::RegisteredTransport(ShmComm& c, char* data, const char* prev_data,
                                         DType dtype, RedOp op)
    : c_(c),
      data_(data),
      prev_data_(prev_data),
      k_(cpu::kernels_for(dtype, op)),
      esz_(dtype_size(dtype)),
      avg_div_(op == RedOp::kAvg ? c.world() : 0),
      next_((c.rank() + 1) % c.world()),
      prev_((c.rank() + c.world() - 1) % c.world()) {}

const char* RegisteredTransport::in(const Slice& s) {
  c_.wait(c_.ctrl(prev_).posted, prev_, c_.consumed + 1, "data from predecessor");
  return prev_data_ + s.offset * esz_;
}

void RegisteredTransport::done_in() { c_.publish(c_.ctrl(c_.rank()).consumed, ++c_.consumed); }
void RegisteredTransport::post_out() { c_.publish(c_.ctrl(c_.rank()).posted, ++c_.posted); }

void RegisteredTransport::send(const Slice&) { post_out(); }  // my values are readable in place

void RegisteredTransport::recv_reduce_send(const Slice& s) {
  k_.reduce_inplace(data_ + s.offset * esz_, in(s), s.count, 0);
  done_in();
  post_out();
}

void RegisteredTransport::recv_reduce_copy_send(const Slice& s) {
  k_.reduce_inplace(data_ + s.offset * esz_, in(s), s.count, avg_div_);
  done_in();
  post_out();
}

void RegisteredTransport::recv_copy_send(const Slice& s) {
  std::memcpy(data_ + s.offset * esz_, in(s), s.count * esz_);
  done_in();
  post_out();
}

void RegisteredTransport::recv(const Slice& s) {
  std::memcpy(data_ + s.offset * esz_, in(s), s.count * esz_);
  done_in();
}

void RegisteredTransport::finish() {
  // My tensor is read in place by my successor: the caller may touch it only after the
  // successor consumed every slice I posted.
  c_.wait(c_.ctrl(next_).consumed, next_, c_.posted, "successor to finish reading my tensor");
}

}  // namespace shm
}  // namespace ringdp
