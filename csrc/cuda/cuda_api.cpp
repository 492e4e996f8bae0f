// Factory and small queries of the torch-free CUDA API (cuda_api.h).
#include "cuda_api.h"

#include <cuda_runtime.h>

#include "../common/error.h"
#include "ipc_transport.h"
#include "nccl_transport.h"

namespace ringdp {
namespace cuda {

std::shared_ptr<Comm> create_comm(const Options& opts) {
  switch (opts.kind) {
    case Kind::kIpc: return ipc::make_comm(opts);
    case Kind::kNccl: return nccl::make_comm(opts);
  }
  throw RingError(cat("ringdp cuda rank ", opts.rank, ": unknown transport kind ", static_cast<int>(opts.kind)));
}

bool nccl_available(const std::string& library, int* version, std::string* why) {
  try {
    const nccl::Api& api = nccl::load(library);
    if (version) *version = api.version;
    return true;
  } catch (const std::exception& e) {
    if (why) *why = e.what();
    return false;
  }
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace ringdp
