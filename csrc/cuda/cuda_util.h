// Small helpers shared by the CUDA transports (host code only, torch-free).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "../common/error.h"

namespace ringdp {
namespace cuda {

// Throw a RingError naming the rank, the transport, what failed and the CUDA error.
[[noreturn]] inline void throw_cuda(const char* transport, int rank, const std::string& what, cudaError_t e) {
  throw RingError(cat("ringdp ", transport, " rank ", rank, ": ", what, " failed: ", cudaGetErrorName(e), " (",
                      cudaGetErrorString(e), ")"));
}

// Make `device` current for the lifetime of the guard (the calling thread's device may be
// another one: torch sets it per thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : want_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != want_) cudaSetDevice(want_);
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != want_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int want_;
};

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace cuda
}  // namespace ringdp

// Inside a transport class with members `rank_` and a static `kName`.
#define RINGDP_CUDA_CHECK(expr, what)                                \
  do {                                                               \
    cudaError_t ringdp_err_ = (expr);                                \
    if (ringdp_err_ != cudaSuccess) {                                \
      (void)cudaGetLastError(); /* clear a sticky launch error */     \
      ::ringdp::cuda::throw_cuda(kName, rank_, (what), ringdp_err_); \
    }                                                                \
  } while (0)
