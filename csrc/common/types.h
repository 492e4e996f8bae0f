// Types shared by every part of ringdp's native code: the engine, the transports and the
// kernels (CPU and CUDA). No torch headers here, so .cu files can include it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ringdp {

// Element types. The numeric values are in the shared-memory call header and in the raw
// CudaComm.all_reduce binding (csrc/bindings.cpp maps torch dtypes to them, once): never
// renumber.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

// Reduction operators; the numeric values are also ringdp/_types.py's op codes.
enum class RedOp : int32_t {
  kSum = 0,
  kAvg = 1,
  kMin = 2,
  kMax = 3,
};

// What a collective is. In every call header beside the caller's tag, so ranks that pair
// different collectives fail instead of mixing them; never renumber.
enum class Kind : int32_t {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kBroadcast = 3,
};

// The caller's tag of one call (e.g. RingDDP's "RingDDP step 12 bucket 3"): at most
// kTagBytes - 1 bytes, NUL-terminated in headers and records.
constexpr size_t kTagBytes = 64;

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

// Half types travel as float32 while partial sums are being formed (reduce-scatter), so
// every hop accumulates in float32 and rounds once, at the owner of the chunk.
inline size_t acc_size(DType t) {
  return (t == DType::kFloat16 || t == DType::kBFloat16) ? 4 : dtype_size(t);
}

inline bool dtype_is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

const char* dtype_name(DType t);
const char* redop_name(RedOp op);
const char* kind_name(Kind k);

}  // namespace ringdp
