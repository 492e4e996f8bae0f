// The NCCL point-to-point transport: ranks on different hosts (or GPUs without peer access).
//
// NCCL is loaded at run time with dlopen (libnccl.so.2, normally already loaded by a CUDA
// build of torch from the nvidia-nccl wheel it depends on), and the few entry points ringdp
// needs are declared here, so no NCCL header is needed to build ringdp.
//
// ringdp keeps its own communicator (from a unique id that rank 0 creates and the others
// receive through the torch.distributed store). The ring schedule is ringdp's
// (csrc/ring/ring.cpp); NCCL only moves bytes: at every ring step one ncclSend of the slice
// produced by the previous step to the successor and one ncclRecv from the predecessor,
// inside one ncclGroupStart/ncclGroupEnd, then ringdp's reduce kernel on the received slice.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>

#include "cuda_api.h"

namespace ringdp {
namespace cuda {
namespace nccl {

// ---- the part of NCCL's ABI ringdp uses (stable since NCCL 2.7) ----------------------------
struct ncclComm;
typedef ncclComm* ncclComm_t;
struct ncclUniqueId {
  char internal[128];
};
typedef int ncclResult_t;  // an enum in nccl.h: passed and returned as int
constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclResult_t ncclInProgress = 7;
constexpr int ncclInt8 = 0;  // ncclDataType_t: ringdp moves raw bytes

struct Api {
  void* handle = nullptr;
  std::string path;
  int version = 0;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;  // optional (NCCL >= 2.13)
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*Send)(const void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
};

// Load NCCL once per process: `library` if given (Options::nccl_library; ringdp/cuda_comm.py
// passes $RINGDP_NCCL_LIBRARY, else the nvidia-nccl wheel's) and nothing else, else the
// libnccl.so.2 already loaded (by torch), else the loader's search path. Throws RingError
// listing what was tried, or, once loaded, when `library` names another NCCL than the
// process's.
const Api& load(const std::string& library);

std::shared_ptr<Comm> make_comm(const Options& opts);

}  // namespace nccl
}  // namespace cuda
}  // namespace ringdp
