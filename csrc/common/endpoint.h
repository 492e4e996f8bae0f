// The lifecycle every ringdp communicator shares (shared memory, CUDA IPC, NCCL):
//
//   construct          this rank's own resources (segment, device memory, ...); no peer needed
//   local_blob()       the bytes a peer needs to reach this rank; Python publishes them
//                      through the torch.distributed store
//   connect(blobs)     every rank's blob, index = rank: open the peers' resources and check
//                      that they are compatible; throws RingError naming both ranks if not
//
// Torch-free (csrc/cuda includes it).
#pragma once
#include <string>
#include <vector>

namespace ringdp {

class Endpoint {
 public:
  virtual ~Endpoint() = default;
  virtual std::string local_blob() = 0;
  virtual void connect(const std::vector<std::string>& blobs) = 0;
};

}  // namespace ringdp
