// CPU reduction kernels: plain loops over contiguous arrays that the compiler vectorises.
// Torch-free. Half types (fp16, bf16) are converted to float32 for arithmetic; the
// conversions are bit manipulations so they vectorise too.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../../common/types.h"

namespace ringdp {
namespace cpu {

// Type-erased entry points used by the shm transports. `T` below is the tensor's dtype,
// `Acc` the accumulation type (float32 for half types, else T); see types.h acc_size().
struct Kernels {
  // dst[Acc] = src[T]
  void (*to_acc)(void* dst, const void* src, size_t n);
  // dst[Acc] = a[Acc] op b[T]
  void (*reduce_acc)(void* dst, const void* a, const void* b, size_t n);
  // x = a[Acc] op b[T] (then x /= avg_div when avg_div > 0); data[T] = x; out2[T] = x if out2
  void (*reduce_final)(void* data, void* out2, const void* a, const void* b, size_t n, int avg_div);
  // out[T] = srcs[0] op srcs[1] op ... in this order, accumulated in Acc, then / avg_div.
  // out may be one of srcs: each block is read from every source before it is written.
  void (*reduce_many)(void* out, const void* const* srcs, int k, size_t n, int avg_div);
};

// Kernels for (dtype, op). AVG reduces as SUM; the caller passes avg_div = world size to the
// finalising kernel. Never returns null for valid enums.
const Kernels& kernels_for(DType dtype, RedOp op);

// Float <-> half conversions (round to nearest even), exposed for tests.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);

}  // namespace cpu
}  // namespace ringdp
