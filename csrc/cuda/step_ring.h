// The RingTransport the shared ring engine (csrc/ring/ring.cpp) drives in the CUDA
// transports: every primitive becomes one call of Owner::step(StepKind, Slice), finish()
// becomes Owner::finish_ring(), closes_chain() is Owner::kClosesChain. The owner (IpcComm,
// NcclComm, the protocol simulation) decides what a step enqueues. Torch- and CUDA-free.
#pragma once
#include "../transport/transport.h"
#include "protocol.h"

namespace ringdp {
namespace cuda {

template <class Owner>
class StepRing final : public RingTransport {
 public:
  explicit StepRing(Owner* owner) : o_(owner) {}
  void send(const Slice& s) override { o_->step(StepKind::kSend, s); }
  void recv_reduce_send(const Slice& s) override { o_->step(StepKind::kRecvReduceSend, s); }
  void recv_reduce_copy_send(const Slice& s) override { o_->step(StepKind::kRecvReduceCopySend, s); }
  void recv_copy_send(const Slice& s) override { o_->step(StepKind::kRecvCopySend, s); }
  void recv(const Slice& s) override { o_->step(StepKind::kRecv, s); }
  void copy_send(const Slice& s) override { o_->step(StepKind::kCopySend, s); }
  void recv_reduce_copy(const Slice& s) override { o_->step(StepKind::kRecvReduceCopy, s); }
  bool closes_chain() const override { return Owner::kClosesChain; }
  void finish() override { o_->finish_ring(); }

 private:
  Owner* o_;
};

}  // namespace cuda
}  // namespace ringdp
