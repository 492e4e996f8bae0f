// Small helpers shared by the CUDA transports (host code only, torch-free).
#pragma once
#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../common/error.h"
#include "../common/rank_names.h"

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

// ringdp's streams outlive the communicators that use them. Tensors are recorded on a
// communicator's stream (record_stream: the caching allocator must not hand them out before
// the collective is done); one freed after ringdp.destroy() makes the allocator record an
// event on that stream, and on a destroyed stream that fails and terminates the process
// (seen on an H100: "invalid device context" from CUDACachingAllocator insert_events at
// exit). So a released communicator hands its (idle) stream back here, and the next
// communicator on that device takes it: at most as many streams as communicators alive at
// once, never destroyed. Non-blocking, highest priority (the ring overlaps backward).
class StreamPool {
 public:
  static cudaError_t acquire(int device, cudaStream_t* out) {
    {
      std::lock_guard<std::mutex> lk(mu());
      auto& v = pool();
      for (size_t i = 0; i < v.size(); ++i) {
        if (v[i].first != device) continue;
        *out = v[i].second;
        v.erase(v.begin() + static_cast<long>(i));
        return cudaSuccess;
      }
    }
    int least = 0, greatest = 0;
    cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (e != cudaSuccess) return e;
    return cudaStreamCreateWithPriority(out, cudaStreamNonBlocking, greatest);
  }
  // Back to the pool when idle; a stream with work still pending (a wait that timed out at
  // shutdown) is left alone, neither reused nor destroyed.
  static void release(int device, cudaStream_t s) {
    if (!s) return;
    if (cudaStreamQuery(s) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    std::lock_guard<std::mutex> lk(mu());
    pool().emplace_back(device, s);
  }

 private:
  static std::mutex& mu() {
    static std::mutex* m = new std::mutex;  // never destroyed: used from exit-time teardown
    return *m;
  }
  static std::vector<std::pair<int, cudaStream_t>>& pool() {
    static auto* v = new std::vector<std::pair<int, cudaStream_t>>;
    return *v;
  }
};

}  // namespace cuda
}  // namespace ringdp

// Inside a transport class with a member `me_` (this rank as messages name it) and a static `kName`.
#define RINGDP_CUDA_CHECK(expr, what)                                \
  do {                                                               \
    cudaError_t ringdp_err_ = (expr);                                \
    if (ringdp_err_ != cudaSuccess) {                                \
      (void)cudaGetLastError(); /* clear a sticky launch error */     \
      ::ringdp::cuda::throw_cuda(kName, me_, (what), ringdp_err_);   \
    }                                                                \
  } while (0)
