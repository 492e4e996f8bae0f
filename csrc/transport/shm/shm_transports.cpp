#include "shm_transports.h"

#include <cstring>

#include "../../common/error.h"

namespace ringdp {
namespace shm {

// ---- staged ----------------------------------------------------------------------------

StagedTransport::StagedTransport(Link& link, char* data, char* result, size_t result_base, DType dtype,
                                 RedOp op)
    : link_(link),
      data_(data),
      result_(result),
      result_base_(result_base),
      k_(cpu::kernels_for(dtype, op)),
      esz_(dtype_size(dtype)),
      asz_(acc_size(dtype)),
      avg_div_(op == RedOp::kAvg ? link.world() : 0) {}

void StagedTransport::send(const Slice& s) {
  char* o = link_.out_slot();
  if (asz_ == esz_) std::memcpy(o, at(s), s.count * esz_);
  else k_.to_acc(o, at(s), s.count);
  link_.post();
}

void StagedTransport::recv_reduce_send(const Slice& s) {
  char* o = link_.out_slot();
  const char* i = link_.in_slot();
  k_.reduce_acc(o, i, at(s), s.count);
  link_.consume();
  link_.post();
}

void StagedTransport::recv_reduce_copy_send(const Slice& s) {
  // The final value goes to my tensor and, in the tensor's own dtype, to my successor.
  char* o = link_.out_slot();
  const char* i = link_.in_slot();
  k_.reduce_final(at(s), o, i, at(s), s.count, avg_div_);
  link_.consume();
  link_.post();
}

void StagedTransport::recv_copy_send(const Slice& s) {
  char* o = link_.out_slot();
  const char* i = link_.in_slot();
  std::memcpy(at(s), i, s.count * esz_);
  std::memcpy(o, at(s), s.count * esz_);
  link_.consume();
  link_.post();
}

void StagedTransport::recv(const Slice& s) {
  const char* i = link_.in_slot();
  std::memcpy(at(s), i, s.count * esz_);
  link_.consume();
}

void StagedTransport::copy_send(const Slice& s) {
  char* o = link_.out_slot();
  std::memcpy(o, at(s), s.count * esz_);  // final values: the tensor's own dtype
  link_.post();
}

void StagedTransport::recv_reduce_copy(const Slice& s) {
  const char* i = link_.in_slot();
  k_.reduce_final(result_ + (s.offset - result_base_) * esz_, nullptr, i, at(s), s.count, avg_div_);
  link_.consume();
}

}  // namespace shm
}  // namespace ringdp
